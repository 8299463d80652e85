//! State ingest (not a timed test): what a proxy does with istiod's pushes
//! at cluster scale, through the xDS client's own path (`Held::answer`:
//! decode, convert, hold, build the state the data path reads), on
//! resources shaped as istiod builds them (uids `Kubernetes//Pod/ns/name`,
//! service keys `ns/hostname`, every workload backing one service port,
//! namespace-scoped ALLOW policies naming principals).
//!
//! Per size (workloads N, services N/10, policies N/100):
//! - the full initial push: time, and the process's peak RSS from just
//!   before it (the encoded push is in memory, as a received message is);
//! - the heap the proxy then holds, counted by this bench's allocator (not
//!   an RSS difference);
//! - one workload changed: p50 and p99 of the time to apply it and have
//!   the new state;
//! - a burst of 1,000 such updates, one response each, back to back
//!   (skipped, with an estimate, when it would take over two minutes);
//! - a reconnect: the same full push again, onto the state held (a
//!   control plane that restarts sends everything again): its time and
//!   the heap it takes over the state and the push.
//!
//! Then, at the first size of at least 100,000 (or the largest), the heap
//! per workload, per service and per policy, each pushed alone.
//!
//! Each size ends with one summary line, for comparing runs:
//! `ingest: workloads=N services=S full_ms=.. peak_rss_mb=.. heap_mb=..
//! update_p50_us=.. update_p99_us=.. burst1000_ms=.. reconnect_ms=..`
//!
//! Then the full push into a real proxy (`ingest/proxy.rs`): the `ambit`
//! binary in a lab pod takes N workloads (1,000,000) from this bench's xDS
//! server off a socket; the time to ready and the proxy's own peak RSS,
//! with its summary line `ingest: proxy workloads=N ready_ms=..
//! received_ms=.. applied_ms=.. proxy_peak_rss_mb=.. proxy_rss_mb=..`.
//!
//! Last, the data path while the mesh changes (`ingest/churn.rs`): the
//! latency of connections through two real proxies holding 100,000
//! workloads, idle and while one-workload updates arrive at 100/s, with
//! its own summary line: `ingest: latency workloads=N updates_per_s=.. open=..
//! idle_p50_us=.. idle_p99_us=.. churn_p50_us=.. churn_p99_us=..
//! p99_ratio=..`. It runs the `ambit` binary in lab netns (as root).
//!
//! Run: `cargo bench --bench ingest`. `AMBIT_INGEST_SIZES` the workload
//! counts (`10000,100000,1000000`), `AMBIT_INGEST_UPDATES` one-workload
//! updates timed per size (200; fewer when each takes long),
//! `AMBIT_INGEST_PUSH_ONLY` (set) stops after the first size's full push,
//! for a profile of the push alone. `AMBIT_INGEST_LATENCY` the workloads
//! the proxies hold in the latency part (100000; 0 skips it),
//! `AMBIT_INGEST_RATE` its updates a second (100), `AMBIT_INGEST_OPEN`
//! connections held open through it (0), `AMBIT_INGEST_LOAD` busy loops
//! at nice 19 through its phases (0: a node whose CPUs are otherwise
//! idle), `AMBIT_INGEST_PROXY`
//! the workloads pushed into a real proxy (1000000; 0 skips it),
//! `AMBIT_INGEST_BINARY` another `ambit` to run as the proxies instead;
//! `AMBIT_INGEST_ONLY=latency` or `=proxy` runs only that part.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ambit::proto::discovery::{DeltaDiscoveryResponse, Resource};
use ambit::proto::security as pb_sec;
use ambit::proto::workload as pb;
use ambit::xds::client::Held;
use ambit::xds::convert;
use ambit::xds::delta::Delta;
use prost::Message;

/// The proxy's allocator (jemalloc), counting the bytes live now and at
/// the peak.
struct Counting;

