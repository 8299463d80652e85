//! The routing decision's cost (criterion): one connection's route over a
//! state of 1,000 workloads, for a pod IP, a service VIP without a
//! load-balancing block, a VIP with istiod's FAILOVER block (10 and 1,000
//! endpoints over three zones), and a workload behind a waypoint named by
//! hostname. Paid once per connection, before any byte moves.
//!
//! Run: `cargo bench --bench route`.

use std::net::{IpAddr, SocketAddr};

use ambit::proxy::route::{route, Client, Route};
use criterion::{criterion_group, criterion_main, Criterion};

const PREFER_CLOSE: &str =
    "loadBalancer: {routingPreferences: [NETWORK, REGION, ZONE, SUBZONE], mode: FAILOVER}";

fn state() -> ambit::xds::State {
    let mut yaml = String::from("workloads:\n");
    yaml.push_str("- {name: client, namespace: shop, workloadIps: [10.0.0.2], protocol: HBONE, locality: {region: r, zone: z0}}\n");
    yaml.push_str("- {name: wp, namespace: shop, serviceAccount: wp, workloadIps: [10.0.0.9], protocol: HBONE, locality: {region: r, zone: z0}, services: {\"shop/wp.shop\": {15008: 15008}}}\n");
    yaml.push_str("- {name: behind, namespace: shop, workloadIps: [10.0.0.8], protocol: HBONE, waypoint: {destination: \"shop/wp.shop\"}}\n");
    for i in 0..1_000 {
        let mut svcs =
            String::from("\"shop/big.shop\": {80: 8080}, \"shop/big-lb.shop\": {80: 8080}");
        if i < 10 {
            svcs.push_str(", \"shop/small.shop\": {80: 8080}, \"shop/small-lb.shop\": {80: 8080}");
        }
        yaml.push_str(&format!(
            "- {{name: w{i}, namespace: shop, workloadIps: [10.1.{}.{}], protocol: HBONE, locality: {{region: r, zone: z{}}}, services: {{{svcs}}}}}\n",
            i / 250,
            i % 250,
            i % 3
        ));
    }
    yaml.push_str("services:\n");
    for (name, vip, lb) in [
        ("small", "10.96.0.1", ""),
        ("small-lb", "10.96.0.2", PREFER_CLOSE),
        ("big", "10.96.0.3", ""),
        ("big-lb", "10.96.0.4", PREFER_CLOSE),
        ("wp", "10.96.0.9", PREFER_CLOSE),
    ] {
        let sep = if lb.is_empty() { "" } else { ", " };
        yaml.push_str(&format!(
            "- {{name: {name}, namespace: shop, hostname: {name}.shop, vips: [\"/{vip}\"], ports: {{80: 8080, 15008: 15008}}{sep}{lb}}}\n"
        ));
    }
    ambit::xds::local::parse(std::path::Path::new("bench.yaml"), &yaml).expect("bench mesh parses")
}

fn client(ips: &[IpAddr]) -> Client<'_> {
    Client {
        namespace: "shop",
        name: "client",
        ips,
    }
}

fn bench(c: &mut Criterion) {
    let st = state();
    let ips: Vec<IpAddr> = vec!["10.0.0.2".parse().unwrap()];
    for (label, dst) in [
        ("pod IP", "10.1.0.7:8080"),
        ("VIP, 10 endpoints", "10.96.0.1:80"),
        ("VIP, 10 endpoints, FAILOVER", "10.96.0.2:80"),
        ("VIP, 1000 endpoints", "10.96.0.3:80"),
        ("VIP, 1000 endpoints, FAILOVER", "10.96.0.4:80"),
        ("pod behind a waypoint by hostname", "10.0.0.8:8080"),
    ] {
        let dst: SocketAddr = dst.parse().unwrap();
        let r = route(&st, "", client(&ips), dst, "cluster.local");
        assert!(matches!(r, Route::Hbone { .. }), "{label}: {r:?}");
        c.bench_function(label, |b| {
            b.iter(|| {
                route(
                    &st,
                    "",
                    client(&ips),
                    std::hint::black_box(dst),
                    "cluster.local",
                )
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
