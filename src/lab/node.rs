//! A whole node for tests, benchmarks and the demo: `ambit node` (or agent
//! and proxy as separate processes) inside the lab's node netns, pods created
//! as a container runtime does: a sandbox holding the pod's netns in the
//! pod's cgroup, then the conflist chain (reference bridge + host-local, then
//! the `ambit-cni` the agent installed).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::{http_get_in, pod_uid, CniCall, Lab, LabPod};
use crate::netns::Netns;

/// A node under test.
pub struct Node {
    pub lab: Lab,
    pub dir: PathBuf,
    pub bin_dir: PathBuf,
    pub conf_dir: PathBuf,
    pub pods: Vec<String>,
    pub enroll: String,
    /// First three octets of the pods' network (the bridge holds `.1`).
    pub subnet: String,
    /// The pods' network's prefix length: 24 unless made with [`Node::prepare_sized`].
    pub prefix: u8,
    /// Extra environment for the node's processes (e.g. `XDS_ADDRESS`).
    pub extra_env: Vec<(String, String)>,
}

/// The rules back end a node's agent runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RulesMode {
    Iptables,
    /// `NATIVE_NFTABLES=true`, on a `PATH` without iptables (see
    /// [`Node::rules_env`]).
    Nftables,
}

/// Tools a node in nftables mode does not have: whatever runs iptables or
/// ipset.
const IPTABLES_TOOLS: [&str; 6] = [
    "iptables",
    "ip6tables",
    "ipset",
    "xtables",
    "arptables",
    "ebtables",
];

impl Node {
    /// The environment that puts a node's agent in `mode`. For nftables:
    /// `NATIVE_NFTABLES=true` and a `PATH` (a directory under `dir` linking
    /// every program on this process's `PATH` but iptables', ip6tables',
    /// ipset's and their kin) on which no iptables tool can be found, so
    /// nothing falls back to them unseen.
    pub fn rules_env(dir: &Path, mode: RulesMode) -> Vec<(String, String)> {
        if mode == RulesMode::Iptables {
            return Vec::new();
        }
        let farm = dir.join("path-without-iptables");
        std::fs::create_dir_all(&farm).unwrap();
        let path = std::env::var("PATH").unwrap_or_default();
        for entry in path
            .split(':')
            .filter_map(|d| std::fs::read_dir(d).ok())
            .flatten()
            .flatten()
        {
            let name = entry.file_name();
            let hidden = IPTABLES_TOOLS
                .iter()
                .any(|t| name.to_string_lossy().starts_with(t));
            let link = farm.join(&name);
            if !hidden && !link.exists() {
                let _ = std::os::unix::fs::symlink(entry.path(), link);
            }
        }
        vec![
            ("NATIVE_NFTABLES".into(), "true".into()),
            ("PATH".into(), farm.to_string_lossy().into_owned()),
        ]
    }

    /// [`Node::start_with`] with the agent in `mode`.
    pub fn start_in(
        binary: &str,
        tag: &str,
        enroll: &str,
        combined: bool,
        mode: RulesMode,
    ) -> Node {
        Self::start_two_pods(binary, tag, enroll, combined, |dir| {
            Self::rules_env(dir, mode)
        })
    }

    pub fn start(binary: &str, tag: &str, enroll: &str) -> Node {
        Self::start_with(binary, tag, enroll, true)
    }

    /// `combined`: one `ambit node`; otherwise `ambit agent` and `ambit proxy` as
    /// separate processes ("agent", "proxy") so a test can restart either.
    pub fn start_with(binary: &str, tag: &str, enroll: &str, combined: bool) -> Node {
        Self::start_env(binary, tag, enroll, combined, &[])
    }

