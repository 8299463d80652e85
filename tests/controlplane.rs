//! End-to-end: proxies that take their mesh state (delta xDS) and their
//! certificates (Istio CA API) only from `ambit control-plane`, over TLS with
//! a bearer token. The control plane's TLS certificate comes from a serving
//! root of its own (what the proxies set as `XDS_ROOT_CA`); workload
//! certificates come from the mesh root (`AMBIT_MESH_ROOT_CA`).

mod common;

use std::time::{Duration, Instant};

use ambit::lab::{connect_from, echo_roundtrip, http_get, EchoServer, LabPod};
use common::cp::{
    cp_listening, dump, proxy_via_cp, proxy_via_cp_env, serve_mesh, serving_root, start_cp,
    start_cp_with, wait_for, CP,
};
use common::{workload, Mesh, TD};

#[test]
fn proxies_run_from_the_control_plane_alone() {
    let mut m = Mesh::new("cp");
    let (client, server) = (m.pod("client"), m.pod("server"));
    let workloads = format!(
        "workloads:\n{}{}",
        workload(&client, "client-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE")
    );
    let cp_yaml = m.lab.dir.join("cp.yaml");
    serve_mesh(&m, &workloads);
    proxy_via_cp(&m, &client, "client-sa", "s3cret");
    proxy_via_cp(&m, &server, "server-sa", "s3cret");
    let echo = EchoServer::start(&server, 8080).unwrap();

    // Initial sync, and certificates from the CA service.
    let mut c = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut c, b"via the control plane").unwrap(),
        b"via the control plane"
    );
    let cp_log = std::fs::read_to_string(m.lab.log_path("cp")).unwrap();
    assert!(
        cp_log.matches("certificate signed").count() >= 2,
        "{cp_log}"
    );

    // An added service reaches the proxy within a second.
    std::fs::write(
        &cp_yaml,
        format!("{workloads}services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}}}\n"),
    )
    .unwrap();
    let took = wait_for(
        "new service on the client proxy",
        Duration::from_secs(1),
        || dump(&client).contains("echo.default.svc.cluster.local"),
    );
    eprintln!("service reached the proxy in {took:?}");

    // A removed workload disappears.
    std::fs::write(
        &cp_yaml,
        format!("workloads:\n{}", workload(&client, "client-sa", "HBONE")),
    )
    .unwrap();
    wait_for("removed workload gone", Duration::from_secs(2), || {
        !dump(&client).contains("\"name\":\"server\"")
    });

    // Control plane down: the last good state keeps serving; back up: resync.
    m.lab.stop("cp");
    std::fs::write(&cp_yaml, &workloads).unwrap();
    // Deliberately a fixed window: nothing may change during it, so there is
    // no condition to poll for; a proxy that reloaded from anywhere but the
    // control plane would have picked the edit up well within it.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !dump(&client).contains("\"name\":\"server\""),
        "nothing changes while the control plane is away"
    );
    start_cp(&m, "cp2");
    wait_for(
        "resync after the control plane restarts",
        Duration::from_secs(20),
        || dump(&client).contains("\"name\":\"server\""),
    );
    let mut c = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut c, b"after resync").unwrap(),
        b"after resync"
    );

    // Short-lived certificates (10s) are rotated at half-life.
    wait_for("certificate rotation", Duration::from_secs(12), || {
        m.proxy_log(&client).contains("certificate rotated")
    });
    let metrics = http_get(&client, "127.0.0.1:15020", "/metrics").unwrap().1;
    let gauge = metrics
        .lines()
        .find(|l| l.starts_with("ambit_certificate_expiry_seconds{identity=\"spiffe://cluster.local/ns/default/sa/client-sa\"}"))
        .unwrap_or_else(|| panic!("certificate expiry gauge missing:\n{metrics}"));
    let left: i64 = gauge.rsplit(' ').next().unwrap().parse().unwrap();
    assert!((0..=10).contains(&left), "{gauge}");
    assert!(metrics.contains("ambit_xds_connected 1"), "{metrics}");
    assert!(
        metrics.contains(
            "istio_xds_message_total{url=\"type.googleapis.com/istio.workload.Address\"}"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("istio_xds_connection_terminations_total{reason="),
        "the control-plane restart was counted: {metrics}"
    );

    // A wrong token is refused: that proxy never becomes ready.
    let stranger = m.pod("stranger");
    m.lab.redirect(&stranger).unwrap();
    let tok = m.lab.dir.join("token-stranger");
    std::fs::write(&tok, "wrong").unwrap();
    let mut cmd = stranger.ns.command(env!("CARGO_BIN_EXE_ambit"));
    cmd.arg("proxy")
        .env("PROXY_MODE", "dedicated")
        .env("PROXY_WORKLOAD_INFO", "default/stranger/x")
        .env("XDS_ADDRESS", format!("https://{CP}"))
        .env("CA_ADDRESS", format!("https://{CP}"))
        .env("XDS_ROOT_CA", serving_root(&m).0)
        .env("AMBIT_MESH_ROOT_CA", &m.ca.0)
        .env("AUTH_TOKEN", &tok);
    m.lab.spawn("proxy-stranger", cmd).unwrap();
    // The control plane refuses its calls, saying why; the stranger's proxy
    // says it has no state for it. Both polled for: they are the state.
    let log = |label: &str| std::fs::read_to_string(m.lab.log_path(label)).unwrap_or_default();
    let refused =
        |l: &str| l.contains("call refused") && l.contains("reason=missing or wrong bearer token");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(refused(&log("cp2"))
        && log("proxy-stranger").contains("Unauthenticated: missing or wrong bearer token"))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(refused(&log("cp2")), "{}", log("cp2"));
    // The proxy says the control plane refused it, and why (its CA or its
    // xDS, whichever it asked first).
    let stranger_log = log("proxy-stranger");
    assert!(
        stranger_log.contains("Unauthenticated: missing or wrong bearer token"),
        "{stranger_log}"
    );
    // Refused, it is still running, and not ready: it got no config and no
    // certificate.
    let pid = m
        .lab
        .pid("proxy-stranger")
        .expect("the stranger's proxy was started");
    let state = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    assert!(
        state
            .lines()
            .any(|l| l.starts_with("State:") && !l.contains("zombie")),
        "the refused proxy exited: {stranger_log}"
    );
    let ready = http_get(&stranger, "127.0.0.1:15021", "/healthz/ready")
        .map(|r| r.0)
        .unwrap_or(0);
    assert_ne!(
        ready, 200,
        "a proxy with a wrong token must not get config or certificates"
    );
}

