//! Certificate revocation lists (`crl_path`, ztunnel's `CRL_PATH`): a file
//! of CRLs (PEM, any number, or one DER), checked at every HBONE handshake
//! in both directions, watched and reloaded, and applied to connections
//! already open: one whose peer a new list revokes is closed.
//!
//! As in ztunnel, every certificate of the peer's chain is checked (leaf and
//! intermediates), a certificate whose issuer publishes no list here is
//! accepted, and a list past its `nextUpdate` still counts (its age is a
//! metric to alert on, not a reason to stop the mesh). Unlike ztunnel, a
//! file that cannot be read or parsed at start stops the start (ztunnel then
//! runs without revocation), and a file that turns bad later keeps the last
//! good lists, with a warning and a counted failure (ztunnel logs at debug).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::RootCertStore;
use webpki::{
    CertRevocationList, EndEntityCert, ExpirationPolicy, KeyUsage, OwnedCertRevocationList,
    RevocationCheckDepth, RevocationOptionsBuilder, UnknownStatusPolicy,
};
use x509_parser::prelude::FromDer;

/// Which end of a connection this proxy is, for what it checks and reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Accepting: the peer is a client (`reporter="destination"`).
    Inbound,
    /// Dialing: the peer is a server (`reporter="source"`).
    Outbound,
}

impl Side {
    fn reporter(self) -> &'static str {
        match self {
            Side::Inbound => "destination",
            Side::Outbound => "source",
        }
    }

    fn usage(self) -> KeyUsage {
        match self {
            Side::Inbound => KeyUsage::client_auth(),
            Side::Outbound => KeyUsage::server_auth(),
        }
    }
}

/// The lists of one reading of the file.
#[derive(Debug, Default)]
pub struct CrlSet {
    lists: Vec<CertRevocationList<'static>>,
    /// Serial numbers listed, over all lists.
    pub revoked: usize,
    /// The earliest `nextUpdate` of the lists.
    pub next_update: Option<SystemTime>,
    digest: u64,
}

impl CrlSet {
    /// The lists in `bytes`: PEM (`X509 CRL` blocks; other blocks are
    /// skipped) or one DER list. Empty (or blank) is no list. Any list that
    /// does not parse fails the whole file, as does a PEM file with no list.
    pub fn parse(bytes: &[u8]) -> Result<CrlSet, String> {
        let text_start = bytes.iter().position(|b| !b.is_ascii_whitespace());
        let Some(start) = text_start else {
            return Ok(CrlSet::default());
        };
        let ders: Vec<Vec<u8>> = if bytes[start..].starts_with(b"-----BEGIN") {
            let mut ders = Vec::new();
            for item in rustls_pemfile::read_all(&mut &bytes[..]) {
                match item.map_err(|e| format!("not PEM: {e}"))? {
                    rustls_pemfile::Item::Crl(der) => ders.push(der.to_vec()),
                    _ => continue,
                }
            }
            if ders.is_empty() {
                return Err("PEM with no X509 CRL block".into());
            }
            ders
        } else {
            vec![bytes.to_vec()]
        };
        let mut set = CrlSet {
            digest: digest(bytes),
            ..CrlSet::default()
        };
        for (i, der) in ders.iter().enumerate() {
            let n = i + 1;
            let list = OwnedCertRevocationList::from_der(der)
                .map_err(|e| format!("CRL {n}: not a CRL webpki accepts: {e}"))?;
            let (_, parsed) =
                x509_parser::revocation_list::CertificateRevocationList::from_der(der)
                    .map_err(|e| format!("CRL {n}: {e}"))?;
            set.revoked += parsed.iter_revoked_certificates().count();
            if let Some(next) = parsed.next_update() {
                let at = SystemTime::UNIX_EPOCH
                    + Duration::from_secs(u64::try_from(next.timestamp()).unwrap_or(0));
                set.next_update = Some(set.next_update.map_or(at, |old| old.min(at)));
            }
            set.lists.push(CertRevocationList::Owned(list));
        }
        Ok(set)
    }

    /// Lists loaded.
    pub fn len(&self) -> usize {
        self.lists.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lists.is_empty()
    }

    /// Checks `end_entity` with `intermediates` up to `anchors` against
    /// these lists, as of `now`.
    fn check(
        &self,
        chain: (&CertificateDer<'_>, &[CertificateDer<'_>]),
        anchors: &RootCertStore,
        algs: &WebPkiSupportedAlgorithms,
        side: Side,
        now: UnixTime,
    ) -> Result<(), webpki::Error> {
        let lists: Vec<&CertRevocationList<'static>> = self.lists.iter().collect();
        let Ok(options) = RevocationOptionsBuilder::new(&lists) else {
            return Ok(()); // no list: nothing is revoked
        };
        let revocation = options
            .with_depth(RevocationCheckDepth::Chain)
            .with_status_policy(UnknownStatusPolicy::Allow)
            .with_expiration_policy(ExpirationPolicy::Ignore)
            .build();
        let cert = EndEntityCert::try_from(chain.0)?;
        cert.verify_for_usage(
            algs.all,
            &anchors.roots,
            chain.1,
            now,
            side.usage(),
            Some(revocation),
            None,
        )
        .map(|_| ())
    }
}

