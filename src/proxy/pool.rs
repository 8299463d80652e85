//! The outbound HBONE connection pool: HTTP/2 connections keyed by (source
//! identity, destination identities, destination address), many streams each.
//!
//! A burst of connections to one destination makes one TLS handshake, not a
//! hundred: callers that find a dial under way for their key wait for it,
//! but only for [`JOIN_WAIT`], and then dial on their own, so one stalled
//! handshake never holds every caller to that destination (no lock is held
//! across a handshake). A connection serves at most
//! `max_streams` streams at once; past that a second one is dialed. Idle
//! connections are closed after `idle_timeout`, dead ones are dropped.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::client::SendRequest;

use super::together::Streams;
use crate::identity::Identity;

/// What a pooled connection is for. Connections never cross pods: each was
/// dialed from its pod's own netns and address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub pod: String,
    pub src: Identity,
    pub dst: Vec<Identity>,
    pub addr: SocketAddr,
}

/// One HTTP/2 connection in the pool.
#[derive(Debug)]
pub struct PooledConn {
    sender: SendRequest<Bytes>,
    active: AtomicUsize,
    lifeline: Arc<Lifeline>,
    idle_since: Mutex<Instant>,
    /// The connection's task, where its streams' copies run.
    streams: Streams,
}

impl PooledConn {
    /// `lifeline` is shared with whoever drives the connection, `streams`
    /// leads to that driver's task.
    pub fn new(sender: SendRequest<Bytes>, lifeline: Arc<Lifeline>, streams: Streams) -> Arc<Self> {
        Arc::new(PooledConn {
            sender,
            active: AtomicUsize::new(0),
            lifeline,
            idle_since: Mutex::new(Instant::now()),
            streams,
        })
    }

    fn usable(&self, max: usize) -> bool {
        !self.lifeline.is_closed() && self.active.load(Ordering::Acquire) < max
    }
}

/// The pool and every lease have let go: no stream will use the
/// connection again.
impl Drop for PooledConn {
    fn drop(&mut self) {
        self.lifeline.released.notify_one();
    }
}

/// What a pooled connection and the task driving it tell each other: the
/// driver that the connection ended, the pool that no one will use it again.
#[derive(Debug, Default)]
pub struct Lifeline {
    closed: AtomicBool,
    released: tokio::sync::Notify,
}

impl Lifeline {
    /// The connection has ended (set by its driver).
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Resolves once the connection's last handle is dropped (at once if it
    /// already was).
    pub async fn released(&self) {
        self.released.notified().await
    }
}

/// A stream slot on a pooled connection; gives the slot back when dropped.
#[derive(Debug)]
pub struct Lease {
    conn: Arc<PooledConn>,
}

impl Lease {
    fn new(conn: Arc<PooledConn>) -> Self {
        conn.active.fetch_add(1, Ordering::AcqRel);
        Lease { conn }
    }

    pub fn sender(&self) -> SendRequest<Bytes> {
        self.conn.sender.clone()
    }

    /// Where a stream on this connection is carried: the connection's task.
    pub fn streams(&self) -> &Streams {
        &self.conn.streams
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.conn.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            *self
                .conn
                .idle_since
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Instant::now();
        }
    }
}

/// How long a caller waits for a dial another caller has under way before
/// dialing on its own: far above a handshake between nodes, far below the
/// 10 s a stalled one takes to fail.
pub const JOIN_WAIT: Duration = Duration::from_millis(500);

#[derive(Debug, Default)]
struct Entry {
    /// Dials under way for this key.
    dialing: AtomicUsize,
    /// Woken whenever a dial for this key ends, well or not.
    dial_ended: tokio::sync::Notify,
    conns: Mutex<Vec<Arc<PooledConn>>>,
}

/// Counts one dial under way; on drop (done, failed or cancelled) wakes
/// those waiting for it.
struct Dialing<'a>(&'a Entry);

