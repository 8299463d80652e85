//! The agent's Prometheus metrics (istio-cni's names, and Ambit's own for
//! what istio-cni does not report), served on 15014.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Default)]
pub struct AgentMetrics {
    /// `istio_cni_plugin_requests_total{response_code}`: plugin events by answer.
    pub plugin_requests: Family<Vec<(String, String)>, Counter>,
    /// `istio_cni_install_ready`: 1 while the plugin is installed.
    pub install_ready: Gauge,
    /// `ztunnel_connected`: proxies connected over ZDS.
    pub ztunnel_connected: Gauge,
    /// `nodeagent_reconcile_events_total{type}`: pods added and removed.
    pub reconcile_events: Family<Vec<(String, String)>, Counter>,
    /// `ambit_agent_state_write_failures_total`: failed writes of the state file.
    pub state_write_failures: Counter,
}

impl AgentMetrics {
    pub(super) fn registry(&self) -> Registry {
        let mut r = Registry::default();
        r.register(
            "istio_cni_plugin_requests",
            "CNI plugin events by response code",
            self.plugin_requests.clone(),
        );
        r.register(
            "istio_cni_install_ready",
            "1 while the CNI plugin is installed",
            self.install_ready.clone(),
        );
        r.register(
            "ztunnel_connected",
            "Proxies connected over ZDS",
            self.ztunnel_connected.clone(),
        );
        r.register(
            "nodeagent_reconcile_events",
            "Pods enrolled and removed",
            self.reconcile_events.clone(),
        );
        r.register(
            "ambit_agent_state_write_failures",
            "Failed writes of the agent's state file (each is retried until one succeeds)",
            self.state_write_failures.clone(),
        );
        r
    }

    pub(super) fn event(&self, kind: &str) {
        self.reconcile_events
            .get_or_create(&vec![("type".into(), kind.into())])
            .inc();
    }
}
