//! Scenario harness for the end-to-end tests: a mesh of pods in network
//! namespaces on this host, each meshed pod with its in-pod rules and its own
//! dedicated `ambit proxy`, all torn down when the test ends (even on failure).
//! `kube` holds the pieces for a node enrolled from the fake Kubernetes API,
//! `node` the readers of what a whole lab node holds.

#![allow(dead_code)]

pub mod cp;
pub mod kube;
pub mod node;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ambit::lab::{http_get_in, write_ca, EchoServer, Lab, LabPod, ProxySpec};
use ambit::netns::Netns;

pub const TD: &str = "cluster.local";

pub struct Mesh {
    pub lab: Lab,
    pub config: PathBuf,
    pub ca: (PathBuf, PathBuf),
}

impl Mesh {
    pub fn new(tag: &str) -> Mesh {
        let lab =
            Lab::new(tag, env!("CARGO_BIN_EXE_ambit")).expect("create lab (tests run as root)");
        let ca = write_ca(&lab.dir, "ca", TD).unwrap();
        let config = lab.dir.join("mesh.yaml");
        std::fs::write(&config, "workloads: []\n").unwrap();
        Mesh { lab, config, ca }
    }

    pub fn pod(&mut self, name: &str) -> LabPod {
        self.lab.add_pod(name).unwrap()
    }

    pub fn write_config(&self, yaml: &str) {
        std::fs::write(&self.config, yaml).unwrap();
    }

    /// Redirects `pod`'s traffic and starts its proxy as `default/<name>/<sa>`.
    pub fn mesh(&self, pod: &LabPod, sa: &str) {
        self.mesh_with(pod, sa, self.ca.clone(), TD);
    }

    /// Like [`Mesh::mesh`], with extra environment for the proxy.
    pub fn mesh_env(&self, pod: &LabPod, sa: &str, env: &[(&str, &str)]) {
        self.lab.redirect(pod).unwrap();
        let spec = ProxySpec {
            config: self.config.clone(),
            ca_cert: self.ca.0.clone(),
            ca_key: self.ca.1.clone(),
            workload_info: format!("default/{}/{sa}", pod.name),
            trust_domain: TD.to_string(),
            extra_env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        self.lab.start_proxy(pod, &spec).unwrap();
    }

    pub fn mesh_with(&self, pod: &LabPod, sa: &str, ca: (PathBuf, PathBuf), td: &str) {
        self.lab.redirect(pod).unwrap();
        let spec = ProxySpec {
            config: self.config.clone(),
            ca_cert: ca.0,
            ca_key: ca.1,
            workload_info: format!("default/{}/{sa}", pod.name),
            trust_domain: td.to_string(),
            extra_env: vec![],
        };
        self.lab.start_proxy(pod, &spec).unwrap();
    }

    pub fn proxy_log(&self, pod: &LabPod) -> String {
        std::fs::read_to_string(self.lab.log_path(&format!("proxy-{}", pod.name)))
            .unwrap_or_default()
    }

    pub fn metrics(&self, pod: &LabPod) -> String {
        admin_get(&pod.ns, "127.0.0.1:15020", "/metrics")
    }
}

/// Polls `f` every 25 ms until it holds; panics naming `what` if it does not
/// within `limit`. Use instead of a fixed sleep before checking a state.
pub fn wait_until(what: &str, limit: Duration, f: impl FnMut() -> bool) {
    wait_until_showing(what, limit, f, String::new);
}

/// [`wait_until`], with what `detail` says (a log, say) in the panic.
pub fn wait_until_showing(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> bool,
    detail: impl Fn() -> String,
) {
    let started = Instant::now();
    while !f() {
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}\n{}",
            detail()
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A GET of an admin, metrics or readiness endpoint from inside `ns`: the
/// body of a 200 answer; panics on anything else, so that a failed call is
/// never read as an empty page (which every "does not contain" would pass).
pub fn admin_get(ns: &Netns, addr: &str, path: &str) -> String {
    match http_get_in(ns, addr, path) {
        Ok((200, body)) => body,
        Ok((status, body)) => panic!("GET {addr}{path} answered {status}: {body}"),
        Err(e) => panic!("GET {addr}{path} failed: {e}"),
    }
}

/// A workload entry of the local config.
pub fn workload(pod: &LabPod, sa: &str, protocol: &str) -> String {
    format!(
        "- {{uid: {n}, name: {n}, namespace: default, serviceAccount: {sa}, workloadIps: [\"{ip}\"], protocol: {protocol}}}\n",
        n = pod.name,
        ip = pod.ip
    )
}

/// The sum of a counter's samples whose labels contain every `filter` pair.
pub fn counter(metrics: &str, name: &str, filter: &[(&str, &str)]) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            filter
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The common scenario: meshed `client` and `server` pods, an echo app on server:8080.
pub fn meshed_pair(tag: &str) -> (Mesh, LabPod, LabPod, EchoServer) {
    meshed_pair_env(tag, &[], &[])
}

/// [`meshed_pair`], with extra environment for the client's and the
/// server's proxies.
pub fn meshed_pair_env(
    tag: &str,
    client_env: &[(&str, &str)],
    server_env: &[(&str, &str)],
) -> (Mesh, LabPod, LabPod, EchoServer) {
    let mut m = Mesh::new(tag);
    let (client, server) = (m.pod("client"), m.pod("server"));
    m.write_config(&format!(
        "workloads:\n{}{}",
        workload(&client, "client-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE")
    ));
    m.mesh_env(&client, "client-sa", client_env);
    m.mesh_env(&server, "server-sa", server_env);
    let echo = EchoServer::start(&server, 8080).unwrap();
    (m, client, server, echo)
}