impl<'a> Dialing<'a> {
    fn start(entry: &'a Entry) -> Self {
        entry.dialing.fetch_add(1, Ordering::AcqRel);
        Dialing(entry)
    }
}

impl Drop for Dialing<'_> {
    fn drop(&mut self) {
        self.0.dialing.fetch_sub(1, Ordering::AcqRel);
        self.0.dial_ended.notify_waiters();
    }
}

impl Entry {
    fn pick(&self, max: usize) -> Option<Lease> {
        let conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        conns
            .iter()
            .find(|c| c.usable(max))
            .map(|c| Lease::new(c.clone()))
    }
}

/// The pool of one proxy.
#[derive(Debug)]
pub struct Pool {
    entries: Mutex<HashMap<PoolKey, Arc<Entry>>>,
    max_streams: usize,
    idle_timeout: Duration,
    dials: AtomicUsize,
}

impl Pool {
    pub fn new(max_streams: usize, idle_timeout: Duration) -> Arc<Self> {
        Arc::new(Pool {
            entries: Mutex::default(),
            max_streams,
            idle_timeout,
            dials: AtomicUsize::new(0),
        })
    }

    /// A stream slot for `key`, dialing with `dial` only if no connection has room.
    pub async fn get<F, Fut, E>(&self, key: PoolKey, dial: F) -> Result<Lease, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Arc<PooledConn>, E>>,
    {
        let entry = self
            .entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_default()
            .clone();
        if let Some(lease) = entry.pick(self.max_streams) {
            return Ok(lease);
        }
        if entry.dialing.load(Ordering::Acquire) > 0 {
            // Registered before the second look, so an end in between is not missed.
            let ended = entry.dial_ended.notified();
            if let Some(lease) = entry.pick(self.max_streams) {
                return Ok(lease);
            }
            let _ = tokio::time::timeout(JOIN_WAIT, ended).await;
            if let Some(lease) = entry.pick(self.max_streams) {
                return Ok(lease);
            }
        }
        let dialing = Dialing::start(&entry);
        let conn = dial().await?;
        self.dials.fetch_add(1, Ordering::Relaxed);
        let lease = Lease::new(conn.clone());
        entry
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(conn);
        drop(dialing);
        Ok(lease)
    }

    /// Connections dialed so far (for tests and the admin dump).
    pub fn dials(&self) -> usize {
        self.dials.load(Ordering::Relaxed)
    }

    /// Open connections now.
    pub fn open(&self) -> usize {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries
            .values()
            .map(|e| e.conns.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }

    /// Drops dead connections and those idle past the timeout (dropping the
    /// last `SendRequest` makes h2 send GOAWAY and close).
    pub fn evict(&self) {
        let now = Instant::now();
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.retain(|_, entry| {
            let mut conns = entry.conns.lock().unwrap_or_else(|e| e.into_inner());
            conns.retain(|c| {
                let idle = c.active.load(Ordering::Acquire) == 0
                    && now.duration_since(*c.idle_since.lock().unwrap_or_else(|e| e.into_inner()))
                        >= self.idle_timeout;
                !c.lifeline.is_closed() && !idle
            });
            !conns.is_empty()
        });
    }

    /// Lets go of every connection dialed from pod `pod`: a removed pod's
    /// connections serve no one, and each would keep its netns alive and
    /// the peer's side open until the idle timeout. They close with GOAWAY
    /// as their streams end.
    pub fn forget_pod(&self, pod: &str) -> usize {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let before = entries.len();
        entries.retain(|key, _| key.pod != pod);
        before - entries.len()
    }

    /// On shutdown: lets go of every connection. Each closes with GOAWAY as
    /// soon as its last stream in flight ends (the pool's handle was the last
    /// one keeping an idle connection open).
    pub fn drain(&self) {
        let entries = std::mem::take(&mut *self.entries.lock().unwrap_or_else(|e| e.into_inner()));
        let n: usize = entries
            .values()
            .map(|e| e.conns.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum();
        tracing::debug!(connections = n, "HBONE client pool drained");
    }

    /// Runs [`Pool::evict`] periodically for the life of the pool.
    pub fn spawn_evictor(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let every =
            (self.idle_timeout / 2).clamp(Duration::from_millis(100), Duration::from_secs(30));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                match weak.upgrade() {
                    Some(pool) => pool.evict(),
                    None => return,
                }
            }
        });
    }
}

