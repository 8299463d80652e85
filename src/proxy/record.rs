//! One proxied connection from open to close, as metrics and the access log
//! see it (ztunnel's `connection complete` line and field names). [`ConnectionRecord::open`] counts it opened; exactly one of
//! `closed`, `failed` or `denied` counts it closed, adds its bytes and writes
//! its single access-log line (tracing target `access`). A record dropped
//! unfinished (its task cancelled) still counts the close and logs it, so
//! opened and closed always balance. Touched twice per connection, never per
//! byte.

use std::fmt::Display;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::copy::Transferred;
use super::metrics::{ConnectionLabels, Metrics};

/// Which listener took the connection; names it in the log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Outbound,
    InboundHbone,
    InboundPlaintext,
}

impl Direction {
    /// ztunnel's `direction`: both inbound listeners are `inbound`.
    fn as_str(self) -> &'static str {
        match self {
            Direction::Outbound => "outbound",
            Direction::InboundHbone | Direction::InboundPlaintext => "inbound",
        }
    }
}

/// How the connection ended.
enum End {
    Closed(Transferred, Option<String>),
    Failed(String),
    Denied(String),
}

#[must_use = "a record counts its connection closed when finished or dropped"]
pub struct ConnectionRecord {
    metrics: Arc<Metrics>,
    /// Shared with every connection of the same labels.
    labels: Arc<ConnectionLabels>,
    /// The UID of the pod whose connection this is (its series go with it).
    owner: Arc<str>,
    direction: Direction,
    src: Option<SocketAddr>,
    dst: SocketAddr,
    route: Option<&'static str>,
    /// Over HBONE: the outer address (dialed, or accepted on) and the
    /// CONNECT authority (sent, or received).
    hbone: Option<(SocketAddr, SocketAddr)>,
    /// Inbound: the policy that allowed it (`-`: no policy applies).
    policy: Option<String>,
    start: Instant,
    finished: bool,
}

impl ConnectionRecord {
    /// Counts a connection of pod `owner` (its UID) opened with `labels`.
    pub fn open(
        metrics: Arc<Metrics>,
        (labels, owner): (ConnectionLabels, &Arc<str>),
        direction: Direction,
        src: Option<SocketAddr>,
        dst: SocketAddr,
    ) -> Self {
        let labels = metrics.opened(labels, owner);
        ConnectionRecord {
            metrics,
            labels,
            owner: owner.clone(),
            direction,
            src,
            dst,
            route: None,
            hbone: None,
            policy: None,
            start: Instant::now(),
            finished: false,
        }
    }

    /// Outbound: how the destination is reached (`hbone`, `passthrough`, ...).
    pub fn set_route(&mut self, route: &'static str) {
        self.route = Some(route);
    }

    /// Over HBONE: `outer` is the address dialed (outbound) or accepted on
    /// (inbound), `authority` the CONNECT's target as sent or received (an
    /// endpoint's address where the client dialed a service VIP).
    pub fn set_hbone(&mut self, outer: SocketAddr, authority: SocketAddr) {
        self.hbone = Some((outer, authority));
    }

    /// Inbound: the policy that allowed the connection.
    pub fn set_allowed_by(&mut self, policy: String) {
        self.policy = Some(policy);
    }

    /// Carried and closed; `t.sent` is source → destination. `error` says
    /// why a copy ended early, if it did.
    pub fn closed(mut self, t: Transferred, error: Option<String>) {
        self.end(End::Closed(t, error));
    }

    /// Never carried: `flag` is the `response_flags` label (`CONNECT`, ...).
    pub fn failed(mut self, flag: &'static str, error: impl Display) {
        if self.labels.response_flags != flag {
            let mut flagged = (*self.labels).clone();
            flagged.response_flags = flag;
            self.labels = self.metrics.shared(flagged, &self.owner);
        }
        self.end(End::Failed(error.to_string()));
    }

    /// A connection refused by `policy`: counted opened and closed with
    /// `response_flags="DENY"`, and logged.
    pub fn denied(
        metrics: Arc<Metrics>,
        (mut labels, owner): (ConnectionLabels, &Arc<str>),
        direction: Direction,
        (src, dst, hbone): (Option<SocketAddr>, SocketAddr, Option<SocketAddr>),
        policy: impl Display,
    ) {
        labels.response_flags = "DENY";
        let mut record = Self::open(metrics, (labels, owner), direction, src, dst);
        record.hbone = hbone.map(|outer| (outer, dst));
        record.end(End::Denied(policy.to_string()));
    }

    fn end(&mut self, end: End) {
        self.finished = true;
        let t = match &end {
            End::Closed(t, _) => *t,
            _ => Transferred::default(),
        };
        self.metrics.closed(&self.labels, t);
        self.log(&end, t);
    }

