//! The proxy's Prometheus metrics with Istio's names and labels (docs/wire.md §9):
//! `istio_tcp_connections_opened_total`, `istio_tcp_connections_closed_total`,
//! `istio_tcp_sent_bytes_total`, `istio_tcp_received_bytes_total`.
//!
//! Counters are touched once at open and once at close of a connection, never
//! per byte.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::copy::Transferred;
use crate::xds::types::Workload;

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
    /// ztunnel's four locality labels, written once either side's
    /// workload is known.
    #[prometheus(flatten)]
    pub locality: Locality,
}

/// `source_region`, `source_zone`, `destination_region`,
/// `destination_zone`: all four or none (none while neither side's
/// workload is known, as ztunnel writes them).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Locality(pub Option<LocalityLabels>);

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct LocalityLabels {
    pub source_region: String,
    pub source_zone: String,
    pub destination_region: String,
    pub destination_zone: String,
}

impl EncodeLabelSet for Locality {
    fn encode(
        &self,
        encoder: prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        match &self.0 {
            Some(l) => l.encode(encoder),
            None => Ok(()),
        }
    }
}

impl Locality {
    /// The four labels, "unknown" where not set yet.
    fn labels(&mut self) -> &mut LocalityLabels {
        self.0.get_or_insert_with(|| {
            let u = || "unknown".to_string();
            LocalityLabels {
                source_region: u(),
                source_zone: u(),
                destination_region: u(),
                destination_zone: u(),
            }
        })
    }
}

/// A workload as the labels of its connections name it, ztunnel's way:
/// `workload_name` (the Deployment's, as istiod sends it; the workload's
/// own name where none is sent, which is what istiod sends for a bare
/// pod), canonical service and revision (`latest` where none, istiod's
/// default), cluster (`Kubernetes` where none, as ztunnel fills it in) and
/// locality ("unknown" where none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadLabels {
    pub workload: String,
    pub namespace: String,
    pub canonical_service: String,
    pub canonical_revision: String,
    pub cluster: String,
    pub region: String,
    pub zone: String,
}

impl WorkloadLabels {
    pub fn of(w: &Workload) -> Self {
        let or =
            |value: &str, default: &str| if value.is_empty() { default } else { value }.to_string();
        WorkloadLabels {
            workload: or(&w.workload_name, &w.name),
            namespace: w.namespace.to_string(),
            canonical_service: w.canonical_service().to_string(),
            canonical_revision: or(&w.canonical_revision, "latest"),
            cluster: or(&w.cluster_id, DEFAULT_CLUSTER),
            region: or(&w.locality.region, "unknown"),
            zone: or(&w.locality.zone, "unknown"),
        }
    }
}

/// The cluster ztunnel names for a workload that names none.
pub const DEFAULT_CLUSTER: &str = "Kubernetes";

impl ConnectionLabels {
    /// The source's workload fields (not its principal: that is the
    /// identity the connection proved).
    pub fn set_source(&mut self, w: &WorkloadLabels) {
        self.source_workload.clone_from(&w.workload);
        self.source_workload_namespace.clone_from(&w.namespace);
        self.source_canonical_service
            .clone_from(&w.canonical_service);
        self.source_canonical_revision
            .clone_from(&w.canonical_revision);
        self.source_app.clone_from(&w.canonical_service);
        self.source_version.clone_from(&w.canonical_revision);
        self.source_cluster.clone_from(&w.cluster);
        let l = self.locality.labels();
        l.source_region.clone_from(&w.region);
        l.source_zone.clone_from(&w.zone);
    }

