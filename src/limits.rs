//! Process limits: the open-file limit the long-lived roles raise to its
//! hard limit at start (a node proxy holds two descriptors per proxied
//! connection for every pod of its node, the agent one per pod), and the
//! cap on open connections every listener enforces.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use nix::sys::resource::{getrlimit, setrlimit, Resource};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Raises `RLIMIT_NOFILE`'s soft limit to the hard limit; returns the limit
/// in force. A failure is logged and the old limit kept.
pub fn raise_open_files() -> u64 {
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit; keeping it");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-file limit");
            0
        }
    }
}

/// A cap on the connections one listener holds open at once, and
/// optionally on those from one source address (so one client cannot take
/// every place). Past a cap a new connection is accepted and closed at once
/// (the client sees it refused rather than waiting in the backlog), logged
/// at most every ten seconds per listener, and counted in
/// `ambit_listener_connections_refused_total`.
#[derive(Debug, Clone)]
pub struct ConnectionCap {
    listener: &'static str,
    max: usize,
    open: Arc<Semaphore>,
    /// Places one source address may hold; 0: no per-source cap.
    per_source: usize,
    by_source: BySource,
    warned: Arc<LogThrottle>,
    /// Counts the connections open (`istio_tcp_sockets_open`), if set.
    counted: Option<Gauge>,
}

/// Connections open per source address.
type BySource = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// Holds one connection's place under its listener's caps until dropped.
#[derive(Debug)]
pub struct CapSlot {
    _place: OwnedSemaphorePermit,
    source: Option<(IpAddr, BySource)>,
    counted: Option<Gauge>,
}

impl Drop for CapSlot {
    fn drop(&mut self) {
        if let Some(open) = &self.counted {
            open.dec();
        }
        if let Some((ip, by_source)) = self.source.take() {
            let mut m = by_source.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = m.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&ip);
                }
            }
        }
    }
}

impl ConnectionCap {
    pub fn new(listener: &'static str, max: usize) -> Self {
        ConnectionCap {
            listener,
            max,
            open: Arc::new(Semaphore::new(max)),
            per_source: 0,
            by_source: Arc::default(),
            warned: Arc::new(LogThrottle::new(1)),
            counted: None,
        }
    }

    /// Counts the connections this listener holds open in `open`.
    pub fn counted_in(mut self, open: Gauge) -> Self {
        self.counted = Some(open);
        self
    }

    /// Also caps the connections from one source address at a quarter of
    /// the listener's.
    pub fn per_source(mut self) -> Self {
        self.per_source = (self.max / 4).max(1);
        self
    }

    /// A place for one more connection from `source`, or `None` (counted,
    /// logged) when the listener, or the source's share, is full.
    pub fn admit(&self, source: IpAddr) -> Option<CapSlot> {
        let admitted = self
            .open
            .clone()
            .try_acquire_owned()
            .ok()
            .and_then(|place| {
                if self.per_source == 0 {
                    return Some(CapSlot {
                        _place: place,
                        source: None,
                        counted: None,
                    });
                }
                let mut m = self.by_source.lock().unwrap_or_else(|e| e.into_inner());
                let n = m.entry(source).or_default();
                (*n < self.per_source).then(|| {
                    *n += 1;
                    CapSlot {
                        _place: place,
                        source: Some((source, self.by_source.clone())),
                        counted: None,
                    }
                })
            });
        let Some(mut slot) = admitted else {
            self.refused(source);
            return None;
        };
        if let Some(open) = &self.counted {
            open.inc();
            slot.counted = Some(open.clone());
        }
        Some(slot)
    }

    fn refused(&self, source: IpAddr) {
        REFUSED
            .get_or_create(&ListenerLabels {
                listener: self.listener,
            })
            .inc();
        if let Some(unsaid) = self.warned.admit() {
            tracing::warn!(
                listener = self.listener,
                max = self.max,
                per_source = self.per_source,
                src.addr = %source,
                unsaid,
                "connection cap reached: new connections are closed until some end"
            );
        }
    }
}

const WARN_EVERY: Duration = Duration::from_secs(10);

/// At most `burst` log lines per [`WARN_EVERY`] for a kind of event a
/// peer can cause at will (a failed handshake, a full cap), the first line
/// of a period saying how many went unsaid before it: a flood of them
/// cannot flood the log. The one throttle of every such log line.
#[derive(Debug)]
pub struct LogThrottle {
    burst: u32,
    /// When the period began, lines said in it, events unsaid.
    state: Mutex<(Option<Instant>, u32, u64)>,
}

impl LogThrottle {
    pub const fn new(burst: u32) -> Self {
        LogThrottle {
            burst,
            state: Mutex::new((None, 0, 0)),
        }
    }

