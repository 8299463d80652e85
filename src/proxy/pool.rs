//! The outbound HBONE connection pool: HTTP/2 connections keyed by (source
//! identity, destination identities, destination address), many streams each.
//!
//! A burst of connections to one destination makes few TLS handshakes, not a
//! hundred: callers that find a dial under way for their key may wait for it,
//! but only for [`JOIN_WAIT`], and then dial on their own, so one stalled
//! handshake never holds every caller to that destination (no lock is held
//! across a handshake). A key gets up to `spread` connections (the worker
//! threads) before two streams share one: each connection is served by one
//! task at each end, so streams on one connection share one thread's time
//! (eight bulk streams on one connection carried less than one alone). Past
//! that, a stream goes to the connection (or dial under way) with the fewest.
//! A connection serves at most `max_streams` streams at once. Idle
//! connections are closed after `idle_timeout`, dead ones are dropped; an
//! `idle_timeout` of zero turns pooling off: a connection leaves the pool,
//! and closes, as its last stream ends, so each connection a pod makes
//! after a quiet moment is a new TLS handshake.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// tokio's clock (the system's, outside tests): the pool's timing tests
// run on a paused clock, with no real waits.
use tokio::time::Instant;

use bytes::Bytes;
use h2::client::SendRequest;

use super::activity::Activity;
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
    lifeline: Arc<Lifeline>,
    /// The connection's task, where its streams' copies run.
    streams: Streams,
}

impl PooledConn {
    /// `lifeline` is shared with whoever drives the connection, `streams`
    /// leads to that driver's task.
    pub fn new(sender: SendRequest<Bytes>, lifeline: Arc<Lifeline>, streams: Streams) -> Arc<Self> {
        Arc::new(PooledConn {
            sender,
            lifeline,
            streams,
        })
    }

