//! `/config_dump` on the admin port, in ztunnel's JSON shape so that
//! `istioctl ztunnel-config workloads|services|policies|certificates` reads
//! it: `workloads`, `services` and `policies` as arrays (sorted by uid,
//! hostname and key), `certificates` with their chains, `workloadState`
//! keyed by pod uid; plus Ambit's own `pods`, `pool` and `refused` (the
//! addresses and names of refused resources, with the reasons). Read-only, built
//! per request from snapshots; never on the data path.

use std::time::SystemTime;

use base64::Engine;
use rustls::pki_types::CertificateDer;
use serde_json::{json, Map, Value};

use super::{inpod, pool};
use crate::identity::CertManager;
use crate::xds::types::{
    Authorization, GatewayAddress, HealthStatus, IpFamilies, NetworkMode, PolicyAction,
    PolicyScope, Protocol, RbacMatch, Service, StringMatch, Visibility, Workload,
};
use crate::xds::{State, StateHandle};

/// What the dump says of the proxy's own configuration: the effective
/// settings (fixed at start) and the local config file, if any.
pub(super) struct Configured {
    pub effective: Value,
    pub local_file: Option<std::path::PathBuf>,
}

impl Configured {
    pub fn of(cfg: &crate::config::ProxyConfig) -> Self {
        Configured {
            effective: config::effective(cfg),
            local_file: cfg.local_xds_path.clone(),
        }
    }
}

pub(super) fn config_dump(
    state: &StateHandle,
    certs: &CertManager,
    pool: &pool::Pool,
    pods: &inpod::PodTable,
    trust_domain: &str,
    configured: &Configured,
) -> String {
    let st = state.load();
    let mut workloads: Vec<_> = st.workloads().collect();
    workloads.sort_by(|a, b| a.uid.cmp(&b.uid));
    let mut services: Vec<_> = st.services().collect();
    services.sort_by(|a, b| {
        a.hostname
            .cmp(&b.hostname)
            .then(a.namespace.cmp(&b.namespace))
    });
    let mut policies: Vec<_> = st.policies().collect();
    policies.sort_by_key(|p| p.key());
    // Ambit's own: what a refused resource claimed (refused to every
    // connection, never passed through), with the resource and its reason.
    let mut refused: Vec<_> = st
        .refusals()
        .map(|(claim, r)| json!({"address": claim, "resource": r.resource, "reason": r.reason}))
        .collect();
    refused.sort_by(|a, b| a["address"].as_str().cmp(&b["address"].as_str()));
    let held = certs.certificates();
    let views = pods.views();
    let served: Vec<Value> = views
        .iter()
        .map(|p| {
            let cert = held.iter().find(|(id, _)| id.to_string() == p.identity);
            json!({
                "uid": p.uid, "name": p.name, "namespace": p.namespace, "identity": p.identity,
                "ips": p.ips, "netns": {"dev": p.netns.0, "ino": p.netns.1}, "addedUnix": p.added_unix,
                // Serving with its certificate, or still waiting for it from the CA.
                "state": if cert.is_some() { "serving" } else { "certificate pending" },
                "certificateExpiresUnix": cert.map(|(_, c)| unix(c.cert.not_after)),
            })
        })
        .collect();
    let workload_state: Map<String, Value> = views
        .iter()
        .map(|p| {
            let sa = p.identity.rsplit("/sa/").next().unwrap_or_default();
            let info = json!({"name": p.name, "namespace": p.namespace, "serviceAccount": sa});
            let state = json!({"state": "Up", "connections": p.open.dump(), "info": info});
            (p.uid.clone(), state)
        })
        .collect();
    json!({
        "workloads": workloads.iter().map(|w| workload(w, trust_domain)).collect::<Vec<_>>(),
        "services": services.iter().map(|s| service(&st, s)).collect::<Vec<_>>(),
        "policies": policies.iter().map(|p| policy(p)).collect::<Vec<_>>(),
        "certificates": held.iter().map(|(id, c)| certificate(&id.to_string(), &c.cert.chain, &c.cert.roots)).collect::<Vec<_>>(),
        "workloadState": workload_state,
        "version": version(),
        "config": configured.effective,
        "staticConfig": config::static_config(configured.local_file.as_deref()),
        "pool": {"open": pool.open(), "dials": pool.dials()},
        "pods": served,
        "refused": refused,
    })
    .to_string()
}

