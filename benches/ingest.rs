//! State ingest (not a timed test): building the indexed state snapshot from
//! 100,000 workloads and 10,000 services — what a full xDS push (or a large
//! local config) turns into — and the memory it holds. Each service has ten
//! endpoints; every workload backs one service port.
//!
//! Run: `cargo bench --bench ingest`.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use ambit::xds::types::{NetworkAddress, Protocol, Service, Workload};
use ambit::xds::State;

fn rss_kb() -> u64 {
    ambit::lab::rss_kb(std::process::id())
}

fn resources(workloads: usize, services: usize) -> (Vec<Workload>, Vec<Service>) {
    let svc = |i: usize| format!("ns{}/svc{i}.ns{}.svc.cluster.local", i % 100, i % 100);
    let ws = (0..workloads)
        .map(|i| Workload {
            uid: format!("Kubernetes//Pod/ns{}/pod-{i}", i % 100),
            name: format!("pod-{i}"),
            namespace: format!("ns{}", i % 100),
            service_account: format!("sa-{}", i % 1000),
            workload_ips: vec![IpAddr::V4(Ipv4Addr::from(0x0a00_0000u32 + i as u32))],
            protocol: Protocol::Hbone,
            node: format!("node-{}", i % 500),
            canonical_name: format!("app-{}", i % 10_000),
            services: HashMap::from([(svc(i % services), BTreeMap::from([(80u16, 8080u16)]))]),
            ..Default::default()
        })
        .collect();
    let ss = (0..services)
        .map(|i| Service {
            name: format!("svc{i}"),
            namespace: format!("ns{}", i % 100),
            hostname: format!("svc{i}.ns{}.svc.cluster.local", i % 100),
            vips: vec![NetworkAddress {
                network: String::new(),
                address: IpAddr::V4(Ipv4Addr::from(0x6400_0000u32 + i as u32)),
            }],
            ports: BTreeMap::from([(80, 8080)]),
            ..Default::default()
        })
        .collect();
    (ws, ss)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let (w, s) = (100_000, 10_000);
    let (ws, ss) = resources(w, s);
    let before = rss_kb();
    let t = Instant::now();
    let state = State::build(ws, ss, Vec::new()).expect("valid resources");
    let took = t.elapsed();
    let after = rss_kb();
    let probe = state
        .service_by_vip("", IpAddr::V4(Ipv4Addr::from(0x6400_0000u32 + 42)), None)
        .expect("indexed");
    assert_eq!(state.healthy_endpoints(probe).count(), w / s);
    println!("ambit state ingest: {w} workloads + {s} services");
    println!(
        "build (indexes by uid, address, VIP, hostname, endpoints): {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    println!(
        "process RSS: {:.1} MB (resources decoded) -> {:.1} MB (state built); state adds {:.1} MB",
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        after.saturating_sub(before) as f64 / 1024.0
    );
}
