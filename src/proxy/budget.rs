//! The proxy-wide budget for bytes held on behalf of peers
//! (docs/wire.md §10).
//!
//! What a peer can make the proxy hold is bounded by construction, not by
//! hoping it reads: each HBONE connection the proxy accepts reserves the
//! receive window it grants, and each stream reserves the most it may
//! queue: its read buffer before it is served, and its HTTP/2 send buffer
//! once it first has data to send (so the idle connections of a client's
//! pool cost little). A reservation is given back when its stream or
//! connection ends. Past the budget a new stream is refused
//! (`REFUSED_STREAM` inbound; the application's connection closed
//! outbound), a stream that starts sending is reset (`CANCEL`), and an
//! HBONE connection gets smaller windows, then is refused; memory does not
//! grow.
//!
//! No one may take the whole budget: one peer identity may reserve at most
//! a quarter of it, and the streams to one pod at most half, so a
//! misbehaving workload cannot starve the rest of the node. A connection
//! gets the configured (large) windows only while the budget is less than
//! half reserved and its peer holds less than half its share; otherwise
//! 1 MiB, which is still far above a cluster network's bandwidth-delay
//! product.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::hbone::H2Settings;
use crate::identity::Identity;

/// What one HTTP/2 stream may queue towards its peer before it stops
/// taking data from its TCP side (h2's per-stream send buffer).
pub const STREAM_SEND_BUFFER: usize = 256 * 1024;

/// The most a stream's read buffer grows to, for bulk flows.
pub const STREAM_READ_BUFFER: usize = 256 * 1024;

/// A stream's read buffer to start with (idle and small flows keep it).
pub const STREAM_READ_START: usize = 16 * 1024;

/// What a stream reserves before it is served: its read buffer as it
/// starts (allocated only while its source has data).
pub const STREAM_OPEN_COST: usize = STREAM_READ_START;

/// A sending stream's whole reservation: [`STREAM_OPEN_COST`], and its send
/// buffer, added ([`Reservation::grow`]) when it first has data to send. A
/// read buffer that grows for a bulk flow reserves the rest
/// ([`Budget::grow_read_buffer`]). The reservation is what a peer could
/// make the stream hold.
#[cfg(test)]
pub const STREAM_COST: usize = STREAM_SEND_BUFFER + STREAM_OPEN_COST;

/// Windows an HBONE connection gets when the budget is more than half
/// reserved: still far above a cluster network's bandwidth-delay product.
const REDUCED_CONNECTION_WINDOW: u32 = 1 << 20;
const REDUCED_STREAM_WINDOW: u32 = 256 * 1024;

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The proxy-wide budget is spent.
    Budget,
    /// The peer identity holds its share (a quarter).
    Peer,
    /// The destination pod's streams hold their share (a half).
    Pod,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::Budget => "memory budget spent",
            Refusal::Peer => "peer identity holds its share of the memory budget",
            Refusal::Pod => "destination pod holds its share of the memory budget",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Refusal::Budget => "budget",
            Refusal::Peer => "peer",
            Refusal::Pod => "pod",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RefusedLabels {
    reason: &'static str,
}

/// How much of the limit a reservation may bring the budget to (`1/whole`)
/// and its peer's share to (`1/peer`).
#[derive(Debug, Clone, Copy)]
struct Shares {
    whole: usize,
    peer: usize,
}

impl Shares {
    const WHOLE: Shares = Shares { whole: 1, peer: 4 };
}

/// The budget of one proxy process.
#[derive(Debug, Default)]
pub struct Budget {
    /// Bytes; 0 means no budget (nothing is refused).
    limit: AtomicUsize,
    used: AtomicUsize,
    by_peer: Mutex<HashMap<Identity, usize>>,
    by_pod: Mutex<HashMap<Arc<str>, usize>>,
    refused: Family<RefusedLabels, Counter>,
}

/// The one budget of this process.
pub static BUDGET: LazyLock<Budget> = LazyLock::new(Budget::default);

/// Bytes held in a budget until dropped.
#[derive(Debug)]
#[must_use]
pub struct Reservation {
    budget: &'static Budget,
    bytes: usize,
    peer: Option<Identity>,
    pod: Option<Arc<str>>,
}

