//! End-to-end: a node — `ambit node` (agent + shared proxy) inside a node
//! netns, pods created by running the conflist chain (reference bridge +
//! host-local, then ambit-cni installed by the agent) exactly as a container
//! runtime does.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use ambit::lab::{connect_from, echo_roundtrip, http_get_in, CniCall, EchoServer, Lab, LabPod};
use ambit::netns::Netns;

struct Node {
    lab: Lab,
    dir: PathBuf,
    bin_dir: PathBuf,
    conf_dir: PathBuf,
    pods: Vec<String>,
    enroll: String,
}

const SUBNET: &str = "10.78.0";

impl Node {
    fn start(tag: &str, enroll: &str) -> Node {
        Self::start_with(tag, enroll, true)
    }

    /// `combined`: one `ambit node`; otherwise `ambit agent` and `ambit proxy` as
    /// separate processes ("agent", "proxy") so a test can restart either.
    fn start_with(tag: &str, enroll: &str, combined: bool) -> Node {
        // host-local hands out .2, .3, ... in order: name the pods' service accounts up front.
        let mesh = format!(
            "workloads:\n- {{name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"{SUBNET}.2\"], protocol: HBONE}}\n- {{name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{SUBNET}.3\"], protocol: HBONE}}\n"
        );
        Self::start_full(tag, enroll, combined, SUBNET, &mesh, None)
    }

