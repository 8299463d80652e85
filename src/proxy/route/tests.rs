//! Routing decisions: pods, services, waypoints, shared VIPs.

use super::*;
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