#[test]
fn xds_root_ca_system_trusts_the_system_store_and_nothing_else() {
    let mut m = Mesh::new("cpsys");
    let (client, server, stranger) = (m.pod("client"), m.pod("server"), m.pod("stranger"));
    serve_mesh(
        &m,
        &format!(
            "workloads:\n{}{}",
            workload(&client, "client-sa", "HBONE"),
            workload(&server, "server-sa", "HBONE")
        ),
    );
    // `SYSTEM` is the OS trust store; SSL_CERT_FILE stands in for it here,
    // the way operators point it at a bundle: the control plane's serving
    // root is in it. (The mesh root is AMBIT_MESH_ROOT_CA, never the system's.)
    let serving = serving_root(&m).0.display().to_string();
    let system = [
        ("XDS_ROOT_CA", "SYSTEM"),
        ("SSL_CERT_FILE", serving.as_str()),
    ];
    proxy_via_cp_env(&m, &client, "client-sa", "s3cret", &system).unwrap();
    proxy_via_cp_env(&m, &server, "server-sa", "s3cret", &system).unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    let mut c = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut c, b"trusted by the system store").unwrap(),
        b"trusted by the system store"
    );

    // A system store without the mesh CA: the control plane is not trusted,
    // so the proxy gets neither config nor a certificate.
    let other = ambit::lab::write_ca(&m.lab.dir, "other", TD).unwrap();
    let other_ca = other.0.display().to_string();
    let err = proxy_via_cp_env(
        &m,
        &stranger,
        "client-sa",
        "s3cret",
        &[
            ("XDS_ROOT_CA", "SYSTEM"),
            ("SSL_CERT_FILE", other_ca.as_str()),
        ],
    )
    .expect_err("a proxy must not trust a control plane outside its roots");
    let msg = err.to_string();
    assert!(
        msg.contains("invalid peer certificate"),
        "the log says the control plane's certificate was refused: {msg}"
    );
}

