//! Waypoints: traffic to a service or workload that istiod gives a waypoint
//! goes to the waypoint over HBONE (with the original destination as the
//! CONNECT authority and the waypoint's identity checked), never around it;
//! the waypoint's own leg to the pod is accepted by the pod's proxy; a
//! waypoint taken away sends traffic direct again; one named but absent
//! refuses the connection. The waypoint is the lab's recording stand-in.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use ambit::identity::Identity;
use ambit::lab::waypoint::WaypointStandIn;
use ambit::lab::{connect_from, echo_roundtrip, LabPod};
use common::{counter, wait_until, workload, Mesh, TD};

const VIP: &str = "10.96.0.50";
const SETTLE: Duration = Duration::from_secs(10);

/// The local config: client, server (behind `server_waypoint`, if any), the
/// waypoint pods, and service `api` (behind `service_waypoint`, if any).
fn config(
    client: &LabPod,
    server: &LabPod,
    waypoints: &[&LabPod],
    server_waypoint: Option<&str>,
    service_waypoint: &str,
) -> String {
    let mut out = String::from("workloads:\n");
    out.push_str(&workload(client, "client-sa", "HBONE"));
    let wp = server_waypoint
        .map(|d| format!(", waypoint: {{destination: \"{d}\"}}"))
        .unwrap_or_default();
    out.push_str(&format!(
        "- {{uid: server, name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{}\"], protocol: HBONE{wp},\n   services: {{\"default/api.default.svc.cluster.local\": {{80: 8080}}}}}}\n",
        server.ip
    ));
    for w in waypoints {
        out.push_str(&workload(w, &format!("{}-sa", w.name), "HBONE"));
    }
    out.push_str(&format!(
        "services:\n- {{name: api, namespace: default, hostname: api.default.svc.cluster.local, vips: [\"/{VIP}\"], ports: {{80: 8080}}{service_waypoint}}}\n"
    ));
    out
}

fn identity(sa: &str) -> String {
    Identity::new(TD, "default", sa).to_string()
}

/// The waypoint stand-in in `pod`, as `<pod>-sa`, carrying `vip` to `to`.
fn start_stand_in(m: &Mesh, pod: &LabPod, vip: SocketAddr, to: SocketAddr) -> WaypointStandIn {
    let id = Identity::new(TD, "default", &format!("{}-sa", pod.name));
    WaypointStandIn::start(pod, (&m.ca.0, &m.ca.1), id, HashMap::from([(vip, to)])).unwrap()
}

fn roundtrip(client: &LabPod, dst: SocketAddr, msg: &[u8]) -> Vec<u8> {
    connect_from(client, dst)
        .and_then(|mut c| echo_roundtrip(&mut c, msg))
        .unwrap_or_default()
}

