//! The node agent's configuration: its keys and the typed [`AgentConfig`].

use std::net::SocketAddr;
use std::path::PathBuf;

use super::proxy::LogFormat;
use super::{parse_bool, CommandLine, ConfigError, Key, Layers};

/// Which pods the agent puts in the mesh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnrollRule {
    All,
    None,
    Namespaces(Vec<String>),
    PodPattern(String),
    /// Istio ambient's labels, read from the Kubernetes API.
    Kubernetes,
}

pub static AGENT_KEYS: &[Key] = &[
    Key {
        name: "run_dir",
        env: &["CNI_AGENT_RUN_DIR"],
        default: "/var/run/ambit",
        help: "holds pluginevent.sock (dir 0750)",
    },
    Key {
        name: "zds_path",
        env: &["ZTUNNEL_UDS_ADDRESS"],
        default: "/var/run/ztunnel/ztunnel.sock",
        help: "ZDS socket the proxy connects to",
    },
    Key {
        name: "cni_bin_dir",
        env: &["CNI_BIN_DIR"],
        default: "/opt/cni/bin",
        help: "where ambit-cni is installed",
    },
    Key {
        name: "cni_conf_dir",
        env: &["CNI_NET_DIR"],
        default: "/etc/cni/net.d",
        help: "CNI config dir whose first conflist gets our entry",
    },
    Key {
        name: "install_cni",
        env: &["AMBIT_INSTALL_CNI"],
        default: "true",
        help: "install, watch and repair the plugin and conflist entry",
    },
    Key {
        name: "enroll",
        env: &["AMBIT_ENROLL"],
        default: "all",
        help: "kubernetes (Istio's labels) | all | none | namespaces:ns1,ns2 | pods:<glob on pod name>",
    },
    Key {
        name: "exclude_namespaces",
        env: &["EXCLUDE_NAMESPACES"],
        default: "kube-system",
        help: "comma-separated namespaces never enrolled",
    },
    Key {
        name: "dns_capture",
        env: &["AMBIENT_DNS_CAPTURE"],
        default: "true",
        help: "redirect pod DNS to the proxy's 15053",
    },
    Key {
        name: "pod_loopback_big_tcp",
        env: &["AMBIT_POD_LOOPBACK_BIG_TCP"],
        default: "true",
        help: "raise each meshed pod's loopback GSO limit (BIG TCP) for the proxy's loopback legs",
    },
    Key {
        name: "native_nftables",
        env: &["NATIVE_NFTABLES"],
        default: "false",
        help: "write the pods' rules and the host's kubelet-probe rule and set with nftables (istio-cni's inet istio-ambient-* tables: one nft transaction per pod, probe-set entries added and removed per pod; chart: global.nativeNftables) instead of iptables and ipset; the host is checked at start (nft -c)",
    },
    Key {
        name: "ipv6",
        env: &["AMBIENT_IPV6"],
        default: "true",
        help: "also write the pods' IPv6 rules (ip6tables, or the IPv6 rules of the nftables tables)",
    },
    Key {
        name: "local_xds_path",
        env: &["LOCAL_XDS_PATH"],
        default: "",
        help: "local config; gives enrolled pods their service account",
    },
    Key {
        name: "node_name",
        env: &["NODE_NAME"],
        default: "",
        help:
            "this node; when set, only local-config workloads of this node are looked for at start",
    },
    Key {
        name: "pod_namespace",
        env: &["POD_NAMESPACE"],
        default: "istio-system",
        help: "the agent's own namespace; with pod_name, its own pods are never enrolled",
    },
    Key {
        name: "pod_name",
        env: &["POD_NAME"],
        default: "",
        help: "the agent's own pod (a DaemonSet pod: <name>-<suffix>)",
    },
    Key {
        name: "host_proc",
        env: &["HOST_PROC"],
        default: "/proc",
        help: "the host's /proc (scanned for pods' netns; /host/proc in a container)",
    },
    Key {
        name: "state_file",
        env: &["AMBIT_AGENT_STATE"],
        default: "/var/lib/ambit/agent-state.json",
        help: "enrolled pods, kept across restarts",
    },
    Key {
        name: "service_account",
        env: &["SERVICE_ACCOUNT"],
        default: "",
        help: "the agent's ServiceAccount (Kubernetes mode): the CNI plugin gets a token of its own for it, bound to no pod, so it outlives this agent's pod; empty: the plugin gets the agent pod's token",
    },
    Key {
        name: "pod_ip",
        env: &["POD_IP"],
        default: "",
        help: "the agent pod's IP (on the host network: the node's); the side ports bind to it rather than to every host interface",
    },
    Key {
        name: "readiness_addr",
        env: &["AMBIT_AGENT_READINESS_ADDR"],
        default: "",
        help: "/healthz and /readyz; empty: pod_ip:8000, or 0.0.0.0:8000 without pod_ip",
    },
    Key {
        name: "metrics_addr",
        env: &["MONITORING_PORT_ADDR", "AMBIT_AGENT_METRICS_ADDR"],
        default: "",
        help: "Prometheus metrics (/metrics); empty: pod_ip:15014, or 0.0.0.0:15014 without pod_ip",
    },
    super::LOG_FORMAT_KEY,
    super::LOG_LEVEL_KEY,
];

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub run_dir: PathBuf,
    pub zds_path: PathBuf,
    pub cni_bin_dir: PathBuf,
    pub cni_conf_dir: PathBuf,
    pub install_cni: bool,
    pub enroll: EnrollRule,
    pub exclude_namespaces: Vec<String>,
    pub dns_capture: bool,
    /// The in-pod rules in nftables, not iptables.
    pub native_nftables: bool,
    pub pod_loopback_big_tcp: bool,
    pub ipv6: bool,
    pub local_xds_path: Option<PathBuf>,
    pub node_name: String,
    pub pod_namespace: String,
    /// The agent's ServiceAccount; empty: unknown.
    pub service_account: String,
    pub pod_name: String,
    pub host_proc: PathBuf,
    pub state_file: PathBuf,
    pub readiness_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub log_format: LogFormat,
    pub log_level: String,
}