/// ztunnel's `version` block: what this build knows of itself. A field
/// its build does not record reads `unknown`.
fn version() -> Value {
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "gitRevision": option_env!("AMBIT_GIT_REVISION").unwrap_or("unknown"),
        "rustVersion": option_env!("AMBIT_RUST_VERSION").unwrap_or("unknown"),
        "buildProfile": if cfg!(debug_assertions) { "debug" } else { "release" },
        "buildStatus": "unknown",
        "istioVersion": "unknown",
        "cryptoProvider": if cfg!(feature = "fips") { "aws-lc-rs (FIPS)" } else { "aws-lc-rs" },
    })
}

/// Adds `key: value` unless the value is empty (ztunnel leaves defaults out).
fn put(m: &mut Map<String, Value>, key: &str, value: impl Into<Value>) {
    let v = value.into();
    let empty = match &v {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    };
    if !empty {
        m.insert(key.to_string(), v);
    }
}

fn gateway(g: &GatewayAddress) -> Value {
    json!({"destination": g.destination.to_string(), "hboneMtlsPort": g.hbone_mtls_port})
}

/// `{service port: target port}`, from a service's map or a workload's.
fn ports<'a>(p: impl IntoIterator<Item = (&'a u16, &'a u16)>) -> Value {
    p.into_iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect::<Map<_, _>>()
        .into()
}

fn health(s: HealthStatus) -> &'static str {
    match s {
        HealthStatus::Healthy => "Healthy",
        HealthStatus::Unhealthy => "Unhealthy",
    }
}

fn workload(w: &Workload, trust_domain: &str) -> Value {
    let mut m = Map::new();
    put(&mut m, "uid", w.uid.as_str());
    m.insert("workloadIps".into(), json!(w.workload_ips));
    put(&mut m, "hostname", w.hostname.as_str());
    m.insert(
        "protocol".into(),
        json!(match w.protocol {
            Protocol::Hbone => "HBONE",
            Protocol::Tcp => "TCP",
        }),
    );
    let mode = match w.network_mode {
        NetworkMode::Standard => "Standard",
        NetworkMode::HostNetwork => "HostNetwork",
    };
    m.insert("networkMode".into(), json!(mode));
    put(&mut m, "name", w.name.as_str());
    put(&mut m, "namespace", w.namespace.as_str());
    let td = if w.trust_domain.is_empty() {
        trust_domain
    } else {
        &w.trust_domain
    };
    put(&mut m, "trustDomain", td);
    put(&mut m, "serviceAccount", w.service_account.as_str());
    put(&mut m, "network", w.network.as_str());
    put(&mut m, "workloadName", w.workload_name.as_str());
    put(&mut m, "workloadType", w.workload_type.as_str());
    put(&mut m, "canonicalName", w.canonical_name.as_str());
    put(&mut m, "canonicalRevision", w.canonical_revision.as_str());
    put(&mut m, "node", w.node.as_str());
    m.insert("status".into(), json!(health(w.status)));
    // Always written, defaults filled in as ztunnel fills them.
    let cluster = match w.cluster_id.as_str() {
        "" => super::metrics::DEFAULT_CLUSTER,
        id => id,
    };
    m.insert("clusterId".into(), json!(cluster));
    put(&mut m, "waypoint", w.waypoint.as_deref().map(gateway));
    put(&mut m, "networkGateway", w.network_gateway().map(gateway));
    if w.native_tunnel {
        m.insert("nativeTunnel".into(), json!(true));
    }
    put(
        &mut m,
        "applicationTunnel",
        w.application_tunnel().map(|t| {
            let protocol = match t.protocol {
                crate::xds::types::TunnelToApp::None => "NONE",
                crate::xds::types::TunnelToApp::Proxy => "PROXY",
            };
            json!({"protocol": protocol, "port": t.port})
        }),
    );
    let l = &w.locality;
    if !(l.region.is_empty() && l.zone.is_empty() && l.subzone.is_empty()) {
        m.insert(
            "locality".into(),
            json!({"region": l.region, "zone": l.zone, "subzone": l.subzone}),
        );
    }
    m.insert("capacity".into(), json!(w.capacity().unwrap_or(1)));
    put(
        &mut m,
        "authorizationPolicies",
        json!(w.authorization_policies),
    );
    // ztunnel's: the names only (the ports are the services' endpoints').
    // Sorted, as BackedServices keeps them.
    let services: Vec<&str> = w.services.keys().map(|k| k.as_str()).collect();
    put(&mut m, "services", json!(services));
    m.into()
}

