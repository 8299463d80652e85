//! The dump read as its readers read it: istioctl's decoder and ztunnel's
//! own types.

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

/// A certificate manager on a fresh local CA (trust domain `cluster.local`).
fn local_certs() -> std::sync::Arc<CertManager> {
    CertManager::new(
        CertSource::Local(Box::new(LocalCa::generate("cluster.local").unwrap())),
        std::time::Duration::from_secs(3600),
    )
}

/// A dedicated proxy's configuration, from `env` over the defaults.
fn proxy_config(env: &[(&str, &str)]) -> crate::config::ProxyConfig {
    let cl = crate::config::CommandLine::parse(&[]).unwrap();
    let layers = crate::config::Layers::resolve(crate::config::proxy::PROXY_KEYS, &cl, |k| {
        env.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    })
    .unwrap();
    crate::config::ProxyConfig::from_layers(&layers).unwrap()
}

/// The dump of `state` and `certs`, with an empty pool and no pods, from
/// a proxy configured by `env`.
fn dump_with(state: &StateHandle, certs: &CertManager, env: &[(&str, &str)]) -> String {
    let pool = pool::Pool::new(100, 1, std::time::Duration::from_secs(60));
    config_dump(
        state,
        certs,
        &pool,
        &inpod::PodTable::default(),
        "cluster.local",
        &Configured::of(&proxy_config(env)),
    )
}

