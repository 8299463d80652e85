//! The CNI plugin role (`ambit-cni`, DESIGN §3.3) as pure logic: the stdin/stdout contract of a
//! chained CNI plugin. It parses the network config from the stdin bytes and the `CNI_*`
//! environment from a lookup function, decides whether the pod must be enrolled in the mesh, and
//! renders what goes to stdout: the `prevResult` converted to the config's `cniVersion`, the
//! VERSION answer, or a CNI error object. It does no I/O besides what the caller passes in:
//! reading stdin and the environment, printing, exiting, and the POST to the agent's
//! `pluginevent.sock` belong to the binary's thin shell, which hands the POST in as a closure to
//! [`handle`]. Nothing here may log to stdout.

use std::fmt;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// CNI spec versions this plugin accepts in a network config.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// The newest supported spec version, used when no config version can be read.
pub const LATEST_VERSION: &str = "1.1.0";

/// The agent's run dir (it holds `pluginevent.sock`) when the config names none.
pub const DEFAULT_AGENT_RUN_DIR: &str = "/var/run/ambit";

/// Namespaces never enrolled when the config has no `exclude_namespaces`.
const DEFAULT_EXCLUDED_NAMESPACES: &[&str] = &["kube-system"];

/// A CNI error object (spec "Error" section), printed on stdout with a non-zero exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const INVALID_ENV: u32 = 4;
    pub const DECODING_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// Plugin-specific (codes >= 100): the pod had to be enrolled and was not.
    pub const ENROLLMENT_FAILED: u32 = 100;
    /// libcni's "unknown" code, used for an agent that refused or could not be reached.
    pub const AGENT_UNREACHABLE: u32 = 999;

    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        CniError { code, msg: msg.into(), details: details.into() }
    }

    pub fn incompatible_version(requested: &str) -> Self {
        Self::new(
            Self::INCOMPATIBLE_VERSION,
            format!("incompatible CNI version {requested:?}"),
            format!("supported versions: {}", SUPPORTED_VERSIONS.join(", ")),
        )
    }

    pub fn unsupported_field(field: &str, details: impl Into<String>) -> Self {
        Self::new(Self::UNSUPPORTED_FIELD, format!("unsupported field {field:?}"), details)
    }

    pub fn invalid_env(msg: impl Into<String>) -> Self {
        Self::new(Self::INVALID_ENV, msg, "")
    }

    pub fn decoding_failure(details: impl Into<String>) -> Self {
        Self::new(Self::DECODING_FAILURE, "cannot decode the network config on stdin", details)
    }

    pub fn invalid_config(msg: impl Into<String>) -> Self {
        Self::new(Self::INVALID_CONFIG, msg, "")
    }

    pub fn try_again_later(msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self::new(Self::TRY_AGAIN_LATER, msg, details)
    }

    pub fn enrollment_failed(msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self::new(Self::ENROLLMENT_FAILED, msg, details)
    }

    pub fn agent_unreachable(msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self::new(Self::AGENT_UNREACHABLE, msg, details)
    }

    /// The error object as the spec's JSON, tagged with `cni_version` (the config's, when known;
    /// see [`reply_version`]).
    pub fn to_json(&self, cni_version: &str) -> String {
        json!({
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
            "details": self.details,
        })
        .to_string()
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CNI error {}: {}", self.code, self.msg)?;
        if !self.details.is_empty() {
            write!(f, ": {}", self.details)?;
        }
        Ok(())
    }
}

impl std::error::Error for CniError {}

/// Which pods outside the excluded namespaces are enrolled (config key `enroll`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enrollment {
    /// `{"mode": "all"}` (the default): every pod.
    All,
    /// `{"mode": "none"}`: no pod; the plugin only passes results through.
    None,
    /// `{"mode": "namespaces", "namespaces": [..]}`: pods in these namespaces.
    Namespaces(Vec<String>),
    /// `{"mode": "pod_pattern", "pod_pattern": "web-*"}`: pods whose name matches the glob,
    /// where `*` matches any run of characters and every other character matches itself.
    PodPattern(String),
}

impl Enrollment {
    /// Whether the rule selects the pod `namespace/pod_name`.
    pub fn selects(&self, namespace: &str, pod_name: &str) -> bool {
        match self {
            Enrollment::All => true,
            Enrollment::None => false,
            Enrollment::Namespaces(list) => list.iter().any(|n| n == namespace),
            Enrollment::PodPattern(pattern) => glob_match(pattern, pod_name),
        }
    }