#[test]
fn traffic_with_a_waypoint_goes_through_it_and_never_around_it() {
    let mut m = Mesh::new("wayp");
    let (client, server, wp) = (m.pod("client"), m.pod("server"), m.pod("wp"));
    let vip: SocketAddr = format!("{VIP}:80").parse().unwrap();
    let server_app: SocketAddr = SocketAddr::new(server.ip.into(), 8080);
    let at_wp = format!("/{}", wp.ip);
    let by_address = format!(", waypoint: {{destination: \"{at_wp}\"}}");
    m.write_config(&config(&client, &server, &[&wp], Some(&at_wp), &by_address));
    m.mesh(&client, "client-sa");
    m.mesh(&server, "server-sa");
    let echo = ambit::lab::EchoServer::start(&server, 8080).unwrap();
    // The waypoint pod runs no Ambit: the stand-in terminates HBONE itself.
    let stand_in = start_stand_in(&m, &wp, vip, server_app);

    // Workload-addressed: the pod IP reaches the waypoint, authority = pod IP:port.
    assert_eq!(roundtrip(&client, server_app, b"to-pod"), b"to-pod");
    let seen = stand_in.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].authority, server_app.to_string());
    assert_eq!(
        seen[0].peer,
        identity("client-sa"),
        "the client's proxy speaks for the client"
    );
    let forwarded = &seen[0].headers["forwarded"];
    assert!(
        forwarded.starts_with(&format!("for=\"{}:", client.ip)),
        "{forwarded}"
    );
    let baggage = &seen[0].headers["baggage"];
    assert!(
        baggage.contains("k8s.namespace.name=default") && baggage.contains("k8s.pod.name=client"),
        "{baggage}"
    );

    // Service-addressed: authority = the VIP and service port, and the
    // waypoint is told the service's name.
    assert_eq!(roundtrip(&client, vip, b"to-service"), b"to-service");
    let seen = stand_in.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[1].authority, vip.to_string());
    assert!(
        seen[1].headers["forwarded"].ends_with(";host=api.default.svc.cluster.local"),
        "{:?}",
        seen[1].headers
    );

    // The waypoint's leg to the pod was accepted by the server's proxy, from
    // the waypoint's identity: the application saw both connections.
    assert_eq!(echo.peers().len(), 2);
    wait_until(
        "the server's proxy counts the waypoint's connections",
        SETTLE,
        || {
            counter(
                &m.metrics(&server),
                "istio_tcp_connections_opened_total",
                &[
                    ("reporter", "destination"),
                    ("source_principal", &identity("wp-sa")),
                    // Labelled by the authenticated peer, not by the client
                    // address the waypoint reports in `forwarded`.
                    ("source_workload", "wp"),
                ],
            ) == 2
        },
    );
    // Its access log names the authenticated peer's address (the one policy
    // was applied to), not the client address the waypoint reports.
    let inbound_lines = |log: &str| -> Vec<String> {
        log.lines()
            .filter(|l| l.contains("connection complete") && l.contains("direction=\"inbound\""))
            .map(String::from)
            .collect()
    };
    wait_until("the server's access log of both legs", SETTLE, || {
        inbound_lines(&m.proxy_log(&server)).len() == 2
    });
    for line in inbound_lines(&m.proxy_log(&server)) {
        assert!(
            line.contains(&format!("src.addr={}:", wp.ip))
                && !line.contains(&format!("src.addr={}:", client.ip)),
            "{line}"
        );
    }
    // The server's proxy names the service the client asked for (the
    // waypoint passes `host=` on) and ztunnel's app/version/cluster labels.
    let sm = m.metrics(&server);
    let inbound = [
        ("reporter", "destination"),
        ("destination_service", "api.default.svc.cluster.local"),
        ("destination_service_name", "api"),
        ("destination_app", "server"),
        ("destination_version", "latest"),
        ("source_app", "wp"),
    ];
    assert_eq!(
        counter(&sm, "istio_tcp_connections_opened_total", &inbound),
        2,
        "{sm}"
    );
    // The client's access log names the hop.
    wait_until(
        "the client's access log shows the waypoint route",
        SETTLE,
        || m.proxy_log(&client).matches("route=\"waypoint\"").count() == 2,
    );

    // The waypoint taken away (config edit): traffic goes direct again.
    m.write_config(&config(&client, &server, &[&wp], None, ""));
    // (Until the proxy reloads, a connection may still take the waypoint.)
    wait_until("direct again after the waypoint is removed", SETTLE, || {
        let before = stand_in.seen().len();
        roundtrip(&client, server_app, b"direct") == b"direct" && stand_in.seen().len() == before
    });
    let before = stand_in.seen().len();
    assert_eq!(roundtrip(&client, vip, b"direct-svc"), b"direct-svc");
    assert_eq!(roundtrip(&client, server_app, b"again"), b"again");
    assert_eq!(
        stand_in.seen().len(),
        before,
        "nothing more reached the waypoint"
    );

    // A waypoint named but absent: refused, never sent around it.
    let nowhere = ", waypoint: {destination: \"/10.99.99.99\"}";
    m.write_config(&config(
        &client,
        &server,
        &[&wp],
        Some("/10.99.99.99"),
        nowhere,
    ));
    wait_until("refused once the waypoint is unknown", SETTLE, || {
        roundtrip(&client, server_app, b"x").is_empty()
    });
    let peers_before = echo.peers().len();
    assert!(
        roundtrip(&client, vip, b"y").is_empty(),
        "service traffic refused too"
    );
    assert_eq!(
        echo.peers().len(),
        peers_before,
        "the application saw nothing"
    );
    wait_until(
        "the refusal is counted and logged with its reason",
        SETTLE,
        || {
            let log = m.proxy_log(&client);
            log.contains("route=\"no-waypoint\"")
                && log.contains("waypoint /10.99.99.99 is not known")
        },
    );
}