/// On demand, with a long wait, so that a connection that waited it out is
/// told apart from one that got its answer, however slow the machine.
const ON_DEMAND: &[(&str, &str)] = &[
    ("XDS_ON_DEMAND", "true"),
    ("AMBIT_XDS_ON_DEMAND_WAIT", "10s"),
];

#[test]
fn on_demand_a_proxy_learns_only_the_addresses_its_connections_need() {
    let mut m = Mesh::new("cpod");
    let (client, server, other, outside) = (
        m.pod("client"),
        m.pod("server"),
        m.pod("other"),
        m.pod("outside"),
    );
    serve_mesh(
        &m,
        &format!(
            "workloads:\n{}{}{}services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}}}\n",
            workload(&client, "client-sa", "HBONE"),
            workload(&server, "server-sa", "HBONE"),
            // `other` is the service's endpoint; it is reached only by the VIP.
            workload(&other, "other-sa", "HBONE").replace(
                "protocol: HBONE}",
                "protocol: HBONE, services: {\"default/echo.default.svc.cluster.local\": {80: 8080}}}"
            )
        ),
    );
    proxy_via_cp_env(&m, &client, "client-sa", "s3cret", ON_DEMAND).unwrap();
    proxy_via_cp_env(&m, &server, "server-sa", "s3cret", ON_DEMAND).unwrap();
    proxy_via_cp_env(&m, &other, "other-sa", "s3cret", ON_DEMAND).unwrap();
    let held = |pod: &LabPod, name: &str| dump(pod).contains(&format!("\"name\":\"{name}\""));
    wait_for(
        "its own workload, by its address",
        Duration::from_secs(5),
        || held(&client, "client"),
    );
    assert!(
        !held(&client, "server") && !held(&client, "other"),
        "nothing else up front: {}",
        dump(&client)
    );

    // The first connection to the server's IP asks for it, then goes over HBONE.
    let echo = EchoServer::start(&server, 8080).unwrap();
    let mut c = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut c, b"fetched on demand").unwrap(),
        b"fetched on demand"
    );
    let metrics = http_get(&server, "127.0.0.1:15020", "/metrics").unwrap().1;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("istio_tcp_connections_opened_total")
                && l.contains("reporter=\"destination\"")
                && l.contains(
                    "source_principal=\"spiffe://cluster.local/ns/default/sa/client-sa\""
                )
                && l.contains("mutual_tls")
            && l.contains("source_workload=\"client\"")),
        "the server's proxy saw the client's identity over mTLS, and fetched its workload:\n{metrics}"
    );
    assert!(held(&client, "server") && !held(&client, "other"));
    assert!(held(&server, "client") && !held(&server, "other"));

    // A service VIP brings the service and its endpoints, as istiod sends them.
    let echo_other = EchoServer::start(&other, 8080).unwrap();
    let mut c = connect_from(&client, "10.96.0.10:80".parse().unwrap()).unwrap();
    assert_eq!(
        echo_roundtrip(&mut c, b"by the service").unwrap(),
        b"by the service"
    );
    assert_eq!(echo_other.peers().len(), 1, "the endpoint answered");
    assert!(held(&client, "other") && dump(&client).contains("echo.default.svc.cluster.local"));

    // Outside the mesh: the control plane answers "unknown" once; passthrough.
    let echo_out = EchoServer::start(&outside, 8080).unwrap();
    for round in ["first", "second"] {
        let t = Instant::now();
        let mut c = connect_from(&client, echo_out.addr).unwrap();
        assert_eq!(
            echo_roundtrip(&mut c, round.as_bytes()).unwrap(),
            round.as_bytes()
        );
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{round} passthrough took {:?}: the answer must not be waited out",
            t.elapsed()
        );
    }
    assert_eq!(
        echo_out.peers()[0].ip(),
        std::net::IpAddr::V4(client.ip),
        "passthrough keeps the client's address"
    );
}