    fn from_raw(raw: RawEnroll) -> Result<Self, CniError> {
        match raw.mode.as_str() {
            "all" => Ok(Enrollment::All),
            "none" => Ok(Enrollment::None),
            "namespaces" => Ok(Enrollment::Namespaces(raw.namespaces)),
            "pod_pattern" => match raw.pod_pattern {
                Some(p) if !p.is_empty() => Ok(Enrollment::PodPattern(p)),
                _ => Err(CniError::invalid_config("enroll.mode is \"pod_pattern\" but enroll.pod_pattern is empty")),
            },
            other => Err(CniError::invalid_config(format!(
                "unknown enroll.mode {other:?} (expected all, none, namespaces or pod_pattern)"
            ))),
        }
    }
}

/// The plugin's network config, read from stdin.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    pub cni_version: String,
    pub name: String,
    pub plugin_type: String,
    pub cni_agent_run_dir: String,
    pub enroll: Enrollment,
    pub exclude_namespaces: Vec<String>,
    pub prev_result: Option<Value>,
}

/// The config as it arrives; unknown keys (CNI configs carry many) are ignored.
#[derive(Deserialize)]
struct RawConfig {
    #[serde(rename = "cniVersion")]
    cni_version: Option<String>,
    #[serde(default)]
    name: String,
    #[serde(rename = "type", default)]
    plugin_type: String,
    cni_agent_run_dir: Option<String>,
    /// Istio before 1.24: the full path of the agent's event socket.
    cni_event_address: Option<String>,
    enroll: Option<RawEnroll>,
    exclude_namespaces: Option<Vec<String>>,
    /// Istio before 1.24 nested `exclude_namespaces` here; read leniently.
    kubernetes: Option<Value>,
    #[serde(rename = "prevResult")]
    prev_result: Option<Value>,
}

#[derive(Deserialize)]
struct RawEnroll {
    #[serde(default = "default_enroll_mode")]
    mode: String,
    #[serde(default)]
    namespaces: Vec<String>,
    pod_pattern: Option<String>,
}

fn default_enroll_mode() -> String {
    "all".to_string()
}

/// Parses the network config: bytes that are not a JSON object → code 6, no `cniVersion` → 7,
/// an unsupported `cniVersion` → 1.
pub fn parse_config(stdin: &[u8]) -> Result<PluginConfig, CniError> {
    let value: Value = serde_json::from_slice(stdin).map_err(|e| CniError::decoding_failure(e.to_string()))?;
    if !value.is_object() {
        return Err(CniError::decoding_failure("the network config is not a JSON object"));
    }
    let raw: RawConfig = serde_json::from_value(value).map_err(|e| CniError::decoding_failure(e.to_string()))?;
    let cni_version = match raw.cni_version {
        Some(v) if !v.is_empty() => v,
        _ => return Err(CniError::invalid_config("the network config has no cniVersion")),
    };
    if !SUPPORTED_VERSIONS.contains(&cni_version.as_str()) {
        return Err(CniError::incompatible_version(&cni_version));
    }
    let legacy_run_dir = raw
        .cni_event_address
        .as_deref()
        .and_then(|addr| addr.rsplit_once('/'))
        .map(|(dir, _socket)| dir.to_string())
        .filter(|dir| !dir.is_empty());
    let legacy_excludes = raw
        .kubernetes
        .as_ref()
        .and_then(|k| k.get("exclude_namespaces"))
        .and_then(|v| serde_json::from_value::<Vec<String>>(v.clone()).ok());
    let enroll = match raw.enroll {
        Some(e) => Enrollment::from_raw(e)?,
        None => Enrollment::All,
    };
    Ok(PluginConfig {
        cni_version,
        name: raw.name,
        plugin_type: raw.plugin_type,
        cni_agent_run_dir: raw
            .cni_agent_run_dir
            .or(legacy_run_dir)
            .unwrap_or_else(|| DEFAULT_AGENT_RUN_DIR.to_string()),
        enroll,
        exclude_namespaces: raw
            .exclude_namespaces
            .or(legacy_excludes)
            .unwrap_or_else(|| DEFAULT_EXCLUDED_NAMESPACES.iter().map(|s| s.to_string()).collect()),
        prev_result: raw.prev_result,
    })
}

/// The version to tag a reply with: the config's `cniVersion` when stdin carries a supported
/// one, else [`LATEST_VERSION`]. Never fails, so it can label any error.
pub fn reply_version(stdin: &[u8]) -> String {
    serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion").and_then(Value::as_str).map(str::to_string))
        .filter(|v| SUPPORTED_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| LATEST_VERSION.to_string())
}

/// Pod identity from `CNI_ARGS`; every field is absent unless given with a non-empty value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodArgs {
    pub name: Option<String>,
    pub namespace: Option<String>,
    pub uid: Option<String>,
    pub infra_container_id: Option<String>,
}