fn digest(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReporterLabel {
    reporter: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Debug, Default)]
struct CrlMetrics {
    rejections: Family<ReporterLabel, Counter>,
    loads: Family<ResultLabel, Counter>,
    lists: Gauge,
    revoked: Gauge,
    next_update: Gauge,
}

/// A connection open under a peer chain that a later list may revoke.
struct Open {
    chain: Vec<CertificateDer<'static>>,
    anchors: Arc<RootCertStore>,
    algs: WebPkiSupportedAlgorithms,
    side: Side,
    /// Checked as of the connection's start, so the chain's expiry never
    /// reads as a revocation.
    at: UnixTime,
    revoke: tokio::sync::watch::Sender<bool>,
}

/// The revocation lists in force and the connections they apply to.
pub struct Crls {
    path: PathBuf,
    set: ArcSwap<CrlSet>,
    /// Bumped at each new set, before open connections are checked again.
    generation: AtomicU64,
    open: Mutex<(u64, HashMap<u64, Open>)>,
    metrics: CrlMetrics,
}

impl std::fmt::Debug for Crls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Crls")
            .field("path", &self.path)
            .field("lists", &self.set.load().len())
            .finish_non_exhaustive()
    }
}

impl Crls {
    /// Reads `path`; an error stops the start (revocation asked for and not
    /// had is not run without).
    pub fn load(path: &Path) -> Result<Arc<Crls>, String> {
        let bytes = std::fs::read(path)
            .map_err(|e| format!("cannot read the CRL file {}: {e}", path.display()))?;
        let set = CrlSet::parse(&bytes)
            .map_err(|e| format!("the CRL file {} is refused: {e}", path.display()))?;
        let crls = Crls {
            path: path.to_path_buf(),
            set: ArcSwap::from_pointee(CrlSet::default()),
            generation: AtomicU64::new(0),
            open: Mutex::default(),
            metrics: CrlMetrics::default(),
        };
        crls.metrics
            .loads
            .get_or_create(&ResultLabel { result: "ok" })
            .inc();
        crls.install(set);
        Ok(Arc::new(crls))
    }

    /// The lists in force.
    pub fn current(&self) -> Arc<CrlSet> {
        self.set.load_full()
    }

    /// Where the lists come from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Watches the file and applies each new reading until the watch ends.
    pub fn spawn_watch(self: &Arc<Self>) -> std::io::Result<()> {
        let mut watch = crate::watch::FileWatch::new(&self.path)?;
        let crls = Arc::downgrade(self);
        tokio::spawn(async move {
            while watch.changed().await {
                let Some(crls) = crls.upgrade() else { return };
                crls.reload();
            }
        });
        Ok(())
    }

