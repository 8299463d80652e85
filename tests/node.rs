//! End-to-end: a node — `ambit node` (agent + shared proxy) inside a node
//! netns, pods created by running the conflist chain (reference bridge +
//! host-local, then ambit-cni installed by the agent) exactly as a container
//! runtime does.

mod common;

use std::io::{Read, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use ambit::lab::node::{Node, RulesMode};

const BIN: &str = env!("CARGO_BIN_EXE_ambit");
use std::net::SocketAddr;

use ambit::lab::{
    close_first_echo, connect_from, echo_roundtrip, established, iptables_save, istio_rules,
    pod_uid, set_default_congestion_control, short_connections, stdout_in, time_waits, EchoServer,
    Ends, LabPod,
};
use common::node::{assert_rules_in, probe_entries};
use common::{admin_get, counter, wait_until};

/// Long enough for a loaded machine; the waits end as soon as the state is there.
const SETTLE: Duration = Duration::from_secs(10);

#[test]
fn pods_created_through_the_cni_chain_are_meshed_by_the_shared_proxy() {
    meshed_through_the_cni_chain(RulesMode::Iptables);
}

/// The same node with its rules in nftables, on a `PATH` without iptables.
#[test]
fn with_the_rules_in_nftables_pods_created_through_the_cni_chain_are_meshed() {
    meshed_through_the_cni_chain(RulesMode::Nftables);
}

fn meshed_through_the_cni_chain(mode: RulesMode) {
    let tag = match mode {
        RulesMode::Iptables => "node",
        RulesMode::Nftables => "nodenft",
    };
    let mut node = Node::start_in(BIN, tag, "namespaces:default", true, mode);
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
    assert_rules_in(&node, mode, &[&client, &server]);
    let echo = EchoServer::start(&server, 8080).unwrap();
    // A capture on the node's bridge proves the pods' traffic is HBONE on the wire.
    let pcap = node.dir.join("bridge.pcap");
    let mut cmd = node.lab.node.command("tcpdump");
    cmd.args(["-i", "cni0", "-U", "-s", "0", "-w"]).arg(&pcap);
    node.lab.spawn("tcpdump", cmd).unwrap();
    wait_until("tcpdump listening on cni0", SETTLE, || {
        std::fs::read_to_string(node.lab.log_path("tcpdump"))
            .unwrap_or_default()
            .contains("listening on")
    });
    let payload = b"AMBIT-NODE-PAYLOAD-5e1f".repeat(21_740);
    let mut conn = connect_from(&client, echo.addr).unwrap();
    assert_eq!(echo_roundtrip(&mut conn, &payload).unwrap(), payload);
    assert_eq!(
        echo.peers()[0].ip(),
        std::net::IpAddr::from(client.ip),
        "the app sees the real client address"
    );
    // The payload crossed the bridge twice (there and back), encrypted: the
    // whole transfer is in the file once it holds more than that.
    wait_until("the capture holding the transfer both ways", SETTLE, || {
        std::fs::metadata(&pcap).map_or(0, |f| f.len()) > 2 * payload.len() as u64
    });
    node.lab.stop("tcpdump");
    let raw = std::fs::read(&pcap).unwrap();
    assert!(raw.len() > payload.len(), "capture holds the transfer");
    assert!(
        !raw.windows(23).any(|w| w == b"AMBIT-NODE-PAYLOAD-5e1f"),
        "payload seen in clear on the bridge"
    );
    let tls = Command::new("tcpdump")
        .args(["-nn", "-r"])
        .arg(&pcap)
        .arg("tcp dst port 15008 and tcp[((tcp[12:1] & 0xf0) >> 2):1] = 0x16")
        .output()
        .unwrap();
    assert!(
        !tls.stdout.is_empty(),
        "TLS handshake to 15008 on the bridge"
    );
    // Bytes are counted when the proxy closes the connection.
    let mtls_sent = |l: &str| {
        l.starts_with("istio_tcp_sent_bytes_total{reporter=\"source\"")
            && l.contains("connection_security_policy=\"mutual_tls\"")
    };
    wait_until("the client's mTLS bytes in the metrics", SETTLE, || {
        node.metrics()
            .lines()
            .any(|l| mtls_sent(l) && l.ends_with(&format!(" {}", payload.len())))
    });
    let m = node.metrics();
    let line = m
        .lines()
        .find(|l| mtls_sent(l))
        .unwrap_or_else(|| panic!("no mTLS traffic in metrics:\n{m}\n{}", node.log()));
    assert!(
        line.contains("source_principal=\"spiffe://cluster.local/ns/default/sa/client-sa\"")
            && line.ends_with(&format!(" {}", payload.len())),
        "{line}"
    );
    // The shared proxy's sockets in the pod carry its congestion control
    // (cubic by default); the application's keep the pod's (reno here).
    set_default_congestion_control(&client.ns, "reno").unwrap();
    let mut held = connect_from(&client, echo.addr).unwrap();
    held.write_all(b"x").unwrap();
    held.read_exact(&mut [0u8; 1]).unwrap();
    let conns = established(&client).unwrap();
    let (proxy, app): (Vec<_>, Vec<_>) = conns.iter().partition(|c| c.proxy);
    assert!(
        proxy.len() == 2
            && proxy.iter().all(|c| c.congestion_control == "cubic")
            && app.len() == 1
            && app[0].congestion_control == "reno",
        "{conns:?}"
    );
    // The dump lists the open connection on both pods, as ztunnel's
    // `workloadState.<uid>.connections` (istioctl ztunnel-config connections).
    let connections = |uid: &str| -> serde_json::Value {
        let dump: serde_json::Value = serde_json::from_str(&admin_get(
            &node.lab.node,
            "127.0.0.1:15000",
            "/config_dump",
        ))
        .unwrap();
        dump["workloadState"][uid]["connections"].clone()
    };
    let client_side = connections(&pod_uid("client"));
    assert_eq!(
        client_side["outbound"],
        serde_json::json!([{
            "src": held.local_addr().unwrap().to_string(),
            "originalDst": echo.addr.to_string(),
            "actualDst": echo.addr.to_string(),
            "protocol": "HBONE",
        }]),
        "{client_side}"
    );
    assert_eq!(client_side["inbound"], serde_json::json!([]));
    let server_side = connections(&pod_uid("server"));
    let inbound = &server_side["inbound"][0];
    assert!(
        server_side["inbound"].as_array().unwrap().len() == 1
            && inbound["actualDst"] == echo.addr.to_string()
            && inbound["protocol"] == "HBONE"
            && inbound["src"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{}:", client.ip)),
        "{server_side}"
    );
    drop(held);
    wait_until(
        "the closed connection unlisted on both pods",
        SETTLE,
        || {
            connections(&pod_uid("client"))["outbound"] == serde_json::json!([])
                && connections(&pod_uid("server"))["inbound"] == serde_json::json!([])
        },
    );
    let agent_metrics = || admin_get(&node.lab.node, "127.0.0.1:15014", "/metrics");
    let wanted = [
        "istio_cni_plugin_requests_total{response_code=\"200\"} 2",
        "istio_cni_install_ready 1",
        "ztunnel_connected 1",
        "nodeagent_reconcile_events_total{type=\"add\"} 2",
    ];
    wait_until("the agent's metrics", SETTLE, || {
        let am = agent_metrics();
        wanted.iter().all(|want| am.contains(want))
    });
    let am = agent_metrics();
    for want in wanted {
        assert!(am.contains(want), "agent metrics lack {want}:\n{am}");
    }
    let dump = admin_get(&node.lab.node, "127.0.0.1:15000", "/config_dump");
    assert!(
        dump.contains(&pod_uid("client")) && dump.contains(&pod_uid("server")),
        "{dump}"
    );

    // Kubelet-style probe from the node: SNATed to 169.254.7.127 by the host
    // rule (the pod's IP is in the probe set) and not captured in the pod.
    let sets = probe_entries(&node, mode);
    assert_eq!(
        sets.get(&server.ip.to_string()),
        Some(&pod_uid("server")),
        "{sets:?}"
    );
    let probe = node
        .lab
        .node
        .run(move || std::net::TcpStream::connect((server.ip, 8080)))
        .unwrap();
    let mut probe = probe.unwrap();
    assert_eq!(echo_roundtrip(&mut probe, b"probe").unwrap(), b"probe");
    let probe_src = echo.peers().last().copied().unwrap();
    assert_eq!(
        probe_src.ip().to_string(),
        "169.254.7.127",
        "probe must arrive SNATed and uncaptured"
    );

    // A pod the rule does not select starts normally and is left alone.
    let other = node.add_pod("other", "kube-system").unwrap();
    assert_eq!(istio_rules(&other), 0, "excluded pod must have no rules");

    // A deleted pod (its sandbox and netns gone) is removed from the proxy.
    node.remove_pod(&server);
    wait_until("the deleted pod's probe set entry removed", SETTLE, || {
        !probe_entries(&node, mode).contains_key(&server.ip.to_string())
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    // Only a 200 answer counts: an error page lacks the pod too.
    while admin_get(&node.lab.node, "127.0.0.1:15000", "/config_dump").contains(&pod_uid("server"))
    {
        assert!(Instant::now() < deadline, "deleted pod still served");
        std::thread::sleep(Duration::from_millis(100));
    }
    let m = node.metrics();
    assert!(
        !m.lines().any(|l| l.contains("reporter=\"destination\"")
            && l.contains("destination_workload=\"server\"")),
        "a removed pod's series are dropped:\n{m}"
    );
    assert!(
        m.lines().any(|l| l.contains("source_workload=\"client\"")),
        "the remaining pod's series stay"
    );
}

#[test]
fn agent_down_fails_enrolled_adds_closed_and_garbage_gets_a_cni_error() {
    let mut node = Node::start_with(BIN, "down", "namespaces:default", false);
    // Another writer (the primary CNI) rewrites the conflist without our entry: repaired.
    let original = node.conflist();
    let mut stripped = original.clone();
    stripped["plugins"]
        .as_array_mut()
        .unwrap()
        .retain(|p| p["type"] != "ambit-cni");
    std::fs::write(
        node.conf_dir.join("10-meshnet.conflist"),
        stripped.to_string(),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while node.conflist()["plugins"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()["type"]
        != "ambit-cni"
    {
        assert!(Instant::now() < deadline, "conflist not repaired");
        std::thread::sleep(Duration::from_millis(50));
    }
    node.lab.stop("agent");
    // A clean stop uninstalls: entry and binary gone.
    assert!(
        !node.conflist()["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["type"] == "ambit-cni"),
        "entry removed on a clean stop"
    );
    assert!(
        !node.bin_dir.join("ambit-cni").exists(),
        "binary removed on a clean stop"
    );
    // Put them back as if the agent had crashed instead.
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
    let mut node = Node::start_with(BIN, "prestart", "all", false);
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    let mut long_lived = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip_keep(&mut long_lived, b"before", Duration::from_secs(3)).unwrap(),
        b"before".to_vec()
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
    // Pacing, not a wait for a state: the traffic runs through the old proxy
    // for a while first.
    std::thread::sleep(Duration::from_millis(300));
    // The new proxy starts beside the old one (SO_REUSEPORT) and takes the pods from the agent.
    let mut cmd = node.command("proxy");
    cmd.env("AMBIT_ADMIN_ADDR", "127.0.0.1:16000")
        .env("AMBIT_METRICS_ADDR", "127.0.0.1:16020")
        .env("AMBIT_READINESS_ADDR", "127.0.0.1:16021");
    node.lab.spawn("proxy2", cmd).unwrap();
    node.wait_ready("127.0.0.1:16021", "/healthz/ready");
    assert!(
        node.dump("127.0.0.1:16000").contains(&pod_uid("client")),
        "new proxy serves the pods"
    );
    // Fixed windows on purpose: no new connection may fail while both
    // proxies run, nor after the old one is gone; nothing to poll for.
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
    // The connection carried by the old proxy ends; it does not hang: the
    // read gets an answer, an end of stream or a reset, never the timeout.
    let after = echo_roundtrip_keep(&mut long_lived, b"after", Duration::from_secs(10));
    assert!(
        !matches!(&after, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        "long-lived connection hung: {after:?}"
    );
}

/// Writes `msg` and reads as many bytes back, keeping the connection open;
/// a read that waits longer than `limit` fails with a timeout.
fn echo_roundtrip_keep(
    s: &mut std::net::TcpStream,
    msg: &[u8],
    limit: Duration,
) -> std::io::Result<Vec<u8>> {
    use std::io::{Read, Write};
    s.set_read_timeout(Some(limit))?;
    s.write_all(msg)?;
    let mut buf = vec![0u8; msg.len()];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

#[test]
fn agent_restart_re_adds_nothing_and_drops_pods_deleted_meanwhile() {
    agent_restart(RulesMode::Iptables);
}

#[test]
fn with_the_rules_in_nftables_agent_restart_re_adds_nothing_and_drops_pods_deleted_meanwhile() {
    agent_restart(RulesMode::Nftables);
}

fn agent_restart(mode: RulesMode) {
    let tag = match mode {
        RulesMode::Iptables => "arestart",
        RulesMode::Nftables => "arestartnft",
    };
    let mut node = Node::start_in(BIN, tag, "all", false, mode);
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let added = |n: &Node| n.log().matches("pod added").count();
    assert_eq!(added(&node), 2, "{}", node.log());

    node.lab.stop("agent");
    node.remove_pod(&server);
    node.lab.spawn("agent", node.command("agent")).unwrap();
    node.wait_ready("127.0.0.1:8000", "/readyz");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let dump = node.dump("127.0.0.1:15000");
        if dump.contains(&pod_uid("client"))
            && !dump.contains(&pod_uid("server"))
            && node.log().matches("ZDS snapshot applied").count() >= 2
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
    // The held pod's rules written again, the gone pod's probe entry
    // removed, each in the one back end.
    wait_until("the held pod's rules written again", SETTLE, || {
        node.log()
            .contains("rules of the pods held before this start written again")
    });
    assert_rules_in(&node, mode, &[&client]);
    let probes = probe_entries(&node, mode);
    assert!(
        probes.contains_key(&client.ip.to_string()) && !probes.contains_key(&server.ip.to_string()),
        "{probes:?}"
    );
    // The surviving pod still has its traffic carried by the proxy. The
    // other end is an app on the node (its bridge address), outside the
    // pod: a connection to the pod's own address would stay on its loopback
    // and never reach the proxy.
    let host = LabPod {
        name: "node".into(),
        netns_name: node.lab.node_name().to_string(),
        ip: format!("{}.1", node.subnet).parse().unwrap(),
        ns: node.lab.node.clone(),
    };
    let outsider = EchoServer::start(&host, 9090).unwrap();
    let from_client = [("reporter", "source"), ("source_workload", "client")];
    let opened = |n: &Node| {
        counter(
            &n.metrics(),
            "istio_tcp_connections_opened_total",
            &from_client,
        )
    };
    let before = opened(&node);
    let mut c = connect_from(&client, outsider.addr).unwrap();
    assert_eq!(echo_roundtrip(&mut c, b"alive").unwrap(), b"alive");
    assert_eq!(
        outsider.peers().len(),
        1,
        "the node's app got the connection"
    );
    wait_until(
        "the client's connection counted by the proxy",
        SETTLE,
        || opened(&node) > before,
    );
}

#[test]
fn cross_node_traffic_is_hbone_between_two_nodes() {
    let mesh = "workloads:\n- {name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"10.81.0.2\"], protocol: HBONE}\n- {name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"10.82.0.2\"], protocol: HBONE}\n";
    let mut a = Node::start_full(BIN, "twoa", "all", true, "10.81.0", mesh, None);
    let mut b = Node::start_full(BIN, "twob", "all", true, "10.82.0", mesh, Some(&a));
    ambit::lab::node::link(&a, &b);
    let client = a.add_pod("client", "default").unwrap();
    let server = b.add_pod("server", "default").unwrap();
    assert_eq!(server.ip.to_string(), "10.82.0.2");
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
    let from_client = |mb: &str| {
        mb.lines().any(|l| {
            l.starts_with("istio_tcp_received_bytes_total{reporter=\"destination\"")
                && l.contains("source_principal=\"spiffe://cluster.local/ns/default/sa/client-sa\"")
                && l.contains("connection_security_policy=\"mutual_tls\"")
        })
    };
    wait_until("node B counting the client's mTLS bytes", SETTLE, || {
        from_client(&b.metrics())
    });
    let mb = b.metrics();
    assert!(
        from_client(&mb),
        "node B's proxy must see the client's identity over mTLS:\n{mb}"
    );
}

#[test]
fn agent_start_enrolls_pods_that_already_exist() {
    // `early` belongs to this node; `elsewhere` to another node (its IP shows up here only by accident).
    let mesh = format!(
        "workloads:\n- {{uid: \"{}\", name: early, namespace: default, serviceAccount: early-sa, workloadIps: [\"10.83.0.50\"], protocol: HBONE, node: this-node}}\n- {{uid: \"{}\", name: elsewhere, namespace: default, workloadIps: [\"10.83.0.60\"], protocol: HBONE, node: other-node}}\n",
        pod_uid("early"),
        pod_uid("elsewhere")
    );
    let mut node = Node::start_full(BIN, "early", "all", false, "10.83.0", &mesh, None);
    node.lab.stop("agent");
    // Pods that came up while the agent was away (no CNI event will ever
    // come for them), each held by its sandbox as kubelet leaves a pod.
    let mut netns = Vec::new();
    for (pod, ip) in [("early", "10.83.0.50/24"), ("elsewhere", "10.83.0.60/24")] {
        let name = format!("{}-{pod}", node.lab.id);
        assert!(Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap()
            .success());
        node.pods.push(name.clone());
        let ns = ambit::netns::Netns::named(&name).unwrap();
        for args in [
            &["link", "set", "lo", "up"][..],
            &[
                "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
            ],
            &["addr", "add", ip, "dev", "eth0"],
            &["link", "set", "eth0", "up"],
        ] {
            assert!(ns.command("ip").args(args).status().unwrap().success());
        }
        node.lab.hold(&name, &pod_uid(pod)).unwrap();
        netns.push(ns);
    }
    let ns = netns[0].clone();
    let mut cmd = node.command("agent");
    cmd.env("NODE_NAME", "this-node");
    node.lab.spawn("agent", cmd).unwrap();
    node.wait_ready("127.0.0.1:8000", "/readyz");
    let deadline = Instant::now() + Duration::from_secs(10);
    let served = |n: &Node| {
        serde_json::from_str::<serde_json::Value>(&n.dump("127.0.0.1:15000"))
            .map(|d| {
                let uids = d["pods"].as_array().cloned().unwrap_or_default();
                serde_json::Value::from_iter(uids.iter().map(|p| p["uid"].clone()))
            })
            .unwrap_or_default()
    };
    while served(&node) != serde_json::json!([pod_uid("early")]) {
        assert!(
            Instant::now() < deadline,
            "pre-existing pod not picked up:\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let rules = iptables_save(&ns);
    assert!(rules.contains("--to-ports 15001"), "{rules}");
    assert!(node.log().contains("existing pod found and enrolled"));
    let other = iptables_save(&netns[1]);
    assert!(
        !other.contains("ISTIO"),
        "a workload of another node is left alone: {other}"
    );
    assert_eq!(
        served(&node),
        serde_json::json!([pod_uid("early")]),
        "only this node's pod is served"
    );
    // The admin dump shows the pod with its identity, addresses and state.
    let dump: serde_json::Value = serde_json::from_str(&node.dump("127.0.0.1:15000")).unwrap();
    let pod = &dump["pods"][0];
    assert_eq!(pod["name"], "early");
    assert_eq!(pod["namespace"], "default");
    assert!(
        pod["identity"]
            .as_str()
            .unwrap()
            .starts_with("spiffe://cluster.local/ns/default/sa/"),
        "{pod}"
    );
    assert!(
        pod["ips"].as_array().is_some_and(|a| !a.is_empty()),
        "{pod}"
    );
    assert_eq!(pod["state"], "serving", "{pod}");
    assert!(pod["certificateExpiresUnix"].as_u64().is_some(), "{pod}");
    assert!(
        !dump.to_string().contains("PRIVATE KEY"),
        "no key material in the dump"
    );
}

/// The shared proxy makes each pod's sockets from outside its netns; the
/// TIME_WAITs its side leaves must still be found and removed there.
#[test]
fn short_connections_through_the_shared_proxy_never_stall_and_leave_no_time_wait() {
    let mut node = Node::start(BIN, "nodetw", "namespaces:default");
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let outsider = node.add_pod("outsider", "kube-system").unwrap();
    let meshed = close_first_echo(&server, 7001).unwrap();
    let outside = close_first_echo(&outsider, 7001).unwrap();
    let targets = [
        (meshed, Ends::Echo),
        (outside, Ends::Echo),
        (SocketAddr::new(outsider.ip.into(), 7999), Ends::Closed),
    ];
    let run = short_connections(&client, &targets, 3000).unwrap();
    assert_eq!(run.syn_retries, 0, "no SYN had to be sent again: {run:?}");
    assert_eq!(
        run.aborts, 0,
        "every connection ended without a reset: {run:?}"
    );
    let held = time_waits(&client, 15001).unwrap();
    assert!(
        held.is_empty(),
        "the proxy keeps no TIME_WAIT in the pod:\n{held}\n{}",
        node.log()
    );
}

/// An agent restarted with the other rules back end moves its pods over
/// (their rules and the node's probe rule and set, the old back end's
/// removed) while their connections flow on; and back again.
#[test]
fn an_agent_restarted_with_the_other_backend_moves_its_pods_and_keeps_their_connections() {
    use common::node::{mtls_from, METRICS};
    let mut node = Node::start_in(BIN, "switch", "all", false, RulesMode::Iptables);
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    assert_rules_in(&node, RulesMode::Iptables, &[&client, &server]);
    let echo = EchoServer::start(&server, 8080).unwrap();
    let mut held = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip_keep(&mut held, b"before", SETTLE).unwrap(),
        b"before"
    );
    let rewritten = |n: &Node| {
        n.log()
            .matches("rules of the pods held before this start written again")
            .count()
    };
    for mode in [RulesMode::Nftables, RulesMode::Iptables] {
        node.lab.stop("agent");
        // Both tools on PATH, as in the image: the old back end's rules
        // are there to be removed with its own tool.
        // (Each agent writes a log of its own.)
        node.extra_env = match mode {
            RulesMode::Nftables => vec![("NATIVE_NFTABLES".into(), "true".into())],
            RulesMode::Iptables => Vec::new(),
        };
        node.lab.spawn("agent", node.command("agent")).unwrap();
        node.wait_ready("127.0.0.1:8000", "/readyz");
        common::wait_until_showing(
            "the pods' rules written again",
            SETTLE,
            || rewritten(&node) > 0,
            || node.log(),
        );
        assert!(node.log().contains("pods=2 failed=0"), "{}", node.log());
        assert_rules_in(&node, mode, &[&client, &server]);
        // The connection opened under iptables carries on.
        let again = echo_roundtrip_keep(&mut held, b"still here", SETTLE);
        assert!(
            again.as_ref().is_ok_and(|b| b == b"still here"),
            "{mode:?}: {again:?}\n{}",
            node.log()
        );
        // A new one is captured and carried over mTLS.
        let before = mtls_from(&node, METRICS, "client");
        let mut fresh = connect_from(&client, echo.addr).unwrap();
        assert_eq!(echo_roundtrip(&mut fresh, b"fresh").unwrap(), b"fresh");
        wait_until("the new connection counted as mTLS", SETTLE, || {
            mtls_from(&node, METRICS, "client") > before
        });
        // The node's probes are SNATed by this back end's rule.
        assert_eq!(
            probe_entries(&node, mode).get(&server.ip.to_string()),
            Some(&pod_uid("server"))
        );
        let ip = server.ip;
        let mut probe = node
            .lab
            .node
            .run(move || std::net::TcpStream::connect((ip, 8080)))
            .unwrap()
            .unwrap();
        assert_eq!(echo_roundtrip(&mut probe, b"probe").unwrap(), b"probe");
        assert_eq!(
            echo.peers().last().unwrap().ip().to_string(),
            "169.254.7.127",
            "{mode:?}"
        );
    }
}

/// A node that cannot take the nftables rules stops the agent at its start
/// with the reason, before any pod is touched (not a failure at each
/// ADD): without `nft`, and with an `nft` whose kernel refuses the
/// transaction (a stand-in that fails as nft does when `nf_tables` or one
/// of its expressions is missing).
#[test]
fn an_agent_on_a_host_that_refuses_the_nftables_rules_stops_at_start_with_the_reason() {
    use std::os::unix::fs::PermissionsExt;
    let node = Node::prepare(BIN, "nonft", "all", "10.80.0", "workloads: []\n", None);
    let env = Node::rules_env(&node.dir, RulesMode::Nftables);
    let farm = std::path::PathBuf::from(&env.iter().find(|(k, _)| k == "PATH").unwrap().1);
    std::fs::remove_file(farm.join("nft")).unwrap();
    let refusing =
        "#!/bin/sh\necho 'Error: Could not process rule: No such file or directory' >&2\nexit 1\n";
    for nft in [None, Some(refusing)] {
        if let Some(script) = nft {
            let path = farm.join("nft");
            std::fs::write(&path, script).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let mut cmd = node.command("agent");
        cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let deadline = Instant::now() + SETTLE;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the agent kept running on a host without usable nftables");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert!(!status.success(), "{err}");
        assert!(
            err.contains("the nftables rules back end (native_nftables / NATIVE_NFTABLES) cannot be used on this host")
                && err.contains("nft -c -f -"),
            "{err}"
        );
        match nft {
            None => assert!(err.contains("No such file or directory"), "{err}"),
            Some(_) => assert!(err.contains("Could not process rule"), "{err}"),
        }
        // Nothing was written on the node: no table, no set, no plugin.
        assert!(!stdout_in(&node.lab.node, "nft", &["list", "tables"]).contains("istio"));
        assert!(
            !node.conf_dir.join("10-meshnet.conflist").exists()
                || !std::fs::read_to_string(node.conf_dir.join("10-meshnet.conflist"))
                    .unwrap()
                    .contains("ambit-cni")
        );
    }
}