#[test]
fn on_demand_a_denied_connection_never_asks_about_its_source() {
    let mut m = Mesh::new("cpodeny");
    let (server, outsider) = (m.pod("server"), m.pod("outsider"));
    // The outsider is a workload the control plane knows (plain TCP, outside
    // the mesh); the server takes connections from mesh identities only.
    serve_mesh(
        &m,
        &format!(
            "workloads:\n{}{}policies:\n- {{name: mesh-only, namespace: default, action: Allow, rules: [[[{{principals: [Presence]}}]]]}}\n",
            workload(&server, "server-sa", "HBONE"),
            workload(&outsider, "outsider-sa", "TCP"),
        ),
    );
    proxy_via_cp_env(&m, &server, "server-sa", "s3cret", ON_DEMAND).unwrap();
    let held = |pod: &LabPod, name: &str| dump(pod).contains(&format!("\"name\":\"{name}\""));
    wait_for(
        "the server's own workload, by its address",
        Duration::from_secs(5),
        || held(&server, "server"),
    );
    let echo = EchoServer::start(&server, 8080).unwrap();

    let mut c = connect_from(&outsider, echo.addr).unwrap();
    assert!(
        echo_roundtrip(&mut c, b"let me in").unwrap().is_empty(),
        "plaintext is refused by mesh-only"
    );
    assert!(echo.peers().is_empty());
    let denied = [
        ("reporter", "destination"),
        ("response_flags", "DENY"),
        // Labelled from what the state held: the outsider was not asked for.
        ("source_workload", "unknown"),
    ];
    wait_for("the denial counted", Duration::from_secs(5), || {
        common::counter(
            &http_get(&server, "127.0.0.1:15020", "/metrics").unwrap().1,
            "istio_tcp_connections_opened_total",
            &denied,
        ) == 1
    });
    assert!(
        !held(&server, "outsider"),
        "a denied source is never fetched on demand: {}",
        dump(&server)
    );
}

#[test]
fn two_nodes_take_config_and_certificates_only_from_the_control_plane() {
    use ambit::lab::node::Node;
    // Each workload on its node: a node's token gets only its own workloads' certificates.
    let mesh = "workloads:\n- {uid: client, name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"10.84.0.2\"], protocol: HBONE, node: node-a}\n- {uid: server, name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"10.85.0.2\"], protocol: HBONE, node: node-b}\n";
    let bin = env!("CARGO_BIN_EXE_ambit");
    // Subnets no other test uses (10.78.0 is the demo's).
    let mut a = Node::prepare(bin, "cpa", "all", "10.84.0", mesh, None);
    let mut b = Node::prepare(bin, "cpb", "all", "10.85.0", mesh, Some(&a));
    // One token per node, in node A's own directory (where the control
    // plane reads them): no path shared with other tests, removed with the lab.
    let tokens = a.dir.join("node-tokens");
    std::fs::create_dir_all(&tokens).unwrap();
    for (node, token) in [("node-a", "token-a"), ("node-b", "token-b")] {
        std::fs::write(tokens.join(node), token).unwrap();
    }
    for (n, node) in [(&mut a, "node-a"), (&mut b, "node-b")] {
        // The proxies get nothing locally: no local config, no CA key.
        n.extra_env = vec![
            ("XDS_ADDRESS".into(), "https://10.99.0.1:15012".into()),
            ("CA_ADDRESS".into(), "https://10.99.0.1:15012".into()),
            (
                "XDS_ROOT_CA".into(),
                n.dir.join("serving-ca-cert.pem").display().to_string(),
            ),
            (
                "AMBIT_MESH_ROOT_CA".into(),
                n.dir.join("ca-cert.pem").display().to_string(),
            ),
            ("AUTH_TOKEN".into(), tokens.join(node).display().to_string()),
            ("AMBIT_CA_KEY".into(), "/nonexistent".into()),
        ];
    }
    ambit::lab::node::link(&a, &b);
    // The control plane runs on node A, reachable from both nodes.
    let mut cmd = a.lab.node.command(bin);
    cmd.arg("control-plane")
        .env("LOCAL_XDS_PATH", a.dir.join("mesh.yaml"))
        .env("AMBIT_CA_CERT", a.dir.join("ca-cert.pem"))
        .env("AMBIT_CA_KEY", a.dir.join("ca-key.pem"))
        .env(
            "AMBIT_CP_SERVING_CA_CERT",
            a.dir.join("serving-ca-cert.pem"),
        )
        .env("AMBIT_CP_SERVING_CA_KEY", a.dir.join("serving-ca-key.pem"))
        .env("AMBIT_CP_LISTEN", "10.99.0.1:15012")
        .env("AMBIT_CP_TLS_SANS", "10.99.0.1")
        .env("AMBIT_CP_NODE_TOKENS_DIR", &tokens);
    a.lab.spawn("cp", cmd).unwrap();
    for n in [&a, &b] {
        n.launch(true);
        n.wait_ready("127.0.0.1:8000", "/readyz");
        n.wait_ready("127.0.0.1:15021", "/healthz/ready");
    }
    let client = a.add_pod("client", "default").unwrap();
    let server = b.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    let payload = vec![5u8; 100_000];
    let mut conn = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut conn, &payload).unwrap(),
        payload,
        "{}\n{}",
        a.log(),
        b.log()
    );
    let mb = b.metrics();
    assert!(
        mb.lines().any(|l| l.contains("reporter=\"destination\"")
            && l.contains("source_principal=\"spiffe://cluster.local/ns/default/sa/client-sa\"")
            && l.contains("mutual_tls")),
        "{mb}"
    );
    let cp = std::fs::read_to_string(a.lab.log_path("cp")).unwrap();
    let signed = |sa: &str, node: &str| {
        cp.lines().any(|l| {
            l.contains("certificate signed")
                && l.contains(&format!("/sa/{sa}"))
                && l.contains(&format!("caller=node {node}"))
        })
    };
    assert!(
        signed("client-sa", "node-a") && signed("server-sa", "node-b"),
        "each node's certificates come from the control plane, asked with that node's token:\n{cp}"
    );
}

