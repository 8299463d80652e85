//! Routing decisions: pods, services, waypoints, shared VIPs.

use super::*;
use std::collections::BTreeMap;
use std::path::Path;

fn state() -> State {
    crate::xds::local::parse(
        Path::new("t.yaml"),
        r#"
workloads:
- {name: server, namespace: default, serviceAccount: srv, workloadIps: [10.0.0.3], protocol: HBONE,
   services: {"default/echo.default.svc.cluster.local": {80: 8080}}}
- {name: legacy, namespace: default, workloadIps: [10.0.0.4], protocol: TCP}
- {name: sick, namespace: default, workloadIps: [10.0.0.5], protocol: HBONE, status: Unhealthy,
   services: {"default/lonely.default.svc.cluster.local": {80: 80}}}
services:
- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: ["/10.96.0.10"], ports: {80: 9090},
   subjectAltNames: ["spiffe://cluster.local/ns/default/sa/alt"]}
- {name: lonely, namespace: default, hostname: lonely.default.svc.cluster.local, vips: ["/10.96.0.11"], ports: {80: 80}}
"#,
    )
    .unwrap()
}

fn r(dst: &str) -> Route {
    let client = Client {
        namespace: "default",
        name: "client",
        ips: &[],
    };
    route(&state(), "", client, dst.parse().unwrap(), "cluster.local")
}

/// A mesh where `api` (service and pods) has waypoints of every form.
fn waypoint_state() -> State {
    crate::xds::local::parse(
        Path::new("w.yaml"),
        r#"
workloads:
- {name: wp, namespace: shop, serviceAccount: waypoint, workloadIps: [10.0.0.9], protocol: HBONE,
   services: {"shop/wp.shop.svc.cluster.local": {15008: 15008}}}
- {name: wp2, namespace: shop, serviceAccount: waypoint2, workloadIps: [10.0.0.10], protocol: HBONE}
- {name: api, namespace: shop, serviceAccount: api, workloadIps: [10.0.0.3], protocol: HBONE,
   waypoint: {destination: "/10.0.0.9", hboneMtlsPort: 15008},
   services: {"shop/api.shop.svc.cluster.local": {80: 8080}}}
- {name: by-name, namespace: shop, workloadIps: [10.0.0.4], protocol: HBONE,
   waypoint: {destination: "shop/wp.shop.svc.cluster.local"}}
- {name: orphan, namespace: shop, workloadIps: [10.0.0.5], protocol: HBONE,
   waypoint: {destination: "/10.0.0.99"}}
services:
- {name: api, namespace: shop, hostname: api.shop.svc.cluster.local, vips: ["/10.96.0.20"], ports: {80: 8080},
   waypoint: {destination: "/10.0.0.9", hboneMtlsPort: 15008}}
- {name: wp, namespace: shop, hostname: wp.shop.svc.cluster.local, vips: ["/10.96.0.9"], ports: {15008: 15008}}
- {name: split, namespace: shop, hostname: split.shop.svc.cluster.local, vips: ["/10.96.0.21"], ports: {80: 8080},
   weightedWaypoints: [{destination: "/10.0.0.9", weight: 3}, {destination: "/10.0.0.10", weight: 1}]}
- {name: gone, namespace: shop, hostname: gone.shop.svc.cluster.local, vips: ["/10.96.0.22"], ports: {80: 8080},
   waypoint: {destination: "shop/nowhere.shop.svc.cluster.local"}}
"#,
    )
    .unwrap()
}

fn from(src: &[&str], dst: &str) -> Route {
    let src: Vec<IpAddr> = src.iter().map(|s| s.parse().unwrap()).collect();
    let client = Client {
        namespace: "shop",
        name: "client",
        ips: &src,
    };
    route(
        &waypoint_state(),
        "",
        client,
        dst.parse().unwrap(),
        "cluster.local",
    )
}

fn waypoint_hop(route: Route) -> (SocketAddr, SocketAddr, Vec<Identity>) {
    match route {
        Route::Hbone {
            proxy,
            target,
            identities,
            waypoint: true,
            ..
        } => (proxy, target, identities),
        other => panic!("not through a waypoint: {other:?}"),
    }
}