    /// [`Node::start_with`], with extra environment for the node's processes.
    pub fn start_env(
        binary: &str,
        tag: &str,
        enroll: &str,
        combined: bool,
        env: &[(&str, &str)],
    ) -> Node {
        Self::start_two_pods(binary, tag, enroll, combined, |_| {
            env.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
    }

    /// A node whose local config names the client and server pods, with
    /// the environment `env` makes from the node's directory.
    fn start_two_pods(
        binary: &str,
        tag: &str,
        enroll: &str,
        combined: bool,
        env: impl FnOnce(&Path) -> Vec<(String, String)>,
    ) -> Node {
        // A subnet of its own: nodes of parallel tests share the host, and an
        // agent enrolls pods it finds anywhere on it by their IP.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let subnet = format!("10.{}.0", 120 + n % 100);
        let subnet = subnet.as_str();
        // host-local hands out .2, .3, ... in order: name the pods' service accounts up front.
        let mesh = format!(
            "workloads:\n- {{name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"{subnet}.2\"], protocol: HBONE}}\n- {{name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{subnet}.3\"], protocol: HBONE}}\n"
        );
        let mut node = Self::prepare(binary, tag, enroll, subnet, &mesh, None);
        node.extra_env = env(&node.dir);
        node.launch(combined);
        node.wait_ready("127.0.0.1:8000", "/readyz");
        node.wait_ready("127.0.0.1:15021", "/healthz/ready");
        node
    }

    pub fn start_full(
        binary: &str,
        tag: &str,
        enroll: &str,
        combined: bool,
        subnet: &str,
        mesh: &str,
        ca_from: Option<&Node>,
    ) -> Node {
        let node = Self::prepare(binary, tag, enroll, subnet, mesh, ca_from);
        node.launch(combined);
        node.wait_ready("127.0.0.1:8000", "/readyz");
        node.wait_ready("127.0.0.1:15021", "/healthz/ready");
        node
    }

    /// The node's netns, CNI config, CA and local config, with nothing running yet.
    pub fn prepare(
        binary: &str,
        tag: &str,
        enroll: &str,
        subnet: &str,
        mesh: &str,
        ca_from: Option<&Node>,
    ) -> Node {
        Self::prepare_sized(binary, tag, enroll, subnet, 24, mesh, ca_from)
    }

    /// [`Node::prepare`] with pods in `<subnet>.0/<prefix>` (a /22 holds
    /// 1,021 pods; a Linux bridge takes at most 1,024 ports).
    pub fn prepare_sized(
        binary: &str,
        tag: &str,
        enroll: &str,
        subnet: &str,
        prefix: u8,
        mesh: &str,
        ca_from: Option<&Node>,
    ) -> Node {
        let lab = Lab::new(tag, binary).unwrap();
        let dir = lab.dir.clone();
        let (bin_dir, conf_dir) = (dir.join("cni-bin"), dir.join("net.d"));
        std::fs::create_dir_all(&conf_dir).unwrap();
        let conflist = serde_json::json!({
            "cniVersion": "1.0.0", "name": "meshnet",
            "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
                "ipam": {"type": "host-local", "dataDir": dir.join("ipam"), "ranges": [[{"subnet": format!("{subnet}.0/{prefix}")}]],
                         "routes": [{"dst": "0.0.0.0/0"}]}}]
        });
        std::fs::write(conf_dir.join("10-meshnet.conflist"), conflist.to_string()).unwrap();
        // The mesh root (`ca-*.pem`) and, for a control plane run on this
        // node, its serving root (`serving-ca-*.pem`): never the same.
        match ca_from {
            Some(other) => {
                for f in [
                    "ca-cert.pem",
                    "ca-key.pem",
                    "serving-ca-cert.pem",
                    "serving-ca-key.pem",
                ] {
                    std::fs::copy(other.dir.join(f), dir.join(f)).unwrap();
                }
            }
            None => {
                super::write_ca(&dir, "ca", "cluster.local").unwrap();
                super::write_serving_ca(&dir, "serving-ca").unwrap();
            }
        }
        std::fs::write(dir.join("mesh.yaml"), mesh).unwrap();
        Node {
            lab,
            dir,
            bin_dir,
            conf_dir,
            pods: Vec::new(),
            enroll: enroll.to_string(),
            subnet: subnet.to_string(),
            prefix,
            extra_env: Vec::new(),
        }
    }

    /// Starts `ambit node` (`combined`) or `ambit agent` + `ambit proxy`.
    pub fn launch(&self, combined: bool) {
        if combined {
            self.lab.spawn("node", self.command("node")).unwrap();
        } else {
            self.lab.spawn("agent", self.command("agent")).unwrap();
            self.lab.spawn("proxy", self.command("proxy")).unwrap();
        }
    }

    /// `ambit <role>` inside the node netns with this node's environment.
    pub fn command(&self, role: &str) -> Command {
        self.command_through(role, &[])
    }