/// Lets go of a pod's pooled connections when the pod is no longer served.
pub struct PoolPodGuard {
    pub pool: Arc<Pool>,
    pub pod: String,
}

impl Drop for PoolPodGuard {
    fn drop(&mut self) {
        let n = self.pool.forget_pod(&self.pod);
        if n > 0 {
            tracing::debug!(pod = %self.pod, destinations = n, "removed pod's pooled connections released");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::duplex;

    async fn h2_conn() -> Arc<PooledConn> {
        h2_conn_watched().await.0
    }

    /// Also reports, once the client side ends, whether its last frame was a
    /// GOAWAY with NO_ERROR (a tap between client and server reads the frames).
    async fn h2_conn_watched() -> (Arc<PooledConn>, tokio::sync::oneshot::Receiver<bool>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (a, mut tap_in) = duplex(1 << 16);
        let (mut tap_out, b) = duplex(1 << 16);
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let mut preface = [0u8; 24];
            let mut last = None;
            if tap_in.read_exact(&mut preface).await.is_ok()
                && tap_out.write_all(&preface).await.is_ok()
            {
                let mut head = [0u8; 9];
                while tap_in.read_exact(&mut head).await.is_ok() {
                    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                    let mut payload = vec![0u8; len];
                    if tap_in.read_exact(&mut payload).await.is_err() {
                        break;
                    }
                    last = Some((head[3], payload.get(4..8).map(|c| c.to_vec())));
                    let _ = tap_out.write_all(&head).await;
                    let _ = tap_out.write_all(&payload).await;
                }
            }
            let goaway = last == Some((7, Some(vec![0, 0, 0, 0])));
            let _ = tx.send(goaway);
        });
        tokio::spawn(async move {
            let mut srv = h2::server::handshake(b).await.unwrap();
            while let Some(Ok((_req, mut respond))) = srv.accept().await {
                let _ = respond.send_response(http::Response::new(()), false);
            }
        });
        let (sender, conn) = h2::client::handshake(a).await.unwrap();
        let lifeline = Arc::new(Lifeline::default());
        let driver = lifeline.clone();
        let (streams, inbox) = super::super::together::channel();
        let main = async move {
            let _ = conn.await;
            driver.close();
        };
        tokio::spawn(super::super::together::together(main, inbox));
        (PooledConn::new(sender, lifeline, streams), rx)
    }

    #[tokio::test]
    async fn drain_closes_idle_connections_and_busy_ones_after_their_streams() {
        let pool = Pool::new(100, Duration::from_secs(60));
        let (idle, idle_end) = h2_conn_watched().await;
        drop(
            pool.get(key(), || async { Ok::<_, ()>(idle) })
                .await
                .unwrap(),
        );
        let mut other = key();
        other.addr = "10.0.0.4:15008".parse().unwrap();
        let (busy, mut busy_end) = h2_conn_watched().await;
        let lease = pool
            .get(other, || async { Ok::<_, ()>(busy) })
            .await
            .unwrap();
        let req = http::Request::builder()
            .method("CONNECT")
            .uri("10.0.0.4:8080")
            .body(())
            .unwrap();
        let mut sender = lease.sender().ready().await.unwrap();
        let (_resp, _stream) = sender.send_request(req, false).unwrap();
        drop(sender);
        assert_eq!(pool.open(), 2);
        pool.drain();
        assert_eq!(pool.open(), 0);
        let clean = tokio::time::timeout(Duration::from_secs(2), idle_end).await;
        assert_eq!(
            clean.ok().and_then(Result::ok),
            Some(true),
            "idle connection ends with GOAWAY (NO_ERROR)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            busy_end.try_recv().is_err(),
            "a connection with a stream in flight stays open"
        );
        drop((_resp, _stream, lease));
        let clean = tokio::time::timeout(Duration::from_secs(2), busy_end).await;
        assert_eq!(
            clean.ok().and_then(Result::ok),
            Some(true),
            "busy connection ends with GOAWAY after its stream"
        );
    }

