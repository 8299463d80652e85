//! The CNI plugin role (`ambit-cni`, docs/wire.md §3) as pure logic: the stdin/stdout contract of a
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
    pub const INVALID_ENV: u32 = 4;
    pub const DECODING_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    /// Plugin-specific (codes >= 100): the pod had to be enrolled and was not.
    pub const ENROLLMENT_FAILED: u32 = 100;

    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    pub fn incompatible_version(requested: &str) -> Self {
        Self::new(
            Self::INCOMPATIBLE_VERSION,
            format!("incompatible CNI version {requested:?}"),
            format!("supported versions: {}", SUPPORTED_VERSIONS.join(", ")),
        )
    }

    pub fn invalid_env(msg: impl Into<String>) -> Self {
        Self::new(Self::INVALID_ENV, msg, "")
    }

    pub fn decoding_failure(details: impl Into<String>) -> Self {
        Self::new(
            Self::DECODING_FAILURE,
            "cannot decode the network config on stdin",
            details,
        )
    }

    pub fn invalid_config(msg: impl Into<String>) -> Self {
        Self::new(Self::INVALID_CONFIG, msg, "")
    }

    pub fn enrollment_failed(msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self::new(Self::ENROLLMENT_FAILED, msg, details)
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
    /// `{"mode": "kubernetes", "agent_namespace": "istio-system", "agent_pod_prefix": "ambit-"}`:
    /// the agent decides from the pod's and its namespace's labels; the plugin
    /// only lets the agent's own pods through without asking.
    Kubernetes {
        agent_namespace: String,
        agent_pod_prefix: String,
    },
}

impl Enrollment {
    /// Whether the rule selects the pod `namespace/pod_name`.
    pub fn selects(&self, namespace: &str, pod_name: &str) -> bool {
        match self {
            Enrollment::All => true,
            Enrollment::None => false,
            Enrollment::Namespaces(list) => list.iter().any(|n| n == namespace),
            Enrollment::PodPattern(pattern) => glob_match(pattern, pod_name),
            Enrollment::Kubernetes { .. } => true,
        }
    }

    /// Whether the pod is one of the agent's own (decided without asking anyone).
    pub fn is_agent_pod(&self, namespace: &str, pod_name: &str) -> bool {
        match self {
            Enrollment::Kubernetes {
                agent_namespace,
                agent_pod_prefix,
            } => {
                !agent_pod_prefix.is_empty()
                    && namespace == agent_namespace
                    && pod_name.starts_with(agent_pod_prefix.as_str())
            }
            _ => false,
        }
    }

    fn from_raw(raw: RawEnroll) -> Result<Self, CniError> {
        match raw.mode.as_str() {
            "all" => Ok(Enrollment::All),
            "none" => Ok(Enrollment::None),
            "namespaces" => Ok(Enrollment::Namespaces(raw.namespaces)),
            "kubernetes" => Ok(Enrollment::Kubernetes {
                agent_namespace: raw.agent_namespace.unwrap_or_default(),
                agent_pod_prefix: raw.agent_pod_prefix.unwrap_or_default(),
            }),
            "pod_pattern" => match raw.pod_pattern {
                Some(p) if !p.is_empty() => Ok(Enrollment::PodPattern(p)),
                _ => Err(CniError::invalid_config(
                    "enroll.mode is \"pod_pattern\" but enroll.pod_pattern is empty",
                )),
            },
            other => Err(CniError::invalid_config(format!(
                "unknown enroll.mode {other:?} (expected all, none, namespaces, pod_pattern or kubernetes)"
            ))),
        }
    }
}

/// The plugin's network config, read from stdin.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    pub cni_version: String,
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
    cni_agent_run_dir: Option<String>,
    /// Istio before 1.24: the full path of the agent's event socket.
    cni_event_address: Option<String>,
    enroll: Option<RawEnroll>,
    exclude_namespaces: Option<Vec<String>>,
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
    agent_namespace: Option<String>,
    agent_pod_prefix: Option<String>,
}

fn default_enroll_mode() -> String {
    "all".to_string()
}