    /// The access-log line, with ztunnel's message and field names (and
    /// Ambit's `route`, `policy` and `decision` after them). Unknown
    /// values and identities of connections without mTLS are left out.
    fn log(&self, end: &End, t: Transferred) {
        let l = &self.labels;
        let known = |s: &str| (s != "unknown").then(|| s.to_string());
        let mtls = l.connection_security_policy == "mutual_tls";
        let (policy, decision) = match end {
            End::Denied(p) => (Some(p.as_str()), Some("deny")),
            _ => (
                self.policy.as_deref(),
                self.policy.as_ref().map(|_| "allow"),
            ),
        };
        let error = match end {
            End::Closed(_, e) => e.clone(),
            End::Failed(e) => Some(e.clone()),
            End::Denied(_) => Some("denied by policy".to_string()),
        };
        let level = match end {
            End::Failed(_) => tracing::Level::WARN,
            _ => tracing::Level::INFO,
        };
        // Over HBONE, the address dialed (or accepted on) and the CONNECT authority.
        let (dst_addr, hbone_addr) = match self.hbone {
            Some((outer, authority)) => (outer, Some(authority)),
            None => (self.dst, None),
        };
        macro_rules! line {
            ($level:expr) => {
                tracing::event!(
                    target: "access",
                    $level,
                    src.addr = self.src.map(display),
                    src.workload = known(&l.source_workload),
                    src.namespace = known(&l.source_workload_namespace),
                    src.identity = known(&l.source_principal).filter(|_| mtls),
                    dst.addr = %dst_addr,
                    dst.hbone_addr = hbone_addr.map(display),
                    dst.service = known(&l.destination_service),
                    dst.workload = known(&l.destination_workload),
                    dst.namespace = known(&l.destination_workload_namespace),
                    dst.identity = known(&l.destination_principal).filter(|_| mtls),
                    direction = self.direction.as_str(),
                    bytes_sent = t.sent,
                    bytes_recv = t.received,
                    duration = format!("{}ms", self.start.elapsed().as_millis()),
                    route = self.route,
                    policy = policy.map(display),
                    decision,
                    error,
                    "connection complete"
                )
            };
        }
        match level {
            tracing::Level::WARN => line!(tracing::Level::WARN),
            _ => line!(tracing::Level::INFO),
        }
    }
}