impl Reservation {
    /// Adds `bytes` under the same peer and pod shares, or says which is
    /// spent (counted as a refusal); a refusal leaves the reservation as
    /// it was.
    pub fn grow(&mut self, bytes: usize) -> Result<(), Refusal> {
        let mut more = self
            .budget
            .reserve(bytes, self.peer.as_ref(), self.pod.as_ref())?;
        // Merged into this one: `more` gives nothing back when dropped.
        self.bytes += std::mem::take(&mut more.bytes);
        more.peer = None;
        more.pod = None;
        Ok(())
    }

    /// Gives back `bytes` of this reservation (at most what it holds).
    pub fn shrink(&mut self, bytes: usize) {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        // Those bytes under the same shares, given back as it drops.
        drop(Reservation {
            budget: self.budget,
            bytes,
            peer: self.peer.clone(),
            pod: self.pod.clone(),
        });
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes == 0 {
            // Nothing to give back, and no share entry to touch: an empty
            // reservation never made one (`try_reserve`), and one emptied by
            // `shrink` gave its bytes back then. No lock taken.
            return;
        }
        let b = self.budget;
        b.used.fetch_sub(self.bytes, Ordering::AcqRel);
        if let Some(peer) = self.peer.take() {
            release(&b.by_peer, peer, self.bytes);
        }
        if let Some(pod) = self.pod.take() {
            release(&b.by_pod, pod, self.bytes);
        }
    }
}

fn held<K: std::hash::Hash + Eq>(map: &HashMap<K, usize>, key: &K) -> usize {
    map.get(key).copied().unwrap_or(0)
}

fn release<K: std::hash::Hash + Eq>(map: &Mutex<HashMap<K, usize>>, key: K, bytes: usize) {
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(held) = map.get_mut(&key) {
        *held = held.saturating_sub(bytes);
        if *held == 0 {
            map.remove(&key);
        }
    }
}

impl Budget {
    /// Sets the budget in bytes; 0: none.
    pub fn set_limit(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::Release);
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Acquire)
    }

    /// Bytes reserved now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// Reserves `bytes` for `peer` (if known) towards `pod` (if known),
    /// or says which share is spent. Refusals are counted.
    pub fn reserve(
        &'static self,
        bytes: usize,
        peer: Option<&Identity>,
        pod: Option<&Arc<str>>,
    ) -> Result<Reservation, Refusal> {
        self.try_reserve(bytes, peer, pod, Shares::WHOLE)
            .inspect_err(|r| {
                self.refused
                    .get_or_create(&RefusedLabels { reason: r.label() })
                    .inc();
            })
    }

    /// As [`Budget::reserve`], within the given shares of the limit; not
    /// counted when refused.
    fn try_reserve(
        &'static self,
        bytes: usize,
        peer: Option<&Identity>,
        pod: Option<&Arc<str>>,
        shares: Shares,
    ) -> Result<Reservation, Refusal> {
        let limit = self.limit();
        let unbounded = limit == 0;
        // Shares first, under their locks, so two streams of one peer cannot both pass.
        let mut peers = self.by_peer.lock().unwrap_or_else(|e| e.into_inner());
        let mut pods = self.by_pod.lock().unwrap_or_else(|e| e.into_inner());
        if !unbounded {
            if peer.is_some_and(|p| held(&peers, p) + bytes > limit / shares.peer) {
                return Err(Refusal::Peer);
            }
            if pod.is_some_and(|p| held(&pods, p) + bytes > limit / 2) {
                return Err(Refusal::Pod);
            }
        }
        let cap = if unbounded {
            usize::MAX
        } else {
            limit / shares.whole
        };
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|n| *n <= cap)
            })
            .map_err(|_| Refusal::Budget)?;
        // A share entry only for bytes held, so that every entry is one a
        // drop will take away.
        if let (Some(p), true) = (peer, bytes > 0) {
            *peers.entry(p.clone()).or_default() += bytes;
        }
        if let (Some(p), true) = (pod, bytes > 0) {
            *pods.entry(p.clone()).or_default() += bytes;
        }
        Ok(Reservation {
            budget: self,
            bytes,
            peer: peer.cloned(),
            pod: pod.cloned(),
        })
    }

    /// Room for a stream's read buffer to grow from its start to
    /// [`STREAM_READ_BUFFER`] (a bulk flow); `None` keeps it small. Not
    /// counted as a refusal: the stream goes on, only slower.
    pub fn grow_read_buffer(&'static self, start: usize) -> Option<Reservation> {
        let more = STREAM_READ_BUFFER.saturating_sub(start);
        self.try_reserve(more, None, None, Shares::WHOLE).ok()
    }

    /// The windows an inbound HBONE connection from `peer` gets, with their
    /// reservation: the configured ones while the budget is under half
    /// reserved, smaller ones past that, none (refused) when even those do
    /// not fit.
    pub fn connection(
        &'static self,
        h2: H2Settings,
        peer: &Identity,
    ) -> Result<(H2Settings, Reservation), Refusal> {
        let full = h2.connection_window as usize;
        // Full windows only while they leave the budget half free, and the
        // peer half of its share for its streams.
        let roomy = Shares { whole: 2, peer: 8 };
        if let Ok(r) = self.try_reserve(full, Some(peer), None, roomy) {
            return Ok((h2, r));
        }
        let reduced = H2Settings {
            connection_window: h2.connection_window.min(REDUCED_CONNECTION_WINDOW),
            stream_window: h2.stream_window.min(REDUCED_STREAM_WINDOW),
            ..h2
        };
        let r = self.reserve(reduced.connection_window as usize, Some(peer), None)?;
        Ok((reduced, r))
    }

    /// Registers the budget's gauges and refusal counter.
    pub fn register(&'static self, registry: &mut Registry) {
        let limit = Gauge::<i64>::default();
        limit.set(self.limit() as i64);
        registry.register(
            "ambit_memory_budget_bytes",
            "The proxy-wide budget for bytes held on behalf of peers (0: none)",
            limit,
        );
        registry.register_collector(Box::new(UsedCollector(self)));
        registry.register(
            "ambit_memory_budget_refused",
            "Connections and streams refused or given smaller windows by the memory budget",
            self.refused.clone(),
        );
    }
}