#[test]
fn service_and_workload_traffic_goes_to_the_waypoint_with_the_original_destination() {
    let waypoint = Identity::new("cluster.local", "shop", "waypoint");
    // Service-addressed: the authority is the service VIP and port.
    let (proxy, target, ids) = waypoint_hop(from(&["10.0.0.2"], "10.96.0.20:80"));
    assert_eq!(proxy, "10.0.0.9:15008".parse().unwrap());
    assert_eq!(target, "10.96.0.20:80".parse().unwrap());
    assert_eq!(
        ids,
        vec![waypoint.clone()],
        "the client checks the waypoint's identity"
    );
    // Workload-addressed: the authority is the pod IP and port.
    let (proxy, target, ids) = waypoint_hop(from(&["10.0.0.2"], "10.0.0.3:8080"));
    assert_eq!(
        (proxy, target),
        (
            "10.0.0.9:15008".parse().unwrap(),
            "10.0.0.3:8080".parse().unwrap()
        )
    );
    assert_eq!(ids, vec![waypoint.clone()]);
    // A waypoint named by hostname: one of that service's endpoints.
    let (proxy, _, ids) = waypoint_hop(from(&["10.0.0.2"], "10.0.0.4:8080"));
    assert_eq!(
        (proxy, ids),
        ("10.0.0.9:15008".parse().unwrap(), vec![waypoint])
    );
}