    fn usable(&self, max: usize) -> bool {
        !self.lifeline.is_closed() && self.lifeline.streams.open() < max
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
/// driver that the connection ended, the pool that no one will use it
/// again, and both the streams it carries.
#[derive(Debug)]
pub struct Lifeline {
    closed: AtomicBool,
    released: tokio::sync::Notify,
    streams: Arc<Activity>,
}

impl Lifeline {
    pub fn new(streams: Arc<Activity>) -> Lifeline {
        Lifeline {
            closed: AtomicBool::new(false),
            released: tokio::sync::Notify::new(),
            streams,
        }
    }

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
    /// With pooling off: the entry the connection leaves as its last
    /// stream ends.
    unpool: Option<Arc<Entry>>,
}

impl Lease {
    /// The caller holds `entry`'s lock or owns `conn` alone (a dial not
    /// yet published), so no one can take the connection as this lease
    /// leaves it.
    fn new(conn: Arc<PooledConn>, entry: &Arc<Entry>) -> Self {
        conn.lifeline.streams.enter();
        let unpool = entry.unpooled.then(|| entry.clone());
        Lease { conn, unpool }
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
        if let Some(entry) = self.unpool.take() {
            // Under the entry's lock, where streams are placed: a stream
            // that took the connection between the count and the lock
            // keeps it, and its own lease removes it.
            let mut state = entry.lock();
            if self.conn.lifeline.streams.leave() == 1 {
                state.conns.retain(|c| !Arc::ptr_eq(c, &self.conn));
            }
            return;
        }
        self.conn.lifeline.streams.leave();
    }
}

/// How long a caller waits for a dial another caller has under way before
/// dialing on its own: far above a handshake between nodes, far below the
/// 10 s a stalled one takes to fail.
pub const JOIN_WAIT: Duration = Duration::from_millis(500);

/// A dial under way for a key, and the callers waiting for it.
#[derive(Debug)]
struct Dial {
    /// The streams that will use it: its dialer and those waiting.
    load: AtomicUsize,
    /// Its connection once dialed; dropped unsent if the dial fails or is
    /// given up.
    done: tokio::sync::watch::Receiver<Option<Arc<PooledConn>>>,
}

#[derive(Debug, Default)]
struct Entry {
    state: Mutex<State>,
    /// Pooling off: connections leave the entry as their last stream ends.
    unpooled: bool,
}

#[derive(Debug, Default)]
struct State {
    conns: Vec<Arc<PooledConn>>,
    dials: Vec<Arc<Dial>>,
    /// No dial only to spread streams before this: the last one failed or
    /// was late.
    spread_held_until: Option<Instant>,
}

/// Where [`Entry::pick`] puts a stream.
enum Pick {
    Lease(Lease),
    /// Waits for this dial under way.
    Join(Arc<Dial>),
    /// Dials a connection of its own; `spare`: only to spread streams, an
    /// open connection has room for this one.
    Dial {
        dialing: Dialing,
        spare: bool,
    },
}

/// A caller counted in a dial's load while it waits for it.
struct Waiting(Arc<Dial>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.load.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long a key's streams share its open connections after a dial only
/// to spread them failed or was late.
const SPREAD_HOLD: Duration = Duration::from_secs(30);

/// A dial this caller makes. Until it is published, on drop (failed or
/// cancelled) it leaves the entry and wakes those waiting for it.
struct Dialing {
    entry: Arc<Entry>,
    dial: Arc<Dial>,
    done: tokio::sync::watch::Sender<Option<Arc<PooledConn>>>,
}

impl Dialing {
    fn start(entry: &Arc<Entry>, state: &mut State) -> Self {
        let (done, rx) = tokio::sync::watch::channel(None);
        let dial = Arc::new(Dial {
            load: AtomicUsize::new(1),
            done: rx,
        });
        state.dials.push(dial.clone());
        Dialing {
            entry: entry.clone(),
            dial,
            done,
        }
    }

    /// The dialed connection joins the pool, and those waiting get it.
    fn publish(self, conn: &Arc<PooledConn>) {
        let mut state = self.entry.lock();
        state.dials.retain(|d| !Arc::ptr_eq(d, &self.dial));
        state.conns.push(conn.clone());
        drop(state);
        let _ = self.done.send(Some(conn.clone()));
    }
}

impl Drop for Dialing {
    fn drop(&mut self) {
        // After `publish` this finds nothing left to remove.
        let mut state = self.entry.lock();
        state.dials.retain(|d| !Arc::ptr_eq(d, &self.dial));
    }
}

impl Entry {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where the next stream goes. A connection with no stream first; then,
    /// while the key has fewer than `spread` connections (open or being
    /// dialed), a new one, so that a few bulk streams each get a connection
    /// (and with it a task, a worker thread, at both ends) instead of
    /// sharing one; past that, whichever of the open connections with room
    /// and the dials under way has the fewest streams (an open one on a
    /// tie), so a burst is shared evenly among the dials it set off. A dial
    /// already promised to `max` streams takes no more.
    /// `join`: false, only an open connection or a dial of its own.
    /// `spread` 1: no dial while a connection has room.
    fn pick(self: &Arc<Self>, max: usize, spread: usize, join: bool) -> Pick {
        let mut state = self.lock();
        let alive = state
            .conns
            .iter()
            .filter(|c| !c.lifeline.is_closed())
            .count();
        let least = state
            .conns
            .iter()
            .filter(|c| c.usable(max))
            .map(|c| (c.lifeline.streams.open(), c))
            .min_by_key(|(active, _)| *active)
            .map(|(active, c)| (active, c.clone()));
        if let Some((0, c)) = least {
            return Pick::Lease(Lease::new(c, self));
        }
        let held = state.spread_held_until.is_some_and(|t| Instant::now() < t);
        if alive + state.dials.len() < spread && !held {
            let spare = least.is_some();
            let dialing = Dialing::start(self, &mut state);
            return Pick::Dial { dialing, spare };
        }
        let pending = state
            .dials
            .iter()
            .filter(|_| join)
            .map(|d| (d.load.load(Ordering::Acquire), d))
            .filter(|(load, _)| *load < max)
            .min_by_key(|(load, _)| *load)
            .map(|(load, d)| (load, d.clone()));
        match (least, pending) {
            (Some((active, _)), Some((load, d))) if load < active => Pick::Join(d.joined()),
            (Some((_, c)), _) => Pick::Lease(Lease::new(c, self)),
            (None, Some((_, d))) => Pick::Join(d.joined()),
            (None, None) => Pick::Dial {
                dialing: Dialing::start(self, &mut state),
                spare: false,
            },
        }
    }

    /// No dial only to spread streams for a while.
    fn hold_spreading(&self) {
        self.lock().spread_held_until = Some(Instant::now() + SPREAD_HOLD);
    }
}

impl Dial {
    /// Counts one more caller waiting for this dial.
    fn joined(self: Arc<Self>) -> Arc<Self> {
        self.load.fetch_add(1, Ordering::AcqRel);
        self
    }
}

/// The pool of one proxy.
#[derive(Debug)]
pub struct Pool {
    entries: Mutex<HashMap<PoolKey, Arc<Entry>>>,
    max_streams: usize,
    spread: usize,
    idle_timeout: Duration,
    dials: AtomicUsize,
    /// Told when a key gains an entry: the evictor sleeps while the pool
    /// holds nothing, and wakes for this.
    filled: Arc<tokio::sync::Notify>,
}

impl Pool {
    /// Connections carry up to `max_streams` streams each; a key gets up
    /// to `spread` of them before two streams share one.
    pub fn new(max_streams: usize, spread: usize, idle_timeout: Duration) -> Arc<Self> {
        Arc::new(Pool {
            entries: Mutex::default(),
            max_streams,
            spread,
            idle_timeout,
            dials: AtomicUsize::new(0),
            filled: Arc::default(),
        })
    }

    /// How long a connection carrying no stream is kept.
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// A stream slot for `key`, dialing with `dial` if [`Entry::pick`]
    /// says so. A caller that waits for another's dial waits at most
    /// [`JOIN_WAIT`], and if that dial fails or is late, takes an open
    /// connection with room or dials on its own. A dial only to spread
    /// streams (an open connection has room) is given [`JOIN_WAIT`] too:
    /// if it fails or is late, the stream takes the open connection, and
    /// the key's streams share what is open for [`SPREAD_HOLD`].
    pub async fn get<F, Fut, E>(&self, key: PoolKey, dial: F) -> Result<Lease, E>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<Arc<PooledConn>, E>>,
        E: std::fmt::Display,
    {
        let entry = {
            let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            let was_empty = entries.is_empty();
            let entry = entries
                .entry(key)
                .or_insert_with(|| {
                    Arc::new(Entry {
                        unpooled: self.idle_timeout.is_zero(),
                        ..Entry::default()
                    })
                })
                .clone();
            if was_empty {
                self.filled.notify_one();
            }
            entry
        };
        let mut pick = entry.pick(self.max_streams, self.spread, true);
        if let Pick::Join(joined) = pick {
            let waiting = Waiting(joined);
            let mut done = waiting.0.done.clone();
            let dialed = match tokio::time::timeout(JOIN_WAIT, done.wait_for(Option::is_some)).await
            {
                Ok(Ok(conn)) => conn.clone(),
                // Failed, given up, or late.
                _ => None,
            };
            drop(waiting);
            if let Some(conn) = dialed {
                // Under the entry's lock, as every slot on a published
                // connection is taken: callers woken together by one dial
                // cannot all see its last slot free and take it.
                let _state = entry.lock();
                if conn.usable(self.max_streams) {
                    return Ok(Lease::new(conn, &entry));
                }
            }
            pick = entry.pick(self.max_streams, 1, false);
        }
        let dialing = match pick {
            Pick::Lease(lease) => return Ok(lease),
            Pick::Dial { dialing, spare } if spare => {
                match tokio::time::timeout(JOIN_WAIT, dial()).await {
                    Ok(Ok(conn)) => return Ok(self.dialed(dialing, conn)),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "no second HBONE connection to spread streams over; they share the open one")
                    }
                    Err(_) => tracing::debug!(
                        "a second HBONE connection to spread streams over was late; they share the open one"
                    ),
                }
                drop(dialing);
                entry.hold_spreading();
                match entry.pick(self.max_streams, 1, false) {
                    Pick::Lease(lease) => return Ok(lease),
                    Pick::Dial { dialing, .. } => dialing,
                    Pick::Join(_) => unreachable!("picked without joining"),
                }
            }
            Pick::Dial { dialing, .. } => dialing,
            Pick::Join(_) => unreachable!("picked without joining"),
        };
        let conn = dial().await?;
        Ok(self.dialed(dialing, conn))
    }

    /// A dialed connection joins the pool, with a stream for its dialer.
    fn dialed(&self, dialing: Dialing, conn: Arc<PooledConn>) -> Lease {
        self.dials.fetch_add(1, Ordering::Relaxed);
        let lease = Lease::new(conn.clone(), &dialing.entry);
        dialing.publish(&conn);
        lease
    }

    /// Connections dialed so far (for tests and the admin dump).
    pub fn dials(&self) -> usize {
        self.dials.load(Ordering::Relaxed)
    }

    /// Open connections now.
    pub fn open(&self) -> usize {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.values().map(|e| e.lock().conns.len()).sum()
    }

    /// Drops dead connections and those idle past the timeout (dropping the
    /// last `SendRequest` makes h2 send GOAWAY and close).
    pub fn evict(&self) {
        let now = Instant::now();
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.retain(|_, entry| {
            let mut state = entry.lock();
            state.conns.retain(|c| {
                let idle = c
                    .lifeline
                    .streams
                    .idle_since()
                    .is_some_and(|since| now.duration_since(since) >= self.idle_timeout);
                !c.lifeline.is_closed() && !idle
            });
            !state.conns.is_empty() || !state.dials.is_empty()
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
        let n: usize = entries.values().map(|e| e.lock().conns.len()).sum();
        tracing::debug!(connections = n, "HBONE client pool drained");
    }

    /// Runs [`Pool::evict`] periodically for the life of the pool, while
    /// it holds anything: an empty pool's evictor sleeps until a key gains
    /// an entry, so an idle proxy is not woken for it.
    pub fn spawn_evictor(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let filled = self.filled.clone();
        let every =
            (self.idle_timeout / 2).clamp(Duration::from_millis(100), Duration::from_secs(30));
        tokio::spawn(async move {
            loop {
                let empty = match weak.upgrade() {
                    Some(pool) => {
                        pool.evict();
                        pool.entries
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .is_empty()
                    }
                    None => return,
                };
                if empty {
                    // A key gained since the check left a permit: no loss.
                    filled.notified().await;
                }
                tokio::time::sleep(every).await;
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
mod tests;
