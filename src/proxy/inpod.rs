//! Shared (in-pod) mode: the ZDS client that takes pod network namespaces
//! from the node agent (docs/wire.md §2) and the table of pods it serves.
//!
//! Each Add opens the pod's listeners inside its netns (a socket factory bound
//! to that netns, no thread per pod); Del drains that pod now; the snapshot
//! (Adds/Keeps then SnapshotSent) reconciles: pods not named are drained.
//! Every request gets exactly one Ack, in order. Protocol violations (an fd on
//! anything but Add, Add without workload info, a second SnapshotSent) are
//! answered with an error Ack and the connection is dropped.

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::pod::{Drain, DrainTrigger, SocketFactory};
use super::pods::{PodInfo, ProxyShared};

use crate::backoff::Backoff;
use crate::netns::Netns;
use crate::proto::zds::{
    workload_request::Payload, workload_response, Ack, Version, WorkloadRequest, WorkloadResponse,
    ZdsHello,
};
use crate::zds::SeqPacket;

struct RunningPod {
    netns_id: (u64, u64),
    /// What `/config_dump` shows of the pod.
    view: PodView,
    _drain: DrainTrigger,
    _metrics: super::metrics::PodMetricsGuard,
    _pool: super::pool::PoolPodGuard,
    _gone: super::pods::PodGoneGuard,
}

/// A served pod as the admin endpoint shows it.
#[derive(Debug, Clone)]
pub struct PodView {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub identity: String,
    pub ips: Vec<std::net::IpAddr>,
    /// Device and inode of the pod's netns.
    pub netns: (u64, u64),
    /// When the proxy took the pod (Unix seconds).
    pub added_unix: u64,
    /// Its connections open now.
    pub open: Arc<super::open::OpenConnections>,
}

/// The pods this proxy serves, by uid. Dropping an entry drains the pod.
#[derive(Default)]
pub struct PodTable {
    pods: Mutex<HashMap<String, RunningPod>>,
    /// Adds taken but not serving yet (waiting for a certificate, listeners).
    pending: std::sync::atomic::AtomicI64,
}

/// Counts an Add as pending while it lives.
struct Pending<'a>(&'a std::sync::atomic::AtomicI64);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl PodTable {
    /// Pods handed over but not serving yet.
    pub fn pending(&self) -> i64 {
        self.pending.load(Ordering::Acquire)
    }

    fn start_pending(&self) -> Pending<'_> {
        self.pending.fetch_add(1, Ordering::AcqRel);
        Pending(&self.pending)
    }

    pub fn uids(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// The served pods, sorted by uid.
    pub fn views(&self) -> Vec<PodView> {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<PodView> = pods.values().map(|p| p.view.clone()).collect();
        v.sort_by(|a, b| a.uid.cmp(&b.uid));
        v
    }

    fn netns_of(&self, uid: &str) -> Option<(u64, u64)> {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(uid)
            .map(|p| p.netns_id)
    }

    fn insert(&self, uid: String, pod: RunningPod) {
        // Replacing an entry drops (and so drains) the previous pod with that uid.
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(uid, pod);
    }

    fn remove(&self, uid: &str) -> bool {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        let removed = pods.remove(uid).is_some();
        give_back_room(&mut pods);
        removed
    }

    fn retain(&self, keep: &HashSet<String>) -> Vec<String> {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        let gone: Vec<String> = pods
            .keys()
            .filter(|k| !keep.contains(*k))
            .cloned()
            .collect();
        for uid in &gone {
            pods.remove(uid);
        }
        give_back_room(&mut pods);
        gone
    }
}

/// Shrinks a table of pods that has emptied: a map keeps the room of its
/// busiest moment (and grows past it under churn, as removed entries leave
/// markers behind), ~300 bytes a slot that no pod uses.
fn give_back_room<V>(pods: &mut HashMap<String, V>) {
    if pods.capacity() > 64 && pods.len() * 4 < pods.capacity() {
        pods.shrink_to(pods.len() * 2);
    }
}

impl PodTable {
    /// Registers the pod gauges, read from this table at each scrape. A
    /// dedicated proxy serves its one pod outside the table.
    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry, dedicated: bool) {
        registry.register_collector(Box::new(PodGauges {
            pods: self.clone(),
            dedicated,
        }));
    }
}

/// `workload_manager_active_proxy_count` and `…_pending_proxy_count`.
#[derive(Debug)]
struct PodGauges {
    pods: Arc<PodTable>,
    dedicated: bool,
}

