//! What a whole lab node (`ambit::lab::node::Node`) holds, read the way an
//! operator would: the agent's state file, the pods in the proxy's config
//! dump, the probe ipset, a process's descriptors, and whether a pod's
//! traffic is carried over HBONE. Shared by the soak and the fault tests.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;

use ambit::lab::node::{Node, RulesMode};
use ambit::lab::{
    connect_from, echo_roundtrip, http_get_in, iptables_save, nft_istio_rules, stdout_in, LabPod,
};

use super::counter;

/// The proxy's admin and metrics addresses in the node netns.
pub const ADMIN: &str = "127.0.0.1:15000";
pub const METRICS: &str = "127.0.0.1:15020";
/// The agent's metrics address in the node netns.
pub const AGENT_METRICS: &str = "127.0.0.1:15014";

/// The records of the agent's state file at `path` (none if it does not
/// exist); panics if it does not parse.
pub fn state_records_at(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|_| "[]".into());
    let v: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("agent state {} corrupt: {e}\n{text}", path.display()));
    v.as_array().expect("agent state is a list").clone()
}

/// Pod UIDs in the agent's state file at `path`.
pub fn state_uids_at(path: &Path) -> BTreeSet<String> {
    state_records_at(path)
        .iter()
        .filter_map(|r| r["uid"].as_str().map(str::to_string))
        .collect()
}

/// Pod UIDs in the node's agent state file (where the lab puts it).
pub fn state_uids(node: &Node) -> BTreeSet<String> {
    state_uids_at(&node.dir.join("agent-state.json"))
}

/// The pods the proxy at `admin` serves, from its config dump.
pub fn proxy_pods_at(node: &Node, admin: &str) -> Option<Vec<serde_json::Value>> {
    let (status, body) = http_get_in(&node.lab.node, admin, "/config_dump").ok()?;
    if status != 200 {
        return None;
    }
    let dump: serde_json::Value = serde_json::from_str(&body).ok()?;
    dump["pods"]
        .as_array()
        .or_else(|| dump["workloadState"].as_array())
        .cloned()
}

/// Pod UIDs the node's proxy serves, from its config dump.
pub fn proxy_uids(node: &Node) -> Option<BTreeSet<String>> {
    let pods = proxy_pods_at(node, ADMIN)?;
    Some(
        pods.iter()
            .filter_map(|p| p["uid"].as_str().map(str::to_string))
            .collect(),
    )
}

