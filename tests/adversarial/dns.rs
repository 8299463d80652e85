//! DNS answers one pod can forge (issue #44, item 3): a hostname endpoint
//! is resolved from the proxy's own netns, never from inside a pod.

use std::net::SocketAddr;
use std::time::Duration;

use ambit::lab::node::Node;
use ambit::lab::{connect_from, echo_roundtrip, EchoServer, LabPod};

use crate::common::wait_until;

const SETTLE: Duration = Duration::from_secs(10);

/// A subnet no other test uses.
const SUBNET: &str = "10.88.0";

/// Runs dnsmasq in `ns` on `{SUBNET}.1:53`, answering `api.external.example`
/// with `answer` for `ttl` seconds and logging each query to `label`'s log.
fn dnsmasq(node: &Node, ns: &ambit::netns::Netns, label: &str, answer: &str, ttl: u32) {
    let mut cmd = ns.command("dnsmasq");
    cmd.args([
        "--no-daemon",
        "--no-resolv",
        "--no-hosts",
        "--bind-interfaces",
        "--port=53",
        "--log-queries",
        "--log-facility=-",
    ])
    .arg(format!("--listen-address={SUBNET}.1"))
    .arg(format!("--address=/api.external.example/{answer}"))
    .arg(format!("--local-ttl={ttl}"))
    .arg(format!(
        "--pid-file={}",
        node.dir.join(format!("{label}.pid")).display()
    ));
    node.lab.spawn(label, cmd).unwrap();
    wait_until(&format!("{label} listening"), SETTLE, || {
        ns.command("ss")
            .args(["-Hlun", "src", &format!("{SUBNET}.1:53")])
            .output()
            .is_ok_and(|o| !o.stdout.is_empty())
    });
}

fn queries(node: &Node, label: &str) -> usize {
    std::fs::read_to_string(node.lab.log_path(label))
        .unwrap_or_default()
        .matches("query[A] api.external.example")
        .count()
}

fn roundtrip(pod: &LabPod, dst: SocketAddr, msg: &[u8]) -> Vec<u8> {
    connect_from(pod, dst)
        .and_then(|mut c| echo_roundtrip(&mut c, msg))
        .unwrap_or_default()
}

#[test]
fn a_pod_that_answers_its_own_dns_cannot_send_other_pods_hostname_connections_to_itself() {
    // Service `api` is a DNS ServiceEntry: its one endpoint is the hostname
    // api.external.example, resolved when a connection needs it. The
    // node's resolver says it is the server pod.
    let mesh = format!(
        "workloads:\n\
        - {{name: victim, namespace: default, serviceAccount: victim-sa, workloadIps: [\"{SUBNET}.2\"], protocol: HBONE}}\n\
        - {{name: attacker, namespace: default, serviceAccount: attacker-sa, workloadIps: [\"{SUBNET}.3\"], protocol: HBONE}}\n\
        - {{name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{SUBNET}.4\"], protocol: HBONE}}\n\
        - {{uid: ext, name: ext, namespace: default, hostname: api.external.example, protocol: TCP, services: {{\"default/api.external.example\": {{80: 8080}}}}}}\n\
        services:\n\
        - {{name: api, namespace: default, hostname: api.external.example, vips: [\"/10.96.0.20\"], ports: {{80: 8080}}}}\n"
    );
    // A node with a separate agent and shared proxy.
    let mut node = Node::start_full(
        env!("CARGO_BIN_EXE_ambit"),
        "dnsforge",
        "all",
        false,
        SUBNET,
        &mesh,
        None,
    );
    let victim = node.add_pod("victim", "default").unwrap();
    let attacker = node.add_pod("attacker", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let real = EchoServer::start(&server, 8080).unwrap();
    let fake = EchoServer::start(&attacker, 8080).unwrap();
    dnsmasq(
        &node,
        &node.lab.node,
        "resolver",
        &server.ip.to_string(),
        30,
    );

    // The attacker answers its own DNS: the resolver's address on its own
    // loopback, and a resolver there that names the attacker, for 300 s.
    let out = attacker
        .ns
        .command("ip")
        .args(["addr", "add", &format!("{SUBNET}.1/32"), "dev", "lo"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dnsmasq(&node, &attacker.ns, "forger", &attacker.ip.to_string(), 300);

    // The attacker asks first, so a resolution made from its netns would be
    // the one the proxy keeps for every pod.
    let vip: SocketAddr = "10.96.0.20:80".parse().unwrap();
    assert_eq!(
        roundtrip(&attacker, vip, b"first"),
        b"first",
        "{}",
        node.log()
    );
    for i in 0..3 {
        let msg = format!("victim-{i}");
        assert_eq!(roundtrip(&victim, vip, msg.as_bytes()), msg.as_bytes());
    }
    // Every connection reached the server the node's resolver names; the
    // forged resolver was never asked, the attacker's server never called.
    wait_until("the server saw all four connections", SETTLE, || {
        real.peers().len() == 4
    });
    assert!(
        fake.peers().is_empty(),
        "sent to the attacker: {:?}",
        fake.peers()
    );
    assert_eq!(queries(&node, "forger"), 0, "the pod's resolver was asked");
    assert_eq!(
        queries(&node, "resolver"),
        1,
        "the node's resolver, once, then the cache"
    );
}