static INNER: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call goes to jemalloc unchanged; only counts are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, passed on.
        let p = unsafe { INNER.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, passed on.
        let p = unsafe { INNER.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: a block this allocator gave, with its layout.
        unsafe { INNER.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: a block this allocator gave, with its layout.
        let q = unsafe { INNER.realloc(p, l, new) };
        if !q.is_null() {
            if new >= l.size() {
                grew(new - l.size());
            } else {
                LIVE.fetch_sub(l.size() - new, Ordering::Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The proxy's allocator settings (one arena, freed pages given back
/// after two seconds), so the memory measured is what the proxy holds.
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: ambit::alloc::Settings = ambit::alloc::SETTINGS;

fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

use ambit::xds::convert::{ADDRESS_TYPE as ADDRESS, AUTHORIZATION_TYPE as AUTHORIZATION};

#[path = "ingest/churn.rs"]
mod churn;
#[path = "ingest/proxy.rs"]
mod proxy;

/// A resource as istiod sends one: its version empty (istiod sets none on
/// address and authorization resources).
fn resource(type_url: &str, name: String, body: Vec<u8>) -> Resource {
    Resource {
        name,
        version: String::new(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value: body,
        }),
        aliases: vec![],
    }
}

fn response(type_url: &str, resources: Vec<Resource>) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: type_url.into(),
        resources,
        nonce: "1".into(),
        ..Default::default()
    }
}

fn ns(i: usize) -> String {
    format!("ns-{}", i % 100)
}

fn host(s: usize) -> String {
    format!("svc-{s}.{}.svc.cluster.local", ns(s))
}

/// Workload `i` of a mesh with `services` services, as istiod sends it;
/// `revision` stands for whatever changed in an update.
fn workload(i: usize, services: usize, revision: &str) -> (String, Vec<u8>) {
    let s = i % services.max(1);
    let namespace = ns(s);
    let name = format!("app-{s}-{i:x}");
    let uid = format!("Kubernetes//Pod/{namespace}/{name}");
    let body = pb::Address {
        r#type: Some(pb::address::Type::Workload(pb::Workload {
            uid: uid.clone(),
            name,
            namespace: namespace.clone(),
            addresses: vec![(0x0a00_0000u32 + i as u32).to_be_bytes().to_vec()],
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            trust_domain: "cluster.local".into(),
            service_account: format!("app-{s}"),
            node: format!("node-{}", i % 5_000),
            canonical_name: format!("app-{s}"),
            canonical_revision: revision.into(),
            workload_type: pb::WorkloadType::Pod as i32,
            workload_name: format!("app-{s}"),
            services: [(
                format!("{namespace}/{}", host(s)),
                pb::PortList {
                    ports: vec![pb::Port {
                        service_port: 80,
                        target_port: 8080,
                        app_protocol: 0,
                    }],
                },
            )]
            .into(),
            cluster_id: "Kubernetes".into(),
            ..Default::default()
        })),
    };
    (uid, body.encode_to_vec())
}

fn service(s: usize) -> (String, Vec<u8>) {
    let namespace = ns(s);
    let body = pb::Address {
        r#type: Some(pb::address::Type::Service(pb::Service {
            name: format!("svc-{s}"),
            namespace: namespace.clone(),
            hostname: host(s),
            addresses: vec![pb::NetworkAddress {
                network: String::new(),
                address: (0x6400_0000u32 + s as u32).to_be_bytes().to_vec(),
                length: None,
            }],
            ports: vec![pb::Port {
                service_port: 80,
                target_port: 8080,
                app_protocol: 0,
            }],
            ..Default::default()
        })),
    };
    (format!("{namespace}/{}", host(s)), body.encode_to_vec())
}

/// An ALLOW policy of namespace `ns(p)` letting in three service accounts
/// on port 8080.
fn policy(p: usize) -> (String, Vec<u8>) {
    let namespace = ns(p);
    let name = format!("allow-{p}");
    let principal = |k: usize| pb_sec::StringMatch {
        match_type: Some(pb_sec::string_match::MatchType::Exact(format!(
            "cluster.local/ns/{namespace}/sa/app-{}",
            p + k
        ))),
    };
    let body = pb_sec::Authorization {
        name: name.clone(),
        namespace: namespace.clone(),
        scope: pb_sec::Scope::Namespace as i32,
        action: pb_sec::Action::Allow as i32,
        rules: vec![pb_sec::Rule {
            clauses: vec![
                pb_sec::Clause {
                    matches: vec![pb_sec::Match {
                        principals: (0..3).map(principal).collect(),
                        ..Default::default()
                    }],
                },
                pb_sec::Clause {
                    matches: vec![pb_sec::Match {
                        destination_ports: vec![8080],
                        ..Default::default()
                    }],
                },
            ],
        }],
        ..Default::default()
    };
    (format!("{namespace}/{name}"), body.encode_to_vec())
}

/// A response as the client decodes it off the wire (its resources in
/// chunks: `xds::delta`).
fn delta(type_url: &str, resources: impl IntoIterator<Item = Resource>) -> Delta {
    Delta {
        type_url: type_url.into(),
        resources: resources.into_iter().collect(),
        nonce: "1".into(),
        ..Default::default()
    }
}

/// The two responses of a full push: addresses (workloads then services)
/// and policies.
fn full_push(workloads: usize, services: usize, policies: usize) -> (Delta, Delta) {
    let addresses = (0..workloads)
        .map(|i| workload(i, services, "v1"))
        .chain((0..services).map(service))
        .map(|(name, body)| resource(ADDRESS, name, body));
    let policies = (0..policies)
        .map(policy)
        .map(|(name, body)| resource(AUTHORIZATION, name, body));
    (delta(ADDRESS, addresses), delta(AUTHORIZATION, policies))
}

