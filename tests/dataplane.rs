//! End-to-end: the secure L4 data path through the real binary, pods in
//! network namespaces, traffic redirected by the in-pod rules.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use ambit::lab::{connect_from, echo_roundtrip, passive_opens, EchoServer, LabPod};
use common::{counter, wait_until, workload, Mesh};

/// Long enough for a loaded machine; the waits end as soon as the state is there.
const SETTLE: Duration = Duration::from_secs(10);

/// Until the proxy in `pod` has counted `n` connections closed whose labels
/// contain `filter`: bytes are added at the close, so its counters are final.
fn wait_closed(m: &Mesh, pod: &LabPod, filter: &[(&str, &str)], n: u64) {
    wait_until(
        &format!(
            "{n} connection(s) closed {filter:?} in {}'s metrics",
            pod.name
        ),
        SETTLE,
        || {
            counter(
                &m.metrics(pod),
                "istio_tcp_connections_closed_total",
                filter,
            ) >= n
        },
    );
}

/// Until the capture written by the lab's "tcpdump" runs (it says so on stderr).
fn wait_tcpdump_listening(m: &Mesh) {
    wait_until("tcpdump listening on br0", SETTLE, || {
        std::fs::read_to_string(m.lab.log_path("tcpdump"))
            .unwrap_or_default()
            .contains("listening on")
    });
}

#[test]
fn meshed_pods_talk_over_hbone_by_pod_ip() {
    let (m, client, server, echo) = common::meshed_pair("hbone");

    let payload: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let mut conn = connect_from(&client, echo.addr).unwrap();
    let back = echo_roundtrip(&mut conn, &payload).unwrap();
    assert_eq!(
        back, payload,
        "every byte must come back through both proxies"
    );
    assert_eq!(
        echo.peers().len(),
        1,
        "the server app sees exactly one connection"
    );
    assert_eq!(
        echo.peers()[0].ip(),
        std::net::IpAddr::from(client.ip),
        "the app sees the real client address, not the proxy's"
    );

    let src = [
        ("reporter", "source"),
        ("destination_workload", "server"),
        ("connection_security_policy", "mutual_tls"),
        (
            "destination_principal",
            "spiffe://cluster.local/ns/default/sa/server-sa",
        ),
    ];
    wait_closed(&m, &client, &src, 1);
    let cm = m.metrics(&client);
    assert_eq!(
        counter(&cm, "istio_tcp_connections_opened_total", &src),
        1,
        "{cm}"
    );
    assert_eq!(
        counter(&cm, "istio_tcp_sent_bytes_total", &src),
        payload.len() as u64,
        "{cm}"
    );
    assert_eq!(
        counter(&cm, "istio_tcp_received_bytes_total", &src),
        payload.len() as u64,
        "{cm}"
    );
    let dst = [
        ("reporter", "destination"),
        (
            "source_principal",
            "spiffe://cluster.local/ns/default/sa/client-sa",
        ),
        ("source_workload", "client"),
    ];
    wait_closed(&m, &server, &dst, 1);
    let sm = m.metrics(&server);
    assert_eq!(
        counter(&sm, "istio_tcp_connections_closed_total", &dst),
        1,
        "{sm}"
    );
    assert_eq!(
        counter(&sm, "istio_tcp_sent_bytes_total", &dst),
        payload.len() as u64,
        "{sm}"
    );
}

