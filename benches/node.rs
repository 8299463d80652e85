//! Node benchmark (not a timed test): create 100 pods through the real CNI
//! chain (bridge + host-local + ambit-cni) against a running agent and shared
//! proxy, and report the time from CNI ADD to the pod's listeners being ready
//! (the ADD returns only after the proxy acked the pod, i.e. bound its
//! listeners), p50/p99, and the proxy's memory with the 100 idle pods.
//!
//! Run: `cargo bench --bench node` (as root). `AMBIT_BENCH_PODS` sets the count.

use std::time::{Duration, Instant};

use ambit::lab::node::Node;
use ambit::lab::rss_kb;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let n: usize = std::env::var("AMBIT_BENCH_PODS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let mut node = Node::start_with(env!("CARGO_BIN_EXE_ambit"), "benchnode", "all", false);
    let pid = node.lab.pid("proxy").expect("proxy pid");
    let idle_rss = rss_kb(pid);
    let mut times: Vec<Duration> = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        node.add_pod(&format!("pod{i}"), "default").expect("ADD");
        times.push(t.elapsed());
    }
    std::thread::sleep(Duration::from_millis(500));
    let rss = rss_kb(pid);
    let pods = node.dump("127.0.0.1:15000").matches("\"uid-pod").count();
    times.sort();
    let pct = |p: f64| {
        times[((times.len() as f64 * p).ceil() as usize)
            .saturating_sub(1)
            .min(times.len() - 1)]
    };
    println!("ambit node benchmark: {n} pods through bridge + host-local + ambit-cni, one shared proxy\n");
    println!("CNI ADD (whole chain) until the pod's listeners are up: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms", pct(0.50).as_secs_f64() * 1e3, pct(0.99).as_secs_f64() * 1e3, times[times.len() - 1].as_secs_f64() * 1e3);
    println!("pods served by the proxy: {pods}");
    println!(
        "proxy RSS: {idle_rss} kB with no pods, {rss} kB with {n} idle pods ({:.1} kB per pod)",
        (rss.saturating_sub(idle_rss)) as f64 / n as f64
    );
}
