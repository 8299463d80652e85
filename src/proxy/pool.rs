//! The outbound HBONE connection pool: HTTP/2 connections keyed by (source
//! identity, destination identities, destination address), many streams each.
//!
//! A per-key dial lock means a burst of connections to one destination makes
//! one TLS handshake, not a hundred. A connection serves at most
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
    closed: Arc<AtomicBool>,
    idle_since: Mutex<Instant>,
}

impl PooledConn {
    /// `closed` is set by whoever drives the connection when it ends.
    pub fn new(sender: SendRequest<Bytes>, closed: Arc<AtomicBool>) -> Arc<Self> {
        Arc::new(PooledConn {
            sender,
            active: AtomicUsize::new(0),
            closed,
            idle_since: Mutex::new(Instant::now()),
        })
    }

    fn usable(&self, max: usize) -> bool {
        !self.closed.load(Ordering::Acquire) && self.active.load(Ordering::Acquire) < max
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

#[derive(Debug, Default)]
struct Entry {
    dial: tokio::sync::Mutex<()>,
    conns: Mutex<Vec<Arc<PooledConn>>>,
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
        let _dialing = entry.dial.lock().await;
        if let Some(lease) = entry.pick(self.max_streams) {
            return Ok(lease);
        }
        let conn = dial().await?;
        self.dials.fetch_add(1, Ordering::Relaxed);
        let lease = Lease::new(conn.clone());
        entry
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(conn);
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
                !c.closed.load(Ordering::Acquire) && !idle
            });
            !conns.is_empty()
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::duplex;

    async fn h2_conn() -> Arc<PooledConn> {
        let (a, b) = duplex(1 << 16);
        tokio::spawn(async move {
            let mut srv = h2::server::handshake(b).await.unwrap();
            while let Some(Ok(_)) = srv.accept().await {}
        });
        let (sender, conn) = h2::client::handshake(a).await.unwrap();
        let closed = Arc::new(AtomicBool::new(false));
        let flag = closed.clone();
        tokio::spawn(async move {
            let _ = conn.await;
            flag.store(true, Ordering::Release);
        });
        PooledConn::new(sender, closed)
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
