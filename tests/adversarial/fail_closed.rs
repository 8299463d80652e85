//! Fail closed where ztunnel does: an unknown own workload, plaintext to
//! an address that is not the pod's.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ambit::lab::{connect_from, echo_roundtrip, EchoServer, LabPod, ProxySpec};

use crate::common::{admin_get, counter, wait_until, workload, Mesh, TD};

/// Long enough for a loaded machine; the waits end as soon as the state is there.
const SETTLE: Duration = Duration::from_secs(10);

/// Sends `msg` from `pod` to `dst` and returns what came back (nothing when
/// the connection was refused or closed unserved).
fn roundtrip(pod: &LabPod, dst: SocketAddr, msg: &[u8]) -> Vec<u8> {
    connect_from(pod, dst)
        .and_then(|mut c| echo_roundtrip(&mut c, msg))
        .unwrap_or_default()
}

/// Runs `ip` inside `pod`; panics if it fails.
fn ip_in(pod: &LabPod, args: &[&str]) {
    let out = pod.ns.command("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?} in {}: {}",
        pod.name,
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---------------------------------------------------------------------------
// Fail closed (issue #18, item 7): what ztunnel refuses, Ambit refuses.
// ---------------------------------------------------------------------------

/// Meshes `pod` as `default/<name>/<sa>` with its own local config file
/// (`yaml`), apart from the mesh's shared one.
fn mesh_with_own_config(m: &Mesh, pod: &LabPod, sa: &str, yaml: &str) -> PathBuf {
    let config = m.lab.dir.join(format!("{}.yaml", pod.name));
    std::fs::write(&config, yaml).unwrap();
    m.lab.redirect(pod).unwrap();
    let spec = ProxySpec {
        config: config.clone(),
        ca_cert: m.ca.0.clone(),
        ca_key: m.ca.1.clone(),
        workload_info: format!("default/{}/{sa}", pod.name),
        trust_domain: TD.into(),
        extra_env: vec![],
    };
    m.lab.start_proxy(pod, &spec).unwrap();
    config
}

/// The pod's proxy holds the workload named `name` in its state.
fn holds(pod: &LabPod, name: &str) -> bool {
    admin_get(&pod.ns, "127.0.0.1:15000", "/config_dump").contains(&format!("\"name\":\"{name}\""))
}

#[test]
fn a_pod_whose_own_workload_is_not_known_yet_accepts_nothing_until_it_is() {
    let mut m = Mesh::new("unknowndst");
    let (client, server, outsider) = (m.pod("client"), m.pod("server"), m.pod("outsider"));
    let both = format!(
        "workloads:\n{}{}",
        workload(&client, "client-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE")
    );
    // The client knows the server (so it speaks HBONE to it); the server's
    // own proxy does not know its own workload yet, and no policy exists
    // anywhere: before, namespace policies alone (none) allowed everything.
    m.write_config(&both);
    m.mesh(&client, "client-sa");
    let only_client = format!("workloads:\n{}", workload(&client, "client-sa", "HBONE"));
    let server_config = mesh_with_own_config(&m, &server, "server-sa", &only_client);
    let echo = EchoServer::start(&server, 8080).unwrap();

    // Over HBONE and in plaintext at once (each waits out the proxy's 5 s
    // for the workload to arrive, as ztunnel's does).
    let over_hbone = {
        let (client, dst) = (client.clone(), echo.addr);
        std::thread::spawn(move || roundtrip(&client, dst, b"early"))
    };
    let in_plaintext = roundtrip(&outsider, echo.addr, b"early");
    let over_hbone = over_hbone.join().unwrap();
    assert!(
        over_hbone.is_empty() && in_plaintext.is_empty(),
        "refused, carrying nothing: {over_hbone:?} {in_plaintext:?}"
    );
    assert!(echo.peers().is_empty(), "the application saw nothing");
    wait_until("both denials counted by the server", SETTLE, || {
        counter(
            &m.metrics(&server),
            "istio_tcp_connections_opened_total",
            &[("reporter", "destination"), ("response_flags", "DENY")],
        ) == 2
    });
    let log = m.proxy_log(&server);
    assert!(
        log.contains("destination workload not in the mesh state"),
        "{log}"
    );
    wait_until("the 503 in the client proxy's log", SETTLE, || {
        m.proxy_log(&client).contains("status 503")
    });

    // A connection that arrives just before the workload waits for it: the
    // state changes while it waits, and it is carried.
    let mut waiting = connect_from(&outsider, echo.addr).unwrap();
    std::fs::write(&server_config, &both).unwrap();
    assert_eq!(
        echo_roundtrip(&mut waiting, b"in time").unwrap(),
        b"in time"
    );
    assert!(holds(&server, "server"));
    assert_eq!(roundtrip(&client, echo.addr, b"known"), b"known");
    assert_eq!(echo.peers().len(), 2);
}

#[test]
fn plaintext_to_an_address_that_is_not_the_pods_is_closed() {
    let mut m = Mesh::new("notmine");
    let (server, outsider) = (m.pod("server"), m.pod("outsider"));
    m.write_config(&format!(
        "workloads:\n{}",
        workload(&server, "server-sa", "HBONE")
    ));
    m.mesh(&server, "server-sa");
    let echo = EchoServer::start(&server, 8080).unwrap();
    // An address inside the server's netns that the mesh does not know as
    // the pod's, which the outsider routes through the server's pod. The
    // capture rules take any destination to 15006; a proxy that dialled
    // the original destination would hand the connection to whatever
    // listens there, from inside the pod, with the proxy's mark.
    let other = "10.77.0.200";
    ip_in(
        &server,
        &["addr", "add", &format!("{other}/32"), "dev", "lo"],
    );
    ip_in(
        &outsider,
        &[
            "route",
            "add",
            &format!("{other}/32"),
            "via",
            &server.ip.to_string(),
        ],
    );

    assert_eq!(
        roundtrip(&outsider, echo.addr, b"to the pod"),
        b"to the pod",
        "the pod's own address is served"
    );
    let elsewhere: SocketAddr = format!("{other}:8080").parse().unwrap();
    assert!(
        roundtrip(&outsider, elsewhere, b"relay me").is_empty(),
        "closed, carrying nothing"
    );
    assert_eq!(
        echo.peers().len(),
        1,
        "only the connection to the pod's address reached the application"
    );
    wait_until("the refusal in the server proxy's log", SETTLE, || {
        m.proxy_log(&server)
            .contains("plaintext connection to an address that is not this pod's refused")
    });
    let log = m.proxy_log(&server);
    assert!(log.contains(&format!("dst.addr={elsewhere}")), "{log}");
}

// ---------------------------------------------------------------------------
// No self calls (issue #44, item 1): a pod cannot loop the proxy.
// ---------------------------------------------------------------------------

/// Open descriptors of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn a_pods_call_to_the_proxys_own_ports_is_refused_and_cannot_loop_the_shared_proxy() {
    let mut node = ambit::lab::node::Node::start_with(
        env!("CARGO_BIN_EXE_ambit"),
        "selfcall",
        "namespaces:default",
        false,
    );
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    wait_until("the honest pod is served", SETTLE, || {
        roundtrip(&client, echo.addr, b"hi") == b"hi"
    });
    let pid = node.lab.pid("proxy").expect("the shared proxy runs");
    let before = open_fds(pid);

    // An unprivileged process in the pod calls the proxy's own ports, on
    // loopback and on the pod's address, 10 times each: before, one such
    // connect() looped the proxy into thousands of passthroughs.
    let targets: Vec<String> = ["127.0.0.1:15001", "127.0.0.1:15006", "127.0.0.1:15008"]
        .iter()
        .map(|t| t.to_string())
        .chain(
            [15001, 15006, 15008]
                .iter()
                .map(|p| format!("{}:{p}", client.ip)),
        )
        .collect();
    let script = format!(
        r#"
import socket
served = 0
for t in {targets:?}:
    host, port = t.rsplit(":", 1)
    for _ in range(10):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.settimeout(5)
        try:
            s.sendall(b"loop?" * 100)
            served += len(s.recv(100))
        except OSError:
            pass
        s.close()
print(served)
"#
    );
    let out = client
        .ns
        .command("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
        ])
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0",
        "no self call is served"
    );
    // Each outbound self call is refused at once, logged and counted once:
    // 20 for 15001 (loopback and the pod's address; 15006 and 15008 are
    // not captured as outbound, and refuse on their own).
    crate::common::wait_until_showing(
        "the outbound self calls logged",
        SETTLE,
        || node.log().matches("route=\"self-call\"").count() == 20,
        || node.log(),
    );
    // The proxy's descriptors are back where they were: nothing loops.
    wait_until("the proxy's descriptors flat", SETTLE, || {
        open_fds(pid) <= before + 4
    });
    // Nothing went on behind them: no passthrough, no self call beyond
    // the 20 sent.
    let log = node.log();
    assert_eq!(log.matches("route=\"passthrough\"").count(), 0, "{log}");
    assert_eq!(log.matches("route=\"self-call\"").count(), 20, "{log}");
    assert_eq!(roundtrip(&client, echo.addr, b"still"), b"still");
}