fn service(st: &State, s: &Service) -> Value {
    let mut m = Map::new();
    put(&mut m, "name", s.name.as_str());
    put(&mut m, "namespace", s.namespace.as_str());
    put(&mut m, "hostname", s.hostname.as_str());
    m.insert(
        "vips".into(),
        json!(s.vips.iter().map(|v| v.to_string()).collect::<Vec<_>>()),
    );
    if !s.cidr_vips.is_empty() {
        m.insert(
            "cidrVips".into(),
            json!(s
                .cidr_vips
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()),
        );
    }
    m.insert("ports".into(), ports(&s.ports));
    let endpoints: Map<String, Value> = st
        .endpoints(s)
        .map(|e| {
            let uid = e.workload.uid.to_string();
            let v = json!({"workloadUid": uid, "port": ports(e.ports.iter()),
                "status": health(e.workload.status)});
            (uid, v)
        })
        .collect();
    m.insert("endpoints".into(), endpoints.into());
    m.insert("subjectAltNames".into(), json!(s.subject_alt_names));
    put(&mut m, "waypoint", s.waypoint.as_ref().map(gateway));
    put(
        &mut m,
        "weightedWaypoints",
        json!(s
            .weighted_waypoints
            .iter()
            .map(|w| json!({"destination": gateway(&w.gateway()), "weight": w.weight}))
            .collect::<Vec<_>>()),
    );
    put(
        &mut m,
        "loadBalancer",
        s.load_balancing.as_ref().map(|lb| {
            // ztunnel's spelling: its enums' variant names.
            let scopes: Vec<String> = lb
                .routing_preferences
                .iter()
                .map(|p| format!("{p:?}"))
                .collect();
            json!({"mode": format!("{:?}", lb.mode), "routingPreferences": scopes,
                "healthPolicy": format!("{:?}", lb.health_policy)})
        }),
    );
    put(
        &mut m,
        "ipFamilies",
        s.ip_families.map(|f| match f {
            IpFamilies::Dual => "Dual",
            IpFamilies::V4 => "IPv4",
            IpFamilies::V6 => "IPv6",
        }),
    );
    m.insert("canonical".into(), json!(s.canonical));
    let visibility = match s.visibility {
        Visibility::Public => "Public",
        Visibility::Namespace => "Namespace",
    };
    m.insert("visibility".into(), json!(visibility));
    m.into()
}

fn string_match(s: &StringMatch) -> Value {
    match s {
        StringMatch::Exact(v) => json!({"Exact": v}),
        StringMatch::Prefix(v) => json!({"Prefix": v}),
        StringMatch::Suffix(v) => json!({"Suffix": v}),
        StringMatch::Presence => json!("Presence"),
    }
}