/// [`dump_with`] a dedicated proxy's usual settings, and no local file.
fn dump_of(state: &StateHandle, certs: &CertManager) -> String {
    dump_with(
        state,
        certs,
        &[
            ("PROXY_MODE", "dedicated"),
            ("PROXY_WORKLOAD_INFO", "shop/api-0/api"),
            ("XDS_ADDRESS", "https://istiod.istio-system.svc:15012"),
            ("CA_ADDRESS", "https://istiod.istio-system.svc:15012"),
            ("XDS_ROOT_CA", "/var/run/secrets/istio/root-cert.pem"),
            ("CA_ROOT_CA", "/var/run/secrets/istio/root-cert.pem"),
            ("NODE_NAME", "node-a"),
        ],
    )
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
    let certs = local_certs();
    let id = Identity::new("cluster.local", "shop", "api");
    certs.get(&id).await.unwrap();
    let text = dump_of(&state(), &certs);
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
- {name: gated, namespace: shop, workloadIps: [10.0.0.5], applicationTunnel: {protocol: PROXY}}
services:
- {name: wp, namespace: shop, hostname: wp.shop, vips: ["/10.96.0.9"], cidrVips: ["/10.97.0.0/16"],
   ports: {15008: 15008}, ipFamilies: Dual,
   loadBalancer: {routingPreferences: [NETWORK, REGION, ZONE, SUBZONE], mode: FAILOVER}}
"#,
    )
    .unwrap();
    let (st, _) = State::build_lenient(cfg.workloads, cfg.services, cfg.policies);
    let certs = local_certs();
    let text = dump_of(&StateHandle::new(st), &certs);
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
    assert!(refused[0]["reason"].as_str().unwrap().contains("PROXY"));
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
        pub config: Config,
        pub static_config: LocalConfig,
    }

    /// ztunnel's `Address`: a socket address, or localhost on both
    /// families (`[ipv6_enabled, port]`).
    #[derive(Deserialize, Debug, PartialEq)]
    pub enum Address {
        Localhost(bool, u16),
        SocketAddr(std::net::SocketAddr),
    }

    #[derive(Deserialize, Debug, PartialEq)]
    pub enum RootCert {
        File(std::path::PathBuf),
        Default,
    }

    #[derive(Deserialize, Debug, PartialEq)]
    pub enum ProxyMode {
        Shared,
        Dedicated,
    }

    #[derive(Deserialize, Debug, PartialEq)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct WorkloadInfo {
        pub name: String,
        pub namespace: String,
        pub service_account: String,
    }

    /// ztunnel's `Config`, the fields Ambit shares with it, by ztunnel's
    /// types (durations as serde writes them); Ambit's own under `ambit`.
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct Config {
        pub proxy: bool,
        pub dns_proxy: bool,
        pub window_size: u32,
        pub connection_window_size: u32,
        pub frame_size: u32,
        pub pool_max_streams_per_conn: u16,
        pub pool_unused_release_timeout: std::time::Duration,
        pub admin_addr: Address,
        pub stats_addr: Address,
        pub readiness_addr: Address,
        pub inbound_addr: std::net::SocketAddr,
        pub inbound_plaintext_addr: std::net::SocketAddr,
        pub outbound_addr: std::net::SocketAddr,
        pub dns_proxy_addr: Address,
        pub network: String,
        pub local_node: Option<String>,
        pub proxy_mode: ProxyMode,
        pub proxy_workload_information: Option<WorkloadInfo>,
        pub cluster_id: String,
        pub cluster_domain: String,
        pub ca_address: Option<String>,
        pub ca_root_cert: RootCert,
        pub xds_address: Option<String>,
        pub xds_root_cert: RootCert,
        pub secret_ttl: std::time::Duration,
        pub xds_on_demand: bool,
        pub fake_ca: bool,
        pub self_termination_deadline: std::time::Duration,
        pub num_worker_threads: usize,
        pub inpod_uds: std::path::PathBuf,
        pub packet_mark: Option<u32>,
        pub ipv6_enabled: bool,
        pub crl_path: Option<std::path::PathBuf>,
        pub ambit: serde_json::Value,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct LocalConfig {
        pub workloads: Vec<serde_json::Value>,
        pub policies: Vec<serde_json::Value>,
        pub services: Vec<serde_json::Value>,
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
    let certs = local_certs();
    let text = dump_of(&state(), &certs);
    let dump: ztunnel::Dump = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
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
    assert!(m.not_namespaces.is_none() && m.principals.is_none() && m.destination_ips.is_none());
    assert_eq!(m.destination_ports.as_deref(), Some(&[8080][..]));
    assert_eq!(dump.version.version, env!("CARGO_PKG_VERSION"));
    assert!(
        dump.version.rust_version.starts_with("rustc "),
        "{}",
        dump.version.rust_version
    );
    assert_eq!(dump.version.crypto_provider, "aws-lc-rs");
    if let Some(rev) = option_env!("AMBIT_GIT_REVISION") {
        assert!(rev.len() == 40 && rev.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(dump.version.git_revision, rev);
    }
    let c = &dump.config;
    assert_eq!(c.proxy_mode, ztunnel::ProxyMode::Dedicated);
    assert_eq!(
        c.proxy_workload_information,
        Some(ztunnel::WorkloadInfo {
            name: "api-0".into(),
            namespace: "shop".into(),
            service_account: "api".into()
        })
    );
    assert_eq!(
        c.admin_addr,
        ztunnel::Address::SocketAddr("127.0.0.1:15000".parse().unwrap())
    );
    assert_eq!(
        c.dns_proxy_addr,
        ztunnel::Address::Localhost(c.ipv6_enabled, 15053)
    );
    assert_eq!(c.inbound_addr.port(), 15008);
    assert_eq!(
        c.xds_root_cert,
        ztunnel::RootCert::File("/var/run/secrets/istio/root-cert.pem".into())
    );
    assert_eq!(c.local_node.as_deref(), Some("node-a"));
    assert_eq!(c.secret_ttl, std::time::Duration::from_secs(24 * 3600));
    assert_eq!(c.packet_mark, Some(1337));
    assert_eq!(c.ambit["trustDomain"], "cluster.local");
    assert!(dump.static_config.workloads.is_empty(), "no local file");
}

/// `staticConfig` is the local file's resources, ports keyed by string as
/// ztunnel writes them; a file that stops reading leaves it empty.
#[tokio::test]
async fn static_config_is_the_local_file_s_resources() {
    let dir = std::env::temp_dir().join(format!("ambit-static-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("mesh.yaml");
    std::fs::write(
        &file,
        "workloads:\n- {uid: w1, name: w1, namespace: shop, workloadIps: [10.0.0.3], services: {\"shop/a.shop.svc.cluster.local\": {80: 8080}}}\nservices: []\n",
    )
    .unwrap();
    let path = file.to_str().unwrap();
    let certs = local_certs();
    let text = dump_with(
        &state(),
        &certs,
        &[
            ("PROXY_WORKLOAD_INFO", "shop/w1/default"),
            ("LOCAL_XDS_PATH", path),
        ],
    );
    let dump: ztunnel::Dump = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let w = &dump.static_config.workloads[0];
    assert_eq!(w["uid"], "w1");
    assert_eq!(w["services"]["shop/a.shop.svc.cluster.local"]["80"], 8080);
    assert!(dump.static_config.policies.is_empty());
    assert_eq!(dump.config.ambit["localXdsPath"], path);
    std::fs::write(&file, "workloads: [unclosed\n").unwrap();
    let text = dump_with(
        &state(),
        &certs,
        &[
            ("PROXY_WORKLOAD_INFO", "shop/w1/default"),
            ("LOCAL_XDS_PATH", path),
        ],
    );
    let dump: ztunnel::Dump = serde_json::from_str(&text).unwrap();
    assert!(dump.static_config.workloads.is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}