    /// The destination's workload fields (not its principal).
    pub fn set_destination(&mut self, w: &WorkloadLabels) {
        self.destination_workload.clone_from(&w.workload);
        self.destination_workload_namespace.clone_from(&w.namespace);
        self.destination_canonical_service
            .clone_from(&w.canonical_service);
        self.destination_canonical_revision
            .clone_from(&w.canonical_revision);
        self.destination_app.clone_from(&w.canonical_service);
        self.destination_version.clone_from(&w.canonical_revision);
        self.destination_cluster.clone_from(&w.cluster);
        let l = self.locality.labels();
        l.destination_region.clone_from(&w.region);
        l.destination_zone.clone_from(&w.zone);
    }
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
            locality: Locality::default(),
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

/// The label sets connections use, each once, with the pods whose
/// connections used it: a series goes when the last such pod goes. Label
/// sets name workloads (a Deployment), not pods, so pods of one workload
/// share them.
#[derive(Debug, Default)]
struct Interned {
    /// Each set in use, with how many pods used it.
    sets: std::collections::HashMap<std::sync::Arc<ConnectionLabels>, usize>,
    /// The sets each pod (by UID) used.
    by_pod: std::collections::HashMap<
        std::sync::Arc<str>,
        std::collections::HashSet<std::sync::Arc<ConnectionLabels>>,
    >,
}

/// The four TCP counters, and the proxy's own counters.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Each label set in use, the one copy every connection with those
    /// labels shares, and the pods that used it (bounded cardinality: a
    /// series goes with the last pod that used it).
    interned: std::sync::Mutex<Interned>,
    /// `istio_dns_requests_total`.
    pub dns_requests: Family<DnsLabels, Counter>,
    /// `istio_dns_upstream_failures_total`.
    pub dns_upstream_failures: Counter,
    /// `istio_on_demand_dns_total`.
    on_demand_dns: Family<OnDemandDnsLabels, Counter>,
    opened: Family<SharedLabels, Counter>,
    closed: Family<SharedLabels, Counter>,
    sent: Family<SharedLabels, Counter>,
    received: Family<SharedLabels, Counter>,
    /// `istio_tcp_sockets_open{reporter}`: connections the pods' listeners
    /// hold open (outbound: `source`; HBONE and plaintext inbound:
    /// `destination`), from accept to close.
    sockets_open: Family<SocketLabels, Gauge>,
}

/// A connection's labels as the four TCP counters key their series: the
/// one copy every connection with them shares ([`Metrics::shared`]). Each
/// family kept a copy of its own, inline in its table: 18 strings and more,
/// about 600 bytes a slot, four times over, plus the tables' room to grow
/// (`cargo bench --bench node` with `AMBIT_BENCH_HEAP`: 22 kB of the
/// proxy's heap per pod on a node of 300, the families' tables 5 MB of it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SharedLabels(std::sync::Arc<ConnectionLabels>);

impl EncodeLabelSet for SharedLabels {
    fn encode(
        &self,
        encoder: prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }
}