// ---------------------------------------------------------------------------
// Policy fails closed (issue #44, item 5).
// ---------------------------------------------------------------------------

#[test]
fn a_workload_naming_a_policy_not_held_is_denied_until_it_arrives() {
    let mut m = Mesh::new("latepolicy");
    let (client, server) = (m.pod("client"), m.pod("server"));
    let mesh = |policies: &str| {
        format!(
            "workloads:\n{}- {{uid: server, name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{}\"], protocol: HBONE, authorizationPolicies: [default/late]}}\npolicies: {policies}\n",
            workload(&client, "client-sa", "HBONE"),
            server.ip
        )
    };
    // The workload names a policy the proxy does not hold, and no other
    // policy exists: before, "no ALLOW policy" allowed everything.
    m.write_config(&mesh("[]"));
    m.mesh(&client, "client-sa");
    m.mesh(&server, "server-sa");
    let echo = EchoServer::start(&server, 8080).unwrap();
    for _ in 0..3 {
        assert!(roundtrip(&client, echo.addr, b"early").is_empty());
    }
    assert!(echo.peers().is_empty(), "nothing reached the application");
    crate::common::wait_until_showing(
        "the server's proxy logs the denial with the missing policy",
        SETTLE,
        || {
            m.proxy_log(&server)
                .lines()
                .any(|l| l.contains("default/late (refused: named by the workload but not held"))
        },
        || m.proxy_log(&server),
    );
    // The policy arrives (an ALLOW for the client): served.
    m.write_config(&mesh(
        "[{name: late, namespace: default, scope: WorkloadSelector, action: Allow, rules: [[[{principals: [!Exact cluster.local/ns/default/sa/client-sa]}]]]}]",
    ));
    wait_until("served once the policy arrives", SETTLE, || {
        roundtrip(&client, echo.addr, b"late") == b"late"
    });
}