fn rbac_match(r: &RbacMatch) -> Value {
    let strings = |v: &[StringMatch]| v.iter().map(string_match).collect::<Vec<_>>();
    let cidrs = |v: &[crate::xds::types::Cidr]| {
        v.iter()
            .map(|c| format!("{}/{}", c.net, c.len))
            .collect::<Vec<_>>()
    };
    let sas = |v: &[crate::xds::types::ServiceAccountMatch]| {
        v.iter()
            .map(|s| json!({"namespace": s.namespace, "serviceAccount": s.service_account}))
            .collect::<Vec<_>>()
    };
    // As ztunnel: the fields a match sets, none of the empty ones.
    let mut m = Map::new();
    put(&mut m, "namespaces", strings(&r.namespaces));
    put(&mut m, "notNamespaces", strings(&r.not_namespaces));
    put(&mut m, "serviceAccounts", sas(&r.service_accounts));
    put(&mut m, "notServiceAccounts", sas(&r.not_service_accounts));
    put(&mut m, "principals", strings(&r.principals));
    put(&mut m, "notPrincipals", strings(&r.not_principals));
    put(&mut m, "sourceIps", cidrs(&r.source_ips));
    put(&mut m, "notSourceIps", cidrs(&r.not_source_ips));
    put(&mut m, "destinationIps", cidrs(&r.destination_ips));
    put(&mut m, "notDestinationIps", cidrs(&r.not_destination_ips));
    put(&mut m, "destinationPorts", json!(r.destination_ports));
    put(
        &mut m,
        "notDestinationPorts",
        json!(r.not_destination_ports),
    );
    m.into()
}

fn policy(p: &Authorization) -> Value {
    let scope = match p.scope {
        PolicyScope::Global => "Global",
        PolicyScope::Namespace => "Namespace",
        PolicyScope::WorkloadSelector => "WorkloadSelector",
    };
    let action = match p.action {
        PolicyAction::Allow => "Allow",
        PolicyAction::Deny => "Deny",
    };
    let rules: Vec<Vec<Vec<Value>>> = p
        .rules
        .iter()
        .map(|r| {
            r.iter()
                .map(|c| c.iter().map(rbac_match).collect())
                .collect()
        })
        .collect();
    let mut v = json!({"name": p.name, "namespace": p.namespace, "scope": scope, "action": action,
        "rules": rules, "dryRun": p.dry_run});
    if let Some(reason) = &p.refused {
        // Ambit's own: a refused policy fails closed where it applies.
        v["refused"] = json!(reason);
    }
    v
}

/// One identity's chain and roots, each certificate as istioctl reads it:
/// base64 of its PEM text, a decimal serial, RFC 3339 validity.
fn certificate(
    identity: &str,
    chain: &[CertificateDer<'_>],
    roots: &[CertificateDer<'_>],
) -> Value {
    let state = if chain.is_empty() {
        "Initializing"
    } else {
        "Available"
    };
    json!({
        "identity": identity,
        "state": state,
        "certChain": chain.iter().map(cert).collect::<Vec<_>>(),
        "rootCerts": roots.iter().map(cert).collect::<Vec<_>>(),
    })
}

fn cert(der: &CertificateDer<'_>) -> Value {
    let b64 = base64::engine::general_purpose::STANDARD;
    let pem = crate::identity::pem("CERTIFICATE", der.as_ref());
    let (serial, from, to) = match x509_parser::parse_x509_certificate(der.as_ref()) {
        Ok((_, c)) => (
            c.tbs_certificate.serial.to_string(),
            rfc3339(c.validity().not_before.timestamp()),
            rfc3339(c.validity().not_after.timestamp()),
        ),
        Err(_) => (String::new(), String::new(), String::new()),
    };
    json!({"pem": b64.encode(pem), "serialNumber": serial, "validFrom": from, "expirationTime": to})
}

/// Seconds since 1970 as `2026-01-01T00:00:00Z`.
fn rfc3339(secs: i64) -> String {
    match time::OffsetDateTime::from_unix_timestamp(secs) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        ),
        Err(_) => String::new(),
    }
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

mod config;
#[cfg(test)]
mod tests;