/// The same traffic with both pods' rules written by the nftables back
/// end (istio-cni's `NATIVE_NFTABLES`): the client's connection is
/// captured to its proxy, carried over HBONE, handed to the application
/// with the client's own address (the marks, conntrack mark and table 100
/// work), and a plain sender outside the mesh still reaches the server
/// through its plaintext inbound port. Neither pod holds an iptables rule.
#[test]
fn with_the_pods_rules_in_nftables_traffic_is_captured_and_carried_as_with_iptables() {
    use ambit::cni::redirect::Backend;
    let mut m = Mesh::new("nft-pair");
    let (client, server, outsider) = (m.pod("client"), m.pod("server"), m.pod("outsider"));
    m.write_config(&format!(
        "workloads:\n{}{}",
        workload(&client, "client-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE")
    ));
    for (pod, sa) in [(&client, "client-sa"), (&server, "server-sa")] {
        m.lab.redirect_with(pod, Backend::Nftables).unwrap();
        let spec = ambit::lab::ProxySpec {
            config: m.config.clone(),
            ca_cert: m.ca.0.clone(),
            ca_key: m.ca.1.clone(),
            workload_info: format!("default/{}/{sa}", pod.name),
            trust_domain: common::TD.into(),
            extra_env: vec![],
        };
        m.lab.start_proxy(pod, &spec).unwrap();
        let save = pod.ns.command("iptables-save").output().unwrap();
        assert!(!String::from_utf8_lossy(&save.stdout).contains("ISTIO"));
        let tables = pod
            .ns
            .command("nft")
            .args(["list", "tables"])
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&tables.stdout).contains("inet istio-ambient-nat"));
    }
    let echo = EchoServer::start(&server, 8080).unwrap();
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let mut conn = connect_from(&client, echo.addr).unwrap();
    assert_eq!(echo_roundtrip(&mut conn, &payload).unwrap(), payload);
    assert_eq!(echo.peers()[0].ip(), std::net::IpAddr::from(client.ip));
    let src = [
        ("reporter", "source"),
        ("destination_workload", "server"),
        ("connection_security_policy", "mutual_tls"),
    ];
    wait_closed(&m, &client, &src, 1);
    // Outside the mesh: in through the server's plaintext inbound port.
    let mut plain = connect_from(&outsider, echo.addr).unwrap();
    assert_eq!(echo_roundtrip(&mut plain, b"plain").unwrap(), b"plain");
    let inbound_plain = [
        ("reporter", "destination"),
        ("connection_security_policy", "unknown"),
    ];
    wait_closed(&m, &server, &inbound_plain, 1);
}

const MARKER: &[u8] = b"AMBIT-PLAINTEXT-MARKER-7f3a9c";