#[test]
fn weighted_waypoints_split_a_services_traffic() {
    let mut m = Mesh::new("wwayp");
    let (client, server) = (m.pod("client"), m.pod("server"));
    let (heavy, light) = (m.pod("heavy"), m.pod("light"));
    let vip: SocketAddr = format!("{VIP}:80").parse().unwrap();
    let server_app = SocketAddr::new(server.ip.into(), 8080);
    let weighted = format!(
        ", weightedWaypoints: [{{destination: \"/{}\", weight: 3}}, {{destination: \"/{}\", weight: 1}}]",
        heavy.ip, light.ip
    );
    m.write_config(&config(
        &client,
        &server,
        &[&heavy, &light],
        None,
        &weighted,
    ));
    m.mesh(&client, "client-sa");
    m.mesh(&server, "server-sa");
    let _echo = ambit::lab::EchoServer::start(&server, 8080).unwrap();
    let (to_heavy, to_light) = (
        start_stand_in(&m, &heavy, vip, server_app),
        start_stand_in(&m, &light, vip, server_app),
    );
    let n = 200;
    for i in 0..n {
        let msg = format!("m{i}");
        assert_eq!(roundtrip(&client, vip, msg.as_bytes()), msg.as_bytes());
    }
    let (h, l) = (to_heavy.seen().len(), to_light.seen().len());
    assert_eq!(h + l, n, "every connection went to one of the waypoints");
    // 3:1 of 200 is 150; ±25 is over four standard deviations (σ ≈ 6.1).
    assert!(
        (125..=175).contains(&h),
        "weight-3 waypoint took {h} of {n}"
    );
}

/// A pooled connection to a waypoint carries connection after connection:
/// each ends with the destination's close, which the waypoint passes back as
/// the end of its stream. An HTTP/2 peer counts empty DATA frames that do
/// not end a stream against the connection (h2 ends one past 100 with
/// ENHANCE_YOUR_CALM), so passing an end on as one would cut the pooled
/// connection, and the stream in flight, every hundred connections.
#[test]
fn pooled_connections_to_a_waypoint_carry_hundreds_of_connections_uncut() {
    let mut m = Mesh::new("wpool");
    let (client, server, wp) = (m.pod("client"), m.pod("server"), m.pod("wp"));
    let vip: SocketAddr = format!("{VIP}:80").parse().unwrap();
    let server_app = SocketAddr::new(server.ip.into(), 8080);
    let at_wp = format!(", waypoint: {{destination: \"/{}\"}}", wp.ip);
    m.write_config(&config(&client, &server, &[&wp], None, &at_wp));
    m.mesh(&client, "client-sa");
    m.mesh(&server, "server-sa");
    let _echo = ambit::lab::EchoServer::start(&server, 8080).unwrap();
    let stand_in = start_stand_in(&m, &wp, vip, server_app);
    let n = 250;
    for i in 0..n {
        let msg = format!("m{i}");
        assert_eq!(
            roundtrip(&client, vip, msg.as_bytes()),
            msg.as_bytes(),
            "connection {i} of {n}"
        );
    }
    assert_eq!(stand_in.seen().len(), n);
    // One connection, or two when a connection came before the last one's
    // stream had ended (the pool's spread, the worker threads); a
    // connection cut every hundred streams would make three or more.
    let carried = stand_in.connections();
    assert!(
        (1..=2).contains(&carried),
        "{carried} HBONE connections carried {n} one after another"
    );
}

/// The "sandwich": the waypoint's pod is itself captured by Ambit. Its
/// proxy takes CONNECTs for the workloads it is the waypoint of (the
/// authority is not its own address) and hands them to the waypoint's
/// application on its own address, authority's port; a pod that is not the
/// target's waypoint refuses them.
#[test]
fn a_captured_waypoint_pod_accepts_traffic_for_the_workloads_it_fronts() {
    let mut m = Mesh::new("sandw");
    let (client, server, wp) = (m.pod("client"), m.pod("server"), m.pod("wp"));
    let server_app = SocketAddr::new(server.ip.into(), 8080);
    let at_wp = format!("/{}", wp.ip);
    m.write_config(&config(&client, &server, &[&wp], Some(&at_wp), ""));
    m.mesh(&client, "client-sa");
    m.mesh(&server, "server-sa");
    m.mesh(&wp, "wp-sa");
    let server_echo = ambit::lab::EchoServer::start(&server, 8080).unwrap();
    // The waypoint's application listens on the port traffic is for.
    let waypoint_app = ambit::lab::EchoServer::start(&wp, 8080).unwrap();

    assert_eq!(roundtrip(&client, server_app, b"sandwich"), b"sandwich");
    assert_eq!(
        waypoint_app.peers().len(),
        1,
        "the waypoint's application took it"
    );
    assert!(
        server_echo.peers().is_empty(),
        "nothing went around the waypoint"
    );
    wait_until("the waypoint pod's proxy counts it", SETTLE, || {
        counter(
            &m.metrics(&wp),
            "istio_tcp_connections_opened_total",
            &[
                ("reporter", "destination"),
                ("source_principal", &identity("client-sa")),
            ],
        ) == 1
    });

    // The waypoint taken away: the server is reached directly again, and
    // the former waypoint no longer takes traffic for it.
    m.write_config(&config(&client, &server, &[&wp], None, ""));
    wait_until("direct again", SETTLE, || {
        roundtrip(&client, server_app, b"direct") == b"direct" && !server_echo.peers().is_empty()
    });
    // (Until the proxies reload, a connection may still take the waypoint.)
    let (at_waypoint, at_server) = (waypoint_app.peers().len(), server_echo.peers().len());
    assert_eq!(roundtrip(&client, server_app, b"again"), b"again");
    assert_eq!(
        waypoint_app.peers().len(),
        at_waypoint,
        "the former waypoint took it"
    );
    assert_eq!(server_echo.peers().len(), at_server + 1);
}

