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
}

const SUBNET: &str = "10.78.0";

impl Node {
    fn start(tag: &str, enroll: &str) -> Node {
        let lab = Lab::new(tag, env!("CARGO_BIN_EXE_ambit")).unwrap();
        let dir = lab.dir.clone();
        let (bin_dir, conf_dir) = (dir.join("cni-bin"), dir.join("net.d"));
        std::fs::create_dir_all(&conf_dir).unwrap();
        let conflist = serde_json::json!({
            "cniVersion": "1.0.0", "name": "meshnet",
            "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
                "ipam": {"type": "host-local", "dataDir": dir.join("ipam"), "ranges": [[{"subnet": format!("{SUBNET}.0/24")}]],
                         "routes": [{"dst": "0.0.0.0/0"}]}}]
        });
        std::fs::write(conf_dir.join("10-meshnet.conflist"), conflist.to_string()).unwrap();
        let (ca_cert, ca_key) = ambit::lab::write_ca(&dir, "ca", "cluster.local").unwrap();
        // host-local hands out .2, .3, ... in order: name the pods' service accounts up front.
        let mesh = format!(
            "workloads:\n- {{name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"{SUBNET}.2\"], protocol: HBONE}}\n- {{name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{SUBNET}.3\"], protocol: HBONE}}\n"
        );
        std::fs::write(dir.join("mesh.yaml"), mesh).unwrap();
        let mut cmd = lab.node.command(env!("CARGO_BIN_EXE_ambit"));
        cmd.arg("node")
            .env("CNI_BIN_DIR", &bin_dir)
            .env("CNI_NET_DIR", &conf_dir)
            .env("CNI_AGENT_RUN_DIR", dir.join("run"))
            .env("ZTUNNEL_UDS_ADDRESS", dir.join("zds.sock"))
            .env("INPOD_UDS", dir.join("zds.sock"))
            .env("AMBIT_AGENT_STATE", dir.join("agent-state.json"))
            .env("AMBIT_AGENT_READINESS_ADDR", "127.0.0.1:8000")
            .env("AMBIT_ENROLL", enroll)
            .env("LOCAL_XDS_PATH", dir.join("mesh.yaml"))
            .env("PROXY_MODE", "shared")
            .env("AMBIT_CA_CERT", &ca_cert)
            .env("AMBIT_CA_KEY", &ca_key)
            .env("AMBIT_STATE_DIR", dir.join("state"));
        lab.spawn("node", cmd).unwrap();
        let node = Node {
            lab,
            dir,
            bin_dir,
            conf_dir,
            pods: Vec::new(),
        };
        node.wait_ready("127.0.0.1:8000", "/readyz");
        node.wait_ready("127.0.0.1:15021", "/healthz/ready");
        node
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
        std::fs::read_to_string(self.lab.log_path("node")).unwrap_or_default()
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
        self.lab.stop("node");
        for p in &self.pods {
            let _ = Command::new("ip").args(["netns", "del", p]).status();
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
    let mut node = Node::start("down", "namespaces:default");
    node.lab.stop("node");
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
