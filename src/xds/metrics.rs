//! The xDS link's metrics (Istio's names where ztunnel has them): responses
//! and their bytes by type, streams ended by reason, and whether a stream
//! is open.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Counters of the xDS link, registered by whoever exposes metrics.
#[derive(Debug, Default, Clone)]
pub struct XdsMetrics {
    /// `istio_xds_message_total{url}`: responses received, by type.
    pub messages: Family<Vec<(String, String)>, Counter>,
    /// `istio_xds_message_bytes_total{url}`: the bytes of the resources
    /// they carried (ztunnel's measure: each resource's encoded body).
    pub message_bytes: Family<Vec<(String, String)>, Counter>,
    /// `istio_xds_connection_terminations_total{reason}`.
    pub terminations: Family<Vec<(String, String)>, Counter>,
    /// `ambit_xds_connected`: 1 while a stream is open.
    pub connected: Gauge,
}

impl XdsMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "istio_xds_message",
            "xDS responses received, by type",
            self.messages.clone(),
        );
        registry.register_with_unit(
            "istio_xds_message",
            "Bytes of the resources in xDS responses, by type",
            prometheus_client::registry::Unit::Bytes,
            self.message_bytes.clone(),
        );
        registry.register(
            "istio_xds_connection_terminations",
            "xDS streams ended, by reason",
            self.terminations.clone(),
        );
        registry.register(
            "ambit_xds_connected",
            "1 while an xDS stream is open",
            self.connected.clone(),
        );
    }
}