impl Drop for ConnectionRecord {
    fn drop(&mut self) {
        if !self.finished {
            self.end(End::Closed(
                Transferred::default(),
                Some("cancelled before it closed".into()),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Mutex;

    use prometheus_client::registry::Registry;

    use super::*;

    /// Runs `f` with a JSON subscriber and returns the lines it logged.
    fn logged(f: impl FnOnce()) -> Vec<serde_json::Value> {
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_writer(move || out.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn counter(text: &str, name: &str, flags: &str) -> u64 {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter(|l| l.contains(&format!("response_flags=\"{flags}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// Metrics and the registry that exposes them.
    fn registered() -> (Arc<Metrics>, Registry) {
        let metrics = Arc::new(Metrics::default());
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        (metrics, registry)
    }

    /// The registry's text exposition.
    fn exposed(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    }

    #[test]
    fn every_connection_is_counted_at_both_ends_and_logged_once_as_access() {
        let (metrics, registry) = registered();
        let labels = ConnectionLabels {
            source_workload: "client".into(),
            source_workload_namespace: "shop".into(),
            source_principal: "spiffe://cluster.local/ns/shop/sa/client".into(),
            destination_service: "api.shop.svc.cluster.local".into(),
            connection_security_policy: "mutual_tls",
            ..Default::default()
        };
        let outer: SocketAddr = "10.0.0.3:15008".parse().unwrap();
        let (src, dst) = (
            "10.0.0.2:40000".parse().unwrap(),
            "10.0.0.3:8080".parse().unwrap(),
        );
        let pod: Arc<str> = "client-uid".into();
        let lines = logged(|| {
            let mut carried = ConnectionRecord::open(
                metrics.clone(),
                (labels.clone(), &pod),
                Direction::Outbound,
                Some(src),
                dst,
            );
            carried.set_route("hbone");
            carried.set_hbone(outer, dst);
            let t = Transferred {
                sent: 10,
                received: 3,
                ..Default::default()
            };
            carried.closed(t, None);
            let m = metrics.clone();
            let ends = (Some(src), dst, Some(outer));
            ConnectionRecord::denied(
                m,
                (labels.clone(), &pod),
                Direction::InboundHbone,
                ends,
                "ns/deny",
            );
            ConnectionRecord::open(
                metrics.clone(),
                (labels.clone(), &pod),
                Direction::InboundPlaintext,
                None,
                dst,
            )
            .failed("CONNECT", "connection refused");
            // A task cancelled mid-connection still closes what it opened.
            drop(ConnectionRecord::open(
                metrics.clone(),
                (labels.clone(), &pod),
                Direction::Outbound,
                Some(src),
                dst,
            ));
        });

        let text = exposed(&registry);
        let opened = "istio_tcp_connections_opened_total";
        let closed = "istio_tcp_connections_closed_total";
        assert_eq!(counter(&text, opened, "DENY"), 1, "{text}");
        assert_eq!(counter(&text, closed, "DENY"), 1, "{text}");
        assert_eq!(counter(&text, opened, "-"), 3, "{text}");
        assert_eq!(counter(&text, closed, "-"), 2, "{text}");
        assert_eq!(counter(&text, closed, "CONNECT"), 1, "{text}");
        assert_eq!(
            counter(&text, "istio_tcp_sent_bytes_total", "-"),
            10,
            "{text}"
        );

        assert_eq!(lines.len(), 4, "{lines:?}");
        assert!(lines.iter().all(|l| l["target"] == "access"), "{lines:?}");
        assert!(
            lines
                .iter()
                .all(|l| l["fields"]["message"] == "connection complete"),
            "{lines:?}"
        );
        // ztunnel's fields: over HBONE, dst.addr is the outer address and
        // dst.hbone_addr the tunnel's target.
        let f = &lines[0]["fields"];
        assert_eq!(f["src.addr"], "10.0.0.2:40000");
        assert_eq!(
            (f["src.workload"].as_str(), f["src.namespace"].as_str()),
            (Some("client"), Some("shop"))
        );
        assert_eq!(
            f["src.identity"],
            "spiffe://cluster.local/ns/shop/sa/client"
        );
        assert_eq!(
            (f["dst.addr"].as_str(), f["dst.hbone_addr"].as_str()),
            (Some("10.0.0.3:15008"), Some("10.0.0.3:8080"))
        );
        assert_eq!(f["dst.service"], "api.shop.svc.cluster.local");
        assert!(
            f.get("dst.workload").is_none() && f.get("dst.identity").is_none(),
            "unknown values are left out: {f}"
        );
        assert_eq!(f["direction"], "outbound");
        assert_eq!(
            (f["bytes_sent"].as_u64(), f["bytes_recv"].as_u64()),
            (Some(10), Some(3))
        );
        assert!(
            f["duration"].as_str().is_some_and(|d| d.ends_with("ms")),
            "{f}"
        );
        assert_eq!(f["route"], "hbone");
        assert!(
            f.get("decision").is_none(),
            "outbound has no policy decision: {f}"
        );
        let f = &lines[1]["fields"];
        assert_eq!(f["direction"], "inbound");
        assert_eq!(
            (f["policy"].as_str(), f["decision"].as_str()),
            (Some("ns/deny"), Some("deny"))
        );
        assert_eq!(f["error"], "denied by policy");
        assert_eq!(lines[2]["level"], "WARN");
        assert_eq!(lines[2]["fields"]["error"], "connection refused");
        assert_eq!(lines[3]["fields"]["error"], "cancelled before it closed");
    }

    #[test]
    fn connections_share_one_copy_of_their_labels_and_the_last_pod_using_a_series_takes_it() {
        let (metrics, registry) = registered();
        let labels = ConnectionLabels {
            source_workload: "client".into(),
            source_workload_namespace: "shop".into(),
            ..Default::default()
        };
        let dst: SocketAddr = "10.0.0.3:8080".parse().unwrap();
        // Two pods of the workload `client`, and a pod of another workload.
        let (pod, twin, neighbour_pod): (Arc<str>, Arc<str>, Arc<str>) =
            ("client-1".into(), "client-2".into(), "cart-1".into());
        let open = |labels: &ConnectionLabels, pod: &Arc<str>| {
            ConnectionRecord::open(
                metrics.clone(),
                (labels.clone(), pod),
                Direction::Outbound,
                None,
                dst,
            )
        };
        let neighbour = ConnectionLabels {
            source_workload: "cart".into(),
            ..labels.clone()
        };
        // Under a subscriber, as every test here that logs: tracing caches
        // whether a log line is wanted when the line first runs, and a
        // first run with none would hide it from the other tests' capture.
        let lines = logged(|| {
            let (a, b, c) = (
                open(&labels, &pod),
                open(&labels, &pod),
                open(&labels, &twin),
            );
            assert!(Arc::ptr_eq(&a.labels, &b.labels), "one copy for both");
            assert!(Arc::ptr_eq(&a.labels, &c.labels), "and for the twin pod");
            a.closed(Transferred::default(), None);
            // A failure counts its close under its own flag, and that
            // series belongs to the pod too.
            b.failed("CONNECT", "connection refused");
            c.closed(Transferred::default(), None);
            open(&neighbour, &neighbour_pod).closed(Transferred::default(), None);
        });
        assert_eq!(lines.len(), 4, "{lines:?}");
        let text = exposed(&registry);
        let closed = "istio_tcp_connections_closed_total";
        assert_eq!(counter(&text, closed, "CONNECT"), 1, "{text}");
        // The twin still uses the series `client` shares: it stays.
        metrics.forget(&pod);
        let left = exposed(&registry);
        assert_eq!(counter(&left, closed, "-"), 3, "{left}");
        // The CONNECT series was the first pod's alone.
        assert_eq!(counter(&left, closed, "CONNECT"), 0, "{left}");
        metrics.forget(&twin);
        let left = exposed(&registry);
        assert!(!left.contains("source_workload=\"client\""), "{left}");
        assert!(left.contains("source_workload=\"cart\""), "{left}");
    }
}