/// istiod's waypoint fields reach the proxy over xDS and are obeyed: the
/// control plane serves a server workload with a waypoint, the client's
/// traffic arrives at the waypoint (the lab's recording stand-in); a
/// waypoint the state does not know refuses the connection.
#[test]
fn a_waypoint_served_over_xds_is_used_and_an_unknown_one_refuses() {
    use ambit::identity::Identity;
    use ambit::lab::waypoint::WaypointStandIn;

    let mut m = Mesh::new("cpwp");
    let (client, server, wp) = (m.pod("client"), m.pod("server"), m.pod("wp"));
    let mesh = |waypoint_ip: &str| {
        format!(
            "workloads:\n{}- {{name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{}\"], protocol: HBONE, waypoint: {{destination: \"/{waypoint_ip}\", hboneMtlsPort: 15008}}}}\n{}",
            workload(&client, "client-sa", "HBONE"),
            server.ip,
            workload(&wp, "wp-sa", "HBONE"),
        )
    };
    serve_mesh(&m, &mesh(&wp.ip.to_string()));
    proxy_via_cp(&m, &client, "client-sa", "s3cret");
    proxy_via_cp(&m, &server, "server-sa", "s3cret");
    let echo = EchoServer::start(&server, 8080).unwrap();
    let waypoint = Identity::new(TD, "default", "wp-sa");
    let stand_in =
        WaypointStandIn::start(&wp, (&m.ca.0, &m.ca.1), waypoint, Default::default()).unwrap();

    let target = std::net::SocketAddr::new(server.ip.into(), 8080);
    let mut c = connect_from(&client, target).unwrap();
    assert_eq!(echo_roundtrip(&mut c, b"via-xds").unwrap(), b"via-xds");
    let seen = stand_in.seen();
    assert_eq!(
        seen.len(),
        1,
        "the connection went through the waypoint: {seen:?}"
    );
    assert_eq!(seen[0].authority, target.to_string());
    assert_eq!(
        echo.peers().len(),
        1,
        "and the waypoint's leg reached the app"
    );

    // The waypoint now names an address nobody has: refused, not bypassed.
    std::fs::write(m.lab.dir.join("cp.yaml"), mesh("10.99.99.99")).unwrap();
    wait_for(
        "the unknown waypoint to refuse",
        Duration::from_secs(15),
        || {
            connect_from(&client, target)
                .and_then(|mut c| echo_roundtrip(&mut c, b"x"))
                .map_or(true, |b| b.is_empty())
        },
    );
    // (Until the update arrives a connection may still take the waypoint.)
    let (peers, seen) = (echo.peers().len(), stand_in.seen().len());
    let refused = connect_from(&client, target).and_then(|mut c| echo_roundtrip(&mut c, b"y"));
    assert!(refused.map_or(true, |b| b.is_empty()));
    assert_eq!(
        echo.peers().len(),
        peers,
        "nothing reached the app around the waypoint"
    );
    assert_eq!(stand_in.seen().len(), seen);
}