/// The node's probe ipset, `istio-inpod-probes-v4`: (address, the pod UID
/// in its comment).
pub fn ipset_entries(node: &Node) -> BTreeMap<String, String> {
    let out = node
        .lab
        .node
        .command("ipset")
        .args(["list", "istio-inpod-probes-v4"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip_while(|l| !l.starts_with("Members:"))
        .skip(1)
        .filter_map(|l| {
            let ip = l.split_whitespace().next()?.to_string();
            let uid = l.split('"').nth(1).unwrap_or_default().to_string();
            Some((ip, uid))
        })
        .collect()
}

/// The node's nftables probe set `istio-inpod-probes-v4` (table `inet
/// istio-ambient-nat`): (address, the pod UID in its comment). Empty when
/// the set is not there.
pub fn nft_probe_entries(node: &Node) -> BTreeMap<String, String> {
    let out = node
        .lab
        .node
        .command("nft")
        .args([
            "-j",
            "list",
            "set",
            "inet",
            "istio-ambient-nat",
            "istio-inpod-probes-v4",
        ])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let mut entries = BTreeMap::new();
    for o in v["nftables"].as_array().into_iter().flatten() {
        for e in o["set"]["elem"].as_array().into_iter().flatten() {
            match e.as_str() {
                Some(ip) => entries.insert(ip.to_string(), String::new()),
                None => entries.insert(
                    e["elem"]["val"].as_str().unwrap_or_default().to_string(),
                    e["elem"]["comment"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                ),
            };
        }
    }
    entries
}

/// The node's probe set in `mode`'s back end: (address, pod UID).
pub fn probe_entries(node: &Node, mode: RulesMode) -> BTreeMap<String, String> {
    match mode {
        RulesMode::Iptables => ipset_entries(node),
        RulesMode::Nftables => nft_probe_entries(node),
    }
}

/// That the node and `pods` hold our rules in `mode`'s back end and none
/// in the other's: nothing fell back, nothing was left behind.
pub fn assert_rules_in(node: &Node, mode: RulesMode, pods: &[&LabPod]) {
    let host_ipt = stdout_in(&node.lab.node, "iptables-save", &["-t", "nat"]);
    let host_nft = nft_istio_rules(&node.lab.node);
    let ipsets = stdout_in(&node.lab.node, "ipset", &["list", "-n"]);
    for pod in pods {
        let ipt = iptables_save(&pod.ns)
            .lines()
            .filter(|l| l.contains("ISTIO"))
            .count();
        let nft = nft_istio_rules(&pod.ns).len();
        match mode {
            RulesMode::Iptables => assert!(
                ipt > 0 && nft == 0,
                "{}: iptables {ipt}, nftables {nft}",
                pod.name
            ),
            RulesMode::Nftables => assert!(
                ipt == 0 && nft > 0,
                "{}: iptables {ipt}, nftables {nft}",
                pod.name
            ),
        }
    }
    match mode {
        RulesMode::Iptables => assert!(
            host_ipt.contains("ISTIO_POSTRT") && host_nft.is_empty(),
            "host: {host_ipt}\n{host_nft:?}"
        ),
        RulesMode::Nftables => assert!(
            !host_ipt.contains("ISTIO_POSTRT")
                && !ipsets.contains("istio-inpod-probes")
                && host_nft
                    .iter()
                    .any(|r| r.contains("snat ip to 169.254.7.127")),
            "host: {host_ipt}\n{ipsets}\n{host_nft:?}"
        ),
    }
}

/// Addresses in the node's probe ipset.
pub fn ipset_members(node: &Node) -> BTreeSet<String> {
    ipset_entries(node).into_keys().collect()
}

/// Connections from pod `name` the proxy whose metrics are at `metrics`
/// opened over mutual TLS (as their source).
pub fn mtls_from(node: &Node, metrics: &str, name: &str) -> u64 {
    http_get_in(&node.lab.node, metrics, "/metrics")
        .ok()
        .map_or(0, |(_, m)| {
            counter(
                &m,
                "istio_tcp_connections_opened_total",
                &[
                    ("reporter", "source"),
                    ("source_workload", name),
                    ("connection_security_policy", "mutual_tls"),
                ],
            )
        })
}

/// Whether a round trip from `pod` to the echo server at `echo` works.
pub fn round_trip(pod: &LabPod, echo: SocketAddr) -> bool {
    connect_from(pod, echo)
        .and_then(|mut c| echo_roundtrip(&mut c, b"served?"))
        .is_ok_and(|b| b == b"served?")
}

/// Whether `pod`'s traffic to `echo` is carried over HBONE: a round trip
/// works and the proxy counts an mTLS connection from it.
pub fn served(node: &Node, pod: &LabPod, echo: SocketAddr) -> bool {
    round_trip(pod, echo) && mtls_from(node, METRICS, &pod.name) > 0
}

/// A process's descriptors by kind (`socket`, `pipe`, `net`, a path...).
pub fn fd_kinds(pid: u32) -> BTreeMap<String, usize> {
    let mut kinds = BTreeMap::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let target = std::fs::read_link(e.path()).unwrap_or_default();
        let t = target.to_string_lossy();
        let kind = t.split(":[").next().unwrap_or_default().to_string();
        *kinds.entry(kind).or_default() += 1;
    }
    kinds
}

/// The sockets a process holds in its network namespace, one line
/// of `ss -anp` each (state, addresses), for a failure message to name them.
pub fn sockets_held(pid: u32) -> Vec<String> {
    let net = format!("--net=/proc/{pid}/ns/net");
    let out = std::process::Command::new("nsenter")
        .args([net.as_str(), "ss", "-anp"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let me = format!("pid={pid},");
    out.lines()
        .filter(|l| l.contains(&me))
        .map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.iter().take(6).copied().collect::<Vec<_>>().join(" ")
        })
        .collect()
}

/// The network namespaces (by inode) a process holds descriptors of.
pub fn netns_held(pid: u32) -> BTreeSet<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let target = std::fs::read_link(e.path()).ok()?;
            let t = target.to_string_lossy();
            t.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// An unlabelled sample of the Prometheus text `metrics` (a counter's
/// `<name>_total`, a gauge), if present.
pub fn metric_value(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Veths on the node's side (one per pod on the bridge).
pub fn veth_count(node: &Node) -> usize {
    stdout_in(
        &node.lab.node,
        "ip",
        &["-o", "link", "show", "type", "veth"],
    )
    .lines()
    .count()
}
