//! One proxied connection from open to close, as metrics and the access log
//! see it. [`ConnectionRecord::open`] counts it opened; exactly one of
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
    fn as_str(self) -> &'static str {
        match self {
            Direction::Outbound => "outbound",
            Direction::InboundHbone => "inbound HBONE",
            Direction::InboundPlaintext => "inbound plaintext",
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
    labels: ConnectionLabels,
    direction: Direction,
    src: Option<SocketAddr>,
    dst: SocketAddr,
    route: Option<&'static str>,
    /// Inbound: the policy that allowed it (`-`: no policy applies).
    policy: Option<String>,
    start: Instant,
    finished: bool,
}

impl ConnectionRecord {
    /// Counts a connection opened with `labels`.
    pub fn open(
        metrics: Arc<Metrics>,
        labels: ConnectionLabels,
        direction: Direction,
        src: Option<SocketAddr>,
        dst: SocketAddr,
    ) -> Self {
        metrics.opened(&labels);
        ConnectionRecord {
            metrics,
            labels,
            direction,
            src,
            dst,
            route: None,
            policy: None,
            start: Instant::now(),
            finished: false,
        }
    }

    /// Outbound: how the destination is reached (`hbone`, `passthrough`, ...).
    pub fn set_route(&mut self, route: &'static str) {
        self.route = Some(route);
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
        self.labels.response_flags = flag;
        self.end(End::Failed(error.to_string()));
    }

    /// A connection refused by `policy`: counted opened and closed with
    /// `response_flags="DENY"`, and logged.
    pub fn denied(
        metrics: Arc<Metrics>,
        mut labels: ConnectionLabels,
        direction: Direction,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        policy: impl Display,
    ) {
        labels.response_flags = "DENY";
        Self::open(metrics, labels, direction, src, dst).end(End::Denied(policy.to_string()));
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

    fn log(&self, end: &End, t: Transferred) {
        let l = &self.labels;
        let src_workload = format!("{}/{}", l.source_workload_namespace, l.source_workload);
        let dst_workload = format!(
            "{}/{}",
            l.destination_workload_namespace, l.destination_workload
        );
        let dir = self.direction.as_str();
        let (policy, decision) = match end {
            End::Denied(p) => (Some(p.as_str()), Some("deny")),
            _ => (
                self.policy.as_deref(),
                self.policy.as_ref().map(|_| "allow"),
            ),
        };
        let duration_ms = self.start.elapsed().as_millis() as u64;
        macro_rules! line {
            ($level:expr, $error:expr, $what:literal) => {
                tracing::event!(
                    target: "access",
                    $level,
                    src.addr = self.src.map(display),
                    src.workload = %src_workload,
                    src.principal = %l.source_principal,
                    dst.addr = %self.dst,
                    dst.workload = %dst_workload,
                    dst.principal = %l.destination_principal,
                    route = self.route,
                    policy = policy.map(display),
                    decision,
                    bytes_sent = t.sent,
                    bytes_received = t.received,
                    duration_ms,
                    error = $error,
                    "{dir} connection {}",
                    $what
                )
            };
        }
        match end {
            End::Closed(_, error) => line!(tracing::Level::INFO, error.as_deref(), "closed"),
            End::Failed(error) => line!(tracing::Level::WARN, Some(error.as_str()), "failed"),
            End::Denied(_) => line!(tracing::Level::INFO, None::<&str>, "denied by policy"),
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

    #[test]
    fn every_connection_is_counted_at_both_ends_and_logged_once_as_access() {
        let metrics = Arc::new(Metrics::default());
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let labels = ConnectionLabels {
            source_workload: "client".into(),
            ..Default::default()
        };
        let (src, dst) = (
            "10.0.0.2:40000".parse().unwrap(),
            "10.0.0.3:8080".parse().unwrap(),
        );
        let lines = logged(|| {
            let mut carried = ConnectionRecord::open(
                metrics.clone(),
                labels.clone(),
                Direction::Outbound,
                Some(src),
                dst,
            );
            carried.set_route("hbone");
            let t = Transferred {
                sent: 10,
                received: 3,
                ..Default::default()
            };
            carried.closed(t, None);
            let m = metrics.clone();
            ConnectionRecord::denied(
                m,
                labels.clone(),
                Direction::InboundHbone,
                Some(src),
                dst,
                "ns/deny",
            );
            ConnectionRecord::open(
                metrics.clone(),
                labels.clone(),
                Direction::InboundPlaintext,
                None,
                dst,
            )
            .failed("CONNECT", "connection refused");
            // A task cancelled mid-connection still closes what it opened.
            drop(ConnectionRecord::open(
                metrics.clone(),
                labels.clone(),
                Direction::Outbound,
                Some(src),
                dst,
            ));
        });

        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
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
        let messages: Vec<&str> = lines
            .iter()
            .map(|l| l["fields"]["message"].as_str().unwrap())
            .collect();
        assert_eq!(
            messages,
            [
                "outbound connection closed",
                "inbound HBONE connection denied by policy",
                "inbound plaintext connection failed",
                "outbound connection closed",
            ]
        );
        let f = &lines[0]["fields"];
        assert_eq!(f["src.addr"], "10.0.0.2:40000");
        assert_eq!(f["dst.addr"], "10.0.0.3:8080");
        assert_eq!(f["src.workload"], "unknown/client");
        assert_eq!(f["route"], "hbone");
        assert_eq!(
            (f["bytes_sent"].as_u64(), f["bytes_received"].as_u64()),
            (Some(10), Some(3))
        );
        assert!(
            f.get("decision").is_none(),
            "outbound has no policy decision: {f}"
        );
        let f = &lines[1]["fields"];
        assert_eq!(
            (f["policy"].as_str(), f["decision"].as_str()),
            (Some("ns/deny"), Some("deny"))
        );
        assert_eq!(lines[2]["fields"]["error"], "connection refused");
        assert_eq!(lines[3]["fields"]["error"], "cancelled before it closed");
    }
}
