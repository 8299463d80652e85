//! Least privilege (issue #44, item 9): the shared proxy runs with exactly
//! the capabilities its DaemonSet grants (`deploy/manifests/ambit.yaml`,
//! which the chart renders to) and with `no_new_privs` set, as
//! `allowPrivilegeEscalation: false` makes the kubelet do, and serves
//! everything: setns into pods, marked sockets, the caller's address kept
//! (`IP_TRANSPARENT`). With any one of them taken away it refuses to start
//! and names what it lacks.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use ambit::lab::node::Node;
use ambit::lab::{connect_from, echo_roundtrip, EchoServer};
use serde_yaml::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ambit");

/// A subnet no other test uses.
const SUBNET: &str = "10.90.0";

/// The proxy container's added capabilities and `allowPrivilegeEscalation`.
fn proxy_container() -> (Vec<String>, Option<bool>) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/manifests/ambit.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let doc = Value::deserialize(doc).unwrap();
        let Some(containers) = doc["spec"]["template"]["spec"]["containers"].as_sequence() else {
            continue;
        };
        for c in containers {
            if c["name"].as_str() == Some("proxy") {
                let sc = &c["securityContext"];
                let caps = sc["capabilities"]["add"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_string())
                    .collect();
                return (caps, sc["allowPrivilegeEscalation"].as_bool());
            }
        }
    }
    panic!("no proxy container in the manifests");
}

use serde::Deserialize;

/// The bit of each capability the manifests may name (capability.h).
fn bit(cap: &str) -> u32 {
    match cap {
        "DAC_OVERRIDE" => 1,
        "NET_ADMIN" => 12,
        "NET_RAW" => 13,
        "SYS_PTRACE" => 19,
        "SYS_ADMIN" => 21,
        other => panic!("a capability this test does not know: {other}"),
    }
}

/// `setpriv` arguments that leave a root process `caps` and nothing else,
/// with `no_new_privs`, as a container runtime does.
fn setpriv(caps: &[String]) -> Vec<String> {
    let keep: String = caps
        .iter()
        .map(|c| format!(",+{}", c.to_lowercase()))
        .collect();
    vec![
        "setpriv".into(),
        "--no-new-privs".into(),
        format!("--bounding-set=-all{keep}"),
        "--inh-caps=-all".into(),
        "--".into(),
    ]
}

/// `CapEff` and `NoNewPrivs` of a process.
fn privileges(pid: u32) -> (u64, bool) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap()
            .trim()
            .to_string()
    };
    (
        u64::from_str_radix(&field("CapEff:"), 16).unwrap(),
        field("NoNewPrivs:") == "1",
    )
}

#[test]
fn the_shared_proxy_serves_with_only_the_capabilities_its_manifest_grants() {
    let (caps, escalation) = proxy_container();
    assert_eq!(
        escalation,
        Some(false),
        "the proxy container must not allow privilege escalation"
    );
    let mesh = format!(
        "workloads:\n\
        - {{name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"{SUBNET}.2\"], protocol: HBONE}}\n\
        - {{name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{SUBNET}.3\"], protocol: HBONE}}\n"
    );
    let mut node = Node::prepare(BIN, "leastpriv", "namespaces:default", SUBNET, &mesh, None);
    node.lab.spawn("agent", node.command("agent")).unwrap();
    let wrapper = setpriv(&caps);
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    node.lab
        .spawn("proxy", node.command_through("proxy", &wrapper))
        .unwrap();
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");

    // The proxy holds these capabilities and no other, and cannot gain any.
    let pid = node.lab.pid("proxy").unwrap();
    let (effective, no_new_privs) = privileges(pid);
    let wanted = caps.iter().fold(0u64, |m, c| m | 1 << bit(c));
    assert_eq!(
        effective, wanted,
        "CapEff {effective:#x}, the manifest's {wanted:#x}"
    );
    assert!(no_new_privs);

    // And serves: the pods' connections over HBONE, into the server's netns
    // (setns), with the client's address as source (IP_TRANSPARENT).
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    let dst: SocketAddr = echo.addr;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let back = connect_from(&client, dst).and_then(|mut c| echo_roundtrip(&mut c, b"hi"));
        if back.is_ok_and(|b| b == b"hi") {
            break;
        }
        assert!(Instant::now() < deadline, "not served: {}", node.log());
    }
    assert!(
        echo.peers()
            .iter()
            .all(|p| p.ip() == std::net::IpAddr::V4(client.ip)),
        "the server sees the client's own address: {:?}",
        echo.peers()
    );
    let log = node.log();
    assert!(
        !log.contains("Operation not permitted") && !log.contains("EPERM"),
        "{log}"
    );

    // With any one capability fewer, the proxy does not start, and says why.
    for missing in &caps {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != missing).cloned().collect();
        let wrapper = setpriv(&fewer);
        let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
        let mut cmd = node.command_through("proxy", &wrapper);
        // Apart from the running proxy: its own admin and readiness ports.
        cmd.env("AMBIT_ADMIN_ADDR", "127.0.0.1:25000")
            .env("AMBIT_READINESS_ADDR", "127.0.0.1:25021")
            .env("AMBIT_METRICS_ADDR", "127.0.0.1:25020")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("a proxy without {missing} kept running");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "a proxy without {missing} started");
        assert!(
            err.contains(&format!("CAP_{missing}")),
            "without {missing}: {err}"
        );
    }
}
