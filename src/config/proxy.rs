//! The proxy role's configuration: its keys and the typed [`ProxyConfig`] built from them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::{parse_bool, parse_duration, parse_u32, CommandLine, ConfigError, Key, Layers};

/// How the proxy finds the pods it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// One proxy inside one pod's network namespace, serving that pod only.
    Dedicated,
    /// One proxy per node, handed pod namespaces by the agent over ZDS.
    Shared,
}

/// The pod a dedicated proxy serves (`PROXY_WORKLOAD_INFO` = `ns/name/sa`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadInfo {
    pub namespace: String,
    pub name: String,
    pub service_account: String,
}

impl WorkloadInfo {
    pub fn parse(s: &str) -> Option<Self> {
        let mut parts = s.split('/');
        let (ns, name, sa) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || [ns, name, sa].iter().any(|p| p.is_empty()) {
            return None;
        }
        Some(WorkloadInfo {
            namespace: ns.into(),
            name: name.into(),
            service_account: sa.into(),
        })
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

pub static PROXY_KEYS: &[Key] = &[
    Key {
        name: "proxy_mode",
        env: &["PROXY_MODE"],
        default: "shared",
        help: "shared (pods from the node agent over ZDS) or dedicated (one pod, run inside its netns)",
    },
    Key {
        name: "zds_path",
        env: &["INPOD_UDS"],
        default: "/var/run/ztunnel/ztunnel.sock",
        help: "the node agent's ZDS socket (shared mode)",
    },
    Key {
        name: "workload_info",
        env: &["PROXY_WORKLOAD_INFO"],
        default: "",
        help: "the served pod as ns/name/serviceaccount (dedicated mode)",
    },
    Key {
        name: "local_xds_path",
        env: &["LOCAL_XDS_PATH"],
        default: "",
        help: "local config YAML (workloads, services, policies), watched for changes",
    },
    Key {
        name: "xds_address",
        env: &["XDS_ADDRESS"],
        default: "",
        help: "control plane for delta xDS, e.g. https://istiod.istio-system.svc:15012 (unset: local_xds_path)",
    },
    Key {
        name: "ca_address",
        env: &["CA_ADDRESS"],
        default: "",
        help: "Istio CA for workload certificates (unset: the local CA)",
    },
    Key {
        name: "insecure_control_plane",
        env: &["AMBIT_INSECURE_CONTROL_PLANE"],
        default: "false",
        help: "allow http:// (plaintext, unauthenticated) for xds_address and ca_address; for labs only",
    },
    Key {
        name: "xds_root_ca",
        env: &["XDS_ROOT_CA"],
        default: "",
        help: "PEM root the control plane's TLS certificate must chain to",
    },
    Key {
        name: "ca_root_ca",
        env: &["CA_ROOT_CA"],
        default: "",
        help: "PEM root for the CA's TLS (default: xds_root_ca)",
    },
    Key {
        name: "crl_path",
        env: &["CRL_PATH"],
        default: "",
        help: "PEM (or one DER) certificate revocation lists peers are checked against at each handshake; watched, and open connections of a peer a new list revokes are closed",
    },
    Key {
        name: "mesh_root_ca",
        env: &["AMBIT_MESH_ROOT_CA"],
        default: "",
        help: "PEM mesh root(s) that certificates from ca_address must chain to, and peers are checked against (default: the CA's TLS root, as in Istio, when that is a file)",
    },
    Key {
        name: "auth_token",
        env: &["AUTH_TOKEN"],
        default: "",
        help: "file with the bearer token sent to the control plane and CA (re-read per connection)",
    },
    Key {
        name: "pod_name",
        env: &["POD_NAME"],
        default: "ambit",
        help: "this proxy's pod name (xDS node id)",
    },
    Key {
        name: "pod_namespace",
        env: &["POD_NAMESPACE"],
        default: "istio-system",
        help: "this proxy's namespace (xDS node id)",
    },
    Key {
        name: "instance_ip",
        env: &["INSTANCE_IP"],
        default: "1.1.1.1",
        help: "this proxy's IP (xDS node id)",
    },
    Key {
        name: "trust_domain",
        env: &["TRUST_DOMAIN"],
        default: "cluster.local",
        help: "SPIFFE trust domain of this mesh",
    },
    Key {
        name: "cluster_domain",
        env: &["CLUSTER_DOMAIN"],
        default: "cluster.local",
        help: "Kubernetes cluster DNS domain: service names <svc>.<ns>.svc.<domain> and the pods' search domains",
    },
    Key {
        name: "cluster_id",
        env: &["CLUSTER_ID", "ISTIO_META_CLUSTER_ID"],
        default: "Kubernetes",
        help: "cluster name sent in baggage",
    },
    Key {
        name: "node_name",
        env: &["NODE_NAME"],
        default: "",
        help: "node this proxy runs on",
    },
    Key {
        name: "network",
        env: &["NETWORK"],
        default: "",
        help: "network of the served pods",
    },
    Key {
        name: "ca_cert",
        env: &["AMBIT_CA_CERT"],
        default: "",
        help: "local CA root certificate PEM (with ca_key); unset: generated in state_dir",
    },
    Key {
        name: "ca_key",
        env: &["AMBIT_CA_KEY"],
        default: "",
        help: "local CA private key PEM (PKCS#8)",
    },
    Key {
        name: "state_dir",
        env: &["AMBIT_STATE_DIR"],
        default: "/var/lib/ambit",
        help: "where a generated CA root is kept (mode 0700)",
    },
    Key {
        name: "cert_ttl",
        env: &["SECRET_TTL"],
        default: "24h",
        help: "workload certificate lifetime; rotated at half-life",
    },
    Key {
        name: "packet_mark",
        env: &["PACKET_MARK"],
        default: "1337",
        help: "SO_MARK on every socket opened for a pod",
    },
    Key {
        name: "admin_addr",
        env: &["AMBIT_ADMIN_ADDR"],
        default: "127.0.0.1:15000",
        help: "admin server (/config_dump, /logging, /debug/pprof/*, /quitquitquit)",
    },
    Key {
        name: "metrics_addr",
        env: &["AMBIT_METRICS_ADDR"],
        default: "0.0.0.0:15020",
        help: "Prometheus metrics (/metrics, /stats/prometheus)",
    },
    Key {
        name: "readiness_addr",
        env: &["AMBIT_READINESS_ADDR"],
        default: "0.0.0.0:15021",
        help: "readiness (/healthz/ready)",
    },
    Key {
        name: "pool_max_streams_per_connection",
        env: &["POOL_MAX_STREAMS_PER_CONNECTION"],
        default: "100",
        help: "HBONE streams per pooled HTTP/2 connection",
    },
    Key {
        name: "pool_spread",
        env: &["AMBIT_POOL_SPREAD"],
        default: "auto",
        help: "HBONE connections a pod opens to one destination before two streams share one (each is served by one task); auto: the worker threads",
    },
    Key {
        name: "pool_unused_release_timeout",
        env: &["POOL_UNUSED_RELEASE_TIMEOUT"],
        default: "5m",
        help: "HBONE connections that carry no stream (pooled outbound ones, and inbound ones) are closed after this; 0s: no pooling, an outbound connection closes as its last stream ends",
    },
    Key {
        name: "http2_stream_window_size",
        env: &["HTTP2_STREAM_WINDOW_SIZE"],
        default: "4194304",
        help: "HTTP/2 stream flow-control window (bytes)",
    },
    Key {
        name: "http2_connection_window_size",
        env: &["HTTP2_CONNECTION_WINDOW_SIZE"],
        default: "16777216",
        help: "HTTP/2 connection flow-control window (bytes)",
    },
    Key {
        name: "http2_frame_size",
        env: &["HTTP2_FRAME_SIZE"],
        default: "1048576",
        help: "HTTP/2 max frame size (bytes)",
    },
    Key {
        name: "hbone_unsent_limit",
        env: &["AMBIT_HBONE_UNSENT_LIMIT"],
        default: "131072",
        help: "unsent bytes the kernel may queue per HBONE connection (TCP_NOTSENT_LOWAT); 0: no limit",
    },
    Key {
        name: "memory_budget",
        env: &["AMBIT_MEMORY_BUDGET"],
        default: "auto",
        help: "bytes peers may make the proxy hold (windows, stream buffers); past it streams are refused. auto: half the cgroup's memory limit, else 1Gi; 0: none",
    },
    Key {
        name: "congestion_control",
        env: &["AMBIT_CONGESTION_CONTROL"],
        default: "cubic",
        help: "TCP congestion control of the proxy's own connections and listeners; empty: the kernel's default",
    },
    Key {
        name: "worker_threads",
        env: &["ZTUNNEL_WORKER_THREADS", "AMBIT_WORKER_THREADS"],
        default: "2",
        help: "data-plane worker threads",
    },
    Key {
        name: "ipv6",
        env: &["IPV6_ENABLED"],
        default: "true",
        help: "listen on [::] as well as 0.0.0.0",
    },
    Key {
        name: "xds_on_demand",
        env: &["XDS_ON_DEMAND"],
        default: "false",
        help: "fetch addresses from the control plane as connections need them, not all up front",
    },
    Key {
        name: "xds_on_demand_wait",
        env: &["AMBIT_XDS_ON_DEMAND_WAIT"],
        default: "2s",
        help: "on demand: how long a connection waits for the control plane's answer about an unknown address",
    },
    Key {
        name: "xds_max_message_size",
        env: &["AMBIT_XDS_MAX_MESSAGE_SIZE"],
        default: "268435456",
        help: "the largest xDS response taken (bytes); a larger one ends the stream and the last good state keeps serving",
    },
    Key {
        name: "dns_proxy",
        env: &["AMBIT_DNS_PROXY"],
        default: "true",
        help: "serve DNS on 127.0.0.1:15053 (and [::1]) in each pod",
    },
    Key {
        name: "dns_upstreams",
        env: &["AMBIT_DNS_UPSTREAMS"],
        default: "",
        help: "comma-separated ip:port resolvers for non-mesh names; unset: /etc/resolv.conf",
    },
    Key {
        name: "drain_timeout",
        env: &["CONNECTION_TERMINATION_DEADLINE", "AMBIT_DRAIN_TIMEOUT"],
        default: "5s",
        help: "on SIGTERM, how long connections in flight may finish after listeners close",
    },
    Key {
        name: "termination_grace_period",
        env: &["TERMINATION_GRACE_PERIOD_SECONDS"],
        default: "",
        help: "the pod's grace period; unless drain_timeout is set, drain gets it minus 5s (minus 1s if <= 10s)",
    },
    super::LOG_FORMAT_KEY,
    super::LOG_LEVEL_KEY,
];

/// Everything the proxy role needs, validated.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub mode: ProxyMode,
    pub zds_path: PathBuf,
    pub workload_info: Option<WorkloadInfo>,
    pub local_xds_path: Option<PathBuf>,
    pub xds_address: Option<String>,
    pub ca_address: Option<String>,
    pub xds_root_ca: Option<PathBuf>,
    pub ca_root_ca: Option<PathBuf>,
    /// The mesh root file certificates from `ca_address` must chain to:
    /// `mesh_root_ca`, else the CA's TLS root when that is a file (Istio's
    /// layout, one root for both). Always set when `ca_address` is.
    pub mesh_root_ca: Option<PathBuf>,
    /// Revocation lists (`CRL_PATH`); unset: no revocation check.
    pub crl_path: Option<PathBuf>,
    pub auth_token: Option<PathBuf>,
    pub pod_name: String,
    pub pod_namespace: String,
    pub instance_ip: String,
    pub trust_domain: String,
    pub cluster_domain: String,
    pub cluster_id: String,
    pub node_name: String,
    pub network: String,
    pub ca_cert: Option<PathBuf>,
    pub ca_key: Option<PathBuf>,
    pub state_dir: PathBuf,
    pub cert_ttl: Duration,
    pub packet_mark: u32,
    pub admin_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub readiness_addr: SocketAddr,
    pub pool_max_streams: usize,
    /// Connections per destination before streams share one; `None`: the
    /// worker threads.
    pub pool_spread: Option<usize>,
    pub pool_idle_timeout: Duration,
    pub stream_window: u32,
    pub connection_window: u32,
    pub frame_size: u32,
    /// `TCP_NOTSENT_LOWAT` on HBONE connections; 0 leaves the kernel's default.
    pub hbone_unsent_limit: u32,
    /// The memory budget in bytes; `None`: chosen from the cgroup's limit.
    pub memory_budget: Option<usize>,
    /// `TCP_CONGESTION` on the proxy's TCP sockets; `None`: the kernel's default.
    pub congestion_control: Option<Arc<str>>,
    /// Whether `congestion_control` was set (file, env or flag) rather than
    /// defaulted: a kernel that cannot take a chosen one is an error at
    /// start; one that cannot take the default keeps its own, with a warning.
    pub congestion_control_chosen: bool,
    pub worker_threads: usize,
    pub ipv6: bool,
    pub drain_timeout: Duration,
    pub dns_proxy: bool,
    /// Subscribe to each address as a connection needs it (`XDS_ON_DEMAND`).
    pub xds_on_demand: bool,
    /// How long a connection waits for an on-demand answer.
    pub xds_on_demand_wait: Duration,
    /// The largest xDS response decoded (bytes).
    pub xds_max_message_size: u32,
    /// Empty: read /etc/resolv.conf at start.
    pub dns_upstreams: Vec<SocketAddr>,
    pub log_format: LogFormat,
    pub log_level: String,
}

/// An algorithm's name as `TCP_CONGESTION` takes it (at most 15 bytes), or
/// blank for the kernel's default. Whether this kernel has it is checked
/// when the proxy starts.
fn parse_congestion_control(s: &str) -> Option<Option<Arc<str>>> {
    if s.is_empty() {
        return Some(None);
    }
    let name_like = s.len() <= 15
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    name_like.then(|| Some(s.into()))
}

impl ProxyConfig {
    /// Builds the configuration from the command line and the process environment.
    pub fn load(cl: &CommandLine) -> Result<(Self, Layers), ConfigError> {
        let layers = Layers::resolve(PROXY_KEYS, cl, |v| std::env::var(v).ok())?;
        Ok((Self::from_layers(&layers)?, layers))
    }

