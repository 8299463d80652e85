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
        help: "CA root certificate PEM (with ca_key); unset: generated in state_dir",
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
        help: "where a generated CA root is kept",
    },
    Key {
        name: "token_file",
        env: &["AMBIT_CP_TOKEN_FILE"],
        default: "",
        help: "if set, clients must send this bearer token (re-read on each call)",
    },
    Key {
        name: "tls_sans",
        env: &["AMBIT_CP_TLS_SANS"],
        default: "localhost,127.0.0.1",
        help: "names and IPs in the server certificate (comma-separated)",
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
    pub token_file: Option<PathBuf>,
    pub tls_sans: Vec<String>,
    pub max_cert_ttl: Duration,
    pub log_format: LogFormat,
    pub log_level: String,
}

impl ControlPlaneConfig {
    pub fn load(cl: &CommandLine) -> Result<(Self, Layers), ConfigError> {
        let l = Layers::resolve(CONTROL_PLANE_KEYS, cl, |v| std::env::var(v).ok())?;
        let path = |s: &str| Some(PathBuf::from(s));
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
            token_file: l.get("token_file", "a file path", path)?,
            tls_sans: l.require("tls_sans", "comma-separated names", |s| {
                Some(super::parse_list(s))
            })?,
            max_cert_ttl: l.require("max_cert_ttl", "a duration like 24h", parse_duration)?,
            log_format: l.require("log_format", "text or json", super::parse_log_format)?,
            log_level: l.require("log_level", "a tracing filter", |s| Some(s.to_string()))?,
        };
        Ok((cfg, l))
    }
}