#[test]
fn bytes_on_the_wire_are_tls_to_15008_never_cleartext() {
    let (m, client, _server, echo) = common::meshed_pair("wire");
    let pcap = m.lab.dir.join("wire.pcap");
    let mut cmd = m.lab.node.command("tcpdump");
    cmd.args(["-i", "br0", "-U", "-s", "0", "-w"]).arg(&pcap);
    m.lab.spawn("tcpdump", cmd).unwrap();
    wait_tcpdump_listening(&m);

    let payload = MARKER.repeat(2000);
    let mut conn = connect_from(&client, echo.addr).unwrap();
    assert_eq!(echo_roundtrip(&mut conn, &payload).unwrap(), payload);
    // The payload crossed the bridge twice (there and back), encrypted: the
    // whole transfer is in the file once it holds more than that.
    wait_until("the capture holding the transfer both ways", SETTLE, || {
        std::fs::metadata(&pcap).map_or(0, |f| f.len()) > 2 * payload.len() as u64
    });
    m.lab.stop("tcpdump");

    let raw = std::fs::read(&pcap).unwrap();
    assert!(
        raw.len() > payload.len(),
        "capture holds the transfer ({} bytes)",
        raw.len()
    );
    assert!(
        !raw.windows(MARKER.len()).any(|w| w == MARKER),
        "payload seen in clear on the bridge"
    );
    let count = |filter: &str| {
        let out = std::process::Command::new("tcpdump")
            .args(["-nn", "-r"])
            .arg(&pcap)
            .arg(filter)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    assert!(
        count("tcp dst port 15008 and tcp[((tcp[12:1] & 0xf0) >> 2):1] = 0x16") >= 1,
        "TLS handshake to 15008"
    );
    assert!(
        count("tcp dst port 15008 and tcp[((tcp[12:1] & 0xf0) >> 2):1] = 0x17") >= 2,
        "TLS application data to 15008"
    );
    assert_eq!(
        count("tcp port 8080"),
        0,
        "nothing reaches the app port on the wire"
    );
}

#[test]
fn service_vip_reaches_an_endpoint_on_its_target_port() {
    let mut m = Mesh::new("vip");
    let (client, server) = (m.pod("client"), m.pod("server"));
    m.write_config(&format!(
        "workloads:\n{}- {{uid: server, name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{}\"], protocol: HBONE,\n   services: {{\"default/echo.default.svc.cluster.local\": {{80: 8080}}}}}}\nservices:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}}}\n",
        workload(&client, "client-sa", "HBONE"),
        server.ip
    ));
    m.mesh(&client, "client-sa");
    m.mesh(&server, "server-sa");
    let echo = EchoServer::start(&server, 8080).unwrap();
    let mut conn = connect_from(&client, "10.96.0.10:80".parse().unwrap()).unwrap();
    assert_eq!(
        echo_roundtrip(&mut conn, b"via the service").unwrap(),
        b"via the service"
    );
    assert_eq!(echo.peers().len(), 1);
    let via_service = [
        ("destination_service", "echo.default.svc.cluster.local"),
        ("destination_workload", "server"),
    ];
    wait_closed(&m, &client, &via_service, 1);
    let cm = m.metrics(&client);
    assert_eq!(
        counter(&cm, "istio_tcp_connections_closed_total", &via_service),
        1,
        "{cm}"
    );
}

#[test]
fn destination_outside_the_mesh_passes_through_untouched() {
    let mut m = Mesh::new("pass");
    let (client, outsider) = (m.pod("client"), m.pod("outsider"));
    m.write_config(&format!(
        "workloads:\n{}",
        workload(&client, "client-sa", "HBONE")
    ));
    m.mesh(&client, "client-sa");
    let echo = EchoServer::start(&outsider, 9000).unwrap();
    let mut conn = connect_from(&client, echo.addr).unwrap();
    let payload = vec![42u8; 300_000];
    assert_eq!(echo_roundtrip(&mut conn, &payload).unwrap(), payload);
    let peers = echo.peers();
    assert_eq!(peers.len(), 1);
    assert_eq!(
        peers[0].ip(),
        std::net::IpAddr::from(client.ip),
        "outsider sees the client pod's own address"
    );
    let unknown = [
        ("destination_workload", "unknown"),
        ("connection_security_policy", "unknown"),
    ];
    wait_closed(&m, &client, &unknown, 1);
    let cm = m.metrics(&client);
    assert_eq!(
        counter(&cm, "istio_tcp_sent_bytes_total", &unknown),
        payload.len() as u64,
        "{cm}"
    );
    assert!(
        m.proxy_log(&client).contains("route=\"passthrough\""),
        "{}",
        m.proxy_log(&client)
    );
}

fn openssl_client(
    m: &Mesh,
    target: SocketAddr,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> String {
    // `sleep 1` holds stdin open for a fixed window on purpose: in TLS 1.3 a
    // refused client certificate is answered with an alert only after the
    // client's side of the handshake is done, so there is no state to poll
    // for, and "no alert" (the good peer) can only be checked over a window.
    let script = format!(
        "sleep 1 | openssl s_client -connect {target} -tls1_3 -alpn h2 -cert {} -key {} -CAfile {} 2>&1",
        cert.display(),
        key.display(),
        m.ca.0.display()
    );
    let out = m
        .lab
        .node
        .command("sh")
        .args(["-c", &script])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Writes a workload certificate for `id` signed by the CA in `ca` as PEM files.
fn issue_pem(
    m: &Mesh,
    ca: &(std::path::PathBuf, std::path::PathBuf),
    id: ambit::identity::Identity,
    name: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let ca = ambit::identity::LocalCa::from_files(&ca.0, &ca.1).unwrap();
    let cert = ca.issue(&id, Duration::from_secs(600)).unwrap();
    let (der_c, der_k) = (
        m.lab.dir.join(format!("{name}.crt.der")),
        m.lab.dir.join(format!("{name}.key.der")),
    );
    std::fs::write(&der_c, &cert.chain[0]).unwrap();
    std::fs::write(&der_k, cert.key.secret_pkcs8_der()).unwrap();
    let (pem_c, pem_k) = (
        m.lab.dir.join(format!("{name}.crt")),
        m.lab.dir.join(format!("{name}.key")),
    );
    assert!(std::process::Command::new("openssl")
        .args(["x509", "-inform", "der", "-in"])
        .arg(&der_c)
        .arg("-out")
        .arg(&pem_c)
        .status()
        .unwrap()
        .success());
    assert!(std::process::Command::new("openssl")
        .args(["pkey", "-inform", "der", "-in"])
        .arg(&der_k)
        .arg("-out")
        .arg(&pem_k)
        .status()
        .unwrap()
        .success());
    (pem_c, pem_k)
}

#[test]
fn peers_from_another_ca_or_trust_domain_are_refused() {
    let mut m = Mesh::new("peer");
    let (server, intruder) = (m.pod("server"), m.pod("intruder"));
    m.write_config(&format!(
        "workloads:\n{}{}",
        workload(&server, "server-sa", "HBONE"),
        workload(&intruder, "intruder-sa", "HBONE")
    ));
    m.mesh(&server, "server-sa");
    let echo = EchoServer::start(&server, 8080).unwrap();
    let hbone: SocketAddr = SocketAddr::new(server.ip.into(), 15008);
    let id = |td: &str| ambit::identity::Identity::new(td, "default", "intruder-sa");

    // openssl as the peer: the right CA and trust domain gets h2; anything else an alert.
    let (c, k) = issue_pem(&m, &m.ca, id(common::TD), "good");
    let good = openssl_client(&m, hbone, &c, &k);
    assert!(
        good.contains("ALPN protocol: h2") && !good.contains("alert"),
        "{good}"
    );
    let other_ca = ambit::lab::write_ca(&m.lab.dir, "other", common::TD).unwrap();
    let (c, k) = issue_pem(&m, &other_ca, id(common::TD), "foreign-ca");
    let out = openssl_client(&m, hbone, &c, &k);
    assert!(
        out.contains("alert"),
        "certificate from another CA must be refused: {out}"
    );
    let (c, k) = issue_pem(&m, &m.ca, id("evil.example"), "foreign-td");
    let out = openssl_client(&m, hbone, &c, &k);
    assert!(
        out.contains("alert"),
        "certificate of another trust domain must be refused: {out}"
    );
    assert!(
        m.proxy_log(&server)
            .matches("HBONE TLS handshake refused")
            .count()
            >= 2,
        "{}",
        m.proxy_log(&server)
    );

    // A whole ambit proxy under another CA cannot reach the server's application.
    m.mesh_with(&intruder, "intruder-sa", other_ca, common::TD);
    let mut conn = connect_from(&intruder, echo.addr).unwrap();
    let back = echo_roundtrip(&mut conn, b"let me in").unwrap();
    assert!(back.is_empty(), "intruder got bytes back: {back:?}");
    assert!(
        echo.peers().is_empty(),
        "server app must never see the intruder"
    );
}

#[test]
fn authorization_policy_denies_with_401_and_is_counted() {
    let mut m = Mesh::new("policy");
    let (client, server, outsider) = (m.pod("client"), m.pod("server"), m.pod("outsider"));
    m.write_config(&format!(
        "workloads:\n{}{}policies:\n- {{name: deny-admin-port, namespace: default, action: Deny, rules: [[[{{destinationPorts: [9090]}}]]]}}\n- {{name: mesh-only, namespace: default, action: Allow, rules: [[[{{principals: [Presence]}}]]]}}\n",
        workload(&client, "client-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE")
    ));
    m.mesh(&client, "client-sa");
    m.mesh(&server, "server-sa");
    let app = EchoServer::start(&server, 8080).unwrap();
    let admin = EchoServer::start(&server, 9090).unwrap();

    let mut ok = connect_from(&client, app.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut ok, b"allowed").unwrap(),
        b"allowed",
        "mesh-only allows a peer with an identity"
    );
    let mut denied = connect_from(&client, admin.addr).unwrap();
    assert!(
        echo_roundtrip(&mut denied, b"secret").unwrap().is_empty(),
        "a denied connection ends cleanly, carrying nothing"
    );
    assert!(
        admin.peers().is_empty(),
        "the denied port's app never sees the connection"
    );
    // Plaintext from outside the mesh has no identity: mesh-only does not allow it.
    let mut plain = connect_from(&outsider, app.addr).unwrap();
    assert!(echo_roundtrip(&mut plain, b"anon").unwrap().is_empty());
    assert_eq!(app.peers().len(), 1);

    // Until both denials are counted by the server and the 401 logged by the client.
    wait_until(
        "2 denied connections in the server's metrics",
        SETTLE,
        || {
            counter(
                &m.metrics(&server),
                "istio_tcp_connections_opened_total",
                &[("response_flags", "DENY")],
            ) >= 2
        },
    );
    wait_until("the 401 in the client proxy's log", SETTLE, || {
        m.proxy_log(&client).contains("status 401")
    });
    let sm = m.metrics(&server);
    assert_eq!(
        counter(
            &sm,
            "istio_tcp_connections_opened_total",
            &[("response_flags", "DENY")]
        ),
        2,
        "{sm}"
    );
    let log = m.proxy_log(&server);
    assert!(
        log.contains("denied by policy") && log.contains("policy=default/deny-admin-port"),
        "{log}"
    );
    assert!(
        m.proxy_log(&client).contains("status 401"),
        "client proxy saw the 401: {}",
        m.proxy_log(&client)
    );
}

#[test]
fn a_policy_change_closes_open_connections_it_now_denies() {
    let mut m = Mesh::new("reauth");
    let (client, server) = (m.pod("client"), m.pod("server"));
    let workloads = format!(
        "workloads:\n{}{}",
        workload(&client, "client-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE")
    );
    m.write_config(&workloads);
    m.mesh(&client, "client-sa");
    m.mesh(&server, "server-sa");
    let (a, b) = (
        EchoServer::start(&server, 8080).unwrap(),
        EchoServer::start(&server, 8081).unwrap(),
    );
    let ping = |s: &mut std::net::TcpStream| -> bool {
        use std::io::{Read, Write};
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = [0u8; 4];
        s.write_all(b"ping").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"ping"
    };
    let (mut doomed, mut spared) = (
        connect_from(&client, a.addr).unwrap(),
        connect_from(&client, b.addr).unwrap(),
    );
    assert!(ping(&mut doomed) && ping(&mut spared));

    m.write_config(&format!("{workloads}policies:\n- {{name: close-8080, namespace: default, action: Deny, rules: [[[{{destinationPorts: [8080]}}]]]}}\n"));
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !m.proxy_log(&server).contains("no longer allowed by policy") {
        assert!(
            std::time::Instant::now() < deadline,
            "open connection not re-checked: {}",
            m.proxy_log(&server)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !ping(&mut doomed),
        "the connection the new policy denies must be closed"
    );
    assert!(
        ping(&mut spared),
        "a connection the policy still allows stays open"
    );
    assert!(m.proxy_log(&server).contains("policy=default/close-8080"));
}

#[test]
fn policies_by_identity_namespace_and_dry_run() {
    let mut m = Mesh::new("policy2");
    let (alice, bob, server) = (m.pod("alice"), m.pod("bob"), m.pod("server"));
    // bob lives in namespace "blocked"; a namespace-wide DENY and an identity ALLOW on the server.
    let bob_entry = format!(
        "- {{uid: bob, name: bob, namespace: blocked, serviceAccount: bob-sa, workloadIps: [\"{}\"], protocol: HBONE}}\n",
        bob.ip
    );
    m.write_config(&format!(
        "workloads:\n{}{bob_entry}{}policies:\n\
         - {{name: only-alice, namespace: default, action: Allow, rules: [[[{{principals: [!Exact cluster.local/ns/default/sa/alice-sa, !Prefix cluster.local/ns/blocked/]}}]]]}}\n\
         - {{name: no-blocked, namespace: default, action: Deny, rules: [[[{{namespaces: [!Exact blocked]}}]]]}}\n\
         - {{name: would-deny-8081, namespace: default, action: Deny, dryRun: true, rules: [[[{{destinationPorts: [8081]}}]]]}}\n",
        workload(&alice, "alice-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE")
    ));
    m.mesh(&alice, "alice-sa");
    m.lab.redirect(&bob).unwrap();
    let spec = ambit::lab::ProxySpec {
        config: m.config.clone(),
        ca_cert: m.ca.0.clone(),
        ca_key: m.ca.1.clone(),
        workload_info: "blocked/bob/bob-sa".into(),
        trust_domain: common::TD.into(),
        extra_env: vec![],
    };
    m.lab.start_proxy(&bob, &spec).unwrap();
    m.mesh(&server, "server-sa");
    let app = EchoServer::start(&server, 8080).unwrap();
    let dry = EchoServer::start(&server, 8081).unwrap();

    let mut c = connect_from(&alice, app.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut c, b"hi").unwrap(),
        b"hi",
        "allowed by identity"
    );
    let mut c = connect_from(&bob, app.addr).unwrap();
    assert!(
        echo_roundtrip(&mut c, b"hi").unwrap().is_empty(),
        "denied by namespace despite the ALLOW prefix"
    );
    let mut c = connect_from(&alice, dry.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut c, b"dry").unwrap(),
        b"dry",
        "a dry-run DENY only logs"
    );
    wait_until(
        "the denial and the dry-run match in the server's log",
        SETTLE,
        || {
            let log = m.proxy_log(&server);
            log.contains("policy=default/no-blocked") && log.contains("dry-run policy matched")
        },
    );
    let log = m.proxy_log(&server);
    assert!(log.contains("policy=default/no-blocked"), "{log}");
    assert!(
        log.contains("dry-run policy matched") && log.contains("policy=default/would-deny-8081"),
        "{log}"
    );
}

#[test]
fn a_transfer_in_flight_finishes_while_the_proxy_drains() {
    let (m, client, server, echo) = common::meshed_pair("drain");
    let target = echo.addr;
    let c2 = client.clone();
    let transfer = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let mut conn = connect_from(&c2, target).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut reader = conn.try_clone().unwrap();
        let read = std::thread::spawn(move || {
            let mut back = Vec::new();
            reader.read_to_end(&mut back).map(|_| back.len())
        });
        let chunk = vec![1u8; 256 * 1024];
        for _ in 0..80 {
            conn.write_all(&chunk).unwrap();
            std::thread::sleep(Duration::from_millis(25));
        }
        conn.shutdown(std::net::Shutdown::Write).unwrap();
        read.join().unwrap()
    });
    // Mid-transfer: once the server's app has the connection (the writes go on for 2 s).
    wait_until("the transfer reaching the server's app", SETTLE, || {
        !echo.peers().is_empty()
    });
    // SIGTERM the server's proxy mid-transfer: it stops accepting, sends GOAWAY, and lets the stream finish.
    let pid = m.lab.pid("proxy-server").unwrap();
    // SAFETY: kill(2) on a child process of this test's lab.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
    let started = std::time::Instant::now();
    let got = transfer
        .join()
        .unwrap()
        .expect("the transfer must complete");
    assert_eq!(
        got,
        80 * 256 * 1024,
        "every byte of the in-flight transfer came back"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "finished inside the drain deadline"
    );
    wait_until("the server's proxy exiting", SETTLE, || {
        m.proxy_log(&server).contains("proxy exiting")
    });
    let log = m.proxy_log(&server);
    assert!(
        log.contains("SIGTERM: draining") && log.contains("proxy exiting open=0"),
        "{log}"
    );
}

