//! `/config_dump` on the admin port, in ztunnel's JSON shape so that
//! `istioctl ztunnel-config workloads|services|policies|certificates` reads
//! it: `workloads`, `services` and `policies` as arrays (sorted by uid,
//! hostname and key), `certificates` with their chains, `workloadState`
//! keyed by pod uid; plus Ambit's own `pods`, `pool` and `refused` (the
//! addresses and names of refused resources, with the reasons). Read-only, built
//! per request from snapshots; never on the data path.

use std::collections::BTreeMap;
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

pub(super) fn config_dump(
    state: &StateHandle,
    certs: &CertManager,
    pool: &pool::Pool,
    pods: &inpod::PodTable,
    trust_domain: &str,
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
            (p.uid.clone(), json!({"state": "Up", "info": info}))
        })
        .collect();
    json!({
        "workloads": workloads.iter().map(|w| workload(w, trust_domain)).collect::<Vec<_>>(),
        "services": services.iter().map(|s| service(&st, s)).collect::<Vec<_>>(),
        "policies": policies.iter().map(|p| policy(p)).collect::<Vec<_>>(),
        "certificates": held.iter().map(|(id, c)| certificate(&id.to_string(), &c.cert.chain, &c.cert.roots)).collect::<Vec<_>>(),
        "workloadState": workload_state,
        "version": version(),
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
        "gitRevision": "unknown",
        "rustVersion": option_env!("AMBIT_RUST_VERSION").unwrap_or("unknown"),
        "buildProfile": if cfg!(debug_assertions) { "debug" } else { "release" },
        "buildStatus": "unknown",
        "istioVersion": "unknown",
        "cryptoProvider": "aws-lc-rs",
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

fn ports(p: &BTreeMap<u16, u16>) -> Value {
    p.iter()
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
    put(&mut m, "waypoint", w.waypoint.as_ref().map(gateway));
    put(
        &mut m,
        "networkGateway",
        w.network_gateway.as_ref().map(gateway),
    );
    if w.native_tunnel {
        m.insert("nativeTunnel".into(), json!(true));
    }
    put(
        &mut m,
        "applicationTunnel",
        w.application_tunnel.map(|t| {
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
    m.insert("capacity".into(), json!(w.capacity.unwrap_or(1)));
    put(
        &mut m,
        "authorizationPolicies",
        json!(w.authorization_policies),
    );
    // ztunnel's: the names only (the ports are the services' endpoints').
    let mut services: Vec<&String> = w.services.keys().collect();
    services.sort();
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
            let uid = e.workload.uid.clone();
            let v = json!({"workloadUid": uid, "port": ports(&e.ports),
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
    let body = b64.encode(der.as_ref());
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in body.as_bytes().chunks(64) {
        pem.push_str(&String::from_utf8_lossy(line));
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::Path;

    use serde::Deserialize;

    use super::*;
    use crate::identity::{CertSource, Identity, LocalCa};

    // What istioctl's ztunnel config-dump reader decodes, field for field
    // and type for type (a value of another JSON type fails its decode).
    #[derive(Deserialize)]
    #[allow(dead_code)]
    #[serde(rename_all = "camelCase")]
    struct Dump {
        workloads: Vec<IWorkload>,
        services: Vec<IService>,
        policies: Vec<IPolicy>,
        certificates: Vec<ICerts>,
        workload_state: HashMap<String, Value>,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    #[serde(rename_all = "camelCase")]
    struct IWorkload {
        uid: String,
        workload_ips: Vec<String>,
        protocol: String,
        name: String,
        namespace: String,
        service_account: Option<String>,
        workload_name: Option<String>,
        workload_type: Option<String>,
        canonical_name: Option<String>,
        canonical_revision: Option<String>,
        cluster_id: Option<String>,
        trust_domain: Option<String>,
        node: Option<String>,
        network: Option<String>,
        status: String,
        hostname: Option<String>,
        waypoint: Option<IGateway>,
        network_gateway: Option<IGateway>,
        capacity: Option<u32>,
        locality: Option<ILocality>,
        application_tunnel: Option<ITunnel>,
        authorization_policies: Option<Vec<String>>,
    }

    #[derive(Deserialize)]
    struct IGateway {
        destination: String,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct ILocality {
        region: String,
        zone: String,
        subzone: String,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct ITunnel {
        protocol: String,
        port: Option<u32>,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    #[serde(rename_all = "camelCase")]
    struct IService {
        name: String,
        namespace: String,
        hostname: String,
        vips: Vec<String>,
        ports: HashMap<String, i64>,
        endpoints: HashMap<String, IEndpoint>,
        waypoint: Option<IGateway>,
        subject_alt_names: Vec<String>,
        load_balancer: Option<ILoadBalancer>,
        ip_families: Option<String>,
        canonical: Option<bool>,
        visibility: Option<String>,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    #[serde(rename_all = "camelCase")]
    struct IEndpoint {
        workload_uid: String,
        port: HashMap<String, i64>,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    #[serde(rename_all = "camelCase")]
    struct ILoadBalancer {
        mode: String,
        routing_preferences: Vec<String>,
        health_policy: String,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    #[serde(rename_all = "camelCase")]
    struct IPolicy {
        name: String,
        namespace: String,
        scope: String,
        action: String,
        rules: Vec<Vec<Vec<IMatch>>>,
        dry_run: bool,
    }

    /// Absent fields read empty, as Go's decoder reads them.
    #[derive(Deserialize)]
    #[allow(dead_code)]
    #[serde(rename_all = "camelCase", default)]
    #[derive(Default)]
    struct IMatch {
        namespaces: Vec<HashMap<String, String>>,
        principals: Vec<HashMap<String, String>>,
        source_ips: Vec<String>,
        destination_ports: Vec<u32>,
        service_accounts: Vec<ISaMatch>,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    #[serde(rename_all = "camelCase")]
    struct ISaMatch {
        namespace: String,
        service_account: String,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ICerts {
        identity: String,
        state: String,
        cert_chain: Vec<ICert>,
        root_certs: Vec<ICert>,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ICert {
        pem: String,
        serial_number: String,
        valid_from: String,
        expiration_time: String,
    }

    fn state() -> StateHandle {
        StateHandle::new(
            crate::xds::local::parse(
                Path::new("dump.yaml"),
                r#"
workloads:
- {uid: c1//Pod/shop/api-0, name: api-0, namespace: shop, serviceAccount: api, workloadIps: [10.0.0.3], protocol: HBONE,
   node: node-a, canonicalName: api, canonicalRevision: v1, workloadName: api, capacity: 2,
   locality: {region: eu, zone: eu-1}, waypoint: {destination: "/10.96.0.9"},
   services: {"shop/api.shop.svc.cluster.local": {80: 8080}}}
- {uid: c1//Pod/shop/sick-0, name: sick-0, namespace: shop, workloadIps: [10.0.0.4], status: Unhealthy,
   services: {"shop/api.shop.svc.cluster.local": {80: 8080}}}
services:
- {name: api, namespace: shop, hostname: api.shop.svc.cluster.local, vips: ["/10.96.0.20"], ports: {80: 8080},
   waypoint: {destination: "shop/wp.shop.svc.cluster.local"}, loadBalancer: {healthPolicy: ONLY_HEALTHY}}
- {name: wp, namespace: shop, hostname: wp.shop.svc.cluster.local, vips: ["/10.96.0.9"], ports: {15008: 15008}}
policies:
- {name: allow-front, namespace: shop, action: Allow, rules: [[[{namespaces: [!Exact shop], sourceIps: [10.0.0.0/8],
   destinationPorts: [8080], serviceAccounts: [{namespace: shop, serviceAccount: front}]}]]]}
"#,
            )
            .unwrap(),
        )
    }

    /// istioctl's WAYPOINT column: the name of the service the destination names.
    fn waypoint_column(g: &Option<IGateway>, services: &[IService]) -> String {
        let Some(g) = g else { return "None".into() };
        services
            .iter()
            .find(|s| {
                g.destination == format!("{}/{}", s.namespace, s.hostname)
                    || s.vips.contains(&g.destination)
            })
            .map_or("NA".into(), |s| s.name.clone())
    }

    #[tokio::test]
    async fn the_dump_decodes_as_istioctl_reads_a_ztunnel_dump() {
        let certs = CertManager::new(
            CertSource::Local(Box::new(LocalCa::generate("cluster.local").unwrap())),
            std::time::Duration::from_secs(3600),
        );
        let id = Identity::new("cluster.local", "shop", "api");
        certs.get(&id).await.unwrap();
        let pool = pool::Pool::new(100, 1, std::time::Duration::from_secs(60));
        let text = config_dump(
            &state(),
            &certs,
            &pool,
            &inpod::PodTable::default(),
            "cluster.local",
        );
        let dump: Dump = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));

        let w = &dump.workloads[0];
        assert_eq!((w.name.as_str(), w.namespace.as_str()), ("api-0", "shop"));
        assert_eq!(w.workload_ips, ["10.0.0.3"], "plain IPs, not network/IP");
        assert_eq!(
            (w.protocol.as_str(), w.status.as_str()),
            ("HBONE", "Healthy")
        );
        assert_eq!(w.trust_domain.as_deref(), Some("cluster.local"));
        assert_eq!(waypoint_column(&w.waypoint, &dump.services), "wp", "by VIP");
        assert_eq!(
            waypoint_column(&dump.workloads[1].waypoint, &dump.services),
            "None"
        );

        let api = dump.services.iter().find(|s| s.name == "api").unwrap();
        assert_eq!(api.vips, ["/10.96.0.20"]);
        assert_eq!(api.ports.get("80"), Some(&8080));
        assert_eq!(
            waypoint_column(&api.waypoint, &dump.services),
            "wp",
            "by hostname"
        );
        // ENDPOINTS "healthy/total": endpoints joined to workloads' status.
        let healthy = api
            .endpoints
            .values()
            .filter(|e| {
                dump.workloads
                    .iter()
                    .any(|w| w.uid == e.workload_uid && w.status == "Healthy")
            })
            .count();
        assert_eq!((healthy, api.endpoints.len()), (1, 2));

        let p = &dump.policies[0];
        assert_eq!(
            (p.scope.as_str(), p.action.as_str()),
            ("Namespace", "Allow")
        );
        assert_eq!(
            p.rules[0][0][0].namespaces[0]
                .get("Exact")
                .map(String::as_str),
            Some("shop")
        );
        assert_eq!(p.rules[0][0][0].source_ips, ["10.0.0.0/8"]);

        let c = &dump.certificates[0];
        assert_eq!(c.identity, id.to_string());
        assert_eq!(c.state, "Available");
        assert!(!c.cert_chain.is_empty() && !c.root_certs.is_empty());
        let b64 = base64::engine::general_purpose::STANDARD;
        for cert in c.cert_chain.iter().chain(&c.root_certs) {
            let pem = String::from_utf8(b64.decode(&cert.pem).unwrap()).unwrap();
            assert!(pem.starts_with("-----BEGIN CERTIFICATE-----\n"), "{pem}");
            assert!(
                !cert.serial_number.is_empty()
                    && cert.serial_number.bytes().all(|b| b.is_ascii_digit()),
                "a decimal serial: {}",
                cert.serial_number
            );
            // RFC 3339 with seconds, and now inside the validity.
            let parse = |s: &str| {
                time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
                    .unwrap_or_else(|e| panic!("{s}: {e}"))
            };
            let now = time::OffsetDateTime::now_utc();
            assert!(parse(&cert.valid_from) <= now && now <= parse(&cert.expiration_time));
        }
        assert!(dump.workload_state.is_empty(), "no pods served here");
    }

    #[tokio::test]
    async fn the_dump_shows_load_balancing_vip_ranges_and_each_refused_address_with_its_reason() {
        let cfg: crate::xds::local::LocalConfig = serde_yaml::from_str(
            r#"
workloads:
- {name: gated, namespace: shop, workloadIps: [10.0.0.5], networkGateway: {destination: "/192.0.2.1"}}
services:
- {name: wp, namespace: shop, hostname: wp.shop, vips: ["/10.96.0.9"], cidrVips: ["/10.97.0.0/16"],
   ports: {15008: 15008}, ipFamilies: Dual,
   loadBalancer: {routingPreferences: [NETWORK, REGION, ZONE, SUBZONE], mode: FAILOVER}}
"#,
        )
        .unwrap();
        let (st, _) = State::build_lenient(cfg.workloads, cfg.services, cfg.policies);
        let certs = CertManager::new(
            CertSource::Local(Box::new(LocalCa::generate("cluster.local").unwrap())),
            std::time::Duration::from_secs(3600),
        );
        let pool = pool::Pool::new(100, 1, std::time::Duration::from_secs(60));
        let text = config_dump(
            &StateHandle::new(st),
            &certs,
            &pool,
            &inpod::PodTable::default(),
            "cluster.local",
        );
        let dump: Value = serde_json::from_str(&text).unwrap();
        let wp = &dump["services"][0];
        assert_eq!(
            wp["loadBalancer"],
            json!({"mode": "Failover", "routingPreferences": ["Network", "Region", "Zone", "Subzone"],
                "healthPolicy": "OnlyHealthy"})
        );
        assert_eq!(wp["ipFamilies"], "Dual");
        assert_eq!(wp["cidrVips"], json!(["/10.97.0.0/16"]));
        let refused = dump["refused"].as_array().unwrap();
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0]["address"], "/10.0.0.5");
        assert!(refused[0]["reason"]
            .as_str()
            .unwrap()
            .contains("network gateway"));
    }

    /// ztunnel's dump, typed as ztunnel writes it (its `Workload`,
    /// `Service`, `Endpoint`, `Authorization`, `RbacMatch` and `BuildInfo`,
    /// camelCase, unknown keys refused): every key Ambit writes in these
    /// objects must be one of ztunnel's, of ztunnel's type, and the keys
    /// ztunnel always writes must be there.
    // Decoding is the check (a key of the wrong type or unknown fails it),
    // so most fields are never read.
    #[allow(dead_code)]
    mod ztunnel {
        use std::collections::HashMap;

        use serde::Deserialize;

        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        pub struct Dump {
            pub workloads: Vec<Workload>,
            pub services: Vec<Service>,
            pub policies: Vec<Authorization>,
            pub version: BuildInfo,
        }

        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct Gateway {
            pub destination: String,
            pub hbone_mtls_port: u16,
        }

        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct Locality {
            pub region: String,
            pub zone: String,
            pub subzone: String,
        }

        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct Workload {
            pub workload_ips: Vec<std::net::IpAddr>,
            pub waypoint: Option<Gateway>,
            pub network_gateway: Option<Gateway>,
            pub protocol: String,
            pub network_mode: String,
            pub uid: Option<String>,
            pub name: String,
            pub namespace: String,
            pub trust_domain: Option<String>,
            pub service_account: Option<String>,
            pub network: Option<String>,
            pub workload_name: Option<String>,
            pub workload_type: Option<String>,
            pub canonical_name: Option<String>,
            pub canonical_revision: Option<String>,
            pub hostname: Option<String>,
            pub node: Option<String>,
            pub native_tunnel: Option<bool>,
            pub application_tunnel: Option<serde_json::Value>,
            pub authorization_policies: Option<Vec<String>>,
            pub status: String,
            pub cluster_id: String,
            pub locality: Option<Locality>,
            pub services: Option<Vec<String>>,
            pub capacity: u32,
        }

        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct Endpoint {
            pub workload_uid: String,
            pub port: HashMap<u16, u16>,
            pub status: String,
        }

        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct Service {
            pub name: String,
            pub namespace: String,
            pub hostname: String,
            pub vips: Vec<String>,
            pub cidr_vips: Option<Vec<String>>,
            pub ports: HashMap<u16, u16>,
            pub endpoints: HashMap<String, Endpoint>,
            pub subject_alt_names: Vec<String>,
            pub waypoint: Option<Gateway>,
            pub weighted_waypoints: Option<Vec<serde_json::Value>>,
            pub load_balancer: Option<serde_json::Value>,
            pub ip_families: Option<String>,
            pub canonical: bool,
            pub visibility: String,
        }

        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct Authorization {
            pub name: String,
            pub namespace: String,
            pub scope: String,
            pub action: String,
            pub rules: Vec<Vec<Vec<RbacMatch>>>,
            pub dry_run: bool,
        }

        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct ServiceAccountMatch {
            pub namespace: String,
            pub service_account: String,
        }

        /// Every field optional: ztunnel writes only those a match sets.
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct RbacMatch {
            pub namespaces: Option<Vec<serde_json::Value>>,
            pub not_namespaces: Option<Vec<serde_json::Value>>,
            pub service_accounts: Option<Vec<ServiceAccountMatch>>,
            pub not_service_accounts: Option<Vec<ServiceAccountMatch>>,
            pub principals: Option<Vec<serde_json::Value>>,
            pub not_principals: Option<Vec<serde_json::Value>>,
            pub source_ips: Option<Vec<String>>,
            pub not_source_ips: Option<Vec<String>>,
            pub destination_ips: Option<Vec<String>>,
            pub not_destination_ips: Option<Vec<String>>,
            pub destination_ports: Option<Vec<u16>>,
            pub not_destination_ports: Option<Vec<u16>>,
        }

        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct BuildInfo {
            pub version: String,
            pub git_revision: String,
            pub rust_version: String,
            pub build_profile: String,
            pub build_status: String,
            pub istio_version: String,
            pub crypto_provider: String,
        }
    }

    #[tokio::test]
    async fn the_dump_decodes_with_ztunnel_s_types_and_defaults() {
        let certs = CertManager::new(
            CertSource::Local(Box::new(LocalCa::generate("cluster.local").unwrap())),
            std::time::Duration::from_secs(3600),
        );
        let pool = pool::Pool::new(100, 1, std::time::Duration::from_secs(60));
        let text = config_dump(
            &state(),
            &certs,
            &pool,
            &inpod::PodTable::default(),
            "cluster.local",
        );
        let dump: ztunnel::Dump =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let api = &dump.workloads[0];
        assert_eq!(
            api.services.as_deref(),
            Some(&["shop/api.shop.svc.cluster.local".to_string()][..]),
            "a workload's services are their names"
        );
        assert_eq!((api.capacity, api.cluster_id.as_str()), (2, "Kubernetes"));
        let sick = &dump.workloads[1];
        assert_eq!(sick.capacity, 1, "ztunnel's default, written");
        let api_svc = dump.services.iter().find(|s| s.name == "api").unwrap();
        assert!(!api_svc.canonical, "written though false");
        assert_eq!(api_svc.endpoints.len(), 2);
        let m = &dump.policies[0].rules[0][0][0];
        assert!(
            m.not_namespaces.is_none() && m.principals.is_none() && m.destination_ips.is_none()
        );
        assert_eq!(m.destination_ports.as_deref(), Some(&[8080][..]));
        assert_eq!(dump.version.version, env!("CARGO_PKG_VERSION"));
        assert!(
            dump.version.rust_version.starts_with("rustc "),
            "{}",
            dump.version.rust_version
        );
        assert_eq!(dump.version.crypto_provider, "aws-lc-rs");
    }
}