/// Reads the reserved bytes at scrape time.
#[derive(Debug)]
struct UsedCollector(&'static Budget);

impl prometheus_client::collector::Collector for UsedCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        let g = Gauge::<i64>::default();
        g.set(self.0.used() as i64);
        let metric = encoder.encode_descriptor(
            "ambit_memory_budget_used_bytes",
            "Bytes reserved in the memory budget now",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        prometheus_client::encoding::EncodeMetric::encode(&g, metric)
    }
}

/// The default budget: half the memory limit of the proxy's cgroup (the
/// rest is for the process itself, its allocator's slack and the kernel's
/// socket buffers, which the cgroup also charges), or 1 GiB without one.
pub fn default_limit() -> usize {
    let cgroup_max = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok());
    match cgroup_max {
        Some(max) => max / 2,
        None => 1 << 30,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limit: usize) -> &'static Budget {
        let b: &'static Budget = Box::leak(Box::default());
        b.set_limit(limit);
        b
    }

    #[test]
    fn one_peer_gets_a_quarter_one_pod_a_half_and_everything_comes_back() {
        let b = budget(400);
        let (mallory, alice) = (
            Identity::new("td", "ns", "mallory"),
            Identity::new("td", "ns", "alice"),
        );
        let (victim, other): (Arc<str>, Arc<str>) = ("ns/victim".into(), "ns/other".into());
        let m1 = b.reserve(60, Some(&mallory), Some(&victim)).unwrap();
        let _m2 = b.reserve(40, Some(&mallory), Some(&victim)).unwrap();
        assert_eq!(
            b.reserve(1, Some(&mallory), Some(&other)).unwrap_err(),
            Refusal::Peer
        );
        // Others still get in, to the same pod up to its half.
        let a1 = b.reserve(100, Some(&alice), Some(&victim)).unwrap();
        assert_eq!(
            b.reserve(1, Some(&Identity::new("td", "ns", "bob")), Some(&victim))
                .unwrap_err(),
            Refusal::Pod
        );
        assert_eq!(b.used(), 200);
        drop(m1);
        assert!(b.reserve(60, Some(&mallory), Some(&other)).is_ok());
        drop(a1);
        assert_eq!(b.used(), 40);
        assert!(b.by_pod.lock().unwrap().get(&victim) == Some(&40));
    }

    #[test]
    fn a_stream_grows_by_its_send_buffer_under_its_shares_and_gives_it_back_when_quiet() {
        let b = budget(400);
        let mallory = Identity::new("td", "ns", "mallory");
        let pod: Arc<str> = "ns/victim".into();
        // Many idle streams of one peer fit where sending ones would not.
        let mut idle: Vec<Reservation> = (0..10)
            .map(|_| b.reserve(5, Some(&mallory), Some(&pod)).unwrap())
            .collect();
        idle[0].grow(40).unwrap();
        assert_eq!(idle[1].grow(40).unwrap_err(), Refusal::Peer);
        assert_eq!(b.used(), 90, "a refused growth leaves the stream as it was");
        idle[0].shrink(40);
        idle[1].grow(40).unwrap();
        assert_eq!(b.by_peer.lock().unwrap().get(&mallory), Some(&90));
        idle.clear();
        assert_eq!(b.used(), 0);
        assert!(b.by_peer.lock().unwrap().is_empty());
        assert!(b.by_pod.lock().unwrap().is_empty());
    }

    #[test]
    fn an_empty_reservation_leaves_no_share_entry_and_drops_without_a_lock() {
        let b = budget(400);
        let mallory = Identity::new("td", "ns", "mallory");
        let pod: Arc<str> = "ns/victim".into();
        let empty = b.reserve(0, Some(&mallory), Some(&pod)).unwrap();
        assert!(b.by_peer.lock().unwrap().is_empty(), "no entry for 0 bytes");
        assert!(b.by_pod.lock().unwrap().is_empty());
        let mut emptied = b.reserve(40, Some(&mallory), Some(&pod)).unwrap();
        emptied.shrink(usize::MAX);
        assert!(b.by_pod.lock().unwrap().is_empty(), "given back by shrink");
        // Both drop on another thread while the share maps are held locked
        // here: a drop that took a lock would not finish.
        let (peers, pods) = (b.by_peer.lock().unwrap(), b.by_pod.lock().unwrap());
        let (done, dropped) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop((empty, emptied));
            let _ = done.send(());
        });
        let finished = dropped.recv_timeout(std::time::Duration::from_secs(2));
        drop((peers, pods));
        assert!(
            finished.is_ok(),
            "an empty reservation's drop waited for a lock"
        );
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn past_the_budget_streams_are_refused_and_connections_get_smaller_windows() {
        let b = budget(128 << 20);
        let h2 = H2Settings {
            stream_window: 4 << 20,
            connection_window: 16 << 20,
            frame_size: 1 << 20,
            unsent_limit: 0,
        };
        let peers: Vec<Identity> = (0..8)
            .map(|i| Identity::new("td", "ns", &format!("sa{i}")))
            .collect();
        let mut conns = Vec::new();
        for p in &peers[..4] {
            let (granted, r) = b.connection(h2, p).unwrap();
            assert_eq!(granted.connection_window, 16 << 20);
            conns.push(r);
        }
        // Half reserved: the next ones get 1 MiB windows.
        let (reduced, _r) = b.connection(h2, &peers[4]).unwrap();
        assert_eq!(
            (reduced.connection_window, reduced.stream_window),
            (1 << 20, 256 << 10)
        );
        // A peer holding half its share gets the smaller windows too.
        let (second, _r2) = b.connection(h2, &peers[0]).unwrap();
        assert_eq!(second.connection_window, 1 << 20);
        let mut held = Vec::new();
        let refused = loop {
            match b.reserve(STREAM_COST, Some(&peers[5 + held.len() % 3]), None) {
                Ok(r) => held.push(r),
                Err(e) => break e,
            }
        };
        assert_eq!(refused, Refusal::Budget);
        assert!(b.used() <= 128 << 20);
        assert!(b.connection(h2, &peers[6]).is_err());
        assert!(b.grow_read_buffer(STREAM_READ_START).is_none());
        assert_eq!(
            b.refused
                .get_or_create(&RefusedLabels { reason: "budget" })
                .get(),
            2
        );
        drop(held);
        assert_eq!(b.used(), 66 << 20);
    }

    #[test]
    fn no_budget_refuses_nothing() {
        let b = budget(0);
        let p = Identity::new("td", "ns", "p");
        let held: Vec<_> = (0..100)
            .map(|_| b.reserve(1 << 30, Some(&p), None).unwrap())
            .collect();
        assert_eq!(held.len(), 100);
    }
}