#[test]
fn access_logs_name_workloads_identities_bytes_and_decision_and_quitquitquit_drains() {
    let mut m = common::Mesh::new("accesslog");
    let (client, server) = (m.pod("client"), m.pod("server"));
    m.write_config(&format!(
        "workloads:\n{}{}",
        workload(&client, "client-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE")
    ));
    m.mesh_env(&client, "client-sa", &[("LOG_FORMAT", "json")]);
    m.mesh(&server, "server-sa");
    let echo = EchoServer::start(&server, 8080).unwrap();
    let mut conn = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut conn, &[9u8; 1000]).unwrap(),
        [9u8; 1000]
    );
    drop(conn);
    // Each proxy writes its line when it closes the connection.
    wait_until("the close in both proxies' access logs", SETTLE, || {
        m.proxy_log(&client).contains("connection complete")
            && m.proxy_log(&server).contains("connection complete")
    });

    // The client's proxy logs JSON: one object per line, one line at close.
    let log = m.proxy_log(&client);
    let closed: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "access" && v["fields"]["message"] == "connection complete")
        .collect();
    assert_eq!(closed.len(), 1, "{log}");
    let f = &closed[0]["fields"];
    // ztunnel's names: workload and namespace apart, identities, the
    // tunnel's target in dst.hbone_addr, bytes_recv, duration in ms.
    assert_eq!(
        (f["src.workload"].as_str(), f["src.namespace"].as_str()),
        (Some("client"), Some("default")),
        "{f}"
    );
    assert_eq!(
        (f["dst.workload"].as_str(), f["dst.namespace"].as_str()),
        (Some("server"), Some("default")),
        "{f}"
    );
    assert_eq!(
        f["src.identity"],
        "spiffe://cluster.local/ns/default/sa/client-sa"
    );
    assert_eq!(
        f["dst.identity"],
        "spiffe://cluster.local/ns/default/sa/server-sa"
    );
    assert_eq!(f["direction"], "outbound");
    assert_eq!(
        f["dst.hbone_addr"].as_str(),
        Some(echo.addr.to_string().as_str()),
        "{f}"
    );
    assert_eq!(
        f["dst.addr"].as_str(),
        Some(format!("{}:15008", server.ip).as_str()),
        "{f}"
    );
    assert_eq!(
        (f["bytes_sent"].as_u64(), f["bytes_recv"].as_u64()),
        (Some(1000), Some(1000))
    );
    assert!(
        f["duration"].as_str().is_some_and(|d| d.ends_with("ms")),
        "{f}"
    );

    // The server's proxy logs text, with the policy decision.
    let log = m.proxy_log(&server);
    let line = log
        .lines()
        .find(|l| l.contains("connection complete") && l.contains("direction=\"inbound\""))
        .unwrap_or_else(|| panic!("{log}"));
    for part in [
        "src.workload=\"client\"",
        "src.namespace=\"default\"",
        "src.identity=\"spiffe://cluster.local/ns/default/sa/client-sa\"",
        "dst.workload=\"server\"",
        "bytes_sent=1000",
        "bytes_recv=1000",
        "duration=\"",
        "decision=\"allow\"",
        "policy=",
    ] {
        assert!(line.contains(part), "{part} missing: {line}");
    }

    // POST /quitquitquit drains and ends the proxy like SIGTERM.
    let (status, _) =
        ambit::lab::http_request_in(&client.ns, "POST", "127.0.0.1:15000", "/quitquitquit")
            .unwrap();
    assert_eq!(status, 200);
    let pid = m.lab.pid("proxy-client").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{pid}/status")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .contains("State:\tZ")
    {
        assert!(std::time::Instant::now() < deadline, "proxy still running");
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = m.proxy_log(&client);
    assert!(
        log.contains("/quitquitquit: draining") && log.contains("proxy exiting"),
        "{log}"
    );
}

