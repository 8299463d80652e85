//! Policy evaluation cost (criterion): one connection checked against 10,000
//! policies. "all in its namespace" is the worst case (every policy applies and
//! is evaluated); "spread over 1,000 namespaces" is the usual shape, where the
//! namespace index leaves ~10 to evaluate.
//!
//! Then the re-check of open connections after a state change: 100,000
//! tracked connections to 1,000 pods (100 each, in 10 namespaces with 10
//! policies each), after a change of another workload (what most of a
//! mesh's churn is) and after a policy change (every connection checked:
//! what every change cost before re-checks were grouped by pod).
//!
//! Run: `cargo bench --bench rbac`.

use std::path::Path;

use std::sync::Arc;

use ambit::identity::Identity;
use ambit::proxy::rbac::{applicable, evaluate, Connection};
use ambit::proxy::reauth::{Authorized, Destination, Tracked, Tracker};
use ambit::xds::convert::AddressResource;
use ambit::xds::StateHandle;
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

/// 1,000 pods in 10 namespaces, each namespace with 10 ALLOW policies
/// one of which lets `front` in; 100 connections tracked to each pod.
fn tracked() -> (ambit::xds::State, Arc<Tracker>, Vec<Tracked>) {
    let mut yaml = String::from("workloads:\n");
    for i in 0..1000 {
        yaml.push_str(&format!(
            "- {{name: pod{i}, namespace: ns{}, serviceAccount: sa{i}, workloadIps: [10.1.{}.{}], protocol: HBONE}}\n",
            i % 10,
            i / 250,
            i % 250
        ));
    }
    yaml.push_str("- {name: other, namespace: elsewhere, workloadIps: [10.2.0.1]}\npolicies:\n");
    for n in 0..10 {
        for p in 0..10 {
            yaml.push_str(&format!(
                "- {{name: p{p}, namespace: ns{n}, action: Allow, rules: [[[{{principals: [!Exact cluster.local/ns/front/sa/ui{p}]}}]]]}}\n"
            ));
        }
    }
    let st = ambit::xds::local::parse(Path::new("bench.yaml"), &yaml).expect("bench state parses");
    let tracker = Tracker::new(StateHandle::new(st.clone()));
    let mut held = Vec::with_capacity(100_000);
    for i in 0..1000 {
        let destination = Arc::new(Destination {
            namespace: format!("ns{}", i % 10),
            name: format!("pod{i}"),
            service_account: format!("sa{i}"),
        });
        for c in 0..100u32 {
            held.push(tracker.track(Authorized {
                destination: destination.clone(),
                peer: Some(Identity::new("cluster.local", "front", "ui0")),
                src_ip: std::net::IpAddr::from([10, 3, (c / 250) as u8, (c % 250) as u8]),
                target: std::net::SocketAddr::from((
                    [10, 1, (i / 250) as u8, (i % 250) as u8],
                    8080,
                )),
                since: 0,
            }));
        }
    }
    let first = tracker.recheck(&st);
    assert_eq!((first.checked, first.closed), (100_000, 0));
    (st, tracker, held)
}

fn recheck(c: &mut Criterion) {
    let (mut st, tracker, _held) = tracked();
    let other = |ip: u8| {
        let yaml = format!(
            "workloads:\n- {{name: other, namespace: elsewhere, workloadIps: [10.2.0.{ip}]}}\n"
        );
        let one = ambit::xds::local::parse(Path::new("other.yaml"), &yaml).unwrap();
        let w = one.workloads().next().unwrap().clone();
        AddressResource::Workload(w)
    };
    let (a, b) = (other(1), other(2));
    let mut flip = false;
    c.bench_function(
        "re-check 100k connections after another workload's change",
        |bench| {
            bench.iter(|| {
                flip = !flip;
                let w = if flip { a.clone() } else { b.clone() };
                st.put_address("workloads[1000] (elsewhere/other)", "v", w);
                let done = tracker.recheck(&st);
                assert_eq!(done.checked, 0);
            })
        },
    );
    let policy = |n: usize| {
        let yaml = format!("workloads: []\npolicies:\n- {{name: extra, namespace: ns0, action: Allow, rules: [[[{{principals: [!Exact cluster.local/ns/x/sa/y{n}]}}]]]}}\n");
        let one = ambit::xds::local::parse(Path::new("policy.yaml"), &yaml).unwrap();
        let p = one.policies().next().unwrap().as_ref().clone();
        p
    };
    let (p, q) = (policy(1), policy(2));
    c.bench_function("re-check 100k connections after a policy change", |bench| {
        bench.iter(|| {
            flip = !flip;
            st.put_policy("extra", "v", if flip { p.clone() } else { q.clone() });
            let done = tracker.recheck(&st);
            assert_eq!((done.checked, done.closed), (100_000, 0));
        })
    });

    // What a connection opened meanwhile pays: policy changes re-checked
    // back to back on another thread (started when this case runs), one
    // connection tracked and untracked at a time here. Its wait for the
    // tracker's lock is the figure; the worst ones (criterion's warm-up
    // included) are printed after criterion's mean.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut rechecking = None;
    let mut rechecks = Some((tracker.clone(), stop.clone(), st.clone(), p, q));
    let destination = Arc::new(Destination {
        namespace: "ns0".into(),
        name: "pod0".into(),
        service_account: "sa0".into(),
    });
    let mut waits = Vec::new();
    c.bench_function(
        "track and untrack a connection while policy changes re-check 100k",
        |bench| {
            if let Some((tracker, stop, mut st, p, q)) = rechecks.take() {
                rechecking = Some(std::thread::spawn(move || {
                    let mut flip = false;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        flip = !flip;
                        st.put_policy("extra", "v", if flip { p.clone() } else { q.clone() });
                        tracker.recheck(&st);
                    }
                }));
            }
            bench.iter_custom(|iters| {
                let mut total = std::time::Duration::ZERO;
                for _ in 0..iters {
                    let auth = Authorized {
                        destination: destination.clone(),
                        peer: Some(Identity::new("cluster.local", "front", "ui0")),
                        src_ip: std::net::IpAddr::from([10, 4, 0, 1]),
                        target: std::net::SocketAddr::from(([10, 1, 0, 0], 8080)),
                        since: tracker.rechecks(),
                    };
                    let began = std::time::Instant::now();
                    drop(tracker.track(auth));
                    let took = began.elapsed();
                    waits.push(took);
                    total += took;
                }
                total
            })
        },
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(thread) = rechecking {
        thread.join().unwrap();
    }
    if waits.is_empty() {
        return;
    }
    waits.sort();
    let at = |q: f64| waits[((waits.len() - 1) as f64 * q) as usize];
    println!(
        "track and untrack during re-checks: {} samples, p50 {:?}, p99 {:?}, p99.9 {:?}, max {:?}",
        waits.len(),
        at(0.5),
        at(0.99),
        at(0.999),
        at(1.0)
    );
}

criterion_group!(benches, bench, recheck);
criterion_main!(benches);