/// What a PROXY-protocol application read in front of one connection.
#[derive(Debug, Clone)]
struct ProxyHeaderSeen {
    addresses: ppp::v2::Addresses,
    tlvs: Vec<(u8, Vec<u8>)>,
}

/// An application in `pod` on `127.0.0.1:port` that takes PROXY protocol
/// v2, as a waypoint's inbound binding does: reads the header with a
/// third-party parser, records it, then echoes the rest.
fn proxy_protocol_app(
    pod: &LabPod,
    port: u16,
) -> std::sync::Arc<std::sync::Mutex<Vec<ProxyHeaderSeen>>> {
    use std::io::{Read, Write};
    let listener = pod
        .ns
        .run(move || std::net::TcpListener::bind(("127.0.0.1", port)))
        .unwrap()
        .unwrap();
    let seen: std::sync::Arc<std::sync::Mutex<Vec<ProxyHeaderSeen>>> = Default::default();
    let record = seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let record = record.clone();
            std::thread::spawn(move || {
                let mut fixed = [0u8; 16];
                if conn.read_exact(&mut fixed).is_err() {
                    return;
                }
                let len = u16::from_be_bytes([fixed[14], fixed[15]]) as usize;
                let mut header = fixed.to_vec();
                header.resize(16 + len, 0);
                if conn.read_exact(&mut header[16..]).is_err() {
                    return;
                }
                let Ok(parsed) = ppp::v2::Header::try_from(&header[..]) else {
                    return;
                };
                let tlvs = parsed
                    .tlvs()
                    .filter_map(Result::ok)
                    .map(|t| (t.kind, t.value.to_vec()))
                    .collect();
                record.lock().unwrap().push(ProxyHeaderSeen {
                    addresses: parsed.addresses,
                    tlvs,
                });
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    seen
}

/// istiod's waypoint inbound binding (`ambient.istio.io/waypoint-inbound-
/// binding: PROXY/15088`): the waypoint pod's workload asks for a PROXY
/// application tunnel. Its proxy delivers what it fronts to the tunnel's
/// port on the pod's loopback, first telling the application who called
/// (the peer's address and identity) and where the call was going.
#[test]
fn a_waypoint_with_a_proxy_binding_is_told_who_called_and_where_in_a_proxy_header() {
    let mut m = Mesh::new("wp-ppp");
    let (client, server, wp) = (m.pod("client"), m.pod("server"), m.pod("wp"));
    let vip: SocketAddr = format!("{VIP}:80").parse().unwrap();
    let service_wp = format!(", waypoint: {{destination: \"/{}\"}}", wp.ip);
    let cfg = config(&client, &server, &[&wp], None, &service_wp);
    let wp_line = workload(&wp, "wp-sa", "HBONE");
    let tunnel = format!(
        "{}, applicationTunnel: {{protocol: PROXY, port: 15088}}}}\n",
        wp_line.trim_end().trim_end_matches('}')
    );
    m.write_config(&cfg.replace(&wp_line, &tunnel));
    m.mesh(&client, "client-sa");
    m.mesh(&server, "server-sa");
    m.mesh(&wp, "wp-sa");
    let server_echo = ambit::lab::EchoServer::start(&server, 8080).unwrap();
    // Were the tunnel ignored, the waypoint's connection would land here.
    let unbound = ambit::lab::EchoServer::start(&wp, 80).unwrap();
    let headers = proxy_protocol_app(&wp, 15088);

    assert_eq!(
        roundtrip(&client, vip, b"through the binding"),
        b"through the binding"
    );
    let seen = headers.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    match &seen[0].addresses {
        ppp::v2::Addresses::IPv4(a) => {
            assert_eq!(a.source_address, client.ip, "the caller's address");
            assert_eq!(
                SocketAddr::new(a.destination_address.into(), a.destination_port),
                vip,
                "where the call was going"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        seen[0].tlvs,
        [(0xD0, identity("client-sa").into_bytes())],
        "the caller's identity, as ztunnel sends it"
    );
    assert!(unbound.peers().is_empty() && server_echo.peers().is_empty());
}