/// A connection whose stream is open is not idle, however long its bytes
/// rest: the server's proxy lets go only HBONE connections that carry no
/// stream (`POOL_UNUSED_RELEASE_TIMEOUT`, 1 s here, checked every 250 ms).
#[test]
fn a_quiet_connection_outlives_the_idle_timeout_of_its_hbone_connection() {
    let idle = [("POOL_UNUSED_RELEASE_TIMEOUT", "1s")];
    let (m, client, server, echo) = common::meshed_pair_env("quiet", &idle, &idle);
    let mut quiet = connect_from(&client, echo.addr).unwrap();
    wait_until(
        "the quiet connection carried to the server",
        Duration::from_secs(5),
        || echo.peers().len() == 1,
    );
    // A fixed window on purpose: nothing may happen in it. Four idle
    // timeouts, so a connection counted idle would have been let go.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        echo_roundtrip(&mut quiet, b"still here").unwrap(),
        b"still here",
        "{}",
        m.proxy_log(&server)
    );
}

/// `POOL_UNUSED_RELEASE_TIMEOUT=0s`, pooling off: each connection after the
/// last one ended is a new HBONE connection (a new mTLS handshake), closed
/// as its stream ends; one that carries a stream stays open however quiet,
/// on both sides (the server's proxy checks every 100 ms).
#[test]
fn with_pooling_off_each_connection_is_a_new_hbone_connection_and_a_quiet_one_stays() {
    let off = [("POOL_UNUSED_RELEASE_TIMEOUT", "0s")];
    let (m, client, server, echo) = common::meshed_pair_env("nopool", &off, &off);
    let before = passive_opens(&server).unwrap();
    for i in 0..5 {
        let mut c = connect_from(&client, echo.addr).unwrap();
        assert_eq!(
            echo_roundtrip(&mut c, b"hi").unwrap(),
            b"hi",
            "connection {i}"
        );
    }
    // Five for the app, and one HBONE connection each at the server's proxy.
    wait_until("ten accepts", Duration::from_secs(5), || {
        passive_opens(&server).unwrap() - before >= 10
    });
    assert_eq!(passive_opens(&server).unwrap() - before, 10);

    let mut quiet = connect_from(&client, echo.addr).unwrap();
    wait_until(
        "the quiet connection carried to the server",
        Duration::from_secs(5),
        || echo.peers().len() == 6,
    );
    // A fixed window on purpose: nothing may happen in it. Ten of the
    // server's idle checks.
    std::thread::sleep(Duration::from_secs(1));
    let again = echo_roundtrip(&mut quiet, b"still here");
    assert_eq!(
        again.as_deref().ok(),
        Some(&b"still here"[..]),
        "{again:?}\nclient's proxy:\n{}\nserver's proxy:\n{}",
        m.proxy_log(&client),
        m.proxy_log(&server)
    );
}

