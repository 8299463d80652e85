//! Policy evaluation cost (criterion): one connection checked against 10,000
//! policies. "all in its namespace" is the worst case (every policy applies and
//! is evaluated); "spread over 1,000 namespaces" is the usual shape, where the
//! namespace index leaves ~10 to evaluate.
//!
//! Run: `cargo bench --bench rbac`.

use std::path::Path;

use ambit::identity::Identity;
use ambit::proxy::rbac::{applicable, evaluate, Connection};
use criterion::{criterion_group, criterion_main, Criterion};

fn state(namespaces: usize) -> ambit::xds::State {
    let mut yaml = String::from("workloads:\n- {name: web, namespace: ns0, workloadIps: [10.0.0.3], protocol: HBONE}\npolicies:\n");
    for i in 0..10_000 {
        // Each policy: ALLOW from one principal and a CIDR on one port: none of them matches the
        // connection below, so every applicable policy is evaluated in full.
        yaml.push_str(&format!(
            "- {{name: p{i}, namespace: ns{}, action: Allow, rules: [[[{{principals: [!Exact cluster.local/ns/x/sa/sa{i}]}}], [{{sourceIps: [192.168.{}.0/24], destinationPorts: [{}]}}]]]}}\n",
            i % namespaces,
            i % 250,
            1000 + i % 5000
        ));
    }
    ambit::xds::local::parse(Path::new("bench.yaml"), &yaml).expect("bench policies parse")
}

fn bench(c: &mut Criterion) {
    let id = Identity::new("cluster.local", "front", "ui");
    let conn = Connection {
        src_identity: Some(&id),
        src_ip: "10.0.0.2".parse().unwrap(),
        dst_ip: "10.0.0.3".parse().unwrap(),
        dst_port: 80,
    };
    for (label, namespaces) in [
        ("10k policies, all in its namespace", 1),
        ("10k policies, spread over 1000 namespaces", 1000),
    ] {
        let st = state(namespaces);
        let verdict = evaluate(applicable(&st, "ns0", &[]), &conn);
        assert!(!verdict.allowed, "no policy allows this connection");
        c.bench_function(label, |b| {
            b.iter(|| evaluate(applicable(&st, "ns0", &[]), std::hint::black_box(&conn)))
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
