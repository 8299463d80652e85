//! Routing across networks: local endpoints directly, the others (and
//! their waypoints) through their network's gateway, and every refusal.

use super::*;

/// A multi-network mesh as istiod sends it to a node on `net1`: every
/// workload names its own network's east-west gateway (WDS is the same for
/// every client), the services' endpoints on `net2` come as one
/// address-less "split horizon" workload with `net2`'s gateway, the
/// gateway itself as a workload, and a global service's SANs list every
/// network's identities.
const TWO_NETWORKS: &str = r#"
workloads:
- {uid: c1//Pod/shop/client, name: client, namespace: shop, network: net1, workloadIps: [10.1.0.1],
   protocol: HBONE, networkGateway: {destination: "net1/172.18.0.10", hboneMtlsPort: 15008}}
- {uid: c1//Pod/shop/api-1, name: api-1, namespace: shop, serviceAccount: api, network: net1,
   workloadIps: [10.1.0.3], protocol: HBONE,
   networkGateway: {destination: "net1/172.18.0.10", hboneMtlsPort: 15008},
   services: {"shop/api.shop.svc.cluster.local": {80: 8080}}}
- {uid: "net2/SplitHorizonWorkload/istio-system/eastwest/172.18.1.10/shop/api.shop.svc.cluster.local",
   name: "net2/SplitHorizonWorkload/istio-system/eastwest/172.18.1.10/shop/api.shop.svc.cluster.local",
   namespace: shop, network: net2, protocol: HBONE, capacity: 2,
   networkGateway: {destination: "net2/172.18.1.10", hboneMtlsPort: 15008},
   services: {"shop/api.shop.svc.cluster.local": {80: 8080}}}
- {uid: "net2/SplitHorizonWorkload/istio-system/eastwest/172.18.1.10/shop/db.shop.svc.cluster.local",
   name: "net2/SplitHorizonWorkload/istio-system/eastwest/172.18.1.10/shop/db.shop.svc.cluster.local",
   namespace: shop, network: net2, protocol: HBONE,
   networkGateway: {destination: "net2/172.18.1.10", hboneMtlsPort: 15008},
   services: {"shop/db.shop.svc.cluster.local": {5432: 5432}}}
- {uid: NetworkGateway/net2/172.18.1.10/15008, name: NetworkGateway/net2/172.18.1.10/15008,
   namespace: istio-system, serviceAccount: eastwestgateway, network: net2, workloadIps: [172.18.1.10]}
- {uid: c3//Pod/shop/cache-1, name: cache-1, namespace: shop, network: net3, workloadIps: [10.3.0.5],
   protocol: HBONE, services: {"shop/cache.shop.svc.cluster.local": {6379: 6379}}}
- {uid: c1//Pod/shop/report, name: report, namespace: shop, network: net1, workloadIps: [10.1.0.7],
   protocol: HBONE, waypoint: {destination: "net2/172.18.1.10", hboneMtlsPort: 15008}}
- {uid: "net4/SplitHorizonWorkload/x/lost", name: lost-split, namespace: shop, network: net4,
   protocol: HBONE, networkGateway: {destination: "net4/172.18.4.10", hboneMtlsPort: 15008},
   services: {"shop/lost.shop.svc.cluster.local": {80: 80}}}
- {uid: "net5/SplitHorizonWorkload/x/astray", name: astray-split, namespace: shop, network: net5,
   protocol: HBONE, networkGateway: {destination: "net2/172.18.1.10", hboneMtlsPort: 15008},
   services: {"shop/astray.shop.svc.cluster.local": {80: 80}}}
- {uid: c6//Pod/shop/loop-1, name: loop-1, namespace: shop, serviceAccount: loop, network: net6,
   workloadIps: [172.18.6.10], protocol: HBONE,
   networkGateway: {destination: "net6/172.18.6.10", hboneMtlsPort: 15008},
   services: {"shop/loop.shop.svc.cluster.local": {80: 80}}}
- {uid: "net2/SplitHorizonWorkload/x/bare", name: bare-split, namespace: shop, network: net2,
   protocol: HBONE, networkGateway: {destination: "net2/172.18.1.10", hboneMtlsPort: 15008},
   services: {"shop/bare.shop.svc.cluster.local": {80: 80}}}
- {uid: "net7/SplitHorizonWorkload/x/web", name: web-split, namespace: shop, network: net7,
   protocol: HBONE, networkGateway: {destination: "istio-system/eastwest.istio-system.svc.cluster.local",
   hboneMtlsPort: 15443}, services: {"shop/web.shop.svc.cluster.local": {80: 80}}}
- {uid: c7//Pod/istio-system/eastwest-1, name: eastwest-1, namespace: istio-system,
   serviceAccount: eastwest, network: net7, workloadIps: [172.18.7.10], protocol: HBONE,
   services: {"istio-system/eastwest.istio-system.svc.cluster.local": {15443: 15008}}}
