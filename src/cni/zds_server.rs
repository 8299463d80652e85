//! The agent's side of ZDS (docs/wire.md §2): accepts proxy connections, waits
//! for the hello, sends the snapshot (an Add with the netns fd for every pod
//! it holds, then SnapshotSent), and afterwards Adds to the newest connection
//! and Dels to all, each request waiting at most 5 s for its in-order Ack.
//! It keeps its socket file in place: one removed is bound again.

use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tokio::sync::{mpsc, oneshot, Mutex};

use crate::backoff::Backoff;
use crate::netns::Netns;
use crate::proto::zds::{
    workload_request::Payload, workload_response, AddWorkload, DelWorkload, SnapshotSent,
    WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello,
};
use crate::unix_bind::{KeptPath, SOCKET_CHECK};
use crate::zds::{SeqPacket, SeqPacketListener};

/// How long the agent waits for the hello and for each Ack.
pub const ZDS_TIMEOUT: Duration = Duration::from_secs(5);
/// First and longest wait before offering a rejected pod again.
const OFFER_AGAIN_FIRST: Duration = Duration::from_secs(1);
const OFFER_AGAIN_MAX: Duration = Duration::from_secs(30);

/// A pod as the agent hands it to the proxy.
#[derive(Debug, Clone)]
pub struct ZdsPod {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub netns: Netns,
}

impl ZdsPod {
    fn add_request(&self) -> WorkloadRequest {
        WorkloadRequest {
            payload: Some(Payload::Add(AddWorkload {
                uid: self.uid.clone(),
                workload_info: Some(WorkloadInfo {
                    name: self.name.clone(),
                    namespace: self.namespace.clone(),
                    service_account: self.service_account.clone(),
                }),
            })),
        }
    }
}

/// Why a ZDS request did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error("no proxy is connected to the ZDS socket")]
    NoProxy,
    #[error("proxy rejected the request: {0}")]
    Rejected(String),
    #[error("proxy connection failed: {0}")]
    Connection(String),
}

type Job = (
    WorkloadRequest,
    Option<Netns>,
    oneshot::Sender<Result<(), ZdsError>>,
);

struct Conn {
    id: u64,
    jobs: mpsc::Sender<Job>,
}

/// Source of the snapshot a new proxy connection receives.
pub trait PodSource: Send + Sync + 'static {
    fn pods(&self) -> Vec<ZdsPod>;
}

/// The ZDS server; cheap to share.
pub struct ZdsServer {
    conns: Mutex<Vec<Conn>>,
    next_id: std::sync::atomic::AtomicU64,
    /// Woken each time a proxy has taken its snapshot and can take pods.
    proxy_came: tokio::sync::Notify,
}

/// How long an ADD waits for a proxy when none is connected (one that is
/// restarting, or reconnecting after the agent restarted) before it is
/// refused: within the plugin's 5 s, and longer than a reconnect takes.
const PROXY_WAIT: Duration = Duration::from_secs(3);