/// The CA signs only what the caller's token may have: a node's token gets
/// the identities of its own node's workloads, and a proxy asking with it
/// for a pod of another node is refused (it never becomes ready), while
/// the node's own pod is served.
#[test]
fn a_node_token_asking_for_another_nodes_pod_is_refused() {
    let mut m = Mesh::new("cp-tokens");
    let (client, server) = (m.pod("client"), m.pod("server"));
    let tokens = m.lab.dir.join("node-tokens");
    std::fs::create_dir_all(&tokens).unwrap();
    std::fs::write(tokens.join("node-a"), "token-a").unwrap();
    std::fs::write(tokens.join("node-b"), "token-b").unwrap();
    std::fs::write(
        m.lab.dir.join("cp.yaml"),
        format!(
            "workloads:\n- {{uid: client, name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"{}\"], protocol: HBONE, node: node-a}}\n- {{uid: server, name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{}\"], protocol: HBONE, node: node-b}}\n",
            client.ip, server.ip
        ),
    )
    .unwrap();
    start_cp_with(&m, "cp", ("AMBIT_CP_NODE_TOKENS_DIR", tokens.as_path()));
    wait_for(
        "the control plane listening",
        Duration::from_secs(20),
        || cp_listening(&m),
    );
    // node-a's own pod: served.
    proxy_via_cp(&m, &client, "client-sa", "token-a");
    // node-a's token asking for node-b's pod: refused, and the proxy says so.
    let refused = proxy_via_cp_env(&m, &server, "server-sa", "token-a", &[]);
    assert!(
        refused.is_err(),
        "a proxy with another node's pod became ready"
    );
    let cp = std::fs::read_to_string(m.lab.log_path("cp")).unwrap();
    assert!(
        cp.lines().any(|l| l.contains("certificate refused")
            && l.contains("/sa/server-sa")
            && l.contains("node-a")),
        "{cp}"
    );
    assert!(
        !cp.lines()
            .any(|l| l.contains("certificate signed") && l.contains("/sa/server-sa")),
        "{cp}"
    );
    let log = m.proxy_log(&server);
    assert!(log.contains("PermissionDenied"), "{log}");
}