- {uid: "net7/SplitHorizonWorkload/x/eastwest", name: eastwest-split, namespace: istio-system,
   network: net7, protocol: HBONE, networkGateway: {destination:
   "istio-system/eastwest.istio-system.svc.cluster.local", hboneMtlsPort: 15443},
   services: {"istio-system/eastwest.istio-system.svc.cluster.local": {15443: 15008}}}
- {uid: "net2/SplitHorizonWorkload/x/wp", name: wp-split, namespace: shop, network: net2,
   protocol: HBONE, networkGateway: {destination: "net2/172.18.1.10", hboneMtlsPort: 15008},
   services: {"shop/wp.shop.svc.cluster.local": {15008: 15008}}}
- {uid: c1//Pod/shop/ledger, name: ledger, namespace: shop, network: net1, workloadIps: [10.1.0.8],
   protocol: HBONE, waypoint: {destination: "shop/wp.shop.svc.cluster.local"}}
services:
- {name: api, namespace: shop, hostname: api.shop.svc.cluster.local, vips: ["net1/10.96.0.20"],
   ports: {80: 8080}, subjectAltNames: ["spiffe://cluster.local/ns/shop/sa/api"]}
- {name: wp, namespace: shop, hostname: wp.shop.svc.cluster.local, vips: ["net1/10.96.0.70"],
   ports: {15008: 15008}, subjectAltNames: ["spiffe://cluster.local/ns/shop/sa/wp"]}
- {name: pay, namespace: shop, hostname: pay.shop.svc.cluster.local, vips: ["net1/10.96.0.71"],
   ports: {443: 8443}, waypoint: {destination: "shop/wp.shop.svc.cluster.local"}}
- {name: web, namespace: shop, hostname: web.shop.svc.cluster.local, vips: ["net1/10.96.0.60"],
   ports: {80: 80}, subjectAltNames: ["spiffe://cluster.local/ns/shop/sa/web"]}
- {name: eastwest, namespace: istio-system, hostname: eastwest.istio-system.svc.cluster.local,
   vips: ["net1/10.96.0.61"], ports: {15443: 15008},
   subjectAltNames: ["spiffe://cluster.local/ns/istio-system/sa/eastwest-svc"]}
- {name: db, namespace: shop, hostname: db.shop.svc.cluster.local, vips: ["net1/10.96.0.30"],
   ports: {5432: 5432}, subjectAltNames: ["spiffe://cluster.local/ns/shop/sa/db"]}
- {name: cache, namespace: shop, hostname: cache.shop.svc.cluster.local, vips: ["net1/10.96.0.40"],
   ports: {6379: 6379}}
- {name: lost, namespace: shop, hostname: lost.shop.svc.cluster.local, vips: ["net1/10.96.0.50"],
   ports: {80: 80}, subjectAltNames: ["spiffe://cluster.local/ns/shop/sa/lost"]}
- {name: astray, namespace: shop, hostname: astray.shop.svc.cluster.local, vips: ["net1/10.96.0.51"],
   ports: {80: 80}, subjectAltNames: ["spiffe://cluster.local/ns/shop/sa/astray"]}
- {name: loop, namespace: shop, hostname: loop.shop.svc.cluster.local, vips: ["net1/10.96.0.52"],
   ports: {80: 80}, subjectAltNames: ["spiffe://cluster.local/ns/shop/sa/loop"]}
- {name: bare, namespace: shop, hostname: bare.shop.svc.cluster.local, vips: ["net1/10.96.0.53"],
   ports: {80: 80}}
"#;

fn routed_on_net1(st: &State, dst: &str) -> Route {
    let ips: Vec<IpAddr> = vec!["10.1.0.1".parse().unwrap()];
    let client = Client {
        namespace: "shop",
        name: "client",
        ips: &ips,
    };
    route(st, "net1", client, dst.parse().unwrap(), "cluster.local")
}