/// The label of `istio_tcp_sockets_open`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SocketLabels {
    pub reporter: &'static str,
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
        reg.register(
            "sockets_open",
            "TCP connections the pods' listeners hold open",
            self.sockets_open.clone(),
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

    /// Counts a connection of pod `owner` (its UID) opened with `labels`;
    /// returns the copy of them the connection keeps (see [`Metrics::shared`]).
    pub fn opened(
        &self,
        labels: ConnectionLabels,
        owner: &std::sync::Arc<str>,
    ) -> std::sync::Arc<ConnectionLabels> {
        let kept = self.shared(labels, owner);
        let key = SharedLabels(kept);
        self.opened.get_or_create(&key).inc();
        key.0
    }

    /// The one copy of `labels` that every connection with them shares,
    /// remembered under pod `owner` so that [`Metrics::forget`] drops their
    /// series once no pod that used them is left. A connection holding its
    /// own label strings for its whole life cost ~1 kB each side (in its
    /// task and on the heap); shared, it holds a pointer.
    pub fn shared(
        &self,
        labels: ConnectionLabels,
        owner: &std::sync::Arc<str>,
    ) -> std::sync::Arc<ConnectionLabels> {
        let mut guard = self.interned.lock().unwrap_or_else(|e| e.into_inner());
        let Interned { sets, by_pod } = &mut *guard;
        let used = by_pod.entry(owner.clone()).or_default();
        if let Some(kept) = used.get(&labels) {
            return kept.clone();
        }
        let kept = match sets.get_key_value(&labels) {
            Some((kept, _)) => kept.clone(),
            None => std::sync::Arc::new(labels),
        };
        *sets.entry(kept.clone()).or_default() += 1;
        used.insert(kept.clone());
        kept
    }

    /// The gauge of the connections open as `reporter` (`source` or
    /// `destination`): a listener's cap moves it (`ConnectionCap::counted_in`).
    pub fn sockets_open(&self, reporter: &'static str) -> Gauge {
        self.sockets_open
            .get_or_create(&SocketLabels { reporter })
            .clone()
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

    /// Pod `owner` (its UID) is gone: drops the series no pod still
    /// served has used.
    pub fn forget(&self, owner: &str) {
        let mut gone = Vec::new();
        {
            let mut guard = self.interned.lock().unwrap_or_else(|e| e.into_inner());
            let Interned { sets, by_pod } = &mut *guard;
            for labels in by_pod.remove(owner).into_iter().flatten() {
                let users = sets.get_mut(&labels).map_or(0, |users| {
                    *users -= 1;
                    *users
                });
                if users == 0 {
                    sets.remove(&labels);
                    gone.push(labels);
                }
            }
        }
        for labels in gone {
            let key = SharedLabels(labels);
            self.opened.remove(&key);
            self.closed.remove(&key);
            self.sent.remove(&key);
            self.received.remove(&key);
        }
    }

    /// `t.sent` is source → destination, as seen by the reporter.
    pub fn closed(&self, labels: &std::sync::Arc<ConnectionLabels>, t: Transferred) {
        let key = SharedLabels(labels.clone());
        self.closed.get_or_create(&key).inc();
        self.sent.get_or_create(&key).inc_by(t.sent);
        self.received.get_or_create(&key).inc_by(t.received);
    }
}

/// Drops a pod's series when the pod is no longer served.
#[derive(Debug)]
pub struct PodMetricsGuard {
    pub metrics: std::sync::Arc<Metrics>,
    /// The pod's UID.
    pub pod: std::sync::Arc<str>,
}

impl Drop for PodMetricsGuard {
    fn drop(&mut self) {
        self.metrics.forget(&self.pod);
    }
}

/// The runtime's and the process's metrics, with ztunnel's names, read
/// at each scrape: from tokio's stable runtime metrics (a few atomic loads
/// each; tokio keeps these counts whether or not they are read),
/// `tokio_num_alive_tasks`, `tokio_num_workers`, `tokio_global_queue_depth`
/// and, per worker thread, `tokio_worker_total_busy_duration_seconds`,
/// `tokio_worker_park_count` and `tokio_worker_park_unpark_count`; from
/// `/proc/self/fd` and `RLIMIT_NOFILE`, `process_open_fds` and
/// `process_max_fds`. A pod's listeners, its connections and each
/// identity's rotation are tasks, so a task count that climbs while pods
/// come and go is state left behind (the churn test asserts it returns to
/// where it was).
#[derive(Debug)]
pub struct RuntimeGauges(pub tokio::runtime::Handle);

impl RuntimeGauges {
    pub fn register(self, registry: &mut Registry) {
        registry.register_collector(Box::new(self));
    }
}

/// The label of a per-worker runtime counter.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WorkerLabels {
    worker: usize,
}