impl ZdsServer {
    /// Binds `path` and serves proxy connections in the background. The
    /// socket file is looked at every [`SOCKET_CHECK`]: if it was removed
    /// it is bound again ([`KeptPath`]), so that a proxy that starts or
    /// reconnects later still finds the agent.
    pub fn start(path: &Path, source: Arc<dyn PodSource>) -> std::io::Result<Arc<Self>> {
        let mut listener = SeqPacketListener::bind(path)?;
        let mut kept = KeptPath::new(path, "ZDS socket");
        let server = Arc::new(ZdsServer {
            conns: Mutex::new(Vec::new()),
            next_id: Default::default(),
            proxy_came: Default::default(),
        });
        let s = server.clone();
        tokio::spawn(async move {
            let mut check = tokio::time::interval(SOCKET_CHECK);
            check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(conn) => {
                            let s = s.clone();
                            let source = source.clone();
                            tokio::spawn(async move {
                                if let Err(e) = s.serve(conn, source).await {
                                    tracing::warn!(error = %e, "ZDS proxy connection ended");
                                }
                            });
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "ZDS accept failed");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    },
                    _ = check.tick() => {
                        if let Some(fresh) = kept.check(SeqPacketListener::bind) {
                            listener = fresh;
                        }
                    }
                }
            }
        });
        Ok(server)
    }

    /// Number of connected proxies.
    pub async fn connected(&self) -> usize {
        self.conns
            .lock()
            .await
            .iter()
            .filter(|c| !c.jobs.is_closed())
            .count()
    }

    /// The newest connected proxy's queue.
    async fn newest(&self) -> Option<mpsc::Sender<Job>> {
        let conns = self.conns.lock().await;
        conns
            .iter()
            .rev()
            .find(|c| !c.jobs.is_closed())
            .map(|c| c.jobs.clone())
    }

    /// Hands a pod to the newest proxy and waits for its Ack. With no proxy
    /// connected it waits [`PROXY_WAIT`] for one before refusing.
    pub async fn add(&self, pod: &ZdsPod) -> Result<(), ZdsError> {
        let deadline = tokio::time::Instant::now() + PROXY_WAIT;
        let jobs = loop {
            // Registered before the look, so a proxy coming in between is not missed.
            let came = self.proxy_came.notified();
            if let Some(jobs) = self.newest().await {
                break jobs;
            }
            if tokio::time::timeout_at(deadline, came).await.is_err() {
                return Err(ZdsError::NoProxy);
            }
        };
        let (tx, rx) = oneshot::channel();
        jobs.send((pod.add_request(), Some(pod.netns.clone()), tx))
            .await
            .map_err(|_| ZdsError::NoProxy)?;
        rx.await
            .map_err(|_| ZdsError::Connection("closed before the Ack".into()))?
    }

    /// Tells every proxy to drop a pod; succeeds if none is connected.
    pub async fn del(&self, uid: &str) -> Result<(), ZdsError> {
        let all: Vec<mpsc::Sender<Job>> = self
            .conns
            .lock()
            .await
            .iter()
            .map(|c| c.jobs.clone())
            .collect();
        let mut result = Ok(());
        for jobs in all {
            let (tx, rx) = oneshot::channel();
            let req = WorkloadRequest {
                payload: Some(Payload::Del(DelWorkload {
                    uid: uid.to_string(),
                })),
            };
            if jobs.send((req, None, tx)).await.is_err() {
                continue;
            }
            if let Ok(Err(e)) = rx.await {
                result = Err(e);
            }
        }
        result
    }

    /// Sends the snapshot: every pod held, then SnapshotSent. Returns the
    /// pods the proxy rejected.
    async fn snapshot(
        &self,
        conn: &SeqPacket,
        source: &dyn PodSource,
    ) -> Result<HashSet<String>, ZdsError> {
        let pods = source.pods();
        let mut rejected = HashSet::new();
        for pod in &pods {
            match exchange(conn, &pod.add_request(), Some(&pod.netns)).await {
                Ok(()) => {}
                // One pod the proxy cannot serve (its ports taken, no
                // certificate) must not keep every other pod from it: the
                // proxy stays connected, and the pod is offered again.
                Err(ZdsError::Rejected(why)) => {
                    tracing::warn!(pod = %pod.uid, error = %why, "the proxy rejected a pod of the snapshot; sending the rest, and offering it again later");
                    rejected.insert(pod.uid.clone());
                }
                Err(e) => return Err(e),
            }
        }
        let sent = WorkloadRequest {
            payload: Some(Payload::SnapshotSent(SnapshotSent {})),
        };
        exchange(conn, &sent, None).await?;
        tracing::info!(
            pods = pods.len() - rejected.len(),
            rejected = rejected.len(),
            "proxy connected; snapshot sent"
        );
        Ok(rejected)
    }

    async fn serve(
        self: Arc<Self>,
        conn: SeqPacket,
        source: Arc<dyn PodSource>,
    ) -> Result<(), ZdsError> {
        let err = |e: std::io::Error| ZdsError::Connection(e.to_string());
        let (hello, fd) = tokio::time::timeout(ZDS_TIMEOUT, conn.recv())
            .await
            .map_err(|_| ZdsError::Connection("no hello within 5s".into()))?
            .map_err(err)?;
        if fd.is_some() || ZdsHello::decode(hello.as_slice()).is_err() {
            return Err(ZdsError::Connection(
                "first message is not a ZdsHello".into(),
            ));
        }
        // Registered before the snapshot is taken: a pod removed or added
        // while the snapshot goes out queues its Del or Add here, sent
        // after SnapshotSent. Registered after, a pod removed in between
        // went out in the snapshot and its Del to no one: the proxy served
        // it until it next reconnected.
        let (tx, mut rx) = mpsc::channel::<Job>(64);
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        {
            let mut conns = self.conns.lock().await;
            conns.retain(|c| !c.jobs.is_closed());
            conns.push(Conn { id, jobs: tx });
        }
        let rejected = match self.snapshot(&conn, source.as_ref()).await {
            Ok(rejected) => rejected,
            Err(e) => {
                self.conns.lock().await.retain(|c| c.id != id);
                return Err(e);
            }
        };
        self.proxy_came.notify_waiters();
        if !rejected.is_empty() {
            tokio::spawn(self.clone().offer_again(rejected, source.clone()));
        }
        let result = loop {
            tokio::select! {
                job = rx.recv() => {
                    let Some((req, netns, reply)) = job else { break Ok(()) };
                    let r = exchange(&conn, &req, netns.as_ref()).await;
                    let failed = matches!(r, Err(ZdsError::Connection(_)));
                    let _ = reply.send(r);
                    if failed {
                        break Err(ZdsError::Connection("lost during a request".into()));
                    }
                }
                // Anything the proxy sends unasked (or EOF) ends the connection.
                r = conn.recv() => break Err(ZdsError::Connection(match r {
                    Ok(_) => "unexpected message from the proxy".into(),
                    Err(e) => e.to_string(),
                })),
            }
        };
        self.conns.lock().await.retain(|c| c.id != id);
        result
    }

    /// Offers the pods (by uid) a proxy rejected in its snapshot again, with
    /// backoff, for as long as the agent holds them and a proxy is connected
    /// (a new proxy's snapshot carries them anyway).
    async fn offer_again(self: Arc<Self>, mut uids: HashSet<String>, source: Arc<dyn PodSource>) {
        let mut backoff = Backoff::new(OFFER_AGAIN_FIRST, OFFER_AGAIN_MAX);
        while !uids.is_empty() {
            tokio::time::sleep(backoff.next_delay()).await;
            // As the agent holds them now: gone ones are dropped, and a pod
            // re-created in a new netns is offered with that one.
            let held: Vec<ZdsPod> = source
                .pods()
                .into_iter()
                .filter(|p| uids.contains(&p.uid))
                .collect();
            uids = held.iter().map(|p| p.uid.clone()).collect();
            for pod in held {
                match self.add(&pod).await {
                    Ok(()) => {
                        tracing::info!(pod = %pod.uid, "the proxy took a pod it had rejected in the snapshot");
                        uids.remove(&pod.uid);
                    }
                    Err(ZdsError::Rejected(why)) => {
                        tracing::debug!(pod = %pod.uid, error = %why, "rejected again");
                    }
                    Err(_) => return,
                }
            }
        }
    }
}