/// Parses `IgnoreUnknown=1;K8S_POD_NAME=x;K8S_POD_NAMESPACE=y;...`. Unknown keys and malformed
/// pieces are skipped. Podman passes only `K8S_POD_NAME`, so a named pod without a namespace is
/// in `default`.
pub fn parse_cni_args(s: &str) -> PodArgs {
    let mut pod = PodArgs::default();
    for pair in s.split(';') {
        let Some((key, value)) = pair.split_once('=') else { continue };
        let value = value.trim();
        if value.is_empty() {
            continue;
        }
        let slot = match key.trim() {
            "K8S_POD_NAME" => &mut pod.name,
            "K8S_POD_NAMESPACE" => &mut pod.namespace,
            "K8S_POD_UID" => &mut pod.uid,
            "K8S_POD_INFRA_CONTAINER_ID" => &mut pod.infra_container_id,
            _ => continue,
        };
        *slot = Some(value.to_string());
    }
    if pod.name.is_some() && pod.namespace.is_none() {
        pod.namespace = Some("default".to_string());
    }
    pod
}

/// The `CNI_*` environment; variables the command does not need are empty strings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniEnv {
    pub command: String,
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    pub args: String,
    pub path: String,
}

/// Reads the environment through `get` (empty counts as unset). `CNI_COMMAND` is always required;
/// ADD, DEL and CHECK also need `CNI_CONTAINERID` and `CNI_IFNAME`; ADD needs `CNI_NETNS`.
pub fn env_from(get: impl Fn(&str) -> Option<String>) -> Result<CniEnv, CniError> {
    let read = |key: &str| get(key).filter(|v| !v.is_empty());
    let command = read("CNI_COMMAND").ok_or_else(|| CniError::invalid_env("CNI_COMMAND is not set"))?;
    let per_container = matches!(command.as_str(), "ADD" | "DEL" | "CHECK");
    let require = |key: &str, needed: bool| match read(key) {
        Some(v) => Ok(v),
        None if needed => Err(CniError::invalid_env(format!("{key} is not set (required for {command})"))),
        None => Ok(String::new()),
    };
    Ok(CniEnv {
        container_id: require("CNI_CONTAINERID", per_container)?,
        netns: require("CNI_NETNS", command == "ADD")?,
        ifname: require("CNI_IFNAME", per_container)?,
        args: require("CNI_ARGS", false)?,
        path: require("CNI_PATH", false)?,
        command,
    })
}

/// One pod address in an [`AddEvent`].
///
/// Istio's plugin sends `Address` as a Go `net.IPNet` object (`{"IP": .., "Mask": base64}`); we
/// send CIDR text (`"10.0.0.2/24"`), and the agent accepts both.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodIp {
    /// Index into `prevResult.interfaces`.
    #[serde(rename = "Interface")]
    pub interface: Option<u32>,
    #[serde(rename = "Address")]
    pub address: String,
    #[serde(rename = "Gateway")]
    pub gateway: Option<String>,
}

/// The body POSTed to the agent for a pod to enroll; the keys are the Go field names of Istio's
/// `CNIPluginAddEvent` (which has no `PodUID`/`ContainerID`, hence their defaults).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddEvent {
    #[serde(rename = "Netns")]
    pub netns: String,
    #[serde(rename = "PodName")]
    pub pod_name: String,
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    #[serde(rename = "PodUID", default)]
    pub pod_uid: String,
    #[serde(rename = "ContainerID", default)]
    pub container_id: String,
    #[serde(rename = "IPs", default)]
    pub ips: Vec<PodIp>,
}

/// What ADD does with a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Print the result and nothing else; the reason is for the logs.
    PassThrough(&'static str),
    /// Tell the agent first; fail the ADD if it does not accept.
    Enroll(AddEvent),
}

/// Decides whether the pod is enrolled: not without Kubernetes pod args, not in an excluded
/// namespace, otherwise as the enrollment rule says.
pub fn decide(cfg: &PluginConfig, env: &CniEnv, pod: &PodArgs) -> Decision {
    let Some(name) = pod.name.as_deref() else {
        return Decision::PassThrough("no Kubernetes pod args");
    };
    let namespace = pod.namespace.as_deref().unwrap_or("default");
    if cfg.exclude_namespaces.iter().any(|n| n == namespace) {
        return Decision::PassThrough("namespace excluded");
    }
    if !cfg.enroll.selects(namespace, name) {
        return Decision::PassThrough("not selected by the enrollment rule");
    }
    Decision::Enroll(AddEvent {
        netns: env.netns.clone(),
        pod_name: name.to_string(),
        pod_namespace: namespace.to_string(),
        pod_uid: pod.uid.clone().unwrap_or_default(),
        container_id: env.container_id.clone(),
        ips: prev_result_ips(cfg.prev_result.as_ref()),
    })
}