#[test]
fn the_waypoints_own_traffic_goes_to_the_destination() {
    match from(&["10.0.0.9"], "10.0.0.3:8080") {
        Route::Hbone {
            proxy,
            waypoint: false,
            ..
        } => assert_eq!(proxy, "10.0.0.3:15008".parse().unwrap()),
        other => panic!("{other:?}"),
    }
    match from(&["10.0.0.9"], "10.96.0.20:80") {
        Route::Hbone {
            target,
            waypoint: false,
            ..
        } => assert_eq!(target, "10.0.0.3:8080".parse().unwrap()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_unknown_waypoint_refuses_instead_of_bypassing() {
    for dst in ["10.0.0.5:8080", "10.96.0.22:80"] {
        match from(&["10.0.0.2"], dst) {
            Route::NoWaypoint { reason } => assert!(reason.contains("not known"), "{reason}"),
            other => panic!("{dst}: {other:?}"),
        }
    }
}

#[test]
fn weighted_waypoints_split_by_weight() {
    let n = 4000;
    let to_first = (0..n)
        .filter(|_| {
            waypoint_hop(from(&["10.0.0.2"], "10.96.0.21:80"))
                .0
                .ip()
                .to_string()
                == "10.0.0.9"
        })
        .count();
    // 3:1 → 75 %; 4000 draws land within ±4 points far beyond chance.
    let share = to_first as f64 / n as f64;
    assert!(
        (0.71..0.79).contains(&share),
        "share to the weight-3 waypoint: {share}"
    );
}

#[test]
fn meshed_pod_goes_over_hbone_to_15008() {
    match r("10.0.0.3:8080") {
        Route::Hbone {
            proxy,
            target,
            identities,
            ..
        } => {
            assert_eq!(proxy, "10.0.0.3:15008".parse().unwrap());
            assert_eq!(target, "10.0.0.3:8080".parse().unwrap());
            assert_eq!(
                identities,
                vec![Identity::new("cluster.local", "default", "srv")]
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn vip_maps_to_endpoint_target_port_with_service_sans() {
    match r("10.96.0.10:80") {
        Route::Hbone {
            target,
            identities,
            service,
            ..
        } => {
            assert_eq!(
                target,
                "10.0.0.3:8080".parse().unwrap(),
                "workload port override wins"
            );
            assert_eq!(identities.len(), 2);
            assert_eq!(service.unwrap().name, "echo");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(r("10.96.0.10:81"), Route::NoEndpoint { .. }),
        "port not in service"
    );
    assert!(
        matches!(r("10.96.0.11:80"), Route::NoEndpoint { .. }),
        "only endpoint is unhealthy"
    );
}

#[test]
fn tcp_workload_and_unknown_destinations() {
    assert!(matches!(r("10.0.0.4:80"), Route::Tcp { .. }));
    assert!(matches!(r("192.0.2.1:443"), Route::Passthrough { .. }));
}

#[test]
fn a_shared_vip_routes_to_the_clients_own_namespace_first() {
    let st = crate::xds::local::parse(
        Path::new("v.yaml"),
        r#"
workloads:
- {name: db-a, namespace: shop, workloadIps: [10.0.0.21], protocol: HBONE, services: {"shop/db.example.com": {5432: 5432}}}
- {name: db-b, namespace: bank, workloadIps: [10.0.0.22], protocol: HBONE, services: {"bank/db.example.com": {5432: 5432}}}
services:
- {name: db, namespace: shop, hostname: db.example.com, vips: ["/10.96.0.40"], ports: {5432: 5432}}
- {name: db, namespace: bank, hostname: db.example.com, vips: ["/10.96.0.40"], ports: {5432: 5432}}
"#,
    )
    .unwrap();
    let target = |ns: &str| match route(
        &st,
        "",
        Client {
            namespace: ns,
            name: "client",
            ips: &[],
        },
        "10.96.0.40:5432".parse().unwrap(),
        "cluster.local",
    ) {
        Route::Hbone { target, .. } => target.ip().to_string(),
        other => panic!("{other:?}"),
    };
    assert_eq!(target("shop"), "10.0.0.21");
    assert_eq!(target("bank"), "10.0.0.22");
    assert_eq!(target("elsewhere"), "10.0.0.21", "else the first to arrive");
}

#[test]
fn waypoints_of_waypoints_never_loop() {
    // Each waypoint is the other's: every hop's source is the next
    // hop's waypoint, so its traffic goes on instead of back.
    let st = crate::xds::local::parse(
        Path::new("loop.yaml"),
        r#"
workloads:
- {name: w1, namespace: shop, serviceAccount: w1, workloadIps: [10.0.0.31], protocol: HBONE, waypoint: {destination: "/10.0.0.32"}}
- {name: w2, namespace: shop, serviceAccount: w2, workloadIps: [10.0.0.32], protocol: HBONE, waypoint: {destination: "/10.0.0.31"}}
"#,
    )
    .unwrap();
    let hop = |from: &str, to: &str| {
        let ips: Vec<IpAddr> = vec![from.parse().unwrap()];
        let client = Client {
            namespace: "shop",
            name: "client",
            ips: &ips,
        };
        match route(&st, "", client, to.parse().unwrap(), "cluster.local") {
            Route::Hbone {
                proxy, waypoint, ..
            } => (proxy.ip().to_string(), waypoint),
            other => panic!("{other:?}"),
        }
    };
    // A client to w1 goes through w1's waypoint, w2...
    assert_eq!(hop("10.0.0.2", "10.0.0.31:80"), ("10.0.0.32".into(), true));
    // ...and w2, w1's waypoint, goes on to w1 itself, not to w1's
    // waypoint's waypoint (w1) as a waypoint hop, nor back to itself.
    assert_eq!(
        hop("10.0.0.32", "10.0.0.31:80"),
        ("10.0.0.31".into(), false)
    );
}

/// A state from local-config YAML that keeps what fits and holds the
/// refused resources' addresses as refused (as the xDS client does).
fn lenient(yaml: &str) -> State {
    let cfg: crate::xds::local::LocalConfig = serde_yaml::from_str(yaml).unwrap();
    State::build_lenient(cfg.workloads, cfg.services, cfg.policies).0
}

fn routed_from(st: &State, ns: &str, name: &str, src: &str, dst: &str) -> Route {
    let ips: Vec<IpAddr> = vec![src.parse().unwrap()];
    let client = Client {
        namespace: ns,
        name,
        ips: &ips,
    };
    route(st, "", client, dst.parse().unwrap(), "cluster.local")
}

/// The name of the workload a route ends at (its endpoint, or waypoint).
fn endpoint_of(r: &Route) -> String {
    match r {
        Route::Hbone { workload, .. }
        | Route::Tcp { workload, .. }
        | Route::Gateway { workload, .. } => workload.name.to_string(),
        other => panic!("no endpoint: {other:?}"),
    }
}

/// How many of `n` connections from `client` to `dst` end at each workload.
fn spread(st: &State, client: &str, dst: &str, n: usize) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for _ in 0..n {
        *seen
            .entry(endpoint_of(&routed_from(
                st, "shop", client, "10.1.0.1", dst,
            )))
            .or_default() += 1;
    }
    seen
}

/// istiod's shape: the waypoint Service carries FAILOVER over
/// [NETWORK, REGION, ZONE, SUBZONE]; the workload and its service name the
/// waypoint by hostname.
const ISTIOD_MESH: &str = r#"
workloads:
- {uid: c//Pod/shop/client, name: client, namespace: shop, workloadIps: [10.1.0.1], protocol: HBONE,
   node: n1, locality: {region: r, zone: a}}
- {uid: c//Pod/shop/wp-a, name: wp-a, namespace: shop, serviceAccount: waypoint, workloadIps: [10.1.0.9], protocol: HBONE,
   node: n1, locality: {region: r, zone: a}, services: {"shop/waypoint.shop.svc.cluster.local": {15008: 15008}}}
- {uid: c//Pod/shop/wp-b, name: wp-b, namespace: shop, serviceAccount: waypoint, workloadIps: [10.1.0.10], protocol: HBONE,
   node: n2, locality: {region: r, zone: b}, services: {"shop/waypoint.shop.svc.cluster.local": {15008: 15008}}}
- {uid: c//Pod/shop/api, name: api, namespace: shop, serviceAccount: api, workloadIps: [10.1.0.3], protocol: HBONE,
   node: n2, waypoint: {destination: "shop/waypoint.shop.svc.cluster.local", hboneMtlsPort: 15008},
   services: {"shop/api.shop.svc.cluster.local": {80: 8080}}}
services:
- {name: waypoint, namespace: shop, hostname: waypoint.shop.svc.cluster.local, vips: ["/10.96.0.9"],
   ports: {15008: 15008, 15021: 15021},
   loadBalancer: {routingPreferences: [NETWORK, REGION, ZONE, SUBZONE], mode: FAILOVER}}
- {name: api, namespace: shop, hostname: api.shop.svc.cluster.local, vips: ["/10.96.0.20"], ports: {80: 8080},
   waypoint: {destination: "shop/waypoint.shop.svc.cluster.local", hboneMtlsPort: 15008},
   loadBalancer: {routingPreferences: [NETWORK, REGION, ZONE, SUBZONE], mode: FAILOVER}}
"#;

#[test]
fn istiods_waypoint_by_hostname_with_failover_takes_pod_and_service_traffic() {
    let st = lenient(ISTIOD_MESH);
    for dst in ["10.1.0.3:8080", "10.96.0.20:80"] {
        let r = routed_from(&st, "shop", "client", "10.1.0.1", dst);
        let (proxy, target, ids) = waypoint_hop(r.clone());
        // The waypoint in the client's own zone, on its HBONE port, with
        // the original destination as the CONNECT authority.
        assert_eq!(proxy, "10.1.0.9:15008".parse().unwrap(), "{dst}");
        assert_eq!(target, dst.parse().unwrap());
        assert_eq!(
            ids[0].to_string(),
            "spiffe://cluster.local/ns/shop/sa/waypoint"
        );
    }
    // The waypoint's own traffic goes on to the destination, whichever
    // of the waypoint's pods sends it.
    for wp in ["10.1.0.9", "10.1.0.10"] {
        let r = routed_from(&st, "shop", "wp", wp, "10.96.0.20:80");
        assert!(
            matches!(&r, Route::Hbone { waypoint: false, target, .. } if *target == "10.1.0.3:8080".parse().unwrap()),
            "{r:?}"
        );
    }
}

#[test]
fn failover_keeps_to_the_clients_zone_while_it_has_a_healthy_endpoint() {
    let mesh = |zone_a_health: &str| {
        lenient(&format!(
            r#"
workloads:
- {{name: client, namespace: shop, workloadIps: [10.1.0.1], protocol: HBONE, locality: {{region: r, zone: a}}}}
- {{name: a1, namespace: shop, workloadIps: [10.1.1.1], protocol: HBONE, status: {zone_a_health},
   locality: {{region: r, zone: a}}, services: {{"shop/db.shop": {{5432: 5432}}}}}}
- {{name: a2, namespace: shop, workloadIps: [10.1.1.2], protocol: HBONE, status: {zone_a_health},
   locality: {{region: r, zone: a}}, services: {{"shop/db.shop": {{5432: 5432}}}}}}
- {{name: a3, namespace: shop, workloadIps: [10.1.1.3], protocol: HBONE, capacity: 0,
   locality: {{region: r, zone: a}}, services: {{"shop/db.shop": {{5432: 5432}}}}}}
- {{name: b1, namespace: shop, workloadIps: [10.1.2.1], protocol: HBONE,
   locality: {{region: r, zone: b}}, services: {{"shop/db.shop": {{5432: 5432}}}}}}
- {{name: far, namespace: shop, workloadIps: [10.1.3.1], protocol: HBONE,
   locality: {{region: q, zone: a}}, services: {{"shop/db.shop": {{5432: 5432}}}}}}
services:
- {{name: db, namespace: shop, hostname: db.shop, vips: ["/10.96.1.1"], ports: {{5432: 5432}},
   loadBalancer: {{routingPreferences: [REGION, ZONE], mode: FAILOVER}}}}
"#
        ))
    };
    let local = spread(&mesh("Healthy"), "client", "10.96.1.1:5432", 400);
    assert_eq!(local.keys().collect::<Vec<_>>(), ["a1", "a2"], "{local:?}");
    // Both shares within 35-65% of 400.
    assert!(local.values().all(|n| (140..=260).contains(n)), "{local:?}");
    // Zone a down (but for a3, whose capacity 0 holds no rank): the same
    // region's other zone, never the other region.
    let failed_over = spread(&mesh("Unhealthy"), "client", "10.96.1.1:5432", 100);
    assert_eq!(failed_over.keys().collect::<Vec<_>>(), ["b1"]);
}

#[test]
fn strict_over_node_never_leaves_the_node_and_refuses_when_none_is_there() {
    let st = lenient(
        r#"
workloads:
- {name: here, namespace: shop, workloadIps: [10.1.0.1], node: n1}
- {name: there, namespace: shop, workloadIps: [10.1.0.2], node: n2}
- {name: local-ep, namespace: shop, workloadIps: [10.1.1.1], protocol: HBONE, node: n1,
   services: {"shop/logs.shop": {514: 514}}}
- {name: remote-ep, namespace: shop, workloadIps: [10.1.1.2], protocol: HBONE, node: n3,
   services: {"shop/logs.shop": {514: 514}}}
services:
- {name: logs, namespace: shop, hostname: logs.shop, vips: ["/10.96.2.1"], ports: {514: 514},
   loadBalancer: {routingPreferences: [NODE], mode: STRICT}}
"#,
    );
    let seen = spread(&st, "here", "10.96.2.1:514", 200);
    assert_eq!(seen.keys().collect::<Vec<_>>(), ["local-ep"]);
    match routed_from(&st, "shop", "there", "10.1.0.2", "10.96.2.1:514") {
        Route::NoEndpoint { reason, .. } => {
            assert!(reason.contains("STRICT over [NODE]"), "{reason}")
        }
        other => panic!("left the node: {other:?}"),
    }
}

#[test]
fn allow_all_capacity_and_passthrough_modes() {
    let st = lenient(
        r#"
workloads:
- {name: client, namespace: shop, workloadIps: [10.1.0.1]}
- {name: starting, namespace: shop, workloadIps: [10.1.1.1], protocol: HBONE, status: Unhealthy,
   services: {"shop/ready.shop": {80: 80}, "shop/not-ready.shop": {80: 80}}}
- {name: big, namespace: shop, workloadIps: [10.1.2.1], protocol: HBONE, capacity: 3,
   services: {"shop/weighted.shop": {80: 80}, "shop/drained.shop": {80: 80}}}
- {name: small, namespace: shop, workloadIps: [10.1.2.2], protocol: HBONE,
   services: {"shop/weighted.shop": {80: 80}}}
- {name: off, namespace: shop, workloadIps: [10.1.2.3], protocol: HBONE, capacity: 0,
   services: {"shop/weighted.shop": {80: 80}}}
- {name: off2, namespace: shop, workloadIps: [10.1.2.4], protocol: HBONE, capacity: 0,
   services: {"shop/zero.shop": {80: 80}}}
services:
- {name: ready, namespace: shop, hostname: ready.shop, vips: ["/10.96.3.1"], ports: {80: 80}}
- {name: not-ready, namespace: shop, hostname: not-ready.shop, vips: ["/10.96.3.2"], ports: {80: 80},
   loadBalancer: {healthPolicy: ALLOW_ALL}}
- {name: weighted, namespace: shop, hostname: weighted.shop, vips: ["/10.96.3.3"], ports: {80: 80}}
- {name: zero, namespace: shop, hostname: zero.shop, vips: ["/10.96.3.4"], ports: {80: 80}}
- {name: kube, namespace: shop, hostname: kube.shop, vips: ["/10.96.3.5"], ports: {80: 80},
   loadBalancer: {mode: PASSTHROUGH}}
"#,
    );
    let at = |dst: &str| routed_from(&st, "shop", "client", "10.1.0.1", dst);
    assert!(matches!(at("10.96.3.1:80"), Route::NoEndpoint { .. }));
    assert_eq!(endpoint_of(&at("10.96.3.2:80")), "starting", "ALLOW_ALL");
    let seen = spread(&st, "client", "10.96.3.3:80", 800);
    assert_eq!(seen.get("off"), None, "capacity 0 is never chosen");
    // 3:1 = 600:200; within 525..675.
    assert!((525..=675).contains(&seen["big"]), "{seen:?}");
    match at("10.96.3.4:80") {
        Route::NoEndpoint { reason, .. } => assert!(reason.contains("capacity 0"), "{reason}"),
        other => panic!("{other:?}"),
    }
    match at("10.96.3.5:80") {
        Route::Passthrough { target } => assert_eq!(target, "10.96.3.5:80".parse().unwrap()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_refused_resources_addresses_are_refused_never_passed_through() {
    let st = lenient(
        r#"
workloads:
- {name: client, namespace: shop, workloadIps: [10.1.0.1]}
- {name: gated, namespace: shop, workloadIps: [10.1.5.1], applicationTunnel: {protocol: PROXY}}
- {name: twice, namespace: shop, uid: dup, workloadIps: [10.1.5.2]}
- {name: twice2, namespace: shop, uid: dup, workloadIps: [10.1.5.3]}
services:
- {name: ext, namespace: shop, hostname: ext.shop, vips: ["/10.96.5.1"], cidrVips: ["/10.97.0.0/16"],
   ports: {80: 80}, weightedWaypoints: [{destination: "/10.1.0.9", weight: 0}]}
- {name: range, namespace: shop, hostname: range.shop, cidrVips: ["/10.98.0.0/16"], ports: {80: 80}}
- {name: narrow, namespace: shop, hostname: narrow.shop, cidrVips: ["/10.98.7.0/24"], ports: {80: 80}}
"#,
    );
    let at = |dst: &str| routed_from(&st, "shop", "client", "10.1.0.1", dst);
    for (dst, why) in [
        ("10.1.5.1:80", "PROXY"),
        ("10.96.5.1:80", "total weight of 0"),
        ("10.97.44.1:80", "total weight of 0"),
        ("10.1.5.3:80", "used twice"),
    ] {
        match at(dst) {
            Route::Refused { reason, .. } => assert!(reason.contains(why), "{dst}: {reason}"),
            other => panic!("{dst}: {other:?}"),
        }
    }
    // A CIDR VIP is a service's like a VIP: the longest prefix wins.
    for (dst, svc) in [("10.98.1.2:80", "range"), ("10.98.7.9:80", "narrow")] {
        match at(dst) {
            Route::NoEndpoint { service, .. } => assert_eq!(service.name, svc, "{dst}"),
            other => panic!("{dst}: {other:?}"),
        }
    }
    assert!(matches!(at("10.99.0.1:80"), Route::Passthrough { .. }));
}

#[test]
fn a_dual_stack_endpoint_is_dialled_on_the_callers_family_within_the_services() {
    let st = lenient(
        r#"
workloads:
- {name: client, namespace: shop, workloadIps: [10.1.0.1, "fd00::1"]}
- {name: web, namespace: shop, workloadIps: [10.1.6.1, "fd00::6:1"], protocol: HBONE,
   services: {"shop/web.shop": {80: 8080}, "shop/web4.shop": {80: 8080}}}
services:
- {name: web, namespace: shop, hostname: web.shop, vips: ["/10.96.6.1", "/fd00:96::6:1"], ports: {80: 80},
   ipFamilies: Dual}
- {name: web4, namespace: shop, hostname: web4.shop, vips: ["/10.96.6.4", "/fd00:96::6:4"], ports: {80: 80},
   ipFamilies: IPv4}
"#,
    );
    let target = |dst: &str| match routed_from(&st, "shop", "client", "10.1.0.1", dst) {
        Route::Hbone { target, .. } => target,
        other => panic!("{other:?}"),
    };
    assert_eq!(target("10.96.6.1:80"), "10.1.6.1:8080".parse().unwrap());
    assert_eq!(
        target("[fd00:96::6:1]:80"),
        "[fd00::6:1]:8080".parse().unwrap()
    );
    // An IPv4-only service is dialled on IPv4 even from an IPv6 caller.
    assert_eq!(
        target("[fd00:96::6:4]:80"),
        "10.1.6.1:8080".parse().unwrap()
    );
}

#[test]
fn broken_waypoints_refuse_with_a_reason_and_never_loop() {
    let st = lenient(
        r#"
workloads:
- {name: client, namespace: shop, workloadIps: [10.1.0.1]}
- {name: a, namespace: shop, workloadIps: [10.1.7.1], protocol: HBONE,
   waypoint: {destination: "shop/nowhere.shop"}}
- {name: b, namespace: shop, workloadIps: [10.1.7.2], protocol: HBONE,
   waypoint: {destination: "shop/empty-wp.shop"}}
- {name: c, namespace: shop, workloadIps: [10.1.7.3], protocol: HBONE,
   waypoint: {destination: "shop/strict-wp.shop"}}
- {name: wp, namespace: shop, workloadIps: [10.1.7.9], protocol: HBONE, node: n9,
   services: {"shop/strict-wp.shop": {15008: 15008}}}
- {name: d, namespace: shop, workloadIps: [10.1.7.4], protocol: HBONE,
   waypoint: {destination: "shop/self-wp.shop"}, services: {"shop/self-wp.shop": {15008: 15008}}}
services:
- {name: empty-wp, namespace: shop, hostname: empty-wp.shop, vips: ["/10.96.7.2"], ports: {15008: 15008}}
- {name: strict-wp, namespace: shop, hostname: strict-wp.shop, vips: ["/10.96.7.3"], ports: {15008: 15008},
   loadBalancer: {routingPreferences: [NODE], mode: STRICT}}
- {name: self-wp, namespace: shop, hostname: self-wp.shop, vips: ["/10.96.7.4"], ports: {15008: 15008}}
"#,
    );
    for (dst, why) in [
        ("10.1.7.1:80", "not known"),
        ("10.1.7.2:80", "no endpoint"),
        ("10.1.7.3:80", "STRICT over [NODE]"),
    ] {
        match routed_from(&st, "shop", "client", "10.1.0.1", dst) {
            Route::NoWaypoint { reason } => assert!(reason.contains(why), "{dst}: {reason}"),
            other => panic!("{dst}: {other:?}"),
        }
    }
    // A workload that is its own waypoint: others go through it (to it),
    // and its own traffic goes on, never back to itself as a waypoint.
    let r = routed_from(&st, "shop", "d", "10.1.7.4", "10.1.7.4:80");
    assert!(
        matches!(
            r,
            Route::Hbone {
                waypoint: false,
                ..
            }
        ),
        "{r:?}"
    );
}

#[test]
fn a_pods_call_to_the_proxys_own_ports_is_a_self_call_never_passed_through() {
    let st = state();
    let pod: Vec<IpAddr> = vec!["10.0.0.2".parse().unwrap(), "fd00::2".parse().unwrap()];
    let at = |dst: &str| {
        let client = Client {
            namespace: "default",
            name: "client",
            ips: &pod,
        };
        route(&st, "", client, dst.parse().unwrap(), "cluster.local")
    };
    for dst in [
        "127.0.0.1:15001",
        "127.0.0.1:15006",
        "[::1]:15008",
        "0.0.0.0:15053",
        "10.0.0.2:15001",
        "[fd00::2]:15020",
        "[::ffff:127.0.0.1]:15001",
        "127.0.0.1:15000",
        "10.0.0.2:15021",
    ] {
        assert!(matches!(at(dst), Route::SelfCall), "{dst}");
    }
    // Another pod's ports, and the pod's other ports, route as ever.
    assert!(matches!(at("10.0.0.3:15001"), Route::Hbone { .. }));
    assert!(matches!(at("10.0.0.99:15001"), Route::Passthrough { .. }));
    assert!(matches!(at("127.0.0.1:8080"), Route::Passthrough { .. }));
}

mod networks;
