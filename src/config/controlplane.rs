//! `ambit control-plane` configuration.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::proxy::LogFormat;
use super::{parse_duration, CommandLine, ConfigError, Key, Layers};

pub static CONTROL_PLANE_KEYS: &[Key] = &[
    Key {
        name: "listen_addr",
        env: &["AMBIT_CP_LISTEN"],
        default: "0.0.0.0:15012",
        help: "gRPC (TLS) address for delta ADS and the certificate service",
    },
    Key {
        name: "local_xds_path",
        env: &["LOCAL_XDS_PATH"],
        default: "",
        help: "local-config YAML served as xDS (watched; edits are pushed)",
    },
    Key {
        name: "trust_domain",
        env: &["TRUST_DOMAIN"],
        default: "cluster.local",
        help: "trust domain of the identities it signs",
    },
    Key {
        name: "ca_cert",
        env: &["AMBIT_CA_CERT"],
        default: "",
        help: "mesh CA root certificate PEM (with ca_key), what proxies set as mesh_root_ca; unset: generated in state_dir",
    },
    Key {
        name: "ca_key",
        env: &["AMBIT_CA_KEY"],
        default: "",
        help: "CA private key PEM (PKCS#8)",
    },
    Key {
        name: "state_dir",
        env: &["AMBIT_STATE_DIR"],
        default: "/var/lib/ambit-control-plane",
        help: "where generated roots (mesh and serving) are kept",
    },
    Key {
        name: "serving_ca_cert",
        env: &["AMBIT_CP_SERVING_CA_CERT"],
        default: "",
        help: "root PEM that signs the control plane's own TLS certificate, what proxies set as xds_root_ca (with serving_ca_key; must not be the mesh root); unset: generated in state_dir",
    },
    Key {
        name: "serving_ca_key",
        env: &["AMBIT_CP_SERVING_CA_KEY"],
        default: "",
        help: "serving root private key PEM (PKCS#8)",
    },
    Key {
        name: "node_tokens_dir",
        env: &["AMBIT_CP_NODE_TOKENS_DIR"],
        default: "",
        help: "directory of per-node bearer tokens, file <node name> holding that node's token: its proxy gets certificates only for workloads on that node (re-read at most once a second)",
    },
    Key {
        name: "token_file",
        env: &["AMBIT_CP_TOKEN_FILE"],
        default: "",
        help: "an any-node bearer token: certificates for every workload in the config, for one-node labs and admins; nodes get node_tokens_dir (re-read at most once a second)",
    },
    Key {
        name: "insecure",
        env: &["AMBIT_CP_INSECURE"],
        default: "false",
        help: "serve without any token: whoever reaches the port gets the mesh state and a certificate for any workload in it (labs only; otherwise token_file or node_tokens_dir is required)",
    },
    Key {
        name: "tls_sans",
        env: &["AMBIT_CP_TLS_SANS"],
        default: "localhost,127.0.0.1",
        help: "names and IPs in the server certificate, signed by the serving root (comma-separated)",
    },
    Key {
        name: "max_cert_ttl",
        env: &["AMBIT_CP_MAX_CERT_TTL"],
        default: "24h",
        help: "longest workload certificate it signs",
    },
    super::LOG_FORMAT_KEY,
    super::LOG_LEVEL_KEY,
];

#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    pub listen_addr: SocketAddr,
    pub local_xds_path: PathBuf,
    pub trust_domain: String,
    pub ca_cert: Option<PathBuf>,
    pub ca_key: Option<PathBuf>,
    pub state_dir: PathBuf,
    pub serving_ca_cert: Option<PathBuf>,
    pub serving_ca_key: Option<PathBuf>,
    pub node_tokens_dir: Option<PathBuf>,
    pub token_file: Option<PathBuf>,
    pub insecure: bool,
    pub tls_sans: Vec<String>,
    pub max_cert_ttl: Duration,
    pub log_format: LogFormat,
    pub log_level: String,
}

impl ControlPlaneConfig {
    pub fn load(cl: &CommandLine) -> Result<(Self, Layers), ConfigError> {
        let l = Layers::resolve(CONTROL_PLANE_KEYS, cl, |v| std::env::var(v).ok())?;
        let path = |s: &str| Some(PathBuf::from(s));
        let serving_ca_cert = l.get("serving_ca_cert", "a file path", path)?;
        let serving_ca_key = l.get("serving_ca_key", "a file path", path)?;
        if serving_ca_cert.is_some() != serving_ca_key.is_some() {
            return Err(ConfigError::Missing {
                key: if serving_ca_cert.is_some() {
                    "serving_ca_key"
                } else {
                    "serving_ca_cert"
                },
                hint: "serving_ca_cert and serving_ca_key go together",
            });
        }
        let cfg = ControlPlaneConfig {
            listen_addr: l.require("listen_addr", "an address like 0.0.0.0:15012", |s| {
                s.parse().ok()
            })?,
            local_xds_path: l.get("local_xds_path", "a file path", path)?.ok_or(
                ConfigError::Missing {
                    key: "local_xds_path",
                    hint: "the control plane serves a local-config YAML: set LOCAL_XDS_PATH",
                },
            )?,
            trust_domain: l.require("trust_domain", "a name", |s| Some(s.to_string()))?,
            ca_cert: l.get("ca_cert", "a file path", path)?,
            ca_key: l.get("ca_key", "a file path", path)?,
            state_dir: l.require("state_dir", "a directory", path)?,
            serving_ca_cert,
            serving_ca_key,
            node_tokens_dir: l.get("node_tokens_dir", "a directory path", path)?,
            token_file: l.get("token_file", "a file path", path)?,
            insecure: l.require("insecure", "true or false", super::parse_bool)?,
            tls_sans: l.require("tls_sans", "comma-separated names", |s| {
                Some(super::parse_list(s))
            })?,
            max_cert_ttl: l.require("max_cert_ttl", "a duration like 24h", parse_duration)?,
            log_format: l.require("log_format", "text or json", super::parse_log_format)?,
            log_level: l.require("log_level", "a tracing filter", |s| Some(s.to_string()))?,
        };
        if cfg.token_file.is_none() && cfg.node_tokens_dir.is_none() && !cfg.insecure {
            // Fail closed: an open control plane hands out every workload's
            // certificate to whoever reaches it.
            return Err(ConfigError::Missing {
                key: "node_tokens_dir",
                hint: "callers need a token: set node_tokens_dir (one per node) or token_file, or --insecure=true to serve anyone who reaches the port",
            });
        }
        Ok((cfg, l))
    }
}