/// A pod is usually served before its workload reaches the proxy (the CNI
/// ADD comes before istiod's push). Until then its connections are labelled
/// as a pod's; once the workload arrives, new connections carry its
/// workload name, canonical service and revision, cluster and locality, at
/// both ends, and follow a change of revision. Every value differs from the
/// pod's name and from the defaults, so a label from the wrong source fails.
#[test]
fn labels_follow_a_workload_that_arrives_after_its_pod_and_its_changes() {
    let mut m = Mesh::new("cplabel");
    let (client, server) = (m.pod("client"), m.pod("server"));
    // The client's service account named by a workload elsewhere: the CA
    // signs only identities its config names.
    let anchor = "- {uid: elsewhere, name: elsewhere, namespace: default, serviceAccount: client-sa, workloadIps: [\"10.232.0.9\"], protocol: HBONE}\n";
    let described = |pod: &LabPod, sa: &str, revision: &str| {
        format!(
            "- {{uid: {n}, name: {n}, namespace: default, serviceAccount: {sa}, workloadIps: [\"{ip}\"], protocol: HBONE, workloadName: {n}-deploy, canonicalName: {n}-app, canonicalRevision: {revision}, clusterId: east, locality: {{region: r1, zone: z-{n}}}}}\n",
            n = pod.name,
            ip = pod.ip
        )
    };
    let server_workload = described(&server, "server-sa", "s1");
    let cp_yaml = m.lab.dir.join("cp.yaml");
    serve_mesh(&m, &format!("workloads:\n{anchor}{server_workload}"));
    proxy_via_cp(&m, &client, "client-sa", "s3cret");
    proxy_via_cp(&m, &server, "server-sa", "s3cret");
    let echo = EchoServer::start(&server, 8080).unwrap();
    let closed = |pod: &LabPod, labels: &[(&str, &str)]| {
        common::counter(
            &m.metrics(pod),
            "istio_tcp_connections_closed_total",
            labels,
        )
    };
    let roundtrip_counted = |what: &str, at: &[(&LabPod, Vec<(&str, &str)>)]| {
        let mut c = connect_from(&client, echo.addr).unwrap();
        assert_eq!(echo_roundtrip(&mut c, b"hi").unwrap(), b"hi");
        drop(c);
        for (pod, labels) in at {
            common::wait_until_showing(
                &format!(
                    "{what}: a connection counted at {} with {labels:?}",
                    pod.name
                ),
                Duration::from_secs(5),
                || closed(pod, labels) == 1,
                || m.metrics(pod),
            );
        }
    };
    let server_side = [
        ("destination_workload", "server-deploy"),
        ("destination_canonical_service", "server-app"),
        ("destination_canonical_revision", "s1"),
        ("destination_app", "server-app"),
        ("destination_version", "s1"),
        ("destination_cluster", "east"),
        ("destination_region", "r1"),
        ("destination_zone", "z-server"),
    ];
    let client_side = |revision: &'static str| {
        [
            ("source_workload", "client-deploy"),
            ("source_canonical_service", "client-app"),
            ("source_canonical_revision", revision),
            ("source_app", "client-app"),
            ("source_version", revision),
            ("source_cluster", "east"),
            ("source_region", "r1"),
            ("source_zone", "z-client"),
        ]
    };
    let with = |reporter, sides: &[&[(&'static str, &'static str)]]| {
        let mut l = vec![("reporter", reporter)];
        for side in sides {
            l.extend_from_slice(side);
        }
        l
    };

    // Before its workload: the client is labelled as the pod it is.
    let unlisted: &[(&str, &str)] = &[
        ("source_workload", "client"),
        ("source_canonical_service", "client"),
        ("source_canonical_revision", "latest"),
        ("source_cluster", "Kubernetes"),
        ("source_region", "unknown"),
    ];
    roundtrip_counted(
        "before the client's workload",
        &[(&client, with("source", &[unlisted, &server_side]))],
    );

    // Its workload arrives: the next connection is labelled by it, at both ends.
    for revision in ["c1", "c2"] {
        std::fs::write(
            &cp_yaml,
            format!(
                "workloads:\n{anchor}{server_workload}{}",
                described(&client, "client-sa", revision)
            ),
        )
        .unwrap();
        let held = format!("\"canonicalRevision\":\"{revision}\"");
        wait_for(
            &format!("revision {revision} on both proxies"),
            Duration::from_secs(5),
            || dump(&client).contains(&held) && dump(&server).contains(&held),
        );
        let (client_side, server_side) = (client_side(revision), &server_side[..]);
        roundtrip_counted(
            &format!("revision {revision}"),
            &[
                (&client, with("source", &[&client_side, server_side])),
                (&server, with("destination", &[&client_side, server_side])),
            ],
        );
    }
}