/// One client that opens short connections fast does not use up the
/// server pod's ports. The server's proxy connects to the app from the
/// client's address; its port is chosen at connect, unique per 4-tuple
/// (`IP_BIND_ADDRESS_NO_PORT`), not reserved at bind for that address,
/// where ports in TIME_WAIT count too. With the server pod's range cut to
/// 4,000 ports, 6,000 connections in a row all echo, and the last are as
/// quick as the first. (Before: from about the 4,000th, bind found no
/// port and the connection failed; with the whole range, connections
/// slowed from ~0.5 ms to ~10 ms after ~14,000.)
#[test]
fn a_busy_client_does_not_use_up_the_server_pod_s_ports() {
    use std::io::{Read, Write};
    use std::time::Instant;
    let (_m, client, server, echo) = common::meshed_pair_env("ports", &[], &[]);
    let sysctl = |pod: &LabPod, key: &'static str, value: &'static str| {
        pod.ns
            .run(move || std::fs::write(format!("/proc/sys/net/ipv4/{key}"), value))
            .unwrap()
            .unwrap();
    };
    // Both ends may reuse a TIME_WAIT port once that is safe (the app's
    // own connects need it as much as the proxy's).
    sysctl(&client, "tcp_tw_reuse", "1");
    sysctl(&server, "tcp_tw_reuse", "1");
    sysctl(&server, "ip_local_port_range", "40000 43999");
    let dst = echo.addr;
    let times = client
        .ns
        .run(move || {
            (0..6_000)
                .map(|i| {
                    let t = Instant::now();
                    let mut s = std::net::TcpStream::connect_timeout(&dst, SETTLE)
                        .unwrap_or_else(|e| panic!("connection {i}: {e}"));
                    s.set_read_timeout(Some(SETTLE)).unwrap();
                    s.write_all(b"x").unwrap();
                    let mut b = [0u8; 1];
                    s.read_exact(&mut b)
                        .unwrap_or_else(|e| panic!("connection {i} got no echo: {e}"));
                    t.elapsed()
                })
                .collect::<Vec<_>>()
        })
        .unwrap();
    let median = |part: &[Duration]| {
        let mut v = part.to_vec();
        v.sort();
        v[v.len() / 2]
    };
    let (first, last) = (median(&times[..500]), median(&times[times.len() - 500..]));
    assert!(
        last < first * 3,
        "the last connections took {last:?} each, the first {first:?}"
    );
}