/// `prevResult.ips[]`, skipping entries without a textual address.
fn prev_result_ips(prev: Option<&Value>) -> Vec<PodIp> {
    let Some(ips) = prev.and_then(|p| p.get("ips")).and_then(Value::as_array) else {
        return Vec::new();
    };
    ips.iter()
        .filter_map(|ip| {
            Some(PodIp {
                interface: ip.get("interface").and_then(Value::as_u64).and_then(|i| u32::try_from(i).ok()),
                address: ip.get("address")?.as_str()?.to_string(),
                gateway: ip.get("gateway").and_then(Value::as_str).map(str::to_string),
            })
        })
        .collect()
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters (including none).
fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    // After the last `*` seen: where the pattern resumes, and where in the text that star's
    // match currently ends (so a mismatch can retry with the star eating one more character).
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if p.get(pi) == Some(&'*') {
            pi += 1;
            star = Some((pi, ti));
        } else if p.get(pi) == Some(&t[ti]) {
            pi += 1;
            ti += 1;
        } else if let Some((resume, end)) = star {
            pi = resume;
            ti = end + 1;
            star = Some((resume, end + 1));
        } else {
            return false;
        }
    }
    p.iter().skip(pi).all(|&c| c == '*')
}

/// Result versions before 1.0.0 carry `ips[].version`.
fn result_has_ip_version(cni_version: &str) -> bool {
    matches!(cni_version, "0.3.0" | "0.3.1" | "0.4.0")
}

/// The stdout of a successful ADD: `prevResult` converted to the config's `cniVersion` (adding
/// or dropping `ips[].version`; interfaces, routes and dns kept as they are), or an empty result
/// when there is no `prevResult`.
pub fn result_for(cfg: &PluginConfig) -> Result<String, CniError> {
    let target = cfg.cni_version.as_str();
    let Some(prev) = &cfg.prev_result else {
        return Ok(json!({"cniVersion": target, "interfaces": [], "ips": []}).to_string());
    };
    let Value::Object(prev) = prev else {
        return Err(CniError::invalid_config("prevResult is not a JSON object"));
    };
    match prev.get("cniVersion") {
        None => {}
        Some(Value::String(v)) if SUPPORTED_VERSIONS.contains(&v.as_str()) => {}
        Some(other) => {
            return Err(CniError::new(
                CniError::INCOMPATIBLE_VERSION,
                format!("cannot convert prevResult from version {other} to {target}"),
                format!("supported versions: {}", SUPPORTED_VERSIONS.join(", ")),
            ))
        }
    }
    let mut out = prev.clone();
    out.insert("cniVersion".to_string(), Value::String(target.to_string()));
    if let Some(ips) = out.get_mut("ips") {
        let Value::Array(ips) = ips else {
            return Err(CniError::invalid_config("prevResult.ips is not a list"));
        };
        for ip in ips {
            let Value::Object(ip) = ip else {
                return Err(CniError::invalid_config("prevResult.ips has an entry that is not an object"));
            };
            if !result_has_ip_version(target) {
                ip.remove("version");
            } else if !ip.contains_key("version") {
                let family = ip_family(ip.get("address"))?;
                ip.insert("version".to_string(), Value::String(family.to_string()));
            }
        }
    }
    Ok(Value::Object(out).to_string())
}

/// `"4"` or `"6"` for a CIDR address such as `"10.0.0.2/24"`.
fn ip_family(address: Option<&Value>) -> Result<&'static str, CniError> {
    let text = address.and_then(Value::as_str).unwrap_or_default();
    let ip = text.split('/').next().unwrap_or_default();
    match ip.parse::<IpAddr>() {
        Ok(IpAddr::V4(_)) => Ok("4"),
        Ok(IpAddr::V6(_)) => Ok("6"),
        Err(_) => Err(CniError::invalid_config(format!("prevResult.ips has an invalid address {text:?}"))),
    }
}