    /// [`Node::command`] started through `wrapper` (a program and its
    /// arguments, `setpriv` with a capability set, say), which runs `ambit`.
    pub fn command_through(&self, role: &str, wrapper: &[&str]) -> Command {
        self.command_of(self.lab.binary(), role, wrapper)
    }

    /// [`Node::command_through`] running `binary` in `ambit`'s place: another
    /// proxy that reads the same environment (ztunnel, in a bench).
    pub fn command_of(&self, binary: &Path, role: &str, wrapper: &[&str]) -> Command {
        let dir = &self.dir;
        let binary = binary.to_string_lossy().into_owned();
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut cmd = self.lab.node.command(program);
                cmd.args(args).arg(&binary);
                cmd
            }
            None => self.lab.node.command(&binary),
        };
        cmd.arg(role)
            .env("CNI_BIN_DIR", &self.bin_dir)
            .env("CNI_NET_DIR", &self.conf_dir)
            .env("CNI_AGENT_RUN_DIR", dir.join("run"))
            .env("ZTUNNEL_UDS_ADDRESS", dir.join("zds.sock"))
            .env("INPOD_UDS", dir.join("zds.sock"))
            .env("AMBIT_AGENT_STATE", dir.join("agent-state.json"))
            .env("AMBIT_AGENT_READINESS_ADDR", "127.0.0.1:8000")
            .env("AMBIT_ENROLL", &self.enroll)
            .env("LOCAL_XDS_PATH", dir.join("mesh.yaml"))
            .env("PROXY_MODE", "shared")
            .env("AMBIT_CA_CERT", dir.join("ca-cert.pem"))
            .env("AMBIT_CA_KEY", dir.join("ca-key.pem"))
            .env("AMBIT_STATE_DIR", dir.join("state"))
            // Non-mesh names go to a resolver on the node's bridge address (tests run one there).
            .env("AMBIT_DNS_UPSTREAMS", format!("{}.1:53", self.subnet));
        for (k, v) in &self.extra_env {
            cmd.env(k, v);
        }
        cmd
    }

    pub fn wait_ready(&self, addr: &str, path: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while http_get_in(&self.lab.node, addr, path)
            .map(|(s, _)| s)
            .unwrap_or(0)
            != 200
        {
            assert!(
                Instant::now() < deadline,
                "{addr}{path} not ready; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        ["node", "agent", "proxy", "proxy2"]
            .iter()
            .map(|l| std::fs::read_to_string(self.lab.log_path(l)).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The proxy's `/config_dump`; panics unless it answers 200, so a check
    /// that something is absent from it cannot pass on a failed call.
    pub fn dump(&self, admin: &str) -> String {
        match http_get_in(&self.lab.node, admin, "/config_dump") {
            Ok((200, body)) => body,
            other => panic!("config dump from {admin}: {other:?}"),
        }
    }

    pub fn conflist(&self) -> serde_json::Value {
        serde_json::from_str(
            &std::fs::read_to_string(self.conf_dir.join("10-meshnet.conflist")).unwrap(),
        )
        .unwrap()
    }

    /// Creates pod `name` as a runtime would: its netns, held by its
    /// sandbox in the cgroup of pod [`pod_uid`]`(name)`, then the CNI chain
    /// ADD with that UID. A failed ADD ends the sandbox (the netns stays
    /// until the node is dropped).
    pub fn add_pod(&mut self, name: &str, namespace: &str) -> Result<LabPod, String> {
        self.add_sandbox(name, namespace, name)
    }

    /// [`Node::add_pod`] for one sandbox of pod `name`: the netns is named
    /// after `sandbox` (`<lab id>-<sandbox>`, also the container id the
    /// chain is given), the UID is the pod's. Kubelet makes a second
    /// sandbox for the same pod, with the same UID, when the first dies.
    pub fn add_sandbox(
        &mut self,
        name: &str,
        namespace: &str,
        sandbox: &str,
    ) -> Result<LabPod, String> {
        let netns_name = self.create_sandbox(name, sandbox);
        self.attach(name, namespace, sandbox, &netns_name, None)
    }

    /// Creates the pods `pods` (name, the address host-local is asked for)
    /// in namespace `namespace` as [`Node::add_pod`] does, `parallel` at a
    /// time, as kubelet starts the pods scheduled to a node at once. Right
    /// after its ADD returns, each pod is handed to `then` on the same
    /// thread. Returns, in `pods`' order, each pod, its ADD's time (the
    /// sandbox, then the chain) and what `then` gave.
    pub fn add_pods<T: Send>(
        &mut self,
        pods: &[(String, Ipv4Addr)],
        namespace: &str,
        parallel: usize,
        then: impl Fn(&LabPod) -> T + Sync,
    ) -> Vec<Result<(LabPod, Duration, T), String>> {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let done = std::sync::Mutex::new(Vec::with_capacity(pods.len()));
        let node = &*self;
        std::thread::scope(|s| {
            for _ in 0..parallel.max(1) {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((name, ip)) = pods.get(i) else {
                        return;
                    };
                    let started = Instant::now();
                    let netns_name = node.make_sandbox(name, name);
                    let added = node
                        .attach(name, namespace, name, &netns_name, Some(*ip))
                        .map(|pod| {
                            let took = started.elapsed();
                            let then = then(&pod);
                            (pod, took, then)
                        });
                    done.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((i, netns_name, added));
                });
            }
        });
        let mut done = done.into_inner().unwrap_or_else(|e| e.into_inner());
        done.sort_by_key(|(i, _, _)| *i);
        done.into_iter()
            .map(|(_, netns_name, added)| {
                self.pods.push(netns_name);
                added
            })
            .collect()
    }

    /// The CNI ADD of sandbox `sandbox` (netns `netns_name`) of pod `name`,
    /// asking host-local for `ip` if given. A failed ADD ends the sandbox.
    fn attach(
        &self,
        name: &str,
        namespace: &str,
        sandbox: &str,
        netns_name: &str,
        ip: Option<Ipv4Addr>,
    ) -> Result<LabPod, String> {
        let ns = Netns::named(netns_name).unwrap();
        let result = match self.cni_at("ADD", name, namespace, sandbox, ip) {
            Ok(result) => result,
            Err(e) => {
                self.lab.release(netns_name);
                return Err(e.to_string());
            }
        };
        let ip: Ipv4Addr = result["ips"][0]["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        Ok(LabPod {
            name: name.to_string(),
            netns_name: netns_name.to_string(),
            ip,
            ns,
        })
    }

    /// The sandbox `sandbox` of pod `name` with no CNI call yet: its netns
    /// (`<lab id>-<sandbox>`, loopback up, as runtimes leave it), held by a
    /// process in the cgroup of pod [`pod_uid`]`(name)`. Returns the netns
    /// name; the netns goes when the node is dropped.
    pub fn create_sandbox(&mut self, name: &str, sandbox: &str) -> String {
        let netns_name = self.make_sandbox(name, sandbox);
        self.pods.push(netns_name.clone());
        netns_name
    }

    /// [`Node::create_sandbox`], leaving the netns for the caller to record.
    fn make_sandbox(&self, name: &str, sandbox: &str) -> String {
        let netns_name = self.netns_name(sandbox);
        assert!(Command::new("ip")
            .args(["netns", "add", &netns_name])
            .status()
            .unwrap()
            .success());
        self.lab
            .hold(&netns_name, &pod_uid(name))
            .unwrap_or_else(|e| panic!("sandbox {sandbox} of pod {name}: {e}"));
        let ns = Netns::named(&netns_name).unwrap();
        // Runtimes bring the pod's loopback up themselves, before the network's plugins run.
        assert!(ns
            .command("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .unwrap()
            .success());
        netns_name
    }

    /// The name of the netns of sandbox `sandbox` (`<lab id>-<sandbox>`).
    pub fn netns_name(&self, sandbox: &str) -> String {
        format!("{}-{sandbox}", self.lab.id)
    }

    /// Deletes the pod named `name` as a runtime does: CNI DEL through the
    /// chain (which frees its address), then its sandbox and netns. Works
    /// for a pod whose ADD failed too. Returns the DEL's error, if any; the
    /// pod is torn down either way.
    pub fn delete_pod(&mut self, name: &str, namespace: &str) -> Result<(), String> {
        self.delete_sandbox(name, namespace, name)
    }

    /// [`Node::delete_pod`] for the sandbox `sandbox` of pod `name`.
    pub fn delete_sandbox(
        &mut self,
        name: &str,
        namespace: &str,
        sandbox: &str,
    ) -> Result<(), String> {
        let deleted = self
            .cni("DEL", name, namespace, sandbox)
            .map(|_| ())
            .map_err(|e| e.to_string());
        let netns_name = self.netns_name(sandbox);
        self.tear_down(&netns_name);
        deleted
    }

    /// Runs the CNI chain's `command` for the sandbox `sandbox` of pod
    /// `name`, as a runtime does (its netns path, even once that is gone).
    pub fn cni(
        &self,
        command: &str,
        name: &str,
        namespace: &str,
        sandbox: &str,
    ) -> std::io::Result<serde_json::Value> {
        self.cni_at(command, name, namespace, sandbox, None)
    }

    /// [`Node::cni`], asking host-local for the address `ip` (its `IP`
    /// argument) if given.
    fn cni_at(
        &self,
        command: &str,
        name: &str,
        namespace: &str,
        sandbox: &str,
        ip: Option<Ipv4Addr>,
    ) -> std::io::Result<serde_json::Value> {
        let netns_name = self.netns_name(sandbox);
        let conflist = self.conflist();
        let mut args = format!(
            "IgnoreUnknown=1;K8S_POD_NAME={name};K8S_POD_NAMESPACE={namespace};K8S_POD_UID={}",
            pod_uid(name)
        );
        if let Some(ip) = ip {
            args += &format!(";IP={ip}");
        }
        CniCall {
            node: &self.lab.node,
            conflist: &conflist,
            cni_path: &format!("/usr/lib/cni:{}", self.bin_dir.display()),
            container_id: &netns_name,
            netns_path: &PathBuf::from(format!("/var/run/netns/{netns_name}")),
            cni_args: &args,
        }
        .run(command)
    }

    /// Kills a sandbox's process and deletes its netns, as a runtime does
    /// when the sandbox goes (with or without a CNI DEL). Takes `&self`, so
    /// it can race a CNI call on another thread.
    pub fn kill_sandbox(&self, netns_name: &str) {
        self.lab.release(netns_name);
        let _ = Command::new("ip")
            .args(["netns", "del", netns_name])
            .stderr(std::process::Stdio::null())
            .status();
    }

    /// Kills a pod's sandbox and deletes its netns.
    fn tear_down(&mut self, netns_name: &str) {
        self.kill_sandbox(netns_name);
        self.pods.retain(|p| p != netns_name);
    }

    /// Pod `pod` goes away with no CNI DEL reaching the agent (as when its
    /// sandbox dies, or is torn down while the agent is away): its sandbox
    /// process is killed and its netns deleted.
    pub fn remove_pod(&mut self, pod: &LabPod) {
        self.tear_down(&pod.netns_name);
    }

    pub fn metrics(&self) -> String {
        http_get_in(&self.lab.node, "127.0.0.1:15020", "/metrics")
            .unwrap()
            .1
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for l in ["node", "agent", "proxy", "proxy2"] {
            self.lab.stop(l);
        }
        for p in &self.pods {
            let _ = Command::new("ip")
                .args(["netns", "del", p])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// Routes two nodes to each other over a veth pair: `a` gets `10.99.0.1/30`,
/// `b` `10.99.0.2/30`, each routes the other's pod subnet and forwards.
pub fn link(a: &Node, b: &Node) {
    let (na, nb) = (a.lab.node_name().to_string(), b.lab.node_name().to_string());
    let ip = |args: &[&str]| {
        assert!(
            Command::new("ip").args(args).status().unwrap().success(),
            "ip {args:?}"
        )
    };
    ip(&[
        "-n", &na, "link", "add", "xa", "type", "veth", "peer", "name", "xb", "netns", &nb,
    ]);
    ip(&["-n", &na, "addr", "add", "10.99.0.1/30", "dev", "xa"]);
    ip(&["-n", &nb, "addr", "add", "10.99.0.2/30", "dev", "xb"]);
    ip(&["-n", &na, "link", "set", "xa", "up"]);
    ip(&["-n", &nb, "link", "set", "xb", "up"]);
    for (n, node, via) in [(&na, b, "10.99.0.2"), (&nb, a, "10.99.0.1")] {
        ip(&[
            "-n",
            n,
            "route",
            "add",
            &format!("{}.0/24", node.subnet),
            "via",
            via,
        ]);
        assert!(Command::new("ip")
            .args(["netns", "exec", n, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            .status()
            .unwrap()
            .success());
    }
}