    /// `Some(n)` when this event may be logged, `n` the events not logged
    /// before it; `None` when it is one of those.
    pub fn admit(&self) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.0.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            s.0 = Some(Instant::now());
            s.1 = 0;
        }
        if s.1 < self.burst {
            s.1 += 1;
            Some(std::mem::take(&mut s.2))
        } else {
            s.2 += 1;
            None
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

static REFUSED: LazyLock<Family<ListenerLabels, Counter>> = LazyLock::new(Family::default);

/// Registers `ambit_listener_connections_refused_total{listener}` (every
/// cap of the process counts into the one family).
pub fn register(registry: &mut Registry) {
    registry.register(
        "ambit_listener_connections_refused",
        "Connections closed on accept because their listener was at its cap",
        REFUSED.clone(),
    );
}

/// Caps per listener (docs/wire.md §10). The pod-facing ones are
/// per pod and high, since they carry the application's own connections;
/// the side ports serve probes, scrapes and operators.
pub mod caps {
    pub const OUTBOUND: usize = 16_384;
    pub const INBOUND_PLAINTEXT: usize = 16_384;
    pub const HBONE: usize = 16_384;
    pub const DNS_TCP: usize = 64;
    pub const SIDE_PORT: usize = 128;
    /// A side port's places kept for its own host (loopback, or a source
    /// that is the address the connection came to: the kubelet's probes of
    /// a host-network pod, a node-local scraper), apart from the
    /// [`SIDE_PORT`] places pods and others share: pods holding those
    /// cannot keep the kubelet from the agent's health port.
    pub const SIDE_PORT_LOCAL: usize = 16;
    pub const AGENT_EVENTS: usize = 256;
    pub const CONTROL_PLANE: usize = 4_096;
    /// HBONE TLS handshakes in progress (before the peer is authenticated)
    /// in the whole proxy, every pod's 15008 together; a quarter per
    /// source. Each buffers up to one handshake flight (about 25 KB, its
    /// first 16 KB record and rustls' state): 1,024 hold at most ~25 MB.
    pub const HBONE_HANDSHAKES: usize = 1_024;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counted_cap_counts_the_connections_it_holds_open() {
        let open = Gauge::default();
        let cap = ConnectionCap::new("test", 4).counted_in(open.clone());
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let (a, b) = (cap.admit(ip).unwrap(), cap.admit(ip).unwrap());
        assert_eq!(open.get(), 2);
        drop(a);
        assert_eq!(open.get(), 1);
        let per_source = ConnectionCap::new("test", 4)
            .per_source()
            .counted_in(open.clone());
        let c = per_source.admit(ip).unwrap();
        assert!(per_source.admit(ip).is_none(), "a quarter per source");
        assert_eq!(open.get(), 2, "a refused connection is not counted");
        drop((b, c));
        assert_eq!(open.get(), 0);
    }

    #[test]
    fn a_cap_refuses_past_its_max_counts_it_and_frees_a_place_when_one_ends() {
        let cap = ConnectionCap::new("test-cap", 2);
        let refused = || {
            REFUSED
                .get_or_create(&ListenerLabels {
                    listener: "test-cap",
                })
                .get()
        };
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let a = cap.admit(ip).expect("first");
        let _b = cap.admit(ip).expect("second");
        assert!(cap.admit(ip).is_none());
        assert!(cap.admit(ip).is_none());
        assert_eq!(refused(), 2);
        drop(a);
        assert!(
            cap.admit(ip).is_some(),
            "a place is freed when a connection ends"
        );
    }

    #[test]
    fn a_throttled_log_says_a_few_lines_then_counts_the_rest() {
        let t = LogThrottle::new(10);
        for _ in 0..10 {
            assert_eq!(t.admit(), Some(0));
        }
        for _ in 0..1000 {
            assert_eq!(t.admit(), None);
        }
        t.state.lock().unwrap().0 = Some(Instant::now() - WARN_EVERY);
        assert_eq!(
            t.admit(),
            Some(1000),
            "the next line says how many went unsaid"
        );
        assert_eq!(t.admit(), Some(0));
    }

    #[test]
    fn one_source_gets_a_quarter_of_the_places() {
        let cap = ConnectionCap::new("test-source", 8).per_source();
        let (greedy, other): (IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let held: Vec<_> = (0..2).map(|_| cap.admit(greedy).unwrap()).collect();
        assert!(cap.admit(greedy).is_none(), "a third place for one source");
        let _o = cap.admit(other).expect("another source still gets in");
        drop(held);
        assert!(
            cap.admit(greedy).is_some(),
            "places come back when connections end"
        );
    }
}
