//! Certificates of the identities this proxy serves: issued on first use,
//! rotated at half-life, and handed to the data path as ready-made rustls
//! configurations behind an atomic pointer, so a rotation never blocks a
//! connection and a connection never sees half a rotation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use arc_swap::ArcSwap;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::CertificateDer;

use super::ca::{IdentityError, LocalCa, WorkloadCert};
use super::caclient::CaClient;
use super::crl::{Crls, Side, Tracked};
use super::spiffe::Identity;
use super::tls;

/// One identity's certificate with its TLS configurations.
#[derive(Debug)]
pub struct TlsIdentity {
    pub cert: WorkloadCert,
    pub server: Arc<rustls::ServerConfig>,
    pub client: Arc<rustls::ClientConfig>,
    /// With revocation lists: what open connections are followed with.
    revocation: Option<(
        Arc<Crls>,
        Arc<rustls::RootCertStore>,
        WebPkiSupportedAlgorithms,
    )>,
}

impl TlsIdentity {
    fn new(cert: WorkloadCert, crls: Option<&Arc<Crls>>) -> Result<Self, IdentityError> {
        let revocation = match crls {
            Some(c) => Some((
                c.clone(),
                Arc::new(tls::roots(&cert)?),
                tls::provider().signature_verification_algorithms,
            )),
            None => None,
        };
        Ok(TlsIdentity {
            server: Arc::new(tls::server_config(&cert, crls)?),
            client: Arc::new(tls::client_config(&cert, crls)?),
            cert,
            revocation,
        })
    }

    /// The revocation lists' generation (see [`Crls::track`]), read before a
    /// handshake; 0 without lists.
    pub fn crl_generation(&self) -> u64 {
        self.revocation
            .as_ref()
            .map_or(0, |(c, _, _)| c.generation())
    }

    /// Follows a connection authenticated with the peer's `chain` (leaf
    /// first), so a revocation list loaded later closes it; `None` without
    /// lists.
    pub fn track(
        &self,
        chain: &[CertificateDer<'_>],
        side: Side,
        generation: u64,
    ) -> Option<Tracked> {
        let (crls, roots, algs) = self.revocation.as_ref()?;
        Some(crls.track(chain, roots.clone(), *algs, side, generation))
    }
}

/// The current TLS material of one identity; swapped on rotation.
pub type TlsHandle = Arc<ArcSwap<TlsIdentity>>;

/// Where certificates come from.
pub enum CertSource {
    /// Signed in-process by the local CA.
    Local(Box<LocalCa>),
    /// Asked of an Istio CA (istiod, or `ambit control-plane`).
    Remote(CaClient),
}

impl CertSource {
    async fn issue(&self, id: &Identity, ttl: Duration) -> Result<WorkloadCert, IdentityError> {
        let cert = match self {
            CertSource::Local(ca) => ca.issue(id, ttl)?,
            CertSource::Remote(client) => client.issue(id, ttl).await?,
        };
        usable(cert, SystemTime::now())
    }
}

/// Refuses a certificate that cannot serve when it arrives: expired, or
/// ending before it begins. One merely past half its life (a clock ahead of
/// the CA's, a short lifetime) is taken; [`rotate`] then waits at least
/// [`RETRY`] before asking again, so neither case loops on the CA.
fn usable(cert: WorkloadCert, now: SystemTime) -> Result<WorkloadCert, IdentityError> {
    if cert.not_after > now && cert.not_after > cert.not_before {
        return Ok(cert);
    }
    Err(IdentityError::Sign {
        identity: cert.identity.to_string(),
        reason: format!(
            "the CA issued a certificate that is not valid now (valid {:?} to {:?})",
            cert.not_before, cert.not_after
        ),
    })
}

/// Issues, caches and rotates workload certificates.
pub struct CertManager {
    ca: CertSource,
    ttl: Duration,
    /// Revocation lists every configuration checks peers against.
    crls: Option<Arc<Crls>>,
    held: Mutex<HashMap<Identity, Held>>,
    /// Told when a pod that held a certificate goes (its [`PodLease`]).
    left: Arc<tokio::sync::Notify>,
    /// One issuance at a time per identity.
    fetching: tokio::sync::Mutex<()>,
}

/// An identity's certificate and the task that rotates it.
struct Held {
    handle: TlsHandle,
    rotation: tokio::task::AbortHandle,
}

impl Drop for Held {
    /// The rotation ends with the entry: a released identity's task would
    /// otherwise sleep to its half-life (hours) holding the whole
    /// certificate and its TLS configurations, one more for each time an
    /// identity's pods all leave and come back.
    fn drop(&mut self) {
        self.rotation.abort();
    }
}

/// Held by each pod that uses a certificate; see [`CertManager::lease`].
#[derive(Debug)]
pub struct PodLease(Arc<tokio::sync::Notify>);

impl Drop for PodLease {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

/// Delay before retrying a failed rotation.
const RETRY: Duration = Duration::from_secs(5);

impl CertManager {
    pub fn new(ca: CertSource, ttl: Duration) -> Arc<Self> {
        Self::with_crls(ca, ttl, None)
    }