    pub fn from_layers(l: &Layers) -> Result<Self, ConfigError> {
        let path = |s: &str| Some(PathBuf::from(s));
        let addr = |s: &str| s.parse::<SocketAddr>().ok();
        let mode = l.require("proxy_mode", "shared or dedicated", |s| match s {
            "dedicated" => Some(ProxyMode::Dedicated),
            "shared" => Some(ProxyMode::Shared),
            _ => None,
        })?;
        let workload_info = l.get(
            "workload_info",
            "namespace/name/serviceaccount, e.g. default/web/web-sa",
            WorkloadInfo::parse,
        )?;
        if mode == ProxyMode::Dedicated && workload_info.is_none() {
            return Err(ConfigError::Missing {
                key: "workload_info",
                hint: "dedicated mode serves one pod: set PROXY_WORKLOAD_INFO=ns/name/sa",
            });
        }
        let local_xds_path = l.get("local_xds_path", "a file path", path)?;
        let insecure = l.require("insecure_control_plane", "true or false", parse_bool)?;
        // Plaintext to the control plane only when asked for by name:
        // certificates and mesh state would cross the network unprotected.
        let url = |key: &'static str| {
            l.get(
                key,
                if insecure {
                    "a URL like https://istiod.istio-system.svc:15012"
                } else {
                    "an https:// URL like https://istiod.istio-system.svc:15012 (http:// needs insecure_control_plane: true)"
                },
                |s| {
                    let ok = s.starts_with("https://") || (insecure && s.starts_with("http://"));
                    ok.then(|| s.to_string())
                },
            )
        };
        let xds_address = url("xds_address")?;
        if xds_address.is_none() && local_xds_path.is_none() {
            return Err(ConfigError::Missing {
                key: "local_xds_path",
                hint: "the mesh state comes from a control plane (XDS_ADDRESS) or a local config YAML (LOCAL_XDS_PATH)",
            });
        }
        let ca_address = url("ca_address")?;
        let xds_root_ca = l.get("xds_root_ca", "a file path", path)?;
        let ca_root_ca = l.get("ca_root_ca", "a file path", path)?;
        let is_file = |p: &PathBuf| p.as_os_str() != "SYSTEM";
        let mesh_root_ca = l
            .get(
                "mesh_root_ca",
                "a PEM file path (the system store is no mesh root)",
                |s| Some(PathBuf::from(s)).filter(is_file),
            )?
            .or_else(|| {
                ca_root_ca
                    .clone()
                    .or_else(|| xds_root_ca.clone())
                    .filter(is_file)
            });
        if ca_address.is_some() && mesh_root_ca.is_none() {
            return Err(ConfigError::Missing {
                key: "mesh_root_ca",
                hint: "certificates from ca_address are checked against the mesh root: set mesh_root_ca (AMBIT_MESH_ROOT_CA) to its PEM file (the CA's TLS root stands in only when it is a file, not SYSTEM)",
            });
        }
        let ca_cert = l.get("ca_cert", "a file path", path)?;
        let ca_key = l.get("ca_key", "a file path", path)?;
        if ca_cert.is_some() != ca_key.is_some() {
            return Err(ConfigError::Missing {
                key: if ca_cert.is_some() {
                    "ca_key"
                } else {
                    "ca_cert"
                },
                hint: "ca_cert and ca_key go together",
            });
        }
        let trust_domain = l.require("trust_domain", "a DNS-like name without '/'", |s| {
            (!s.contains('/') && !s.contains(char::is_whitespace)).then(|| s.to_string())
        })?;
        let window = |name: &'static str, min: u32| {
            l.require(
                name,
                &format!("a byte count between {min} and 2147483647"),
                move |s| parse_u32(s).filter(|v| (min..=i32::MAX as u32).contains(v)),
            )
        };
        Ok(ProxyConfig {
            mode,
            zds_path: l.require("zds_path", "a socket path", path)?,
            workload_info,
            local_xds_path,
            xds_address,
            ca_address,
            xds_root_ca,
            ca_root_ca,
            mesh_root_ca,
            crl_path: l.get("crl_path", "a file path", path)?,
            auth_token: l.get("auth_token", "a file path", path)?,
            pod_name: l.require("pod_name", "a name", |s| Some(s.to_string()))?,
            pod_namespace: l.require("pod_namespace", "a name", |s| Some(s.to_string()))?,
            instance_ip: l.require("instance_ip", "an IP", |s| {
                s.parse::<std::net::IpAddr>().ok().map(|_| s.to_string())
            })?,
            trust_domain,
            cluster_domain: l.require("cluster_domain", "a DNS name", |s| {
                let s = s.strip_suffix('.').unwrap_or(s);
                let ok = !s.is_empty()
                    && s.split('.').all(|label| {
                        !label.is_empty()
                            && label.len() <= 63
                            && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                    });
                ok.then(|| s.to_ascii_lowercase())
            })?,
            cluster_id: l.require("cluster_id", "a name", |s| Some(s.to_string()))?,
            node_name: l
                .get("node_name", "a name", |s| Some(s.to_string()))?
                .unwrap_or_default(),
            network: l
                .get("network", "a name", |s| Some(s.to_string()))?
                .unwrap_or_default(),
            ca_cert,
            ca_key,
            state_dir: l.require("state_dir", "a directory path", path)?,
            cert_ttl: l.require(
                "cert_ttl",
                "a duration from 10s to 8760h (a year), like 90s, 30m or 24h",
                |s| {
                    parse_duration(s).filter(|d| {
                        (Duration::from_secs(10)..=Duration::from_secs(365 * 86_400)).contains(d)
                    })
                },
            )?,
            packet_mark: l.require(
                "packet_mark",
                "a non-zero number (decimal or 0x hex)",
                |s| parse_u32(s).filter(|m| *m != 0),
            )?,
            admin_addr: l.require("admin_addr", "an address like 127.0.0.1:15000", addr)?,
            metrics_addr: l.require("metrics_addr", "an address like 0.0.0.0:15020", addr)?,
            readiness_addr: l.require("readiness_addr", "an address like 0.0.0.0:15021", addr)?,
            pool_max_streams: l.require(
                "pool_max_streams_per_connection",
                "a number from 1 to 10000",
                |s| s.parse().ok().filter(|n| (1..=10_000).contains(n)),
            )?,
            pool_spread: l.require("pool_spread", "auto or a number from 1 to 256", |s| {
                match s {
                    "auto" => Some(None),
                    n => n.parse().ok().filter(|n| (1..=256).contains(n)).map(Some),
                }
            })?,
            pool_idle_timeout: l.require(
                "pool_unused_release_timeout",
                "a duration like 5m",
                parse_duration,
            )?,
            stream_window: window("http2_stream_window_size", 65_535)?,
            connection_window: window("http2_connection_window_size", 65_535)?,
            frame_size: l.require(
                "http2_frame_size",
                "a byte count between 16384 and 16777215",
                |s| parse_u32(s).filter(|v| (16_384..=16_777_215).contains(v)),
            )?,
            hbone_unsent_limit: l.require(
                "hbone_unsent_limit",
                "0 (no limit) or a byte count between 4096 and 1073741824",
                |s| parse_u32(s).filter(|v| *v == 0 || (4096..=1 << 30).contains(v)),
            )?,
            memory_budget: l.require(
                "memory_budget",
                "auto, 0 (none) or a size like 512Mi, 2Gi or 268435456 (at least 16Mi)",
                parse_memory_budget,
            )?,
            congestion_control: l
                .get(
                    "congestion_control",
                    "empty (the kernel's default) or an algorithm's name like cubic or bbr: lowercase letters, digits or _, at most 15",
                    parse_congestion_control,
                )?
                .flatten(),
            congestion_control_chosen: l.chosen("congestion_control"),
            worker_threads: l.require("worker_threads", "a number from 1 to 256", |s| {
                s.parse().ok().filter(|n| (1..=256).contains(n))
            })?,
            ipv6: l.require("ipv6", "true or false", parse_bool)?,
            drain_timeout: {
                let explicit = l.chosen("drain_timeout");
                let grace = l.get(
                    "termination_grace_period",
                    "a number of seconds up to 86400",
                    |s| s.parse::<u64>().ok().filter(|g| *g <= 86_400),
                )?;
                match (explicit, grace) {
                    (false, Some(g)) => {
                        Duration::from_secs(if g > 10 { g - 5 } else { g.saturating_sub(1) })
                    }
                    _ => l.require("drain_timeout", "a duration up to 24h, like 5s", |s| {
                        parse_duration(s).filter(|d| *d <= Duration::from_secs(86_400))
                    })?,
                }
            },
            dns_proxy: l.require("dns_proxy", "true or false", parse_bool)?,
            xds_on_demand: l.require("xds_on_demand", "true or false", parse_bool)?,
            xds_max_message_size: l.require(
                "xds_max_message_size",
                "a byte count between 4194304 (4 MiB) and 4294967295",
                |s| parse_u32(s).filter(|v| *v >= 4 << 20),
            )?,
            xds_on_demand_wait: l.require(
                "xds_on_demand_wait",
                "a duration from 1ms to 60s, like 2s",
                |s| {
                    parse_duration(s).filter(|d| {
                        (Duration::from_millis(1)..=Duration::from_secs(60)).contains(d)
                    })
                },
            )?,
            dns_upstreams: l
                .get(
                    "dns_upstreams",
                    "comma-separated ip:port, like 10.0.0.10:53",
                    |s| {
                        s.split(',')
                            .map(|a| a.trim().parse::<SocketAddr>().ok())
                            .collect::<Option<Vec<_>>>()
                    },
                )?
                .unwrap_or_default(),
            log_format: l.require("log_format", "text or json", super::parse_log_format)?,
            log_level: l.require("log_level", "a tracing filter", |s| Some(s.to_string()))?,
        })
    }
}

#[cfg(test)]
mod tests;

/// `auto` → `Some(None)`; `0` → no budget; else a byte count, plain or with
/// a `Ki`/`Mi`/`Gi` suffix, of at least 16 MiB (less could not hold one
/// HBONE connection's window).
fn parse_memory_budget(s: &str) -> Option<Option<usize>> {
    if s == "auto" {
        return Some(None);
    }
    let (digits, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, ""),
    };
    let shift = match unit {
        "" => 0,
        "Ki" => 10,
        "Mi" => 20,
        "Gi" => 30,
        _ => return None,
    };
    let n: usize = digits.parse().ok()?;
    let bytes = n.checked_mul(1 << shift)?;
    (bytes == 0 || bytes >= 16 << 20).then_some(Some(bytes))
}