#[test]
fn on_a_network_with_a_gateway_the_local_endpoints_are_reached_directly_and_the_others_through_it()
{
    let cfg: crate::xds::local::LocalConfig = serde_yaml::from_str(TWO_NETWORKS).unwrap();
    let (st, errors) = State::build_lenient(cfg.workloads, cfg.services, cfg.policies);
    assert!(errors.is_empty(), "nothing refused: {errors:?}");

    // A pod of this network that names its gateway: HBONE to it directly.
    match routed_on_net1(&st, "10.1.0.3:8080") {
        Route::Hbone {
            proxy, identities, ..
        } => {
            assert_eq!(proxy, "10.1.0.3:15008".parse().unwrap());
            assert_eq!(
                identities[0].to_string(),
                "spiffe://cluster.local/ns/shop/sa/api"
            );
        }
        other => panic!("not HBONE to the pod: {other:?}"),
    }
    // Its service: the endpoint here and the other network's (through its
    // gateway) by capacity, 1 : 2, as ztunnel balances them.
    let mut seen = BTreeMap::<String, usize>::new();
    for _ in 0..3000 {
        *seen
            .entry(endpoint_of(&routed_on_net1(&st, "10.96.0.20:80")))
            .or_default() += 1;
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!((850..1150).contains(&seen["api-1"]), "{seen:?}");

    // Only on another network: through its gateway, checked against the
    // gateway's identity; the CONNECT names the service, and the inner
    // tunnel is checked against the service's identities.
    match routed_on_net1(&st, "10.96.0.30:5432") {
        Route::Gateway {
            gateway,
            gateway_identities,
            host,
            port,
            identities,
            ..
        } => {
            assert_eq!(gateway, "172.18.1.10:15008".parse().unwrap());
            assert_eq!(
                gateway_identities[0].to_string(),
                "spiffe://cluster.local/ns/istio-system/sa/eastwestgateway"
            );
            assert_eq!((host.as_str(), port), ("db.shop.svc.cluster.local", 5432));
            let ids: Vec<String> = identities.iter().map(|i| i.to_string()).collect();
            assert_eq!(ids, ["spiffe://cluster.local/ns/shop/sa/db"]);
        }
        other => panic!("not through the gateway: {other:?}"),
    }
    // A gateway named by hostname (istiod's form for a gateway with a
    // hostname address): an endpoint of that service on the endpoint's
    // network, at the target port of the HBONE port, checked against the
    // endpoint's identity and the gateway service's SANs.
    match routed_on_net1(&st, "10.96.0.60:80") {
        Route::Gateway {
            gateway,
            gateway_identities,
            ..
        } => {
            assert_eq!(gateway, "172.18.7.10:15008".parse().unwrap());
            let ids: Vec<String> = gateway_identities.iter().map(|i| i.to_string()).collect();
            assert_eq!(
                ids,
                [
                    "spiffe://cluster.local/ns/istio-system/sa/eastwest",
                    "spiffe://cluster.local/ns/istio-system/sa/eastwest-svc"
                ]
            );
        }
        other => panic!("not through the gateway service: {other:?}"),
    }
    // Refused with the reason, never dialled nor passed through: no
    // gateway; a gateway not in the state; a gateway on another network
    // than the endpoint's; a gateway that is the endpoint itself; nothing
    // to verify the destination by.
    for (vip, why) in [
        ("10.96.0.40:6379", "with no gateway to them"),
        (
            "10.96.0.50:80",
            "network gateway net4/172.18.4.10 is not known",
        ),
        (
            "10.96.0.51:80",
            "is on network \"net2\", not the endpoint's \"net5\"",
        ),
        ("10.96.0.52:80", "is the endpoint itself"),
        ("10.96.0.53:80", "the service lists no subjectAltNames"),
        // The gateway service's own endpoints on net7: its gateway would
        // be itself, a loop.
        ("10.96.0.61:15443", "is the service itself"),
    ] {
        match routed_on_net1(&st, vip) {
            Route::NoEndpoint { reason, .. } => assert!(reason.contains(why), "{vip}: {reason}"),
            other => panic!("{vip}: {other:?}"),
        }
    }
    // Another network's pod by its own address: refused, never dialled
    // across networks (nor passed through in plaintext).
    match routed_on_net1(&st, "10.3.0.5:6379") {
        Route::OtherNetwork { workload, reason } => {
            assert_eq!(workload.name.as_str(), "cache-1");
            assert!(reason.contains("on network \"net3\""), "{reason}");
        }
        other => panic!("dialled another network's pod: {other:?}"),
    }
    // An address no network holds still passes through.
    assert!(matches!(
        routed_on_net1(&st, "10.9.9.9:80"),
        Route::Passthrough { .. }
    ));
    // A service whose waypoint is on another network (a global waypoint
    // service's endpoints there, as istiod sends them): through the
    // gateway, the CONNECT naming the service the client asked for, the
    // inner tunnel checked against the waypoint service's identities.
    match routed_on_net1(&st, "10.96.0.71:443") {
        Route::Gateway {
            gateway,
            host,
            port,
            identities,
            waypoint,
            ..
        } => {
            assert!(waypoint);
            assert_eq!(gateway, "172.18.1.10:15008".parse().unwrap());
            assert_eq!((host.as_str(), port), ("pay.shop.svc.cluster.local", 443));
            let ids: Vec<String> = identities.iter().map(|i| i.to_string()).collect();
            assert_eq!(ids, ["spiffe://cluster.local/ns/shop/sa/wp"]);
        }
        other => panic!("not to the waypoint through the gateway: {other:?}"),
    }
    // A workload behind it, called by address: no service to name through
    // the gateway, so refused, never sent around the waypoint.
    match routed_on_net1(&st, "10.1.0.8:80") {
        Route::NoWaypoint { reason } => {
            assert!(
                reason.contains("takes only traffic to a service"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    // A waypoint named by an address on another network: refused, not dialled.
    match routed_on_net1(&st, "10.1.0.7:80") {
        Route::NoWaypoint { reason } => {
            assert!(reason.contains("on network \"net2\""), "{reason}")
        }
        other => panic!("dialled another network's waypoint: {other:?}"),
    }
}
