//! The proxy-wide budget for bytes held on behalf of peers
//! (docs/wire.md §10).
//!
//! What a peer can make the proxy hold is bounded by construction, not by
//! hoping it reads: each HBONE connection, accepted or dialed, reserves
//! the receive window it grants its peer, and each stream reserves the most it may
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
//! misbehaving workload cannot starve the rest of the node.
//!
//! HBONE connections, the ones the proxy accepts and the ones it dials,
//! share half the budget equally ([`fair_windows`]): each reserves the
//! receive windows it grants its peer, the configured (large) ones while
//! they all fit in that half, and past it the same smaller power-of-two
//! windows (down to 64 KiB / 16 KiB, at which a budget of 1 GiB holds
//! 16,384 connections); every connection moves to the new share when it
//! moves. The share is among the connections that carry streams: an idle
//! one ([`windows::IDLE_WINDOWS_AFTER`] without a stream) keeps the smallest
//! windows, so a node's thousands of pooled connections do not shrink the
//! windows of the few that carry its flows. Equal windows matter: on a
//! loaded proxy a flow's rate follows its window, and when the first
//! connections kept 16 MiB while later ones got 1 MiB, 50 flows through
//! one shared proxy ran 5–7× apart. A connection also keeps its peer
//! under half the peer's share, or gets the smallest windows.
//!
//! The share falls as soon as a connection makes it fall, so that the
//! reservations stay within the budget, but rises only once the
//! connections are an eighth fewer than the step ([`Budget::publish`]): a
//! peer opening and closing one connection at a step cannot wake every
//! other connection each time. A window that shrinks leaves the peer the
//! credit it already had: what a connection holds can stay above its
//! reservation, by at most its largest window, until the application
//! reads (docs/wire.md §10).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use super::activity::Activity;
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

/// The smallest windows an HBONE connection gets, when the budget is more
/// than half reserved or the share is smaller: HTTP/2's own starting
/// connection window (64 KiB, which carries 2.6 Gbit/s over a 200 µs round
/// trip). A budget of 1 GiB holds 16,384 connections at it, 4,096 with one
/// peer identity. At 256 KiB it held 1,024 with one identity, and a node
/// of 1,000 pods refused the pod every other pod talks to once 512 of them
/// had (`cargo bench --bench node`): each pair keeps a connection each way
/// in the pool, and both count in that pod's identity's quarter.
const REDUCED_CONNECTION_WINDOW: u32 = 64 * 1024;
const REDUCED_STREAM_WINDOW: u32 = 16 * 1024;

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
    /// HBONE connections now, inbound and outbound.
    connections: Mutex<Counted>,
    /// Each HBONE connection's share of half the budget, as a power of
    /// two (bytes; 0 before the first connection), between the smallest
    /// windows and the largest configured: sent only when it moves
    /// ([`Budget::publish`]), so a connection coming or going wakes the
    /// others only when their windows change.
    share: watch::Sender<usize>,
    /// The largest connection window configured on a connection yet.
    ceiling: AtomicUsize,
}

/// HBONE connections counted in the budget's share: all of them, and
/// those carrying streams (a busy [`ConnectionWindows`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counted {
    all: usize,
    busy: usize,
}

