//! The proxy's Prometheus metrics with Istio's names and labels (docs/wire.md §9):
//! `istio_tcp_connections_opened_total`, `istio_tcp_connections_closed_total`,
//! `istio_tcp_sent_bytes_total`, `istio_tcp_received_bytes_total`.
//!
//! Counters are touched once at open and once at close of a connection, never
//! per byte.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::copy::Transferred;

/// Labels of one connection, as Istio reports them (ztunnel's set and
/// order; `*_app` and `*_version` are the canonical service and revision).
/// Unknown values read "unknown".
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ConnectionLabels {
    pub reporter: &'static str,
    pub source_workload: String,
    pub source_canonical_service: String,
    pub source_canonical_revision: String,
    pub source_workload_namespace: String,
    pub source_principal: String,
    pub source_app: String,
    pub source_version: String,
    pub source_cluster: String,
    pub destination_service: String,
    pub destination_service_namespace: String,
    pub destination_service_name: String,
    pub destination_workload: String,
    pub destination_canonical_service: String,
    pub destination_canonical_revision: String,
    pub destination_workload_namespace: String,
    pub destination_principal: String,
    pub destination_app: String,
    pub destination_version: String,
    pub destination_cluster: String,
    pub request_protocol: &'static str,
    pub response_flags: &'static str,
    pub connection_security_policy: &'static str,
}

impl Default for ConnectionLabels {
    fn default() -> Self {
        let u = || "unknown".to_string();
        ConnectionLabels {
            reporter: "source",
            source_workload: u(),
            source_canonical_service: u(),
            source_canonical_revision: u(),
            source_workload_namespace: u(),
            source_principal: u(),
            source_app: u(),
            source_version: u(),
            source_cluster: u(),
            destination_service: u(),
            destination_service_namespace: u(),
            destination_service_name: u(),
            destination_workload: u(),
            destination_canonical_service: u(),
            destination_canonical_revision: u(),
            destination_workload_namespace: u(),
            destination_principal: u(),
            destination_app: u(),
            destination_version: u(),
            destination_cluster: u(),
            request_protocol: "tcp",
            response_flags: "-",
            connection_security_policy: "unknown",
        }
    }
}

/// Labels of an on-demand DNS request (ztunnel's): the asking workload and
/// the hostname resolved.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct OnDemandDnsLabels {
    pub source_workload: String,
    pub source_canonical_service: String,
    pub source_canonical_revision: String,
    pub source_workload_namespace: String,
    pub source_principal: String,
    pub source_app: String,
    pub source_version: String,
    pub source_cluster: String,
    pub hostname: String,
}

/// Label of a DNS request: answered by the proxy or forwarded upstream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DnsLabels {
    pub answered_by: &'static str,
}

/// The label sets of one pod's connections.
type LabelSets = std::collections::HashSet<std::sync::Arc<ConnectionLabels>>;

/// Label sets by namespace, then pod name.
type ByPod = std::collections::HashMap<String, std::collections::HashMap<String, LabelSets>>;