/// Sends one request and waits for its Ack.
async fn exchange(
    conn: &SeqPacket,
    req: &WorkloadRequest,
    netns: Option<&Netns>,
) -> Result<(), ZdsError> {
    let err = |e: std::io::Error| ZdsError::Connection(e.to_string());
    let fd = netns.map(|n| n.as_fd().as_raw_fd());
    tokio::time::timeout(ZDS_TIMEOUT, conn.send(&req.encode_to_vec(), fd))
        .await
        .map_err(|_| ZdsError::Connection("send timed out".into()))?
        .map_err(|e| match e.kind() {
            // Too large to send (nothing was sent): this request fails, the
            // connection is fine.
            std::io::ErrorKind::InvalidInput => ZdsError::Rejected(e.to_string()),
            _ => err(e),
        })?;
    let (bytes, fd) = tokio::time::timeout(ZDS_TIMEOUT, conn.recv())
        .await
        .map_err(|_| ZdsError::Connection("no Ack within 5s".into()))?
        .map_err(err)?;
    if fd.is_some() {
        return Err(ZdsError::Connection("Ack carried an fd".into()));
    }
    let resp = WorkloadResponse::decode(bytes.as_slice())
        .map_err(|e| ZdsError::Connection(format!("bad Ack: {e}")))?;
    match resp.payload {
        Some(workload_response::Payload::Ack(a)) if a.error.is_empty() => Ok(()),
        Some(workload_response::Payload::Ack(a)) => Err(ZdsError::Rejected(a.error)),
        None => Err(ZdsError::Connection("empty response".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TwoPods;

    impl PodSource for TwoPods {
        fn pods(&self) -> Vec<ZdsPod> {
            ["uid-a", "uid-b"]
                .map(|uid| ZdsPod {
                    uid: uid.into(),
                    name: uid.into(),
                    namespace: "default".into(),
                    service_account: "default".into(),
                    netns: Netns::current().unwrap(),
                })
                .to_vec()
        }
    }

    /// The hello a proxy opens with.
    async fn say_hello(proxy: &SeqPacket) {
        let hello = ZdsHello {
            version: crate::proto::zds::Version::V1 as i32,
        };
        proxy.send(&hello.encode_to_vec(), None).await.unwrap();
    }

    async fn ack(proxy: &SeqPacket, error: &str) {
        let resp = WorkloadResponse {
            payload: Some(workload_response::Payload::Ack(crate::proto::zds::Ack {
                error: error.into(),
            })),
        };
        proxy.send(&resp.encode_to_vec(), None).await.unwrap();
    }

    #[tokio::test]
    async fn a_pod_the_proxy_rejects_does_not_cost_the_others_their_snapshot() {
        let dir = std::env::temp_dir().join(format!("ambit-zds-server-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("zds.sock");
        let server = ZdsServer::start(&path, Arc::new(TwoPods)).unwrap();
        let proxy = SeqPacket::connect(&path).unwrap();
        say_hello(&proxy).await;
        let mut got = Vec::new();
        for answer in ["the pod's port 15008 is taken", "", ""] {
            let (bytes, _fd) = tokio::time::timeout(ZDS_TIMEOUT, proxy.recv())
                .await
                .expect("the agent goes on with the snapshot")
                .unwrap();
            got.push(WorkloadRequest::decode(bytes.as_slice()).unwrap().payload);
            ack(&proxy, answer).await;
        }
        assert!(
            matches!(&got[1], Some(Payload::Add(a)) if a.uid == "uid-b"),
            "the second pod is sent after the first is rejected: {got:?}"
        );
        assert!(matches!(got[2], Some(Payload::SnapshotSent(_))), "{got:?}");
        // The rejected pod is offered again, on its own, a moment later.
        let (bytes, _fd) = tokio::time::timeout(Duration::from_secs(3), proxy.recv())
            .await
            .expect("the rejected pod is offered again")
            .unwrap();
        let again = WorkloadRequest::decode(bytes.as_slice()).unwrap().payload;
        assert!(
            matches!(&again, Some(Payload::Add(a)) if a.uid == "uid-a"),
            "{again:?}"
        );
        ack(&proxy, "").await;
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while server.connected().await != 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the proxy stays connected"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Found by the soak: a pod removed while a reconnecting proxy took its
    /// snapshot went out in the snapshot, and its Del went to no one (the
    /// proxy was not yet among the connected): the proxy served it until
    /// it next reconnected. The Del now waits and follows the snapshot.
    #[tokio::test]
    async fn a_pod_removed_during_the_snapshot_is_deleted_right_after_it() {
        let dir = std::env::temp_dir().join(format!("ambit-zds-del-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("zds.sock");
        let server = ZdsServer::start(&path, Arc::new(TwoPods)).unwrap();
        let proxy = SeqPacket::connect(&path).unwrap();
        say_hello(&proxy).await;
        let next = || async {
            let (bytes, _fd) = tokio::time::timeout(ZDS_TIMEOUT, proxy.recv())
                .await
                .expect("the agent goes on")
                .unwrap();
            WorkloadRequest::decode(bytes.as_slice()).unwrap().payload
        };
        let first = next().await;
        assert!(
            matches!(&first, Some(Payload::Add(a)) if a.uid == "uid-a"),
            "{first:?}"
        );
        // Removed now, with the snapshot half sent.
        let s = server.clone();
        let del = tokio::spawn(async move { s.del("uid-a").await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !del.is_finished(),
            "the Del waits for this proxy, not for no one"
        );
        ack(&proxy, "").await;
        let mut got = Vec::new();
        for _ in 0..3 {
            got.push(next().await);
            ack(&proxy, "").await;
        }
        assert!(
            matches!(&got[0], Some(Payload::Add(a)) if a.uid == "uid-b"),
            "{got:?}"
        );
        assert!(matches!(got[1], Some(Payload::SnapshotSent(_))), "{got:?}");
        assert!(
            matches!(&got[2], Some(Payload::Del(d)) if d.uid == "uid-a"),
            "{got:?}"
        );
        del.await.unwrap().expect("the proxy acked the Del");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Says hello and takes the (empty) snapshot, as a proxy does.
    async fn take_snapshot(proxy: SeqPacket) -> SeqPacket {
        say_hello(&proxy).await;
        let (bytes, _fd) = tokio::time::timeout(ZDS_TIMEOUT, proxy.recv())
            .await
            .expect("the agent sends the snapshot")
            .unwrap();
        let payload = WorkloadRequest::decode(bytes.as_slice()).unwrap().payload;
        assert!(
            matches!(payload, Some(Payload::SnapshotSent(_))),
            "{payload:?}"
        );
        ack(&proxy, "").await;
        proxy
    }

    /// A proxy that connects after the socket file was removed finds the
    /// agent again within a check or two; one connected before stays.
    #[tokio::test]
    async fn a_removed_socket_file_is_bound_again_and_takes_new_proxies() {
        let dir = std::env::temp_dir().join(format!("ambit-zds-rebind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("zds.sock");
        let server = ZdsServer::start(&path, Arc::new(NoPods)).unwrap();
        let first = take_snapshot(SeqPacket::connect(&path).unwrap()).await;
        std::fs::remove_file(&path).unwrap();
        assert!(SeqPacket::connect(&path).is_err(), "the file is gone");
        let deadline = std::time::Instant::now() + SOCKET_CHECK * 3;
        let second = loop {
            if let Ok(p) = SeqPacket::connect(&path) {
                break p;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the socket file was not bound again"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let _second = take_snapshot(second).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while server.connected().await != 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "both proxies connected: the old one stays"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(first);
        std::fs::remove_dir_all(&dir).ok();
    }

    struct NoPods;

    impl PodSource for NoPods {
        fn pods(&self) -> Vec<ZdsPod> {
            Vec::new()
        }
    }

    /// Found by the soak: right after an agent restart the proxy is still
    /// reconnecting, and an ADD then was refused at once (fail closed, but
    /// needlessly). It now waits for the proxy, up to PROXY_WAIT.
    #[tokio::test]
    async fn an_add_with_no_proxy_yet_waits_for_one_and_then_is_refused() {
        let dir = std::env::temp_dir().join(format!("ambit-zds-wait-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("zds.sock");
        let server = ZdsServer::start(&path, Arc::new(NoPods)).unwrap();
        let pod = ZdsPod {
            uid: "uid-late".into(),
            name: "late".into(),
            namespace: "default".into(),
            service_account: "default".into(),
            netns: Netns::current().unwrap(),
        };
        let s = server.clone();
        let p = pod.clone();
        let add = tokio::spawn(async move { s.add(&p).await });
        // The proxy comes half a second later, takes its (empty) snapshot, then the pod.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let proxy = SeqPacket::connect(&path).unwrap();
        say_hello(&proxy).await;
        loop {
            let (bytes, _fd) = tokio::time::timeout(ZDS_TIMEOUT, proxy.recv())
                .await
                .expect("the agent talks to the proxy")
                .unwrap();
            let payload = WorkloadRequest::decode(bytes.as_slice()).unwrap().payload;
            ack(&proxy, "").await;
            if matches!(&payload, Some(Payload::Add(a)) if a.uid == "uid-late") {
                break;
            }
        }
        add.await.unwrap().expect("the ADD waited for the proxy");
        drop(proxy);
        // With no proxy at all, it is refused once the wait is over.
        while server.connected().await != 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let t = std::time::Instant::now();
        assert!(matches!(server.add(&pod).await, Err(ZdsError::NoProxy)));
        assert!(t.elapsed() >= PROXY_WAIT - Duration::from_millis(50));
        std::fs::remove_dir_all(&dir).ok();
    }
}