/// Applies `resp` as the xDS client does: the held resources change and
/// the state the data path reads is built; the old state goes.
fn apply(held: &mut Held, resp: Delta) {
    let (state, rejected) = held.answer(resp);
    assert!(rejected.is_empty(), "rejected: {rejected:?}");
    drop(state);
}

fn rss_mb() -> f64 {
    ambit::lab::rss_kb(std::process::id()) as f64 / 1024.0
}

/// The process's peak RSS since [`reset_peak_rss`] (VmHWM).
fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

fn reset_peak_rss() {
    // "5" resets the peak RSS to the RSS now (proc(5), clear_refs).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn mb(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// One size: the full push, then updates.
fn size(workloads: usize, updates: usize) {
    let (services, policies) = (workloads / 10, workloads / 100);
    println!("\n== {workloads} workloads, {services} services, {policies} policies ==");
    // Counted from before the push is made: the client takes it and
    // frees each resource once converted, so what is left after is the
    // state alone.
    let heap_before = live();
    let (addresses, authorizations) = full_push(workloads, services, policies);
    let encoded: usize = addresses
        .resources
        .iter()
        .chain(authorizations.resources.iter())
        .filter_map(|r| r.resource.as_ref())
        .map(|a| a.value.len())
        .sum();
    let pushed = live() - heap_before;
    println!(
        "push encoded: {:.1} MB in {} resources ({:.1} MB decoded, as the client holds it)",
        mb(encoded),
        addresses.resources.len() + authorizations.resources.len(),
        mb(pushed)
    );

    let mut held = Held::default();
    let rss_before = rss_mb();
    reset_peak_rss();
    PEAK.store(live(), Ordering::Relaxed);
    let t = Instant::now();
    apply(&mut held, authorizations);
    let (state, rejected) = held.answer(addresses);
    let full = t.elapsed();
    assert!(rejected.is_empty(), "rejected: {rejected:?}");
    let peak_rss = peak_rss_mb();
    let peak_heap = PEAK.load(Ordering::Relaxed).saturating_sub(heap_before);
    let heap = live().saturating_sub(heap_before);
    let probe = state
        .workload_by_addr("", std::net::IpAddr::from([10, 0, 0, 42]))
        .expect("indexed");
    assert_eq!(probe.canonical_revision, "v1");
    println!(
        "full push: {:.0} ms; peak RSS {peak_rss:.0} MB (from {rss_before:.0} MB with the push in memory); \
         heap at the peak (push + state): {:.1} MB; heap held after it (the state): {:.1} MB",
        full.as_secs_f64() * 1e3,
        mb(peak_heap),
        mb(heap)
    );
    if std::env::var_os("AMBIT_INGEST_PUSH_ONLY").is_some() {
        // For a profile of the push alone: nothing after it, not even
        // freeing what it made.
        std::process::exit(0);
    }
    // What decoding and converting alone cost of it (the same work, with
    // nothing held), on the same push made again.
    let (addresses, _) = full_push(workloads, services, 0);
    let t = Instant::now();
    let converted = addresses
        .resources
        .iter()
        .filter_map(|r| r.resource.as_ref())
        .map(|any| pb::Address::decode(any.value.as_slice()).map(convert::address_from_proto))
        .filter(|a| matches!(a, Ok(Ok(_))))
        .count();
    println!(
        "decoding and converting the addresses alone: {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(converted, addresses.resources.len());
    drop(addresses);
    let mut state = Some(state);

    // One workload changes: a new revision of workload k, one response.
    let one = |k: usize, n: usize| {
        let (name, body) = workload(k % workloads, services, &format!("v{}", n + 2));
        response(ADDRESS, vec![resource(ADDRESS, name, body)])
    };
    let mut times = Vec::new();
    let budget = Duration::from_secs(60);
    let started = Instant::now();
    for n in 0..updates {
        let resp = one(n * 7919, n);
        let t = Instant::now();
        let (next, rejected) = held.answer(resp);
        // The old state goes when the new one replaces it.
        state = Some(next);
        times.push(t.elapsed());
        assert!(rejected.is_empty());
        if n >= 10 && started.elapsed() > budget {
            break;
        }
    }
    times.sort();
    let (p50, p99) = (percentile(&times, 50), percentile(&times, 99));
    println!(
        "one workload updated: p50 {:.1} µs, p99 {:.1} µs ({} updates)",
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        times.len()
    );
    let estimate = p50 * 1_000;
    let burst = if estimate > Duration::from_secs(120) {
        println!(
            "burst of 1,000 updates: skipped, about {:.0} s at the p50",
            estimate.as_secs_f64()
        );
        "skipped".to_string()
    } else {
        let resps: Vec<_> = (0..1_000).map(|n| one(n * 104_729, n + updates)).collect();
        let t = Instant::now();
        for resp in resps {
            let (next, _) = held.answer(resp);
            state = Some(next);
        }
        let took = t.elapsed();
        println!(
            "burst of 1,000 updates, one response each: {:.0} ms",
            took.as_secs_f64() * 1e3
        );
        format!("{:.0}", took.as_secs_f64() * 1e3)
    };

    // A reconnect: the control plane sends the whole push again, onto
    // what is held (the same resources, unchanged).
    let (addresses, authorizations) = full_push(workloads, services, policies);
    let heap_before = live();
    PEAK.store(heap_before, Ordering::Relaxed);
    let t = Instant::now();
    apply(&mut held, authorizations);
    let (next, rejected) = held.answer(addresses);
    let reconnect = t.elapsed();
    assert!(rejected.is_empty(), "rejected: {rejected:?}");
    drop(state.replace(next));
    println!(
        "reconnect (the full push again, onto the state held): {:.0} ms; heap at its peak {:.1} MB \
         over the state and the push",
        reconnect.as_secs_f64() * 1e3,
        mb(PEAK.load(Ordering::Relaxed).saturating_sub(heap_before))
    );
    drop(state);
    println!(
        "ingest: workloads={workloads} services={services} full_ms={:.0} peak_rss_mb={peak_rss:.0} \
         heap_mb={:.0} update_p50_us={:.0} update_p99_us={:.0} burst1000_ms={burst} reconnect_ms={:.0}",
        full.as_secs_f64() * 1e3,
        mb(heap),
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        reconnect.as_secs_f64() * 1e3,
    );
}

/// Resource `i` of `kind` in a mesh with `services` services.
fn nth(kind: &str, i: usize, services: usize) -> Resource {
    let (url, (name, body)) = match kind {
        "workload" => (ADDRESS, workload(i, services, "v1")),
        "service" => (ADDRESS, service(i)),
        _ => (AUTHORIZATION, policy(i)),
    };
    resource(url, name, body)
}

/// The heap held per resource of each kind, each kind pushed alone.
fn per_entry(n: usize) {
    let services = n / 10;
    println!("\n== heap held per resource, each kind pushed alone ==");
    for (kind, count) in [("workload", n), ("service", services), ("policy", n / 100)] {
        let url = if kind == "policy" {
            AUTHORIZATION
        } else {
            ADDRESS
        };
        // Counted from before the response is made: the client takes it
        // and frees it as it goes.
        let before = live();
        let resp = delta(url, (0..count).map(|i| nth(kind, i, services)));
        let mut held = Held::default();
        // The state stays, as the proxy keeps the one it serves.
        let (state, _) = held.answer(resp);
        let bytes = live().saturating_sub(before);
        drop(state);
        println!(
            "{kind}: {:.0} bytes each ({count} held, with the state they make)",
            bytes as f64 / count as f64,
        );
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // As the proxy runs: freed memory given back on time.
    ambit::alloc::purge_in_background();
    let sizes: Vec<usize> = std::env::var("AMBIT_INGEST_SIZES")
        .unwrap_or_else(|_| "10000,100000,1000000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let updates: usize = std::env::var("AMBIT_INGEST_UPDATES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let env = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let only = std::env::var("AMBIT_INGEST_ONLY").unwrap_or_default();
    assert!(
        ["", "latency", "proxy"].contains(&only.as_str()),
        "AMBIT_INGEST_ONLY takes latency or proxy, not {only:?}"
    );
    if only.is_empty() {
        println!("ambit state ingest through the xDS client's path (Held::answer)");
        for &n in &sizes {
            size(n, updates);
        }
        let breakdown = sizes
            .iter()
            .copied()
            .find(|&n| n >= 100_000)
            .or(sizes.iter().copied().max());
        if let Some(n) = breakdown {
            per_entry(n);
        }
    }
    let at = env("AMBIT_INGEST_PROXY", 1_000_000);
    if at > 0 && (only.is_empty() || only == "proxy") {
        proxy::proxy_push(at);
    }
    let at = env("AMBIT_INGEST_LATENCY", 100_000);
    if at > 0 && (only.is_empty() || only == "latency") {
        let rate = env("AMBIT_INGEST_RATE", 100).clamp(1, 10_000) as u32;
        let open = env("AMBIT_INGEST_OPEN", 0);
        let load = env("AMBIT_INGEST_LOAD", 0);
        churn::latency_under_updates(at, rate, open, load, 2_000, 5);
    }
}
