//! The dump's `config` and `staticConfig` blocks, as ztunnel writes them:
//! `config` is the proxy's effective configuration under ztunnel's key
//! names and value shapes (durations as `{secs, nanos}`, addresses as
//! `{"SocketAddr": ...}` or `{"Localhost": [ipv6, port]}`, root
//! certificates as `{"File": path}` or `"Default"`) for every setting the
//! two share, and Ambit's own settings under `ambit`; `staticConfig` is the
//! local config file's resources.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Map, Value};

use crate::config::{ProxyConfig, ProxyMode};
use crate::constants::{DNS_PORT, HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};

fn duration(d: Duration) -> Value {
    json!({"secs": d.as_secs(), "nanos": d.subsec_nanos()})
}

fn socket_address(a: SocketAddr) -> Value {
    json!({"SocketAddr": a.to_string()})
}

fn root_cert(file: Option<&Path>) -> Value {
    match file {
        Some(p) => json!({"File": p}),
        None => json!("Default"),
    }
}

fn blank_is_null(s: &str) -> Value {
    if s.is_empty() {
        Value::Null
    } else {
        json!(s)
    }
}

/// The effective configuration, built once at start (it does not change
/// while the proxy runs).
pub(in crate::proxy) fn effective(cfg: &ProxyConfig) -> Value {
    let any = |port: u16| -> String {
        if cfg.ipv6 {
            format!("[::]:{port}")
        } else {
            format!("0.0.0.0:{port}")
        }
    };
    let mode = match cfg.mode {
        ProxyMode::Shared => "Shared",
        ProxyMode::Dedicated => "Dedicated",
    };
    let workload = cfg.workload_info.as_ref().map(
        |w| json!({"name": w.name, "namespace": w.namespace, "serviceAccount": w.service_account}),
    );
    let mut m = Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put("proxy", json!(true));
    put("dnsProxy", json!(cfg.dns_proxy));
    put("windowSize", json!(cfg.stream_window));
    put("connectionWindowSize", json!(cfg.connection_window));
    put("frameSize", json!(cfg.frame_size));
    put(
        "poolMaxStreamsPerConn",
        json!(cfg.pool_max_streams.min(u16::MAX as usize)),
    );
    put("poolUnusedReleaseTimeout", duration(cfg.pool_idle_timeout));
    put("adminAddr", socket_address(cfg.admin_addr));
    put("statsAddr", socket_address(cfg.metrics_addr));
    put("readinessAddr", socket_address(cfg.readiness_addr));
    put("inboundAddr", json!(any(HBONE_PORT)));
    put("inboundPlaintextAddr", json!(any(INBOUND_PLAINTEXT_PORT)));
    put("outboundAddr", json!(any(OUTBOUND_PORT)));
    put("dnsProxyAddr", json!({"Localhost": [cfg.ipv6, DNS_PORT]}));
    put("network", json!(cfg.network));
    put("localNode", blank_is_null(&cfg.node_name));
    put("proxyMode", json!(mode));
    put("proxyWorkloadInformation", json!(workload));
    put("clusterId", json!(cfg.cluster_id));
    put("clusterDomain", json!(cfg.cluster_domain));
    put("caAddress", json!(cfg.ca_address));
    put("caRootCert", root_cert(cfg.ca_root_ca.as_deref()));
    put("xdsAddress", json!(cfg.xds_address));
    put("xdsRootCert", root_cert(cfg.xds_root_ca.as_deref()));
    put("secretTtl", duration(cfg.cert_ttl));
    put("xdsOnDemand", json!(cfg.xds_on_demand));
    // A local CA (`ca_cert`/`ca_key`) signs this proxy's certificates
    // itself: ztunnel's nearest setting is its fake CA.
    put(
        "fakeCa",
        json!(cfg.ca_cert.is_some() && cfg.ca_address.is_none()),
    );
    put("selfTerminationDeadline", duration(cfg.drain_timeout));
    put("numWorkerThreads", json!(cfg.worker_threads));
    put("inpodUds", json!(cfg.zds_path));
    put("packetMark", json!(cfg.packet_mark));
    put("ipv6Enabled", json!(cfg.ipv6));
    put("crlPath", json!(cfg.crl_path));
    // Ambit's own settings, by their config key names.
    put(
        "ambit",
        json!({
            "trustDomain": cfg.trust_domain,
            "podName": cfg.pod_name,
            "podNamespace": cfg.pod_namespace,
            "instanceIp": cfg.instance_ip,
            "localXdsPath": cfg.local_xds_path,
            "meshRootCa": cfg.mesh_root_ca,
            "authToken": cfg.auth_token,
            "caCert": cfg.ca_cert,
            "stateDir": cfg.state_dir,
            "poolSpread": cfg.pool_spread,
            "hboneUnsentLimit": cfg.hbone_unsent_limit,
            "memoryBudget": cfg.memory_budget,
            "congestionControl": cfg.congestion_control.as_deref(),
            "xdsOnDemandWait": duration(cfg.xds_on_demand_wait),
            "dnsUpstreams": cfg.dns_upstreams.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            "logFormat": format!("{:?}", cfg.log_format).to_lowercase(),
            "logLevel": cfg.log_level,
        }),
    );
    Value::Object(m)
}

/// The local config file's resources, read at the request as ztunnel does:
/// `workloads`, `policies` and `services` as the file has them, each an
/// empty list when the file has none or there is no file. A file that no
/// longer reads is logged and left out (the state keeps its last good
/// version, which the dump's other blocks show).
pub(in crate::proxy) fn static_config(file: Option<&Path>) -> Value {
    let empty = || json!({"workloads": [], "policies": [], "services": []});
    let Some(file) = file else {
        return empty();
    };
    let parsed = std::fs::read_to_string(file)
        .map_err(|e| e.to_string())
        .and_then(|text| {
            serde_yaml::from_str::<serde_yaml::Value>(&text).map_err(|e| e.to_string())
        })
        .map(json_of);
    match parsed {
        Ok(Value::Object(doc)) => {
            let mut out = empty();
            for key in ["workloads", "policies", "services"] {
                if let Some(v @ Value::Array(_)) = doc.get(key) {
                    out[key] = v.clone();
                }
            }
            out
        }
        Ok(_) => empty(),
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "config dump: the local config file does not read; staticConfig left empty");
            empty()
        }
    }
}

/// YAML as JSON: a map's keys become strings (`ports: {80: 8080}` is
/// `{"80": 8080}`, as ztunnel writes ports); tags are dropped.
fn json_of(v: serde_yaml::Value) -> Value {
    use serde_yaml::Value as Y;
    match v {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(b),
        Y::Number(n) => serde_json::to_value(&n).unwrap_or(Value::Null),
        Y::String(s) => Value::String(s),
        Y::Sequence(items) => Value::Array(items.into_iter().map(json_of).collect()),
        Y::Mapping(m) => Value::Object(
            m.into_iter()
                .map(|(k, v)| {
                    let key = match k {
                        Y::String(s) => s,
                        Y::Number(n) => n.to_string(),
                        Y::Bool(b) => b.to_string(),
                        other => serde_yaml::to_string(&other)
                            .unwrap_or_default()
                            .trim()
                            .to_string(),
                    };
                    (key, json_of(v))
                })
                .collect(),
        ),
        Y::Tagged(t) => json_of(t.value),
    }
}