/// The four TCP counters, and the proxy's own counters.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Label sets used, by the pod they describe (namespace, then name),
    /// so a removed pod's series can be dropped (bounded cardinality).
    /// Each is the one copy every connection with those labels shares.
    /// Nested rather than keyed by a pair so that a lookup borrows the
    /// names instead of copying them for every connection.
    by_pod: std::sync::Mutex<ByPod>,
    /// `istio_dns_requests_total`.
    pub dns_requests: Family<DnsLabels, Counter>,
    /// `istio_dns_upstream_failures_total`.
    pub dns_upstream_failures: Counter,
    /// `istio_on_demand_dns_total`.
    on_demand_dns: Family<OnDemandDnsLabels, Counter>,
    opened: Family<ConnectionLabels, Counter>,
    closed: Family<ConnectionLabels, Counter>,
    sent: Family<ConnectionLabels, Counter>,
    received: Family<ConnectionLabels, Counter>,
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        let reg = registry.sub_registry_with_prefix("istio_tcp");
        reg.register(
            "connections_opened",
            "TCP connections opened",
            self.opened.clone(),
        );
        reg.register(
            "connections_closed",
            "TCP connections closed",
            self.closed.clone(),
        );
        reg.register(
            "sent_bytes",
            "Bytes sent from source to destination",
            self.sent.clone(),
        );
        reg.register(
            "received_bytes",
            "Bytes sent from destination back to source",
            self.received.clone(),
        );
        registry.register(
            "istio_on_demand_dns",
            "Connections that resolved a hostname on demand",
            self.on_demand_dns.clone(),
        );
        let dns = registry.sub_registry_with_prefix("istio_dns");
        dns.register(
            "requests",
            "DNS requests served by the proxy",
            self.dns_requests.clone(),
        );
        dns.register(
            "upstream_failures",
            "Forwarded DNS requests no upstream answered",
            self.dns_upstream_failures.clone(),
        );
    }

    /// Counts a connection opened with `labels`; returns the copy of them
    /// the connection keeps (see [`Metrics::shared`]).
    pub fn opened(&self, labels: ConnectionLabels) -> std::sync::Arc<ConnectionLabels> {
        self.opened.get_or_create(&labels).inc();
        self.shared(labels)
    }

    /// The one copy of `labels` that every connection with them shares,
    /// remembered under their pod so that [`Metrics::forget`] drops their
    /// series. A connection holding its own 19 label strings for its whole
    /// life cost ~1 kB each side (in its task and on the heap); shared,
    /// it holds a pointer.
    pub fn shared(&self, labels: ConnectionLabels) -> std::sync::Arc<ConnectionLabels> {
        let (namespace, name) = if labels.reporter == "source" {
            (&labels.source_workload_namespace, &labels.source_workload)
        } else {
            (
                &labels.destination_workload_namespace,
                &labels.destination_workload,
            )
        };
        let mut by_pod = self.by_pod.lock().unwrap_or_else(|e| e.into_inner());
        let known = by_pod
            .get(namespace.as_str())
            .and_then(|pods| pods.get(name.as_str()))
            .and_then(|sets| sets.get(&labels));
        if let Some(kept) = known {
            return kept.clone();
        }
        let (namespace, name) = (namespace.clone(), name.clone());
        let kept = std::sync::Arc::new(labels);
        by_pod
            .entry(namespace)
            .or_default()
            .entry(name)
            .or_default()
            .insert(kept.clone());
        kept
    }

    /// Counts one on-demand resolution of `hostname` for a connection from
    /// the source in `source` (its source labels).
    pub fn on_demand_dns(&self, source: &ConnectionLabels, hostname: &str) {
        let l = OnDemandDnsLabels {
            source_workload: source.source_workload.clone(),
            source_canonical_service: source.source_canonical_service.clone(),
            source_canonical_revision: source.source_canonical_revision.clone(),
            source_workload_namespace: source.source_workload_namespace.clone(),
            source_principal: source.source_principal.clone(),
            source_app: source.source_app.clone(),
            source_version: source.source_version.clone(),
            source_cluster: source.source_cluster.clone(),
            hostname: hostname.to_string(),
        };
        self.on_demand_dns.get_or_create(&l).inc();
    }

    /// Drops every series of the pod `namespace/name`.
    pub fn forget(&self, namespace: &str, name: &str) {
        let sets = {
            let mut by_pod = self.by_pod.lock().unwrap_or_else(|e| e.into_inner());
            let Some(pods) = by_pod.get_mut(namespace) else {
                return;
            };
            let sets = pods.remove(name);
            if pods.is_empty() {
                by_pod.remove(namespace);
            }
            sets
        };
        for labels in sets.into_iter().flatten() {
            self.opened.remove(&*labels);
            self.closed.remove(&*labels);
            self.sent.remove(&*labels);
            self.received.remove(&*labels);
        }
    }

    /// `t.sent` is source → destination, as seen by the reporter.
    pub fn closed(&self, labels: &ConnectionLabels, t: Transferred) {
        self.closed.get_or_create(labels).inc();
        self.sent.get_or_create(labels).inc_by(t.sent);
        self.received.get_or_create(labels).inc_by(t.received);
    }
}

/// Drops a pod's series when the pod is no longer served.
#[derive(Debug)]
pub struct PodMetricsGuard {
    pub metrics: std::sync::Arc<Metrics>,
    pub namespace: String,
    pub name: String,
}

impl Drop for PodMetricsGuard {
    fn drop(&mut self) {
        self.metrics.forget(&self.namespace, &self.name);
    }
}

/// The runtime's gauges, with ztunnel's names, read at each scrape from
/// tokio's stable runtime metrics (a few atomic loads each):
/// `tokio_num_alive_tasks`, `tokio_num_workers`, `tokio_global_queue_depth`.
/// A pod's listeners, its connections and each identity's rotation are
/// tasks, so a task count that climbs while pods come and go is state left
/// behind (the churn test asserts it returns to where it was).
#[derive(Debug)]
pub struct RuntimeGauges(pub tokio::runtime::Handle);

impl RuntimeGauges {
    pub fn register(self, registry: &mut Registry) {
        registry.register_collector(Box::new(self));
    }
}

impl prometheus_client::collector::Collector for RuntimeGauges {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        let m = self.0.metrics();
        for (name, help, value) in [
            (
                "tokio_num_alive_tasks",
                "Tasks alive in the proxy's runtime",
                m.num_alive_tasks(),
            ),
            (
                "tokio_num_workers",
                "Worker threads of the proxy's runtime",
                m.num_workers(),
            ),
            (
                "tokio_global_queue_depth",
                "Tasks waiting in the runtime's global queue",
                m.global_queue_depth(),
            ),
        ] {
            let gauge = prometheus_client::metrics::gauge::ConstGauge::new(value as i64);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_istio_names() {
        let m = Metrics::default();
        let mut reg = Registry::default();
        m.register(&mut reg);
        let l = ConnectionLabels {
            source_workload: "client".into(),
            ..Default::default()
        };
        m.opened(l.clone());
        m.closed(
            &l,
            Transferred {
                sent: 10,
                received: 3,
                ..Default::default()
            },
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(
            text.contains(
                "istio_tcp_connections_opened_total{reporter=\"source\",source_workload=\"client\""
            ),
            "{text}"
        );
        // Each counter's own line carries its value, not just any line.
        let value = |name: &str| -> Option<String> {
            let line = text.lines().find(|l| l.starts_with(&format!("{name}{{")))?;
            Some(line.rsplit(' ').next()?.to_string())
        };
        assert_eq!(
            value("istio_tcp_sent_bytes_total").as_deref(),
            Some("10"),
            "{text}"
        );
        assert_eq!(
            value("istio_tcp_received_bytes_total").as_deref(),
            Some("3"),
            "{text}"
        );
        assert_eq!(
            value("istio_tcp_connections_opened_total").as_deref(),
            Some("1"),
            "{text}"
        );
        assert_eq!(
            value("istio_tcp_connections_closed_total").as_deref(),
            Some("1"),
            "{text}"
        );
    }
}
