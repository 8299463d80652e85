//! Certificates of the identities this proxy serves: issued on first use,
//! rotated at half-life, and handed to the data path as ready-made rustls
//! configurations behind an atomic pointer, so a rotation never blocks a
//! connection and a connection never sees half a rotation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;

use super::ca::{IdentityError, LocalCa, WorkloadCert};
use super::spiffe::Identity;
use super::tls;

/// One identity's certificate with its TLS configurations.
#[derive(Debug)]
pub struct TlsIdentity {
    pub cert: WorkloadCert,
    pub server: Arc<rustls::ServerConfig>,
    pub client: Arc<rustls::ClientConfig>,
}

impl TlsIdentity {
    fn new(cert: WorkloadCert) -> Result<Self, IdentityError> {
        Ok(TlsIdentity {
            server: Arc::new(tls::server_config(&cert)?),
            client: Arc::new(tls::client_config(&cert)?),
            cert,
        })
    }
}

/// The current TLS material of one identity; swapped on rotation.
pub type TlsHandle = Arc<ArcSwap<TlsIdentity>>;

/// Issues, caches and rotates workload certificates.
pub struct CertManager {
    ca: Arc<LocalCa>,
    ttl: Duration,
    held: Mutex<HashMap<Identity, TlsHandle>>,
}

/// Delay before retrying a failed rotation.
const RETRY: Duration = Duration::from_secs(5);

impl CertManager {
    pub fn new(ca: LocalCa, ttl: Duration) -> Arc<Self> {
        Arc::new(CertManager {
            ca: Arc::new(ca),
            ttl,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// The TLS material for `id`, issuing it (and starting its rotation) on first use.
    pub fn get(self: &Arc<Self>, id: &Identity) -> Result<TlsHandle, IdentityError> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = held.get(id) {
            return Ok(h.clone());
        }
        let current = TlsIdentity::new(self.ca.issue(id, self.ttl)?)?;
        tracing::info!(identity = %id, expires = ?current.cert.not_after, "certificate issued");
        let handle: TlsHandle = Arc::new(ArcSwap::from_pointee(current));
        held.insert(id.clone(), handle.clone());
        tokio::spawn(rotate(self.clone(), id.clone(), handle.clone()));
        Ok(handle)
    }

    /// Identities held, with their current expiry (for the admin dump).
    pub fn summary(&self) -> Vec<(String, SystemTime)> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.iter()
            .map(|(id, h)| (id.to_string(), h.load().cert.not_after))
            .collect()
    }
}

async fn rotate(mgr: Arc<CertManager>, id: Identity, handle: TlsHandle) {
    loop {
        let due = handle.load().cert.refresh_at();
        let wait = due.duration_since(SystemTime::now()).unwrap_or_default();
        tokio::time::sleep(wait).await;
        match mgr.ca.issue(&id, mgr.ttl).and_then(TlsIdentity::new) {
            Ok(next) => {
                tracing::info!(identity = %id, expires = ?next.cert.not_after, "certificate rotated");
                handle.store(Arc::new(next));
            }
            Err(e) => {
                tracing::warn!(identity = %id, error = %e, "certificate rotation failed; current one keeps serving");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn rotates_at_half_life() {
        let mgr = CertManager::new(LocalCa::generate("td").unwrap(), Duration::from_secs(2));
        let id = Identity::new("td", "ns", "sa");
        let h = mgr.get(&id).unwrap();
        let first = h.load().cert.chain[0].clone();
        assert!(
            Arc::ptr_eq(&h, &mgr.get(&id).unwrap()),
            "one handle per identity"
        );
        // A 2s certificate (backdated 0.2s) is due at 0.9s.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_ne!(h.load().cert.chain[0], first, "certificate was not rotated");
    }
}