    /// [`CertManager::new`], checking peers against `crls`.
    pub fn with_crls(ca: CertSource, ttl: Duration, crls: Option<Arc<Crls>>) -> Arc<Self> {
        Arc::new(CertManager {
            ca,
            ttl,
            crls,
            held: Mutex::new(HashMap::new()),
            left: Arc::default(),
            fetching: Default::default(),
        })
    }

    fn held(&self, id: &Identity) -> Option<TlsHandle> {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .map(|h| h.handle.clone())
    }

    /// The TLS material for `id`, issuing it (and starting its rotation) on first use.
    pub async fn get(self: &Arc<Self>, id: &Identity) -> Result<TlsHandle, IdentityError> {
        if let Some(h) = self.held(id) {
            return Ok(h);
        }
        let _one_at_a_time = self.fetching.lock().await;
        if let Some(h) = self.held(id) {
            return Ok(h);
        }
        let current = TlsIdentity::new(self.ca.issue(id, self.ttl).await?, self.crls.as_ref())?;
        tracing::info!(identity = %id, expires = ?current.cert.not_after, "certificate issued");
        let handle: TlsHandle = Arc::new(ArcSwap::from_pointee(current));
        let rotation = tokio::spawn(rotate(self.clone(), id.clone(), handle.clone()));
        let held = Held {
            handle: handle.clone(),
            rotation: rotation.abort_handle(),
        };
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), held);
        Ok(handle)
    }

    /// Every held certificate (for the admin dump), by identity.
    pub fn certificates(&self) -> Vec<(Identity, Arc<TlsIdentity>)> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<_> = held
            .iter()
            .map(|(id, h)| (id.clone(), h.handle.load_full()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Identities held, with their current expiry (for the admin dump).
    pub fn summary(&self) -> Vec<(String, SystemTime)> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.iter()
            .map(|(id, h)| (id.to_string(), h.handle.load().cert.not_after))
            .collect()
    }
}

impl CertManager {
    /// Registers `ambit_certificate_expiry_seconds{identity}`, computed at
    /// each scrape so it is never stale: alert before a certificate expires.
    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        registry.register_collector(Box::new(CertExpiry(self.clone())));
    }
}

#[derive(Debug)]
struct CertExpiry(Arc<CertManager>);

impl std::fmt::Debug for CertManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertManager")
            .field("ttl", &self.ttl)
            .finish()
    }
}

impl Collector for CertExpiry {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let mut family = encoder.encode_descriptor(
            "ambit_certificate_expiry_seconds",
            "Seconds until the workload certificate expires",
            None,
            MetricType::Gauge,
        )?;
        for (id, not_after) in self.0.summary() {
            let left = not_after
                .duration_since(SystemTime::now())
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0);
            ConstGauge::new(left).encode(family.encode_family(&[("identity", id.as_str())])?)?;
        }
        Ok(())
    }
}

impl CertManager {
    /// Forgets identities no pod uses any more (only this manager and the
    /// rotation task hold them); their rotation task ends now, and with it
    /// the last hold on the certificate. Returns how many.
    pub fn release_unused(&self) -> usize {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let before = held.len();
        held.retain(|id, h| {
            let used = Arc::strong_count(&h.handle) > 2;
            if !used {
                tracing::info!(identity = %id, "certificate dropped: its last pod left");
            }
            used
        });
        before - held.len()
    }

    /// A pod's hold on the manager's attention: dropped with the pod (after
    /// its certificate handle), it has the releaser look for identities no
    /// pod uses any more.
    pub fn lease(&self) -> PodLease {
        PodLease(self.left.clone())
    }

    /// Runs [`CertManager::release_unused`] `grace` after pods leave (a pod
    /// replaced at once keeps its identity's certificate), for the life of
    /// the manager. It sleeps while no pod leaves: no periodic wake-up.
    pub fn spawn_releaser(self: &Arc<Self>, grace: Duration) {
        let weak = Arc::downgrade(self);
        let left = self.left.clone();
        tokio::spawn(async move {
            loop {
                // Pods that leave during the grace leave a permit: one more look.
                left.notified().await;
                tokio::time::sleep(grace).await;
                match weak.upgrade() {
                    Some(mgr) => {
                        mgr.release_unused();
                    }
                    None => return,
                }
            }
        });
    }
}