    fn key() -> PoolKey {
        PoolKey {
            pod: "default/a".into(),
            src: Identity::new("td", "a", "a"),
            dst: vec![Identity::new("td", "b", "b")],
            addr: "10.0.0.3:15008".parse().unwrap(),
        }
    }

    #[tokio::test]
    async fn burst_dials_once_and_reuses() {
        let pool = Pool::new(100, Duration::from_secs(60));
        let mut leases = Vec::new();
        let futs: Vec<_> = (0..50)
            .map(|_| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    pool.get(key(), || async {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<_, ()>(h2_conn().await)
                    })
                    .await
                    .unwrap()
                })
            })
            .collect();
        for f in futs {
            leases.push(f.await.unwrap());
        }
        assert_eq!(pool.dials(), 1, "a burst must share one dial");
        assert_eq!(pool.open(), 1);
    }

    #[tokio::test]
    async fn a_stalled_dial_holds_later_callers_only_for_the_join_wait() {
        let pool = Pool::new(100, Duration::from_secs(60));
        let stalled = {
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.get(key(), || async {
                    std::future::pending::<()>().await;
                    Ok::<_, ()>(h2_conn().await)
                })
                .await
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let start = Instant::now();
        let lease = pool
            .get(key(), || async { Ok::<_, ()>(h2_conn().await) })
            .await
            .unwrap();
        let waited = start.elapsed();
        assert!(
            waited >= JOIN_WAIT && waited < JOIN_WAIT + Duration::from_millis(400),
            "waited {waited:?} behind a dial that never ends"
        );
        drop(lease);
        // A caller that comes now finds the connection, not the stall.
        let start = Instant::now();
        let _lease = pool
            .get(key(), || async { Ok::<_, ()>(h2_conn().await) })
            .await
            .unwrap();
        assert!(start.elapsed() < Duration::from_millis(100));
        assert_eq!(pool.dials(), 1);
        stalled.abort();
    }

    #[tokio::test]
    async fn a_removed_pods_connections_are_let_go_and_close() {
        let pool = Pool::new(100, Duration::from_secs(300));
        let (conn, ended) = h2_conn_watched().await;
        drop(
            pool.get(key(), || async { Ok::<_, ()>(conn) })
                .await
                .unwrap(),
        );
        let mut other = key();
        other.pod = "default/b".into();
        drop(
            pool.get(other, || async { Ok::<_, ()>(h2_conn().await) })
                .await
                .unwrap(),
        );
        drop(PoolPodGuard {
            pool: pool.clone(),
            pod: "default/a".into(),
        });
        assert_eq!(pool.open(), 1, "only the other pod's connection is kept");
        let clean = tokio::time::timeout(Duration::from_secs(2), ended).await;
        assert_eq!(
            clean.ok().and_then(Result::ok),
            Some(true),
            "the removed pod's connection ends with GOAWAY, long before its idle timeout"
        );
    }

    #[tokio::test]
    async fn full_connection_gets_a_sibling_and_idle_ones_are_evicted() {
        let pool = Pool::new(2, Duration::from_millis(50));
        let mut leases = Vec::new();
        for _ in 0..3 {
            leases.push(
                pool.get(key(), || async { Ok::<_, ()>(h2_conn().await) })
                    .await
                    .unwrap(),
            );
        }
        assert_eq!(pool.dials(), 2, "third stream needs a second connection");
        drop(leases);
        tokio::time::sleep(Duration::from_millis(80)).await;
        pool.evict();
        assert_eq!(pool.open(), 0, "idle connections must be released");
    }
}