/// Parses the network config: bytes that are not a JSON object → code 6, no `cniVersion` → 7,
/// an unsupported `cniVersion` → 1.
pub fn parse_config(stdin: &[u8]) -> Result<PluginConfig, CniError> {
    let value: Value =
        serde_json::from_slice(stdin).map_err(|e| CniError::decoding_failure(e.to_string()))?;
    if !value.is_object() {
        return Err(CniError::decoding_failure(
            "the network config is not a JSON object",
        ));
    }
    let raw: RawConfig =
        serde_json::from_value(value).map_err(|e| CniError::decoding_failure(e.to_string()))?;
    let cni_version = match raw.cni_version {
        Some(v) if !v.is_empty() => v,
        _ => {
            return Err(CniError::invalid_config(
                "the network config has no cniVersion",
            ))
        }
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
    let enroll = match raw.enroll {
        Some(e) => Enrollment::from_raw(e)?,
        None => Enrollment::All,
    };
    Ok(PluginConfig {
        cni_version,
        cni_agent_run_dir: raw
            .cni_agent_run_dir
            .or(legacy_run_dir)
            .unwrap_or_else(|| DEFAULT_AGENT_RUN_DIR.to_string()),
        enroll,
        exclude_namespaces: raw.exclude_namespaces.unwrap_or_else(|| {
            DEFAULT_EXCLUDED_NAMESPACES
                .iter()
                .map(|s| s.to_string())
                .collect()
        }),
        prev_result: raw.prev_result,
    })
}

/// The version to tag a reply with: the config's `cniVersion` when stdin carries a supported
/// one, else [`LATEST_VERSION`]. Never fails, so it can label any error.
pub fn reply_version(stdin: &[u8]) -> String {
    serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| {
            v.get("cniVersion")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
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
        let Some((key, value)) = pair.split_once('=') else {
            continue;
        };
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
    let command =
        read("CNI_COMMAND").ok_or_else(|| CniError::invalid_env("CNI_COMMAND is not set"))?;
    let per_container = matches!(command.as_str(), "ADD" | "DEL" | "CHECK");
    let require = |key: &str, needed: bool| match read(key) {
        Some(v) => Ok(v),
        None if needed => Err(CniError::invalid_env(format!(
            "{key} is not set (required for {command})"
        ))),
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
    if cfg.enroll.is_agent_pod(namespace, name) {
        return Decision::PassThrough("the agent's own pod");
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
                interface: ip
                    .get("interface")
                    .and_then(Value::as_u64)
                    .and_then(|i| u32::try_from(i).ok()),
                address: ip.get("address")?.as_str()?.to_string(),
                gateway: ip
                    .get("gateway")
                    .and_then(Value::as_str)
                    .map(str::to_string),
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
            ));
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
                return Err(CniError::invalid_config(
                    "prevResult.ips has an entry that is not an object",
                ));
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
        Err(_) => Err(CniError::invalid_config(format!(
            "prevResult.ips has an invalid address {text:?}"
        ))),
    }
}

/// Why an event did not reach the agent, or what it said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentError {
    /// No agent to ask (no socket, connection refused). `must_enroll` is
    /// the API server's verdict on the pod when the plugin could ask it
    /// (Kubernetes mode, with the credentials the agent left it).
    Unreachable {
        why: String,
        must_enroll: Option<bool>,
    },
    /// The agent answered with an error, or did not answer in time.
    Refused(String),
}

impl std::fmt::Display for AgentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentError::Unreachable { why: s, .. } | AgentError::Refused(s) => f.write_str(s),
        }
    }
}

/// File in the agent's run dir where agents before 2026-12-05 listed the
/// namespaces labelled ambient for the plugin's fallback. A pod can opt in
/// by its own label in any namespace, so the list could start such a pod
/// outside the mesh; it is no longer written or read, only removed.
pub const AMBIENT_NAMESPACES_FILE: &str = "ambient-namespaces.json";

/// Kubeconfig the agent leaves in its run dir (0600) so the plugin can ask
/// the API server about a pod while no agent runs.
pub const PLUGIN_KUBECONFIG_FILE: &str = "plugin-kubeconfig";

/// Whether a pod may start while the agent is unreachable: only in
/// Kubernetes mode, and only when the API server itself said the pod is not
/// to be enrolled. No answer (no kubeconfig, a token it refuses, no answer
/// in time) is no permission: the ADD fails closed, and the kubelet retries.
fn may_start_without_agent(cfg: &PluginConfig, must_enroll: Option<bool>) -> bool {
    matches!(cfg.enroll, Enrollment::Kubernetes { .. }) && must_enroll == Some(false)
}

/// Runs one plugin invocation and returns its stdout. `post` delivers an [`AddEvent`] to the
/// agent whose run dir is given; a failure fails the ADD (fail closed) with code 100, except
/// for a pod the API server says is not to be enrolled while no agent runs (Kubernetes
/// mode). DEL and CHECK have no side effects: removal is the agent's job.
pub fn handle(
    env: &CniEnv,
    stdin: &[u8],
    post: &mut dyn FnMut(&AddEvent, &str) -> Result<(), AgentError>,
) -> Result<String, CniError> {
    match env.command.as_str() {
        "VERSION" => Ok(json!({
            "cniVersion": reply_version(stdin),
            "supportedVersions": SUPPORTED_VERSIONS,
        })
        .to_string()),
        "ADD" => {
            let cfg = parse_config(stdin)?;
            // Our own answer first: an ADD that fails on a bad prevResult must
            // not have enrolled the pod with the agent first.
            let result = result_for(&cfg)?;
            let pod = parse_cni_args(&env.args);
            if let Decision::Enroll(event) = decide(&cfg, env, &pod) {
                match post(&event, &cfg.cni_agent_run_dir) {
                    Err(AgentError::Unreachable { why, must_enroll })
                        if may_start_without_agent(&cfg, must_enroll) =>
                    {
                        eprintln!(
                            "ambit-cni: {why}; pod {}/{} is not to be enrolled, so it starts now",
                            event.pod_namespace, event.pod_name
                        );
                        return Ok(result);
                    }
                    r => r,
                }
                .map_err(|details| {
                    CniError::enrollment_failed(
                        format!(
                            "pod {}/{} must be enrolled in the mesh but the Ambit agent refused \
                             or is unreachable",
                            event.pod_namespace, event.pod_name
                        ),
                        details.to_string(),
                    )
                })?;
            }
            Ok(result)
        }
        // DEL must not block a pod's teardown: only input that is not a CNI
        // config at all (or of an unknown spec version) is refused.
        "DEL" => match parse_config(stdin) {
            Err(e)
                if e.code == CniError::DECODING_FAILURE
                    || e.code == CniError::INCOMPATIBLE_VERSION =>
            {
                Err(e)
            }
            _ => Ok(String::new()),
        },
        "CHECK" => parse_config(stdin).map(|_| String::new()),
        "GC" | "STATUS" => Ok(String::new()),
        other => Err(CniError::invalid_env(format!(
            "unknown CNI_COMMAND {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests;