pub fn parse_enroll(s: &str) -> Option<EnrollRule> {
    let list = super::parse_list;
    match s.split_once(':') {
        None if s == "all" => Some(EnrollRule::All),
        None if s == "none" => Some(EnrollRule::None),
        Some(("namespaces", v)) if !list(v).is_empty() => Some(EnrollRule::Namespaces(list(v))),
        Some(("pods", v)) if !v.is_empty() => Some(EnrollRule::PodPattern(v.to_string())),
        None if s == "kubernetes" => Some(EnrollRule::Kubernetes),
        _ => None,
    }
}

impl AgentConfig {
    pub fn load(cl: &CommandLine) -> Result<(Self, Layers), ConfigError> {
        let layers = Layers::resolve(AGENT_KEYS, cl, |v| std::env::var(v).ok())?;
        Ok((Self::from_layers(&layers)?, layers))
    }

    pub fn from_layers(l: &Layers) -> Result<Self, ConfigError> {
        let path = |s: &str| Some(PathBuf::from(s));
        // The side ports' host: the pod's IP when given (on the host
        // network, every other interface of the node stays closed), else all.
        let side_ip = l
            .get("pod_ip", "an IP", |s| s.parse::<std::net::IpAddr>().ok())?
            .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into());
        Ok(AgentConfig {
            run_dir: l.require("run_dir", "a directory path", path)?,
            zds_path: l.require("zds_path", "a socket path", path)?,
            cni_bin_dir: l.require("cni_bin_dir", "a directory path", path)?,
            cni_conf_dir: l.require("cni_conf_dir", "a directory path", path)?,
            install_cni: l.require("install_cni", "true or false", parse_bool)?,
            enroll: l.require(
                "enroll",
                "kubernetes, all, none, namespaces:a,b or pods:<glob>",
                parse_enroll,
            )?,
            exclude_namespaces: l
                .get("exclude_namespaces", "comma-separated names", |s| {
                    Some(super::parse_list(s))
                })?
                .unwrap_or_default(),
            dns_capture: l.require("dns_capture", "true or false", parse_bool)?,
            native_nftables: l.require("native_nftables", "true or false", parse_bool)?,
            pod_loopback_big_tcp: l.require("pod_loopback_big_tcp", "true or false", parse_bool)?,
            ipv6: l.require("ipv6", "true or false", parse_bool)?,
            local_xds_path: l.get("local_xds_path", "a file path", path)?,
            node_name: l
                .get("node_name", "a name", |s| Some(s.to_string()))?
                .unwrap_or_default(),
            pod_namespace: l.require("pod_namespace", "a namespace", |s| Some(s.to_string()))?,
            service_account: l
                .get("service_account", "a ServiceAccount name", |s| {
                    Some(s.to_string())
                })?
                .unwrap_or_default(),
            pod_name: l
                .get("pod_name", "a pod name", |s| Some(s.to_string()))?
                .unwrap_or_default(),
            host_proc: l.require("host_proc", "a directory path", path)?,
            state_file: l.require("state_file", "a file path", path)?,
            readiness_addr: l
                .get("readiness_addr", "an address like 10.0.0.5:8000", |s| {
                    s.parse().ok()
                })?
                .unwrap_or(SocketAddr::new(side_ip, 8000)),
            metrics_addr: l
                .get("metrics_addr", "an address like 10.0.0.5:15014", |s| {
                    s.parse().ok()
                })?
                .unwrap_or(SocketAddr::new(side_ip, 15014)),
            log_format: l.require("log_format", "text or json", super::parse_log_format)?,
            log_level: l.require("log_level", "a tracing filter", |s| Some(s.to_string()))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_side_ports_bind_to_the_pods_ip_when_given_else_every_interface() {
        let config = |env: &[(&str, &str)]| {
            let env: Vec<(String, String)> = env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let layers = Layers::resolve(AGENT_KEYS, &CommandLine::default(), |k| {
                env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
            })
            .unwrap();
            AgentConfig::from_layers(&layers).unwrap()
        };
        let on = |addr: &str| addr.parse::<SocketAddr>().unwrap();
        let c = config(&[("POD_IP", "10.0.0.5")]);
        assert_eq!(c.readiness_addr, on("10.0.0.5:8000"));
        assert_eq!(c.metrics_addr, on("10.0.0.5:15014"));
        let c = config(&[("POD_IP", "fd00::5")]);
        assert_eq!(c.readiness_addr, on("[fd00::5]:8000"));
        let c = config(&[]);
        assert_eq!(c.readiness_addr, on("0.0.0.0:8000"));
        assert_eq!(c.metrics_addr, on("0.0.0.0:15014"));
        let c = config(&[
            ("POD_IP", "10.0.0.5"),
            ("AMBIT_AGENT_READINESS_ADDR", "127.0.0.1:9000"),
        ]);
        assert_eq!(
            c.readiness_addr,
            on("127.0.0.1:9000"),
            "an address given wins"
        );
        assert_eq!(c.metrics_addr, on("10.0.0.5:15014"));
    }

    #[test]
    fn enrollment_rules_parse() {
        assert_eq!(parse_enroll("all"), Some(EnrollRule::All));
        assert_eq!(parse_enroll("kubernetes"), Some(EnrollRule::Kubernetes));
        assert_eq!(
            parse_enroll("namespaces:a, b"),
            Some(EnrollRule::Namespaces(vec!["a".into(), "b".into()]))
        );
        assert_eq!(
            parse_enroll("pods:web-*"),
            Some(EnrollRule::PodPattern("web-*".into()))
        );
        assert_eq!(parse_enroll("namespaces:"), None);
        assert_eq!(parse_enroll("some"), None);
    }
}