/// The Python client library's OpenMetrics parser, in the CI venv
/// (`.ci/install-deps`): each family of `text` with its type and the label
/// names of each of its samples.
fn parsed_families(text: &str) -> serde_json::Value {
    use std::io::Write;
    const PARSE: &str = "
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = {}
for f in text_string_to_metric_families(sys.stdin.read()):
    out[f.name] = {'type': f.type, 'unit': f.unit,
                   'labels': sorted({','.join(sorted(s.labels)) for s in f.samples})}
print(json.dumps(out))
";
    let mut child = std::process::Command::new("/opt/ambit-ci/venv/bin/python")
        .args(["-c", PARSE])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the CI venv's python (.ci/install-deps)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the OpenMetrics parser refused the exposition: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What a proxy exposes is valid OpenMetrics to a real parser, and has
/// ztunnel's families with ztunnel's labels.
#[test]
fn metrics_parse_as_openmetrics_with_ztunnel_s_families_and_labels() {
    let mut m = Mesh::new("cpmetric");
    let (client, server) = (m.pod("client"), m.pod("server"));
    serve_mesh(
        &m,
        &format!(
            "workloads:\n{}{}",
            workload(&client, "client-sa", "HBONE"),
            workload(&server, "server-sa", "HBONE")
        ),
    );
    proxy_via_cp(&m, &client, "client-sa", "s3cret");
    proxy_via_cp(&m, &server, "server-sa", "s3cret");
    let echo = EchoServer::start(&server, 8080).unwrap();
    // One connection carried and closed (a round trip ends it), one held
    // open.
    let mut c = connect_from(&client, echo.addr).unwrap();
    assert_eq!(echo_roundtrip(&mut c, b"one").unwrap(), b"one");
    let held = connect_from(&client, echo.addr).unwrap();
    common::wait_until_showing(
        "one connection counted closed and one open",
        Duration::from_secs(5),
        || {
            let text = m.metrics(&client);
            common::counter(&text, "istio_tcp_connections_closed_total", &[]) == 1
                && common::counter(&text, "istio_tcp_connections_opened_total", &[]) == 2
        },
        || m.metrics(&client),
    );
    let text = m.metrics(&client);
    let families = parsed_families(&text);
    let family = |name: &str| {
        families
            .get(name)
            .unwrap_or_else(|| panic!("no family {name} in {families:#}"))
    };
    let traffic = "connection_security_policy,destination_app,destination_canonical_revision,\
destination_canonical_service,destination_cluster,destination_principal,destination_region,\
destination_service,destination_service_name,destination_service_namespace,destination_version,\
destination_workload,destination_workload_namespace,destination_zone,reporter,request_protocol,\
response_flags,source_app,source_canonical_revision,source_canonical_service,source_cluster,\
source_principal,source_region,source_version,source_workload,source_workload_namespace,source_zone";
    assert_eq!(traffic.split(',').count(), 27);
    for (name, kind, labels) in [
        ("istio_tcp_connections_opened", "counter", traffic),
        ("istio_tcp_connections_closed", "counter", traffic),
        ("istio_tcp_sent_bytes", "counter", traffic),
        ("istio_tcp_received_bytes", "counter", traffic),
        ("istio_tcp_sockets_open", "gauge", "reporter"),
        ("istio_build", "gauge", "component,tag"),
        ("istio_xds_message", "counter", "url"),
        ("istio_xds_message_bytes", "counter", "url"),
        ("process_open_fds", "gauge", ""),
        ("process_max_fds", "gauge", ""),
        ("tokio_num_workers", "gauge", ""),
        ("tokio_num_alive_tasks", "gauge", ""),
        ("tokio_global_queue_depth", "gauge", ""),
        (
            "tokio_worker_total_busy_duration_seconds",
            "counter",
            "worker",
        ),
        ("tokio_worker_park_count", "counter", "worker"),
        ("tokio_worker_park_unpark_count", "counter", "worker"),
    ] {
        let f = family(name);
        assert_eq!(f["type"], kind, "{name}: {f}");
        assert_eq!(f["labels"], serde_json::json!([labels]), "{name}: {f}");
    }
    assert_eq!(family("istio_xds_message_bytes")["unit"], "bytes");
    // The values a user reads: the held connection is open at the source
    // (and the closed one is not), the addresses came with bytes, and
    // there is one busy-time series per worker.
    let value = |sample: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(sample))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no sample {sample} in {text}"))
    };
    assert_eq!(
        value("istio_tcp_sockets_open{reporter=\"source\"}"),
        1.0,
        "{text}"
    );
    // (Authorization responses carry no resource here: no policy.)
    for (url, least) in [("Address", 1.0), ("Authorization", 0.0)] {
        let bytes = text
            .lines()
            .find(|l| l.starts_with("istio_xds_message_bytes_total{") && l.contains(url))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
        assert!(bytes.is_some_and(|b| b >= least), "{url} bytes: {text}");
    }
    let workers = value("tokio_num_workers ");
    let busy = text
        .lines()
        .filter(|l| l.starts_with("tokio_worker_total_busy_duration_seconds_total{"))
        .count();
    assert_eq!(busy as f64, workers, "{text}");
    assert!(value("process_open_fds ") > 0.0 && value("process_max_fds ") >= 1024.0);
    assert!(
        text.contains("istio_build{component=\"ztunnel\",tag=\"ambit-"),
        "{text}"
    );
    drop(held);
}
