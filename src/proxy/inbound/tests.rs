//! Inbound decisions: which service a connection names.

use super::decide::inbound_service;

#[test]
fn the_inbound_service_is_the_one_named_else_the_one_on_the_port() {
    let st = crate::xds::local::parse(
        std::path::Path::new("in.yaml"),
        r#"
workloads:
- {name: api-0, namespace: shop, workloadIps: [10.0.0.3],
   services: {"shop/api.shop.svc.cluster.local": {80: 8080}, "shop/admin.shop.svc.cluster.local": {90: 0},
          "shop/grpc.shop.svc.cluster.local": {81: 8080}}}
services:
- {name: api, namespace: shop, hostname: api.shop.svc.cluster.local, vips: ["/10.96.0.1"], ports: {80: 8080}}
- {name: admin, namespace: shop, hostname: admin.shop.svc.cluster.local, vips: ["/10.96.0.2"], ports: {90: 9090}}
- {name: grpc, namespace: shop, hostname: grpc.shop.svc.cluster.local, vips: ["/10.96.0.3"], ports: {81: 8080}}
"#,
    )
    .unwrap();
    let pod = ("shop", "api-0");
    let name = |port, host| inbound_service(&st, pod, port, host).map(|s| s.name.clone());
    // Two services reach 8080: the one the client named wins.
    assert_eq!(
        name(8080, Some("grpc.shop.svc.cluster.local")).as_deref(),
        Some("grpc")
    );
    assert_eq!(
        name(8080, None).as_deref(),
        Some("api"),
        "else the first by key"
    );
    // Target port 0: the service's own target port.
    assert_eq!(name(9090, None).as_deref(), Some("admin"));
    assert_eq!(name(7000, None), None);
    assert_eq!(
        inbound_service(&st, ("shop", "other"), 8080, None).map(|s| s.name.clone()),
        None
    );
}