impl std::fmt::Debug for PodTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodTable")
            .field("pending", &self.pending())
            .finish()
    }
}

impl Collector for PodGauges {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let served = self.pods.uids().len() as i64;
        let active = if served == 0 {
            i64::from(self.dedicated)
        } else {
            served
        };
        for (name, help, value) in [
            (
                "workload_manager_active_proxy_count",
                "Pods this proxy serves",
                active,
            ),
            (
                "workload_manager_pending_proxy_count",
                "Pods handed to this proxy that are not serving yet",
                self.pods.pending(),
            ),
        ] {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

/// What an Add asks for, given what runs under that uid.
#[derive(Debug, PartialEq, Eq)]
pub enum AddAction {
    /// Same uid, same netns: already served.
    Keep,
    /// New uid, or the same uid in a new netns (the old listeners are drained).
    Start,
}

pub fn add_action(running: Option<(u64, u64)>, new: (u64, u64)) -> AddAction {
    match running {
        Some(id) if id == new => AddAction::Keep,
        _ => AddAction::Start,
    }
}

/// Per-connection ZDS session state.
#[derive(Debug, Default)]
struct Session {
    /// Uids named by Add/Keep before SnapshotSent; `None` once the snapshot is in.
    snapshot: Option<HashSet<String>>,
}

/// Errors that end a ZDS connection after the error Ack.
#[derive(Debug, thiserror::Error)]
#[error("ZDS protocol error: {0}")]
struct ProtocolError(String);

/// The ZDS client of a shared-mode proxy.
pub struct ZdsClient {
    path: PathBuf,
    shared: Arc<ProxyShared>,
    pods: Arc<PodTable>,
    ready: Arc<AtomicBool>,
    home: Netns,
}

impl ZdsClient {
    pub fn new(
        path: PathBuf,
        shared: Arc<ProxyShared>,
        pods: Arc<PodTable>,
        ready: Arc<AtomicBool>,
    ) -> std::io::Result<Self> {
        Ok(ZdsClient {
            path,
            shared,
            pods,
            ready,
            home: Netns::current()?,
        })
    }

    /// Connects (and reconnects, backing off 10 ms → 15 s) forever.
    pub async fn run(self) {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(15));
        loop {
            match SeqPacket::connect(&self.path) {
                Ok(conn) => {
                    backoff.reset();
                    tracing::info!(path = %self.path.display(), "connected to the node agent (ZDS)");
                    if let Err(e) = self.session(conn).await {
                        tracing::warn!(error = %e, "ZDS connection ended");
                    }
                    self.ready.store(false, Ordering::Release);
                }
                Err(e) => tracing::debug!(error = %e, "ZDS connect failed; retrying"),
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    async fn session(&self, conn: SeqPacket) -> anyhow::Result<()> {
        let hello = ZdsHello {
            version: Version::V1 as i32,
        };
        conn.send(&hello.encode_to_vec(), None).await?;
        let mut session = Session {
            snapshot: Some(HashSet::new()),
        };
        loop {
            let (bytes, fd) = conn.recv().await?;
            let outcome = match WorkloadRequest::decode(bytes.as_slice()) {
                Ok(req) => self.handle(&mut session, req, fd).await,
                Err(e) => Err(ProtocolError(format!("undecodable request: {e}")).into()),
            };
            let error = match &outcome {
                Ok(()) => String::new(),
                Err(e) => e.to_string(),
            };
            let ack = WorkloadResponse {
                payload: Some(workload_response::Payload::Ack(Ack {
                    error: error.clone(),
                })),
            };
            conn.send(&ack.encode_to_vec(), None).await?;
            if let Err(e) = outcome {
                if e.is::<ProtocolError>() {
                    return Err(e);
                }
                tracing::warn!(error = %error, "ZDS request failed");
            }
        }
    }

    async fn handle(
        &self,
        session: &mut Session,
        req: WorkloadRequest,
        fd: Option<OwnedFd>,
    ) -> anyhow::Result<()> {
        let payload = req
            .payload
            .ok_or_else(|| ProtocolError("empty request".into()))?;
        if fd.is_some() && !matches!(payload, Payload::Add(_)) {
            return Err(ProtocolError("fd attached to a message other than Add".into()).into());
        }
        match payload {
            Payload::Add(add) => {
                let info = add.workload_info.ok_or_else(|| {
                    ProtocolError(format!("Add {} without workload_info", add.uid))
                })?;
                let fd =
                    fd.ok_or_else(|| ProtocolError(format!("Add {} without a netns fd", add.uid)))?;
                let netns = Netns::from_fd(fd, &format!("pod {}", add.uid));
                if !netns.is_netns() {
                    return Err(ProtocolError(format!(
                        "Add {}: fd is not a network namespace",
                        add.uid
                    ))
                    .into());
                }
                if let Some(snap) = session.snapshot.as_mut() {
                    snap.insert(add.uid.clone());
                }
                let id = netns.id()?;
                if add_action(self.pods.netns_of(&add.uid), id) == AddAction::Keep {
                    return Ok(());
                }
                let _pending = self.pods.start_pending();
                let pod_info = PodInfo {
                    uid: add.uid.clone(),
                    namespace: info.namespace,
                    name: info.name,
                    service_account: if info.service_account.is_empty() {
                        "default".into()
                    } else {
                        info.service_account
                    },
                };
                // Drain an older netns under this uid first, so its listeners close.
                self.pods.remove(&add.uid);
                let (trigger, drain) = Drain::new();
                let sockets = SocketFactory::in_pod(
                    self.shared.sockets.clone(),
                    format!("{}/{}", pod_info.namespace, pod_info.name),
                    netns.clone(),
                    self.home.clone(),
                );
                let pod = self
                    .shared
                    .pod(&pod_info, sockets, drain, Some(&netns))
                    .await?;
                tracing::info!(pod = %pod.uid, identity = %pod.identity, ips = ?pod.ips, "pod added");
                let view = PodView {
                    uid: add.uid.clone(),
                    name: pod.name.clone(),
                    namespace: pod.namespace.clone(),
                    identity: pod.identity.to_string(),
                    ips: pod.ips.clone(),
                    netns: id,
                    open: pod.open.clone(),
                    added_unix: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs())
                        .unwrap_or(0),
                };
                let series_of = pod.key.clone();
                self.shared.start(pod)?;
                let pooled_by = add.uid.clone();
                let ips: std::sync::Arc<[std::net::IpAddr]> = view.ips.clone().into();
                self.pods.insert(
                    add.uid,
                    RunningPod {
                        netns_id: id,
                        view,
                        _drain: trigger,
                        _metrics: super::metrics::PodMetricsGuard {
                            metrics: self.shared.metrics.clone(),
                            pod: series_of,
                        },
                        _pool: super::pool::PoolPodGuard {
                            pool: self.shared.pool.clone(),
                            pod: pooled_by,
                        },
                        _gone: super::pods::PodGoneGuard {
                            gone: self.shared.pods_gone.clone(),
                            ips,
                        },
                    },
                );
                Ok(())
            }
            Payload::Keep(keep) => match session.snapshot.as_mut() {
                Some(snap) => {
                    snap.insert(keep.uid);
                    Ok(())
                }
                None => Err(ProtocolError(format!("Keep {} after the snapshot", keep.uid)).into()),
            },
            Payload::Del(del) => {
                if let Some(snap) = session.snapshot.as_mut() {
                    snap.remove(&del.uid);
                }
                if self.pods.remove(&del.uid) {
                    tracing::info!(pod = %del.uid, "pod removed; its connections are closed");
                }
                Ok(())
            }
            Payload::SnapshotSent(_) => {
                let keep = session
                    .snapshot
                    .take()
                    .ok_or_else(|| ProtocolError("second SnapshotSent".into()))?;
                for uid in self.pods.retain(&keep) {
                    tracing::info!(pod = %uid, "pod not in the agent's snapshot; removed");
                }
                self.ready.store(true, Ordering::Release);
                tracing::info!(pods = keep.len(), "ZDS snapshot applied; ready");
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_is_idempotent_on_uid_and_netns() {
        assert_eq!(add_action(None, (1, 2)), AddAction::Start);
        assert_eq!(add_action(Some((1, 2)), (1, 2)), AddAction::Keep);
        assert_eq!(
            add_action(Some((1, 2)), (1, 3)),
            AddAction::Start,
            "new netns replaces the pod"
        );
    }

    #[test]
    fn an_emptied_pod_table_gives_its_room_back() {
        let mut pods: HashMap<String, [u8; 300]> = HashMap::new();
        for round in 0..3 {
            for i in 0..500 {
                pods.insert(format!("{round}-{i}"), [0; 300]);
            }
            let busiest = pods.capacity();
            for i in 0..500 {
                pods.remove(&format!("{round}-{i}"));
                give_back_room(&mut pods);
            }
            assert!(busiest >= 500);
            assert!(pods.capacity() <= 64, "{} slots kept", pods.capacity());
        }
    }
}