impl prometheus_client::collector::Collector for RuntimeGauges {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        let m = self.0.metrics();
        let open_fds = std::fs::read_dir("/proc/self/fd")
            // Less the descriptor that reads the directory.
            .map(|d| d.count().saturating_sub(1) as i64)
            .ok();
        let max_fds = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
            .map(|(soft, _)| i64::try_from(soft).unwrap_or(i64::MAX))
            .ok();
        for (name, help, value) in [
            (
                "tokio_num_alive_tasks",
                "Tasks alive in the proxy's runtime",
                Some(m.num_alive_tasks() as i64),
            ),
            (
                "tokio_num_workers",
                "Worker threads of the proxy's runtime",
                Some(m.num_workers() as i64),
            ),
            (
                "tokio_global_queue_depth",
                "Tasks waiting in the runtime's global queue",
                Some(m.global_queue_depth() as i64),
            ),
            ("process_open_fds", "Open file descriptors", open_fds),
            (
                "process_max_fds",
                "The open file descriptors' limit (soft)",
                max_fds,
            ),
        ] {
            let Some(value) = value else { continue };
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let workers = 0..m.num_workers();
        let mut busy = encoder.encode_descriptor(
            "tokio_worker_total_busy_duration_seconds",
            "Time each worker thread spent busy",
            None,
            MetricType::Counter,
        )?;
        for worker in workers.clone() {
            let seconds = m.worker_total_busy_duration(worker).as_secs_f64();
            ConstCounter::new(seconds).encode(busy.encode_family(&WorkerLabels { worker })?)?;
        }
        for (name, help, count) in [
            (
                "tokio_worker_park_count",
                "Times each worker thread parked (went idle)",
                &(|w| m.worker_park_count(w)) as &dyn Fn(usize) -> u64,
            ),
            (
                "tokio_worker_park_unpark_count",
                "Times each worker thread parked or was unparked",
                &|w| m.worker_park_unpark_count(w),
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for worker in workers.clone() {
                ConstCounter::new(count(worker))
                    .encode(family.encode_family(&WorkerLabels { worker })?)?;
            }
        }
        Ok(())
    }
}

/// `istio_build{component,tag}` (ztunnel's), 1. The component is
/// `ztunnel`, the role this binary fills in the mesh (Istio's dashboards
/// count a node proxy's versions by it); the tag says it is Ambit's build.
pub fn register_build_info(registry: &mut Registry) {
    #[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
    struct BuildLabels {
        component: &'static str,
        tag: String,
    }
    let build: Family<BuildLabels, Gauge> = Family::default();
    build
        .get_or_create(&BuildLabels {
            component: "ztunnel",
            tag: format!("ambit-{}", env!("CARGO_PKG_VERSION")),
        })
        .set(1);
    registry.register("istio_build", "The proxy's build", build);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_sockets_are_counted_per_reporter() {
        let m = Metrics::default();
        let mut reg = Registry::default();
        m.register(&mut reg);
        let source = m.sockets_open("source");
        source.inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(
            text.contains("istio_tcp_sockets_open{reporter=\"source\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn exposes_istio_names() {
        let m = Metrics::default();
        let mut reg = Registry::default();
        m.register(&mut reg);
        let l = ConnectionLabels {
            source_workload: "client".into(),
            ..Default::default()
        };
        let l = m.opened(l, &"pod-uid".into());
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

    #[test]
    fn a_known_workload_brings_the_four_locality_labels_and_ztunnel_s_defaults() {
        let encoded = |l: &ConnectionLabels| {
            let mut text = String::new();
            let m = Metrics::default();
            let mut reg = Registry::default();
            m.register(&mut reg);
            m.opened(l.clone(), &"pod-uid".into());
            prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
            text.lines()
                .find(|l| l.starts_with("istio_tcp_connections_opened_total{"))
                .unwrap()
                .to_string()
        };
        let mut l = ConnectionLabels::default();
        assert!(!encoded(&l).contains("_region"), "{}", encoded(&l));
        let w = Workload {
            name: "web-5d8f-x2x".into(),
            namespace: "shop".into(),
            workload_name: "web".into(),
            locality: crate::xds::types::Locality {
                region: "eu-west1".into(),
                ..Default::default()
            },
            ..Default::default()
        };
        l.set_destination(&WorkloadLabels::of(&w));
        let line = encoded(&l);
        assert!(
            line.ends_with("connection_security_policy=\"unknown\",source_region=\"unknown\",source_zone=\"unknown\",destination_region=\"eu-west1\",destination_zone=\"unknown\"} 1"),
            "{line}"
        );
        for label in [
            "destination_workload=\"web\"",
            "destination_canonical_revision=\"latest\"",
            "destination_cluster=\"Kubernetes\"",
        ] {
            assert!(line.contains(label), "{label} in {line}");
        }
    }
}