    /// Reads the file again: a new set is applied (and open connections
    /// checked against it); the same bytes change nothing; a file that
    /// cannot be read or parsed keeps the lists in force.
    pub fn reload(&self) {
        let read = std::fs::read(&self.path).map_err(|e| format!("cannot read it: {e}"));
        let set = read.and_then(|bytes| {
            if digest(&bytes) == self.set.load().digest {
                return Ok(None);
            }
            CrlSet::parse(&bytes).map(Some)
        });
        match set {
            Ok(None) => {}
            Ok(Some(set)) => {
                tracing::info!(path = %self.path.display(), lists = set.len(), revoked = set.revoked, "CRL file reloaded");
                self.metrics
                    .loads
                    .get_or_create(&ResultLabel { result: "ok" })
                    .inc();
                self.install(set);
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "CRL file refused; the lists in force stay");
                self.metrics
                    .loads
                    .get_or_create(&ResultLabel { result: "error" })
                    .inc();
            }
        }
    }

    fn install(&self, set: CrlSet) {
        let m = &self.metrics;
        m.lists.set(i64::try_from(set.len()).unwrap_or(i64::MAX));
        m.revoked
            .set(i64::try_from(set.revoked).unwrap_or(i64::MAX));
        m.next_update.set(set.next_update.map_or(0, |t| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        }));
        let set = Arc::new(set);
        // Under the lock: a connection registering now is either checked
        // here or sees the new generation and checks itself.
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        self.set.store(set.clone());
        self.generation.fetch_add(1, Ordering::AcqRel);
        let mut closed = 0;
        for o in open.1.values() {
            if *o.revoke.borrow() {
                continue;
            }
            if self.revoked(&set, o) {
                o.revoke.send_replace(true);
                closed += 1;
            }
        }
        if closed > 0 {
            tracing::info!(
                connections = closed,
                "HBONE connections of peers the new CRL revokes closed"
            );
        }
    }

    fn revoked(&self, set: &CrlSet, o: &Open) -> bool {
        let Some((leaf, rest)) = o.chain.split_first() else {
            return false;
        };
        match set.check((leaf, rest), &o.anchors, &o.algs, o.side, o.at) {
            Err(webpki::Error::CertRevoked) => {
                self.rejected(o.side);
                true
            }
            _ => false,
        }
    }

    fn rejected(&self, side: Side) {
        self.metrics
            .rejections
            .get_or_create(&ReporterLabel {
                reporter: side.reporter(),
            })
            .inc();
    }

    /// The set's generation, read before a handshake and given back to
    /// [`Crls::track`].
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The handshake's check: `Err(Revoked)` for a chain a list revokes
    /// (counted), other failures as rustls reports them.
    pub fn check(
        &self,
        chain: (&CertificateDer<'_>, &[CertificateDer<'_>]),
        anchors: &RootCertStore,
        algs: &WebPkiSupportedAlgorithms,
        side: Side,
        now: UnixTime,
    ) -> Result<(), rustls::Error> {
        let set = self.set.load();
        if set.is_empty() {
            return Ok(());
        }
        set.check(chain, anchors, algs, side, now).map_err(|e| {
            let e = match e {
                webpki::Error::CertRevoked => {
                    self.rejected(side);
                    rustls::CertificateError::Revoked
                }
                other => rustls::CertificateError::Other(rustls::OtherError(Arc::new(other))),
            };
            rustls::Error::InvalidCertificate(e)
        })
    }

    /// Follows a connection opened under `chain` (the peer's, leaf first)
    /// until the returned [`Tracked`] is dropped; it says when a later list
    /// revokes the peer. `generation` is what [`Crls::generation`] said
    /// before the handshake: a set installed since is checked here.
    pub fn track(
        self: &Arc<Self>,
        chain: &[CertificateDer<'_>],
        anchors: Arc<RootCertStore>,
        algs: WebPkiSupportedAlgorithms,
        side: Side,
        generation: u64,
    ) -> Tracked {
        let (revoke, revoked) = tokio::sync::watch::channel(false);
        let open = Open {
            chain: chain.iter().map(|c| c.clone().into_owned()).collect(),
            anchors,
            algs,
            side,
            at: UnixTime::now(),
            revoke,
        };
        let mut all = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if self.generation() != generation && self.revoked(&self.set.load(), &open) {
            open.revoke.send_replace(true);
        }
        all.0 += 1;
        let id = all.0;
        all.1.insert(id, open);
        Tracked {
            crls: self.clone(),
            id,
            revoked,
        }
    }

    /// Open connections followed.
    pub fn tracked(&self) -> usize {
        self.open.lock().unwrap_or_else(|e| e.into_inner()).1.len()
    }

    /// `istio_crl_policy_rejections_total{reporter}` (ztunnel's) and the
    /// lists' state: `ambit_crl_lists`, `ambit_crl_revoked_certificates`,
    /// `ambit_crl_next_update_timestamp_seconds`, `ambit_crl_loads_total{result}`.
    pub fn register_metrics(&self, registry: &mut Registry) {
        let m = &self.metrics;
        registry.register(
            "istio_crl_policy_rejections",
            "Connections refused or closed because a CRL revokes the peer's certificate",
            m.rejections.clone(),
        );
        registry.register(
            "ambit_crl_loads",
            "Readings of the CRL file: applied (ok) or refused, keeping the lists in force (error)",
            m.loads.clone(),
        );
        registry.register("ambit_crl_lists", "CRLs in force", m.lists.clone());
        registry.register(
            "ambit_crl_revoked_certificates",
            "Serial numbers the CRLs in force list",
            m.revoked.clone(),
        );
        registry.register(
            "ambit_crl_next_update_timestamp_seconds",
            "The earliest nextUpdate of the CRLs in force (0: none); past it, the lists are stale",
            m.next_update.clone(),
        );
    }
}

/// One open connection followed by [`Crls`]; unregistered when dropped.
pub struct Tracked {
    crls: Arc<Crls>,
    id: u64,
    revoked: tokio::sync::watch::Receiver<bool>,
}

impl Tracked {
    /// Resolves once a list revokes the peer.
    pub async fn revoked(&mut self) {
        if self.revoked.wait_for(|r| *r).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut all = self.crls.open.lock().unwrap_or_else(|e| e.into_inner());
        all.1.remove(&self.id);
    }
}

/// Waits on `tracked` if there is one; never resolves otherwise.
pub async fn revoked(tracked: &mut Option<Tracked>) {
    match tracked {
        Some(t) => t.revoked().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