impl Counted {
    /// `n` connections, every one carrying streams.
    #[cfg(test)]
    fn busy(n: usize) -> Counted {
        Counted { all: n, busy: n }
    }
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
        let more = self
            .budget
            .reserve(bytes, self.peer.as_ref(), self.pod.as_ref())?;
        self.merge(more);
        Ok(())
    }

    /// As [`Reservation::grow`], within `shares`; not counted when refused.
    fn try_grow(&mut self, bytes: usize, shares: Shares) -> Result<(), Refusal> {
        let more = self
            .budget
            .try_reserve(bytes, self.peer.as_ref(), self.pod.as_ref(), shares)?;
        self.merge(more);
        Ok(())
    }

    /// Takes `more`'s bytes into this one: `more` gives nothing back when dropped.
    fn merge(&mut self, mut more: Reservation) {
        self.bytes += std::mem::take(&mut more.bytes);
        more.peer = None;
        more.pod = None;
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

    /// Whether an HBONE connection with one of `peers` would get even the
    /// smallest windows now, checked before dialing so that a dial the
    /// budget is going to refuse costs no handshake with the destination.
    /// A refusal here is counted; a pass reserves nothing (the reservation
    /// after the handshake, [`Budget::connection`], decides).
    pub fn admits_connection(&self, h2: H2Settings, peers: &[Identity]) -> Result<(), Refusal> {
        let limit = self.limit();
        if limit == 0 {
            return Ok(());
        }
        let smallest = fair_windows(h2, 0).connection_window as usize;
        let refusal = if self.used() + smallest > limit {
            Some(Refusal::Budget)
        } else {
            let held = self.by_peer.lock().unwrap_or_else(|e| e.into_inner());
            let room = |p: &Identity| held.get(p).copied().unwrap_or(0) + smallest <= limit / 4;
            (!peers.is_empty() && !peers.iter().any(room)).then_some(Refusal::Peer)
        };
        match refusal {
            None => Ok(()),
            Some(r) => {
                self.refused
                    .get_or_create(&RefusedLabels { reason: r.label() })
                    .inc();
                Err(r)
            }
        }
    }

    /// Room for a stream's read buffer to grow from its start to
    /// [`STREAM_READ_BUFFER`] (a bulk flow); `None` keeps it small. Not
    /// counted as a refusal: the stream goes on, only slower.
    pub fn grow_read_buffer(&'static self, start: usize) -> Option<Reservation> {
        let more = STREAM_READ_BUFFER.saturating_sub(start);
        self.try_reserve(more, None, None, Shares::WHOLE).ok()
    }

    /// The receive windows an HBONE connection with `peer` (accepted from
    /// it, or dialed to it) grants, reserved for its life and moved with
    /// the share ([`ConnectionWindows`]): the fair ones if they fit while
    /// leaving half the budget free and the peer half its share, else the
    /// smallest; refused when even those do not fit.
    pub fn connection(
        &'static self,
        h2: H2Settings,
        peer: &Identity,
        streams: Arc<Activity>,
    ) -> Result<(H2Settings, ConnectionWindows), Refusal> {
        self.ceiling
            .fetch_max(h2.connection_window as usize, Ordering::AcqRel);
        // Busy from the start: it is opened for a stream.
        let share = self.count(1, 1);
        // Counted in from here; its drop counts it out, refused or not.
        let mut windows = ConnectionWindows {
            budget: self,
            configured: h2,
            granted: fair_windows(h2, 0),
            reservation: Reservation {
                budget: self,
                bytes: 0,
                peer: Some(peer.clone()),
                pod: None,
            },
            share: self.share.subscribe(),
            streams,
            busy: true,
            idle_check: None,
            carried: false,
        };
        let fair = fair_windows(h2, share);
        let granted =
            match self.try_reserve(fair.connection_window as usize, Some(peer), None, ROOMY) {
                Ok(r) => {
                    windows.reservation.merge(r);
                    fair
                }
                Err(_) => {
                    let smallest = windows.granted;
                    let r = self.reserve(smallest.connection_window as usize, Some(peer), None)?;
                    windows.reservation.merge(r);
                    smallest
                }
            };
        windows.granted = granted;
        windows.share.mark_unchanged();
        Ok((granted, windows))
    }

    /// Counts connections in (`all`) or out, and busy ones (`busy`, a
    /// connection that starts or stops carrying streams), and moves the
    /// share; returns the share now.
    fn count(&self, all: isize, busy: isize) -> usize {
        let mut n = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        n.all = n.all.saturating_add_signed(all);
        n.busy = n.busy.saturating_add_signed(busy);
        self.publish(*n)
    }

    /// Moves the share for `n` connections, if it must; returns the share
    /// now. It falls at once to what `n` connections make; it rises only
    /// to what an eighth more busy ones (at least one more) would make, so
    /// that after a fall at a step it rises again only once an eighth of
    /// the busy connections have gone, not when the one that crossed the
    /// step goes. A peer churning one connection at a step wakes every
    /// other busy connection once, not at every turn; each rise costs it
    /// an eighth of them. Called under the count's lock, so shares go out
    /// in the count's order.
    fn publish(&self, n: Counted) -> usize {
        let bounded = |n| {
            share_of(self.limit(), n)
                .min(self.ceiling.load(Ordering::Acquire))
                .max(REDUCED_CONNECTION_WINDOW as usize)
        };
        let more = (n.busy / 8).max(1);
        let (fits, risen) = (
            bounded(n),
            bounded(Counted {
                all: n.all + more,
                busy: n.busy + more,
            }),
        );
        let mut now = 0;
        self.share.send_if_modified(|s| {
            let next = if fits < *s { fits } else { risen.max(*s) };
            let moved = *s != next;
            *s = next;
            now = next;
            moved
        });
        now
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
            "Connections and streams refused by the memory budget",
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

/// How much of the limit a connection's fair windows may bring the
/// budget to (half) and its peer's share to (half of a quarter).
const ROOMY: Shares = Shares { whole: 2, peer: 8 };

/// Each busy HBONE connection's share of half of `limit`, once the idle
/// ones have the smallest windows, rounded down to a power of two, so that
/// it moves only when the count crosses a step; unbounded without a limit.
fn share_of(limit: usize, n: Counted) -> usize {
    if limit == 0 {
        return usize::MAX;
    }
    let idle = n.all.saturating_sub(n.busy);
    let left = (limit / 2).saturating_sub(idle.saturating_mul(REDUCED_CONNECTION_WINDOW as usize));
    let each = left / n.busy.max(1);
    if each == 0 {
        0
    } else {
        1 << each.ilog2()
    }
}

/// The windows a connection gets from its `share` of the budget: the
/// configured ones when they fit in it, else a connection window of the
/// share (at least [`REDUCED_CONNECTION_WINDOW`]) and a stream window
/// smaller in the same proportion (at least [`REDUCED_STREAM_WINDOW`]).
/// A share of 0 gives the smallest.
pub fn fair_windows(h2: H2Settings, share: usize) -> H2Settings {
    let full = h2.connection_window as u64;
    if share as u64 >= full {
        return h2;
    }
    let floor = REDUCED_CONNECTION_WINDOW.min(h2.connection_window) as u64;
    let connection = (share as u64).clamp(floor, full);
    let stream_floor = REDUCED_STREAM_WINDOW.min(h2.stream_window) as u64;
    let stream = (h2.stream_window as u64 * connection / full.max(1))
        .clamp(stream_floor, h2.stream_window as u64);
    H2Settings {
        connection_window: connection as u32,
        stream_window: stream as u32,
        ..h2
    }
}

mod windows;
pub use windows::{ConnectionWindows, ReceiveWindows, WindowRetry};

#[cfg(test)]
mod tests;
