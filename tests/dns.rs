//! End-to-end: DNS of enrolled pods is captured by the in-pod rules and
//! answered by the proxy (mesh service names) or forwarded from the pod's
//! netns to the node's resolver (dnsmasq, a real third-party server here).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use ambit::lab::node::{Node, RulesMode};
use ambit::lab::{connect_from, echo_roundtrip, EchoServer, LabPod};
use hickory_proto::op::{Message, Query};
use hickory_proto::rr::{Name, RecordType};

fn query(name: &str, id: u16) -> Vec<u8> {
    let mut m = Message::new();
    m.set_id(id)
        .set_recursion_desired(true)
        .add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    m.to_vec().unwrap()
}

fn a_records(resp: &[u8]) -> Vec<String> {
    Message::from_vec(resp)
        .unwrap()
        .answers()
        .iter()
        .map(|a| a.data().to_string())
        .collect()
}

/// A UDP query from inside `pod` to `server` (any address: the rules capture
/// port 53), retried like a stub resolver does (UDP may drop under a flood).
fn ask_udp(pod: &LabPod, server: SocketAddr, packet: Vec<u8>) -> std::io::Result<Vec<u8>> {
    pod.ns.run(move || {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.set_read_timeout(Some(Duration::from_secs(1)))?;
        let mut last = None;
        for _ in 0..3 {
            s.send_to(&packet, server)?;
            let mut buf = vec![0u8; 4096];
            match s.recv(&mut buf) {
                Ok(n) => {
                    buf.truncate(n);
                    return Ok(buf);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("no answer")))
    })?
}

fn ask_tcp(pod: &LabPod, server: SocketAddr, packet: Vec<u8>) -> std::io::Result<Vec<u8>> {
    pod.ns.run(move || {
        let mut s = TcpStream::connect_timeout(&server, Duration::from_secs(3))?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        s.write_all(&(packet.len() as u16).to_be_bytes())?;
        s.write_all(&packet)?;
        let mut len = [0u8; 2];
        s.read_exact(&mut len)?;
        let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
        s.read_exact(&mut buf)?;
        Ok(buf)
    })?
}

#[test]
fn pods_resolve_mesh_services_through_the_proxy_and_other_names_upstream() {
    // A subnet no other test uses (10.78.0 is the demo's).
    resolve_through_the_proxy(RulesMode::Iptables, "10.86.0");
}

/// The same with the agent's rules in nftables, on a node without iptables.
#[test]
fn with_the_rules_in_nftables_pods_resolve_through_the_proxy_and_upstream() {
    resolve_through_the_proxy(RulesMode::Nftables, "10.79.0");
}

fn resolve_through_the_proxy(mode: RulesMode, subnet: &str) {
    // Beside the pods: a DNS ServiceEntry, service `api` whose endpoint is
    // the hostname api.external.example (no address: resolved on demand).
    let mesh = format!("workloads:\n\
        - {{name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"{subnet}.2\"], protocol: HBONE}}\n\
        - {{name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{subnet}.3\"], protocol: HBONE, services: {{\"default/echo.default.svc.cluster.local\": {{80: 8080}}}}}}\n\
        - {{uid: ext, name: ext, namespace: default, hostname: api.external.example, protocol: TCP, services: {{\"default/api.external.example\": {{80: 8080}}}}}}\n\
        - {{uid: gone, name: gone, namespace: default, hostname: nowhere.invalid, protocol: TCP, services: {{\"default/nowhere.invalid\": {{80: 8080}}}}}}\n\
        services:\n\
        - {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}}}\n\
        - {{name: api, namespace: default, hostname: api.external.example, vips: [\"/10.96.0.20\"], ports: {{80: 8080}}}}\n\
        - {{name: gone, namespace: default, hostname: nowhere.invalid, vips: [\"/10.96.0.21\"], ports: {{80: 8080}}}}\n\
        - {{name: wild, namespace: default, hostname: \"*.wild.example\", vips: [\"/10.96.0.30\"], ports: {{80: 8080}}}}\n\
        - {{name: legacy, namespace: default, hostname: legacy.external.example, ports: {{80: 80}}}}\n");
    let bin = env!("CARGO_BIN_EXE_ambit");
    let tag = match mode {
        RulesMode::Iptables => "dns",
        RulesMode::Nftables => "dnsnft",
    };
    let mut node = Node::prepare(bin, tag, "all", subnet, &mesh, None);
    node.extra_env = Node::rules_env(&node.dir, mode);
    node.launch(true);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    common::node::assert_rules_in(&node, mode, &[&client, &server]);
    let _echo = EchoServer::start(&server, 8080).unwrap();
    // The node's resolver: dnsmasq on the bridge address, knowing one external name and no mesh names.
    let mut cmd = node.lab.node.command("dnsmasq");
    cmd.args([
        "--no-daemon",
        "--no-resolv",
        "--no-hosts",
        "--bind-interfaces",
        &format!("--listen-address={subnet}.1"),
        "--port=53",
    ])
    .arg("--address=/external.example/192.0.2.7")
    // The ServiceEntry's host is the server pod; answers live 30 s, and
    // every query dnsmasq gets is logged.
    .arg(format!("--address=/api.external.example/{subnet}.3"))
    .args(["--local-ttl=30", "--log-queries", "--log-facility=-"])
    .arg(format!(
        "--pid-file={}",
        node.dir.join("dnsmasq.pid").display()
    ));
    node.lab.spawn("dnsmasq", cmd).unwrap();
    common::wait_until(
        &format!("dnsmasq listening on {subnet}.1:53"),
        Duration::from_secs(10),
        || {
            node.lab
                .node
                .command("ss")
                .args(["-Hlun", "src", &format!("{subnet}.1:53")])
                .output()
                .is_ok_and(|o| !o.stdout.is_empty())
        },
    );
    let resolver: SocketAddr = format!("{subnet}.1:53").parse().unwrap();

    // A mesh service name is answered by the proxy (dnsmasq does not know it)...
    let resp = ask_udp(
        &client,
        resolver,
        query("echo.default.svc.cluster.local.", 1),
    )
    .unwrap();
    assert_eq!(a_records(&resp), ["10.96.0.10"]);
    let resp = ask_udp(&client, resolver, query("echo.", 2)).unwrap();
    assert_eq!(
        a_records(&resp),
        ["10.96.0.10"],
        "short name with the pod's search domain"
    );
    let resp = ask_tcp(&client, resolver, query("echo.default.", 3)).unwrap();
    assert_eq!(
        a_records(&resp),
        ["10.96.0.10"],
        "DNS over TCP is captured too"
    );
    // ... and the pod connects to what it resolved.
    let mut c = connect_from(&client, "10.96.0.10:80".parse().unwrap()).unwrap();
    assert_eq!(echo_roundtrip(&mut c, b"resolved").unwrap(), b"resolved");

    // The DNS ServiceEntry: its endpoint's hostname is resolved when a
    // connection needs it, from the proxy's netns, and the answer kept for its TTL.
    for i in 0..3 {
        let msg = format!("by-name-{i}");
        let mut c = connect_from(&client, "10.96.0.20:80".parse().unwrap()).unwrap();
        assert_eq!(
            echo_roundtrip(&mut c, msg.as_bytes()).unwrap(),
            msg.as_bytes(),
            "{}",
            node.log()
        );
    }
    let dnsmasq_log = std::fs::read_to_string(node.lab.log_path("dnsmasq")).unwrap_or_default();
    assert_eq!(
        dnsmasq_log.matches("query[A] api.external.example").count(),
        1,
        "resolved once, then from the cache within the TTL:\n{dnsmasq_log}"
    );
    let on_demand = node
        .metrics()
        .lines()
        .filter(|l| {
            l.starts_with("istio_on_demand_dns_total{")
                && l.contains("hostname=\"api.external.example\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum::<u64>();
    assert_eq!(
        on_demand, 3,
        "every connection that needed the name is counted"
    );
    // A name that does not resolve: the connection is refused, with the reason.
    let refused = connect_from(&client, "10.96.0.21:80".parse().unwrap())
        .and_then(|mut c| echo_roundtrip(&mut c, b"x"));
    assert!(refused.map_or(true, |b| b.is_empty()));
    common::wait_until(
        "the unresolved name in the access log",
        Duration::from_secs(10),
        || {
            let log = node.log();
            log.contains("route=\"unresolved\"") && log.contains("on-demand DNS")
        },
    );

    // Other names are forwarded from the pod to the node's resolver.
    let resp = ask_udp(&client, resolver, query("external.example.", 4)).unwrap();
    assert_eq!(a_records(&resp), ["192.0.2.7"]);
    // A wildcard host answers for the names under it (dnsmasq knows none).
    let resp = ask_udp(&client, resolver, query("shop.wild.example.", 5)).unwrap();
    assert_eq!(a_records(&resp), ["10.96.0.30"]);
    // A ServiceEntry host without a VIP is the upstream's to answer, as in
    // ztunnel (not an empty answer from the proxy).
    let resp = ask_udp(&client, resolver, query("legacy.external.example.", 6)).unwrap();
    assert_eq!(a_records(&resp), ["192.0.2.7"]);

    // Garbage and truncated packets do not hurt the proxy.
    let mut rng = fastrand::Rng::with_seed(7);
    let target = resolver;
    client
        .ns
        .run(move || {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            for i in 0..300 {
                let len = if i % 3 == 0 {
                    rng.usize(0..12)
                } else {
                    rng.usize(12..200)
                };
                let bytes: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
                let _ = s.send_to(&bytes, target);
            }
            let mut trunc = query("echo.default.svc.cluster.local.", 9);
            trunc.truncate(20);
            let _ = s.send_to(&trunc, target);
        })
        .unwrap();
    let resp = ask_udp(
        &client,
        resolver,
        query("echo.default.svc.cluster.local.", 5),
    )
    .unwrap();
    assert_eq!(
        a_records(&resp),
        ["10.96.0.10"],
        "proxy still answers after the garbage:\n{}",
        node.log()
    );
    assert!(!node.log().contains("panicked"), "{}", node.log());
    let m = node.metrics();
    let count = |label: &str| -> u64 {
        m.lines()
            .find(|l| {
                l.starts_with(&format!(
                    "istio_dns_requests_total{{answered_by=\"{label}\"}}"
                ))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    assert!(
        count("proxy") >= 4 && count("upstream") >= 1,
        "DNS requests are counted:\n{m}"
    );
    assert!(m.contains("workload_manager_active_proxy_count 2"), "{m}");
    assert!(m.contains("workload_manager_pending_proxy_count 0"), "{m}");
}

#[test]
fn a_pod_flooding_a_silent_upstream_is_capped_and_served_again_after() {
    let mut m = common::Mesh::new("dnsflood");
    let (client, outsider) = (m.pod("client"), m.pod("outsider"));
    m.write_config(&format!(
        "workloads:\n{}services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}}}\n",
        common::workload(&client, "client-sa", "HBONE")
    ));
    // An upstream that reads every query and never answers.
    let ip = outsider.ip;
    let silent = outsider
        .ns
        .run(move || UdpSocket::bind((ip, 5353)))
        .unwrap()
        .unwrap();
    silent
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    // Room for every query of the flood: what is counted is what was sent.
    socket2::SockRef::from(&silent)
        .set_recv_buffer_size(4 << 20)
        .unwrap();
    let silent = std::sync::Arc::new(silent);
    let upstream = SocketAddr::from((ip, 5353));
    m.mesh_env(
        &client,
        "client-sa",
        &[("AMBIT_DNS_UPSTREAMS", &upstream.to_string())],
    );
    let heard = |silent: &UdpSocket, for_: Duration| {
        let (mut n, end) = (0, std::time::Instant::now() + for_);
        let mut buf = [0u8; 512];
        while std::time::Instant::now() < end {
            if silent.recv(&mut buf).is_ok() {
                n += 1;
            }
        }
        n
    };
    let flood = |ids: std::ops::Range<u16>| {
        client
            .ns
            .run(move || {
                let s = UdpSocket::bind("127.0.0.1:0").unwrap();
                for id in ids {
                    s.send_to(&query("name.example.org.", id), "127.0.0.1:15053")
                        .unwrap();
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
            .unwrap()
    };

    let listening = {
        let silent = silent.clone();
        std::thread::spawn(move || heard(&silent, Duration::from_secs(2)))
    };
    flood(0..600);
    let first = listening.join().unwrap();
    assert!(
        (200..=256).contains(&first),
        "at most 256 queries in flight per pod reach the upstream: {first} did"
    );
    // Meanwhile mesh names, answered from the state, are still answered.
    let local: SocketAddr = "127.0.0.1:15053".parse().unwrap();
    let mesh = ask_udp(&client, local, query("echo.default.svc.cluster.local.", 7)).unwrap();
    assert_eq!(a_records(&mesh), ["10.96.0.10"]);
    // Each waits out its 5 s; then the pod is served again. A fixed wait on
    // purpose: it lets the proxy's own 5 s query timeout run out, and probing
    // for the end of it would put extra queries in the exact count below.
    std::thread::sleep(Duration::from_secs(4));
    flood(1000..1010);
    let later = heard(&silent, Duration::from_secs(1));
    assert_eq!(later, 10, "after the flood, queries are forwarded again");

    // A TCP client that sends half a message is given up on, not waited for.
    let started = std::time::Instant::now();
    let ended = client
        .ns
        .run(|| {
            let mut s = TcpStream::connect("127.0.0.1:15053")?;
            s.set_read_timeout(Some(Duration::from_secs(20)))?;
            s.write_all(&[0x01, 0x00, 1, 2, 3])?;
            s.read(&mut [0u8; 16])
        })
        .unwrap();
    assert_eq!(ended.unwrap(), 0, "the proxy closes the connection");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(15),
        "{waited:?}"
    );

    // At most 64 TCP connections per pod are held open; the next is closed.
    let held: Vec<TcpStream> = client
        .ns
        .run(|| {
            (0..64)
                .map(|_| TcpStream::connect("127.0.0.1:15053"))
                .collect::<std::io::Result<Vec<_>>>()
        })
        .unwrap()
        .unwrap();
    // Until the proxy has taken all 64 off its listen queue (Recv-Q 0).
    common::wait_until(
        "the proxy accepting the 64 DNS connections",
        Duration::from_secs(10),
        || {
            let out = client
                .ns
                .command("ss")
                .args(["-Hltn", "sport", "=", ":15053"])
                .output()
                .expect("ss (iproute2)");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            // State Recv-Q Send-Q Local Peer
            !text.trim().is_empty()
                && text
                    .lines()
                    .all(|l| l.split_whitespace().nth(1) == Some("0"))
        },
    );
    let over = client
        .ns
        .run(|| -> std::io::Result<usize> {
            let mut extra = TcpStream::connect("127.0.0.1:15053")?;
            extra.set_read_timeout(Some(Duration::from_secs(3)))?;
            Ok(extra.read(&mut [0u8; 4]).unwrap_or(usize::MAX))
        })
        .unwrap()
        .unwrap();
    let kept = held.len();
    assert_eq!(
        (kept, over),
        (64, 0),
        "the 65th connection is closed at once"
    );
}