    fn start_full(
        tag: &str,
        enroll: &str,
        combined: bool,
        subnet: &str,
        mesh: &str,
        ca_from: Option<&Node>,
    ) -> Node {
        let lab = Lab::new(tag, env!("CARGO_BIN_EXE_ambit")).unwrap();
        let dir = lab.dir.clone();
        let (bin_dir, conf_dir) = (dir.join("cni-bin"), dir.join("net.d"));
        std::fs::create_dir_all(&conf_dir).unwrap();
        let conflist = serde_json::json!({
            "cniVersion": "1.0.0", "name": "meshnet",
            "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
                "ipam": {"type": "host-local", "dataDir": dir.join("ipam"), "ranges": [[{"subnet": format!("{subnet}.0/24")}]],
                         "routes": [{"dst": "0.0.0.0/0"}]}}]
        });
        std::fs::write(conf_dir.join("10-meshnet.conflist"), conflist.to_string()).unwrap();
        match ca_from {
            Some(other) => {
                for f in ["ca-cert.pem", "ca-key.pem"] {
                    std::fs::copy(other.dir.join(f), dir.join(f)).unwrap();
                }
            }
            None => {
                ambit::lab::write_ca(&dir, "ca", "cluster.local").unwrap();
            }
        }
        std::fs::write(dir.join("mesh.yaml"), mesh).unwrap();
        let node = Node {
            lab,
            dir,
            bin_dir,
            conf_dir,
            pods: Vec::new(),
            enroll: enroll.to_string(),
        };
        if combined {
            node.lab.spawn("node", node.command("node")).unwrap();
        } else {
            node.lab.spawn("agent", node.command("agent")).unwrap();
            node.lab.spawn("proxy", node.command("proxy")).unwrap();
        }
        node.wait_ready("127.0.0.1:8000", "/readyz");
        node.wait_ready("127.0.0.1:15021", "/healthz/ready");
        node
    }

    /// `ambit <role>` inside the node netns with this node's environment.
    fn command(&self, role: &str) -> Command {
        let dir = &self.dir;
        let mut cmd = self.lab.node.command(env!("CARGO_BIN_EXE_ambit"));
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
            .env("AMBIT_STATE_DIR", dir.join("state"));
        cmd
    }

    fn wait_ready(&self, addr: &str, path: &str) {
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

    fn log(&self) -> String {
        ["node", "agent", "proxy", "proxy2"]
            .iter()
            .map(|l| std::fs::read_to_string(self.lab.log_path(l)).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn dump(&self, admin: &str) -> String {
        http_get_in(&self.lab.node, admin, "/config_dump")
            .map(|r| r.1)
            .unwrap_or_default()
    }

    fn conflist(&self) -> serde_json::Value {
        serde_json::from_str(
            &std::fs::read_to_string(self.conf_dir.join("10-meshnet.conflist")).unwrap(),
        )
        .unwrap()
    }

    /// Creates a pod netns and runs the CNI chain ADD for it, as a runtime would.
    fn add_pod(&mut self, name: &str, namespace: &str) -> Result<LabPod, String> {
        let netns_name = format!("{}-{name}", self.lab.id);
        assert!(Command::new("ip")
            .args(["netns", "add", &netns_name])
            .status()
            .unwrap()
            .success());
        self.pods.push(netns_name.clone());
        let ns = Netns::named(&netns_name).unwrap();
        // Runtimes bring the pod's loopback up themselves, before the network's plugins run.
        assert!(ns
            .command("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .unwrap()
            .success());
        let conflist = self.conflist();
        let cni_path = format!("/usr/lib/cni:{}", self.bin_dir.display());
        let netns_path = PathBuf::from(format!("/var/run/netns/{netns_name}"));
        let args = format!("IgnoreUnknown=1;K8S_POD_NAME={name};K8S_POD_NAMESPACE={namespace};K8S_POD_UID=uid-{name}");
        let call = CniCall {
            node: &self.lab.node,
            conflist: &conflist,
            cni_path: &cni_path,
            container_id: &netns_name,
            netns_path: &netns_path,
            cni_args: &args,
        };
        let result = call.run("ADD").map_err(|e| e.to_string())?;
        let ip: std::net::Ipv4Addr = result["ips"][0]["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        Ok(LabPod {
            name: name.to_string(),
            netns_name,
            ip,
            ns,
        })
    }

    fn metrics(&self) -> String {
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

fn istio_rules(pod: &LabPod) -> usize {
    let out = pod.ns.command("iptables-save").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("ISTIO"))
        .count()
}

#[test]
fn pods_created_through_the_cni_chain_are_meshed_by_the_shared_proxy() {
    let mut node = Node::start("node", "namespaces:default");
    let conflist = node.conflist();
    assert_eq!(
        conflist["plugins"].as_array().unwrap().last().unwrap()["type"],
        "ambit-cni",
        "agent appended its entry"
    );
    assert!(
        node.bin_dir.join("ambit-cni").exists(),
        "agent installed the plugin binary"
    );

    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    assert!(
        istio_rules(&client) > 0 && istio_rules(&server) > 0,
        "enrolled pods have the in-pod rules"
    );
    let echo = EchoServer::start(&server, 8080).unwrap();
    let payload = vec![9u8; 500_000];
    let mut conn = connect_from(&client, echo.addr).unwrap();
    assert_eq!(echo_roundtrip(&mut conn, &payload).unwrap(), payload);
    std::thread::sleep(Duration::from_millis(200));
    let m = node.metrics();
    let line = m
        .lines()
        .find(|l| {
            l.starts_with("istio_tcp_sent_bytes_total{reporter=\"source\"")
                && l.contains("connection_security_policy=\"mutual_tls\"")
        })
        .unwrap_or_else(|| panic!("no mTLS traffic in metrics:\n{m}\n{}", node.log()));
    assert!(
        line.contains("source_principal=\"spiffe://cluster.local/ns/default/sa/client-sa\"")
            && line.ends_with(" 500000"),
        "{line}"
    );
    let dump = http_get_in(&node.lab.node, "127.0.0.1:15000", "/config_dump")
        .unwrap()
        .1;
    assert!(
        dump.contains("uid-client") && dump.contains("uid-server"),
        "{dump}"
    );

    // A pod the rule does not select starts normally and is left alone.
    let other = node.add_pod("other", "kube-system").unwrap();
    assert_eq!(istio_rules(&other), 0, "excluded pod must have no rules");

    // A deleted pod (its netns gone) is removed from the proxy.
    let _ = Command::new("ip")
        .args(["netns", "del", &server.netns_name])
        .status();
    let deadline = Instant::now() + Duration::from_secs(5);
    while http_get_in(&node.lab.node, "127.0.0.1:15000", "/config_dump")
        .unwrap()
        .1
        .contains("uid-server")
    {
        assert!(Instant::now() < deadline, "deleted pod still served");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn agent_down_fails_enrolled_adds_closed_and_garbage_gets_a_cni_error() {
    let mut node = Node::start_with("down", "namespaces:default", false);
    node.lab.stop("agent");
    // The conflist entry is removed on a clean stop; put it back as if the agent had crashed.
    let run_dir = node.dir.join("run");
    let mut conflist = node.conflist();
    conflist["plugins"].as_array_mut().unwrap().push(serde_json::json!({"type": "ambit-cni", "name": "ambit-cni", "cni_agent_run_dir": run_dir, "exclude_namespaces": ["kube-system"]}));
    std::fs::write(
        node.conf_dir.join("10-meshnet.conflist"),
        conflist.to_string(),
    )
    .unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_ambit"), node.bin_dir.join("ambit-cni")).unwrap();

    let err = node.add_pod("victim", "default").unwrap_err();
    assert!(
        err.contains("\"code\":100")
            && err.contains("default/victim")
            && err.contains("is the Ambit agent running?"),
        "{err}"
    );
    let ok = node.add_pod("system", "kube-system");
    assert!(ok.is_ok(), "excluded pods still start: {ok:?}");

    let out = Command::new(node.bin_dir.join("ambit-cni"))
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", "x")
        .env("CNI_NETNS", "/nonexistent")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/usr/lib/cni")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(b"{not json")?;
            c.wait_with_output()
        })
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("stdout must be CNI error JSON ({e}): {text}"));
    assert_eq!(v["code"], 6, "{text}");
}

#[test]
fn proxy_restart_keeps_new_connections_flowing() {
    let mut node = Node::start_with("prestart", "all", false);
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    let mut long_lived = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip_keep(&mut long_lived, b"before"),
        Some(b"before".to_vec())
    );

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s2, c2, target) = (stop.clone(), client.clone(), echo.addr);
    let traffic = std::thread::spawn(move || {
        let (mut ok, mut failed) = (0, Vec::new());
        while !s2.load(std::sync::atomic::Ordering::Relaxed) {
            match connect_from(&c2, target).and_then(|mut c| echo_roundtrip(&mut c, b"ping")) {
                Ok(b) if b == b"ping" => ok += 1,
                other => failed.push(format!("{other:?}")),
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        (ok, failed)
    });
    std::thread::sleep(Duration::from_millis(300));
    // The new proxy starts beside the old one (SO_REUSEPORT) and takes the pods from the agent.
    let mut cmd = node.command("proxy");
    cmd.env("AMBIT_ADMIN_ADDR", "127.0.0.1:16000")
        .env("AMBIT_METRICS_ADDR", "127.0.0.1:16020")
        .env("AMBIT_READINESS_ADDR", "127.0.0.1:16021");
    node.lab.spawn("proxy2", cmd).unwrap();
    node.wait_ready("127.0.0.1:16021", "/healthz/ready");
    assert!(
        node.dump("127.0.0.1:16000").contains("uid-client"),
        "new proxy serves the pods"
    );
    std::thread::sleep(Duration::from_millis(300));
    node.lab.stop("proxy");
    std::thread::sleep(Duration::from_millis(700));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = traffic.join().unwrap();
    assert!(ok > 20, "only {ok} connections succeeded");
    assert!(
        failed.is_empty(),
        "{} of {} new connections failed during the restart: {:?}",
        failed.len(),
        ok + failed.len(),
        &failed[..failed.len().min(3)]
    );
    // The connection carried by the old proxy ends; it does not hang.
    let t = Instant::now();
    let _ = echo_roundtrip_keep(&mut long_lived, b"after");
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "long-lived connection hung"
    );
}

/// Writes `msg` and reads as many bytes back, keeping the connection open.
fn echo_roundtrip_keep(s: &mut std::net::TcpStream, msg: &[u8]) -> Option<Vec<u8>> {
    use std::io::{Read, Write};
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    s.write_all(msg).ok()?;
    let mut buf = vec![0u8; msg.len()];
    s.read_exact(&mut buf).ok()?;
    Some(buf)
}

#[test]
fn agent_restart_re_adds_nothing_and_drops_pods_deleted_meanwhile() {
    let mut node = Node::start_with("arestart", "all", false);
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let added = |n: &Node| n.log().matches("pod added").count();
    assert_eq!(added(&node), 2, "{}", node.log());

    node.lab.stop("agent");
    let _ = Command::new("ip")
        .args(["netns", "del", &server.netns_name])
        .status();
    node.lab.spawn("agent", node.command("agent")).unwrap();
    node.wait_ready("127.0.0.1:8000", "/readyz");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let dump = node.dump("127.0.0.1:15000");
        if dump.contains("uid-client")
            && !dump.contains("uid-server")
            && node.log().contains("ZDS snapshot applied")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "proxy did not resync: {dump}\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        added(&node),
        2,
        "no pod may be re-added after an agent restart:\n{}",
        node.log()
    );
    // The surviving pod still has its traffic carried.
    let outsider = EchoServer::start(&client, 9090).unwrap();
    let mut c = connect_from(&client, outsider.addr).unwrap();
    assert_eq!(echo_roundtrip(&mut c, b"alive").unwrap(), b"alive");
}

#[test]
fn cross_node_traffic_is_hbone_between_two_nodes() {
    let mesh = "workloads:\n- {name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"10.78.0.2\"], protocol: HBONE}\n- {name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"10.79.0.2\"], protocol: HBONE}\n";
    let mut a = Node::start_full("twoa", "all", true, "10.78.0", mesh, None);
    let mut b = Node::start_full("twob", "all", true, "10.79.0", mesh, Some(&a));
    // Route the two nodes to each other over a veth pair.
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
    for (n, dst, via) in [
        (&na, "10.79.0.0/24", "10.99.0.2"),
        (&nb, "10.78.0.0/24", "10.99.0.1"),
    ] {
        ip(&["-n", n, "route", "add", dst, "via", via]);
        assert!(Command::new("ip")
            .args(["netns", "exec", n, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            .status()
            .unwrap()
            .success());
    }
    let client = a.add_pod("client", "default").unwrap();
    let server = b.add_pod("server", "default").unwrap();
    assert_eq!(server.ip.to_string(), "10.79.0.2");
    let echo = EchoServer::start(&server, 8080).unwrap();
    let payload = vec![3u8; 200_000];
    let mut conn = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut conn, &payload).unwrap(),
        payload,
        "{}\n{}",
        a.log(),
        b.log()
    );
    std::thread::sleep(Duration::from_millis(200));
    let mb = b.metrics();
    assert!(
        mb.lines().any(|l| l
            .starts_with("istio_tcp_received_bytes_total{reporter=\"destination\"")
            && l.contains("source_principal=\"spiffe://cluster.local/ns/default/sa/client-sa\"")
            && l.contains("connection_security_policy=\"mutual_tls\"")),
        "node B's proxy must see the client's identity over mTLS:\n{mb}"
    );
}