async fn rotate(mgr: Arc<CertManager>, id: Identity, handle: TlsHandle) {
    // Zero at first: a certificate due already (say, after a suspend) is
    // renewed at once. After a rotation, one that came back already past half
    // its life is not asked for again sooner than RETRY.
    let mut at_least = Duration::ZERO;
    loop {
        let due = handle.load().cert.refresh_at();
        let wait = due
            .duration_since(SystemTime::now())
            .unwrap_or_default()
            .max(at_least);
        tokio::time::sleep(wait).await;
        if Arc::strong_count(&handle) == 1 {
            return; // released: no pod uses this identity any more
        }
        let next = mgr.ca.issue(&id, mgr.ttl).await;
        match next.and_then(|cert| TlsIdentity::new(cert, mgr.crls.as_ref())) {
            Ok(next) => {
                tracing::info!(identity = %id, expires = ?next.cert.not_after, "certificate rotated");
                handle.store(Arc::new(next));
                at_least = RETRY;
            }
            Err(e) => {
                let left = handle
                    .load()
                    .cert
                    .not_after
                    .duration_since(SystemTime::now())
                    .unwrap_or_default();
                tracing::warn!(identity = %id, error = %e, expires_in_s = left.as_secs(), "certificate rotation failed; the current one keeps serving");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_that_cannot_serve_is_refused_one_past_half_life_is_not() {
        let ca = LocalCa::generate("td").unwrap();
        let id = Identity::new("td", "ns", "sa");
        let now = SystemTime::now();
        let fresh = ca.issue(&id, Duration::from_secs(600)).unwrap();
        assert!(usable(fresh, now).is_ok());
        // A node clock ahead of the CA's: past half its life, still valid.
        let skewed = ca.issue(&id, Duration::from_secs(600)).unwrap();
        assert!(usable(skewed, now + Duration::from_secs(400)).is_ok());
        let mut expired = ca.issue(&id, Duration::from_secs(600)).unwrap();
        expired.not_after = now - Duration::from_secs(1);
        let mut inverted = ca.issue(&id, Duration::from_secs(600)).unwrap();
        inverted.not_before = now + Duration::from_secs(60);
        inverted.not_after = now + Duration::from_secs(30);
        for cert in [expired, inverted] {
            let err = usable(cert, now).unwrap_err().to_string();
            assert!(err.contains("not valid now"), "{err}");
        }
    }

    #[tokio::test]
    async fn identities_are_released_when_no_pod_uses_them() {
        let mgr = CertManager::new(
            CertSource::Local(Box::new(LocalCa::generate("td").unwrap())),
            Duration::from_secs(600),
        );
        let id = Identity::new("td", "ns", "sa");
        let pod_holds = mgr.get(&id).await.unwrap();
        assert_eq!(mgr.release_unused(), 0, "a pod still uses it");
        drop(pod_holds);
        // The manager and the rotation task held it; now nothing does.
        let gone = Arc::downgrade(&mgr.get(&id).await.unwrap());
        assert_eq!(mgr.release_unused(), 1);
        assert!(mgr.summary().is_empty());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while gone.strong_count() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "a released certificate is still held (its rotation task sleeps to half-life)"
            );
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_identity_is_released_a_grace_after_its_last_pod_leaves() {
        let mgr = CertManager::new(
            CertSource::Local(Box::new(LocalCa::generate("td").unwrap())),
            Duration::from_secs(600),
        );
        mgr.spawn_releaser(Duration::from_secs(10));
        let id = Identity::new("td", "ns", "sa");
        let (tls, lease) = (mgr.get(&id).await.unwrap(), mgr.lease());
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(mgr.summary().len(), 1, "held while its pod is");
        drop(tls);
        drop(lease);
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert_eq!(mgr.summary().len(), 1, "kept through the grace");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(mgr.summary().is_empty(), "released after the grace");
    }

    #[tokio::test]
    async fn rotates_at_half_life() {
        let mgr = CertManager::new(
            CertSource::Local(Box::new(LocalCa::generate("td").unwrap())),
            Duration::from_secs(2),
        );
        let id = Identity::new("td", "ns", "sa");
        let h = mgr.get(&id).await.unwrap();
        let first = h.load().cert.chain[0].clone();
        assert!(
            Arc::ptr_eq(&h, &mgr.get(&id).await.unwrap()),
            "one handle per identity"
        );
        // A 2s certificate (backdated 0.2s) is due at 0.9s: polled for,
        // and not before it is due.
        let issued = std::time::Instant::now();
        let deadline = issued + Duration::from_secs(5);
        while h.load().cert.chain[0] == first {
            assert!(
                std::time::Instant::now() < deadline,
                "certificate was not rotated"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            issued.elapsed() >= Duration::from_millis(500),
            "rotated long before half its life: {:?}",
            issued.elapsed()
        );
    }
}