/// Runs one plugin invocation and returns its stdout. `post` delivers an [`AddEvent`] to the
/// agent whose run dir is given, returning the reason on failure; a failure fails the ADD
/// (fail closed) with code 100. DEL and CHECK have no side effects: removal is the agent's job.
pub fn handle(
    env: &CniEnv,
    stdin: &[u8],
    post: &mut dyn FnMut(&AddEvent, &str) -> Result<(), String>,
) -> Result<String, CniError> {
    match env.command.as_str() {
        "VERSION" => Ok(json!({
            "cniVersion": reply_version(stdin),
            "supportedVersions": SUPPORTED_VERSIONS,
        })
        .to_string()),
        "ADD" => {
            let cfg = parse_config(stdin)?;
            let pod = parse_cni_args(&env.args);
            if let Decision::Enroll(event) = decide(&cfg, env, &pod) {
                post(&event, &cfg.cni_agent_run_dir).map_err(|details| {
                    CniError::enrollment_failed(
                        format!(
                            "pod {}/{} must be enrolled in the mesh but the Ambit agent refused or is unreachable",
                            event.pod_namespace, event.pod_name
                        ),
                        details,
                    )
                })?;
            }
            result_for(&cfg)
        }
        "DEL" | "CHECK" => parse_config(stdin).map(|_| String::new()),
        "GC" | "STATUS" => Ok(String::new()),
        other => Err(CniError::invalid_env(format!("unknown CNI_COMMAND {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREV_V1: &str = r#"{"cniVersion":"1.0.0",
        "interfaces":[{"name":"eth0","mac":"0a:58:0a:f4:01:05","sandbox":"/var/run/netns/cni-1"}],
        "ips":[{"interface":0,"address":"10.244.1.5/24","gateway":"10.244.1.1"},
               {"interface":0,"address":"fd00::5/64"}],
        "routes":[{"dst":"0.0.0.0/0"}],"dns":{"nameservers":["10.96.0.10"]}}"#;

    fn config(version: &str, extra: &str) -> Vec<u8> {
        format!(r#"{{"cniVersion":"{version}","name":"k8s-pod-network","type":"ambit-cni"{extra}}}"#).into_bytes()
    }

    fn env(command: &str, args: &str) -> CniEnv {
        CniEnv {
            command: command.to_string(),
            container_id: "c0ffee".to_string(),
            netns: "/var/run/netns/cni-1".to_string(),
            ifname: "eth0".to_string(),
            args: args.to_string(),
            path: "/opt/cni/bin".to_string(),
        }
    }

    const POD: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-1;K8S_POD_UID=u-1;K8S_POD_INFRA_CONTAINER_ID=c0ffee";

    /// Runs `handle`, recording every event posted.
    fn run(env: &CniEnv, stdin: &[u8], answer: Result<(), String>) -> (Result<String, CniError>, Vec<(AddEvent, String)>) {
        let mut posted = Vec::new();
        let mut post = |ev: &AddEvent, dir: &str| {
            posted.push((ev.clone(), dir.to_string()));
            answer.clone()
        };
        let out = handle(env, stdin, &mut post);
        (out, posted)
    }

    fn json_of(s: &str) -> Value {
        serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
    }

    fn code_of<T: fmt::Debug>(r: Result<T, CniError>) -> u32 {
        r.expect_err("expected a CNI error").code
    }

    #[test]
    fn garbage_stdin_is_a_decoding_failure() {
        assert_eq!(code_of(parse_config(b"{not json")), 6);
        assert_eq!(code_of(parse_config(b"[\"1.0.0\"]")), 6);
        assert_eq!(code_of(parse_config(br#"{"cniVersion":1}"#)), 6);
        for cmd in ["ADD", "DEL", "CHECK"] {
            let (out, posted) = run(&env(cmd, POD), b"\x00garbage", Ok(()));
            assert_eq!(code_of(out), 6, "{cmd}");
            assert!(posted.is_empty());
        }
    }

    #[test]
    fn missing_or_unsupported_version_is_rejected() {
        assert_eq!(code_of(parse_config(br#"{"name":"n","type":"ambit-cni"}"#)), 7);
        let err = parse_config(&config("0.2.0", "")).expect_err("0.2.0 is not supported");
        assert_eq!(err.code, 1);
        for v in SUPPORTED_VERSIONS {
            assert!(err.details.contains(v), "{}", err.details);
            assert!(parse_config(&config(v, "")).is_ok(), "{v}");
        }
    }

    #[test]
    fn config_defaults_and_unknown_keys() {
        let cfg = parse_config(&config("1.0.0", r#","ipam":{"type":"host-local"},"plugin_log_level":"debug""#))
            .expect("valid config");
        assert_eq!((cfg.name.as_str(), cfg.plugin_type.as_str()), ("k8s-pod-network", "ambit-cni"));
        assert_eq!(cfg.cni_agent_run_dir, "/var/run/ambit");
        assert_eq!(cfg.exclude_namespaces, vec!["kube-system".to_string()]);
        assert_eq!(cfg.enroll, Enrollment::All);
        assert!(cfg.prev_result.is_none());
    }

    #[test]
    fn istio_pre_1_24_keys_are_accepted() {
        let extra = r#","cni_event_address":"/var/run/istio-cni/pluginevent.sock",
            "kubernetes":{"kubeconfig":"/etc/cni/net.d/k","exclude_namespaces":["istio-system"]}"#;
        let cfg = parse_config(&config("0.3.1", extra)).expect("valid config");
        assert_eq!(cfg.cni_agent_run_dir, "/var/run/istio-cni");
        assert_eq!(cfg.exclude_namespaces, vec!["istio-system".to_string()]);
        let cfg = parse_config(&config("1.0.0", r#","cni_agent_run_dir":"/run/a","exclude_namespaces":[]"#))
            .expect("valid config");
        assert_eq!(cfg.cni_agent_run_dir, "/run/a");
        assert!(cfg.exclude_namespaces.is_empty());
    }

    #[test]
    fn enrollment_config_is_validated() {
        let parse = |e: &str| parse_config(&config("1.0.0", &format!(r#","enroll":{e}"#)));
        assert_eq!(parse(r#"{"mode":"none"}"#).map(|c| c.enroll), Ok(Enrollment::None));
        assert_eq!(parse("{}").map(|c| c.enroll), Ok(Enrollment::All));
        assert_eq!(
            parse(r#"{"mode":"namespaces","namespaces":["a","b"]}"#).map(|c| c.enroll),
            Ok(Enrollment::Namespaces(vec!["a".into(), "b".into()]))
        );
        assert_eq!(parse(r#"{"mode":"pod_pattern","pod_pattern":"web-*"}"#).map(|c| c.enroll), Ok(Enrollment::PodPattern("web-*".into())));
        assert_eq!(code_of(parse(r#"{"mode":"pod_pattern"}"#)), 7);
        assert_eq!(code_of(parse(r#"{"mode":"some"}"#)), 7);
    }

    #[test]
    fn env_requirements_per_command() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(code_of(env_from(vars(&[]))), 4);
        assert_eq!(code_of(env_from(vars(&[("CNI_COMMAND", "")]))), 4);
        let version = env_from(vars(&[("CNI_COMMAND", "VERSION")])).expect("VERSION needs nothing else");
        assert_eq!((version.command.as_str(), version.netns.as_str()), ("VERSION", ""));
        let base = [("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c"), ("CNI_IFNAME", "eth0"), ("CNI_NETNS", "/n")];
        let full = env_from(vars(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", "/n"),
            ("CNI_ARGS", "K8S_POD_NAME=p"),
            ("CNI_PATH", "/opt/cni/bin"),
        ]))
        .expect("complete ADD env");
        assert_eq!((full.netns.as_str(), full.args.as_str(), full.path.as_str()), ("/n", "K8S_POD_NAME=p", "/opt/cni/bin"));
        for missing in ["CNI_CONTAINERID", "CNI_IFNAME", "CNI_NETNS"] {
            let get = |k: &str| base.iter().find(|(n, _)| *n == k && *n != missing).map(|(_, v)| v.to_string());
            let err = env_from(get).expect_err("a required variable is missing");
            assert_eq!(err.code, 4);
            assert!(err.msg.contains(missing), "{}", err.msg);
        }
        let del = |k: &str| base.iter().find(|(n, _)| *n == k && *n != "CNI_NETNS").map(|(_, v)| v.to_string());
        let del_env = env_from(|k: &str| if k == "CNI_COMMAND" { Some("DEL".into()) } else { del(k) });
        assert_eq!(del_env.map(|e| e.netns), Ok(String::new()), "DEL works without a netns");
    }

    #[test]
    fn cni_args_parsing() {
        let pod = parse_cni_args(POD);
        assert_eq!(pod.name.as_deref(), Some("web-1"));
        assert_eq!(pod.namespace.as_deref(), Some("shop"));
        assert_eq!(pod.uid.as_deref(), Some("u-1"));
        assert_eq!(pod.infra_container_id.as_deref(), Some("c0ffee"));
        let podman = parse_cni_args("IgnoreUnknown=1;K8S_POD_NAME=foo");
        assert_eq!(
            podman,
            PodArgs { name: Some("foo".into()), namespace: Some("default".into()), uid: None, infra_container_id: None }
        );
        assert_eq!(parse_cni_args(""), PodArgs::default());
        assert_eq!(parse_cni_args("IgnoreUnknown=1;junk;K8S_POD_NAME=;=x;;"), PodArgs::default());
    }

    #[test]
    fn glob_matches_star_runs_only() {
        for (p, t) in [("web-*", "web-1"), ("*", ""), ("*", "abc"), ("a*c", "abbbc"), ("*-db-*", "shop-db-0"), ("a**b", "ab"), ("é*", "éa"), ("exact", "exact"), ("*ab", "aab")] {
            assert!(glob_match(p, t), "{p} should match {t}");
        }
        for (p, t) in [("web-*", "api-1"), ("a*c", "abcd"), ("exact", "exactly"), ("", "a"), ("a?c", "abc"), ("*x*", "abc")] {
            assert!(!glob_match(p, t), "{p} should not match {t}");
        }
    }

    #[test]
    fn enrollment_rules_select_pods() {
        let mut cfg = parse_config(&config("1.0.0", "")).expect("valid config");
        let e = env("ADD", "");
        let pod = parse_cni_args(POD);
        let cases = [
            (Enrollment::All, true),
            (Enrollment::None, false),
            (Enrollment::Namespaces(vec!["shop".into()]), true),
            (Enrollment::Namespaces(vec!["other".into()]), false),
            (Enrollment::PodPattern("web-*".into()), true),
            (Enrollment::PodPattern("api-*".into()), false),
        ];
        for (rule, enrolled) in cases {
            cfg.enroll = rule.clone();
            match decide(&cfg, &e, &pod) {
                Decision::Enroll(_) => assert!(enrolled, "{rule:?}"),
                Decision::PassThrough(reason) => {
                    assert!(!enrolled, "{rule:?}");
                    assert_eq!(reason, "not selected by the enrollment rule");
                }
            }
        }
        assert_eq!(decide(&cfg, &e, &PodArgs::default()), Decision::PassThrough("no Kubernetes pod args"));
    }

    #[test]
    fn excluded_namespace_passes_through_without_posting() {
        let stdin = config("1.0.0", &format!(r#","exclude_namespaces":["shop"],"prevResult":{PREV_V1}"#));
        let (out, posted) = run(&env("ADD", POD), &stdin, Err("must not be called".into()));
        assert!(posted.is_empty());
        let out = json_of(&out.expect("pass-through succeeds"));
        assert_eq!(out["ips"][0]["address"], "10.244.1.5/24");
        let cfg = parse_config(&stdin).expect("valid config");
        assert_eq!(decide(&cfg, &env("ADD", POD), &parse_cni_args(POD)), Decision::PassThrough("namespace excluded"));
        let (out, posted) = run(&env("ADD", "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns"), &config("1.0.0", ""), Ok(()));
        assert!(out.is_ok() && posted.is_empty(), "kube-system is excluded by default");
    }

    #[test]
    fn add_for_enrolled_pod_posts_once_with_prev_result_ips() {
        let stdin = config("1.0.0", &format!(r#","cni_agent_run_dir":"/run/ambit","prevResult":{PREV_V1}"#));
        let (out, posted) = run(&env("ADD", POD), &stdin, Ok(()));
        assert_eq!(posted.len(), 1);
        let (event, dir) = &posted[0];
        assert_eq!(dir, "/run/ambit");
        let expected = AddEvent {
            netns: "/var/run/netns/cni-1".into(),
            pod_name: "web-1".into(),
            pod_namespace: "shop".into(),
            pod_uid: "u-1".into(),
            container_id: "c0ffee".into(),
            ips: vec![
                PodIp { interface: Some(0), address: "10.244.1.5/24".into(), gateway: Some("10.244.1.1".into()) },
                PodIp { interface: Some(0), address: "fd00::5/64".into(), gateway: None },
            ],
        };
        assert_eq!(event, &expected);
        let out = json_of(&out.expect("ADD succeeds"));
        assert_eq!(out, json_of(PREV_V1), "prevResult printed back unchanged at the same version");
    }

    #[test]
    fn add_event_uses_istio_keys() {
        let event = AddEvent {
            netns: "/n".into(),
            pod_name: "p".into(),
            pod_namespace: "ns".into(),
            pod_uid: String::new(),
            container_id: "c".into(),
            ips: vec![PodIp { interface: Some(1), address: "10.0.0.2/24".into(), gateway: None }],
        };
        let text = serde_json::to_string(&event).expect("serializable");
        let v = json_of(&text);
        for key in ["Netns", "PodName", "PodNamespace", "PodUID", "ContainerID", "IPs"] {
            assert!(v.get(key).is_some(), "{key} missing in {text}");
        }
        assert_eq!(v["IPs"][0], json!({"Interface": 1, "Address": "10.0.0.2/24", "Gateway": null}));
        let istio_like: AddEvent =
            serde_json::from_str(r#"{"Netns":"/n","PodName":"p","PodNamespace":"ns","IPs":[]}"#).expect("decodes");
        assert_eq!((istio_like.pod_uid.as_str(), istio_like.container_id.as_str()), ("", ""));
    }

    #[test]
    fn agent_failure_fails_the_add_closed() {
        let stdin = config("0.4.0", &format!(r#","prevResult":{PREV_V1}"#));
        let (out, posted) = run(&env("ADD", POD), &stdin, Err("connection refused".into()));
        assert_eq!(posted.len(), 1);
        let err = out.expect_err("ADD must fail");
        assert_eq!(err.code, 100);
        assert_eq!(
            err.msg,
            "pod shop/web-1 must be enrolled in the mesh but the Ambit agent refused or is unreachable"
        );
        assert_eq!(err.details, "connection refused");
        let v = json_of(&err.to_json(&reply_version(&stdin)));
        assert_eq!(v, json!({"cniVersion": "0.4.0", "code": 100, "msg": err.msg, "details": "connection refused"}));
        assert!(err.to_string().contains("connection refused"));
    }

    #[test]
    fn result_converts_down_adding_ip_version() {
        let cfg = parse_config(&config("0.4.0", &format!(r#","prevResult":{PREV_V1}"#))).expect("valid config");
        let out = json_of(&result_for(&cfg).expect("converts"));
        assert_eq!(out["cniVersion"], "0.4.0");
        assert_eq!(out["ips"][0]["version"], "4");
        assert_eq!(out["ips"][1]["version"], "6");
        assert_eq!(out["interfaces"], json_of(PREV_V1)["interfaces"]);
        assert_eq!(out["routes"], json_of(PREV_V1)["routes"]);
        assert_eq!(out["dns"], json_of(PREV_V1)["dns"]);
    }

    #[test]
    fn result_converts_up_dropping_ip_version() {
        let prev = r#"{"cniVersion":"0.3.1","ips":[{"version":"4","interface":0,"address":"10.1.0.2/16"}]}"#;
        let cfg = parse_config(&config("1.0.0", &format!(r#","prevResult":{prev}"#))).expect("valid config");
        let out = json_of(&result_for(&cfg).expect("converts"));
        assert_eq!(out, json!({"cniVersion": "1.0.0", "ips": [{"interface": 0, "address": "10.1.0.2/16"}]}));
    }

    #[test]
    fn result_edge_cases() {
        let cfg = parse_config(&config("1.1.0", "")).expect("valid config");
        assert_eq!(json_of(&result_for(&cfg).expect("empty")), json!({"cniVersion": "1.1.0", "interfaces": [], "ips": []}));
        let versionless = r#"{"ips":[{"address":"10.1.0.2/16"}]}"#;
        let cfg = parse_config(&config("0.3.0", &format!(r#","prevResult":{versionless}"#))).expect("valid config");
        assert_eq!(json_of(&result_for(&cfg).expect("converts"))["ips"][0]["version"], "4");
        let bad = |prev: &str| parse_config(&config("0.3.1", &format!(r#","prevResult":{prev}"#))).map(|c| result_for(&c));
        assert_eq!(bad(r#"{"ips":[{"address":"nonsense"}]}"#).map(|r| code_of(r)), Ok(7));
        assert_eq!(bad(r#"{"ips":{}}"#).map(|r| code_of(r)), Ok(7));
        assert_eq!(bad(r#"{"cniVersion":"0.2.0","ip4":{}}"#).map(|r| code_of(r)), Ok(1));
    }

    #[test]
    fn version_lists_supported_versions() {
        let (out, _) = run(&env("VERSION", ""), br#"{"cniVersion":"0.4.0"}"#, Ok(()));
        let v = json_of(&out.expect("VERSION succeeds"));
        assert_eq!(v["cniVersion"], "0.4.0");
        assert_eq!(v["supportedVersions"], json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]));
        let (out, _) = run(&env("VERSION", ""), b"", Ok(()));
        assert_eq!(json_of(&out.expect("VERSION succeeds"))["cniVersion"], "1.1.0");
    }

    #[test]
    fn del_check_gc_status_have_no_side_effects_and_unknown_is_rejected() {
        let stdin = config("1.0.0", &format!(r#","prevResult":{PREV_V1}"#));
        for cmd in ["DEL", "CHECK", "GC", "STATUS"] {
            let (out, posted) = run(&env(cmd, POD), &stdin, Err("must not be called".into()));
            assert_eq!(out, Ok(String::new()), "{cmd}");
            assert!(posted.is_empty(), "{cmd}");
        }
        let (out, _) = run(&env("FROB", POD), &stdin, Ok(()));
        assert_eq!(code_of(out), 4);
    }

    #[test]
    fn error_constructors_carry_spec_codes() {
        let codes = [
            CniError::incompatible_version("9").code,
            CniError::unsupported_field("x", "").code,
            CniError::invalid_env("e").code,
            CniError::decoding_failure("d").code,
            CniError::invalid_config("c").code,
            CniError::try_again_later("t", "").code,
            CniError::enrollment_failed("f", "").code,
            CniError::agent_unreachable("a", "").code,
        ];
        assert_eq!(codes, [1, 2, 4, 6, 7, 11, 100, 999]);
        assert_eq!(CniError::invalid_config("no cniVersion").to_string(), "CNI error 7: no cniVersion");
    }
}
