//! Node benchmark (not a timed test): create 100 pods through the real CNI
//! chain (bridge + host-local + ambit-cni) against a running agent and shared
//! proxy, and report the time from CNI ADD to the pod's listeners being ready
//! (the ADD returns only after the proxy acked the pod, i.e. bound its
//! listeners), p50/p99, and the proxy's memory with the 100 idle pods.
//!
//! Then every pod gets one flow: the first half each runs an iperf3 client
//! to one pod of the second half, all at once, all HBONE through the one
//! shared proxy. It reports the total, the spread between flows, and the
//! proxy's CPU per Gbit. Every netns and the proxy's sockets run the node's
//! congestion control.
//!
//! Run: `cargo bench --bench node` (as root). `AMBIT_BENCH_PODS` sets the
//! count (even, at most 200), `AMBIT_BENCH_SECS` the flows' seconds (10).

use std::time::{Duration, Instant};

use ambit::lab::node::Node;
use ambit::lab::{cpu_seconds, iperf3, pod_uid, rss_kb};

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let n: usize = std::env::var("AMBIT_BENCH_PODS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100)
        .clamp(2, 200)
        / 2
        * 2;
    let secs: u64 = std::env::var("AMBIT_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    // host-local hands out .2, .3, ... in order: every pod is a mesh workload.
    let subnet = "10.119.0";
    let mut mesh = String::from("workloads:\n");
    for i in 0..n {
        mesh += &format!(
            "- {{name: pod{i}, namespace: default, serviceAccount: sa{i}, workloadIps: [\"{subnet}.{}\"], protocol: HBONE}}\n",
            i + 2
        );
    }
    let cc = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .unwrap_or_default()
        .trim()
        .to_string();
    let mut node = Node::prepare(
        env!("CARGO_BIN_EXE_ambit"),
        "benchnode",
        "all",
        subnet,
        &mesh,
        None,
    );
    node.extra_env = vec![("AMBIT_CONGESTION_CONTROL".into(), cc.clone())];
    node.launch(false);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");
    let pid = node.lab.pid("proxy").expect("proxy pid");
    let idle_rss = rss_kb(pid);
    let mut times: Vec<Duration> = Vec::with_capacity(n);
    let mut pods = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        pods.push(node.add_pod(&format!("pod{i}"), "default").expect("ADD"));
        times.push(t.elapsed());
    }
    std::thread::sleep(Duration::from_millis(500));
    let rss = rss_kb(pid);
    let dump = node.dump("127.0.0.1:15000");
    let served = pods
        .iter()
        .filter(|p| dump.contains(&pod_uid(&p.name)))
        .count();
    times.sort();
    let pct = |p: f64| {
        times[((times.len() as f64 * p).ceil() as usize)
            .saturating_sub(1)
            .min(times.len() - 1)]
    };
    println!("ambit node benchmark: {n} pods through bridge + host-local + ambit-cni, one shared proxy\n");
    println!("CNI ADD (whole chain) until the pod's listeners are up: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms", pct(0.50).as_secs_f64() * 1e3, pct(0.99).as_secs_f64() * 1e3, times[times.len() - 1].as_secs_f64() * 1e3);
    println!("pods served by the proxy: {served}");
    println!(
        "proxy RSS: {idle_rss} kB with no pods, {rss} kB with {n} idle pods ({:.1} kB per pod)",
        (rss.saturating_sub(idle_rss)) as f64 / n as f64
    );

    // One flow per pod, all at once.
    let half = n / 2;
    for server in &pods[half..] {
        node.lab.start_iperf3_server(server).expect("iperf3 -s");
    }
    let cpu_before = cpu_seconds(pid);
    let started = Instant::now();
    let flows: Vec<_> = (0..half)
        .map(|i| {
            let (client, server) = (pods[i].clone(), pods[half + i].ip);
            std::thread::spawn(move || iperf3(&client, server, secs, &[]))
        })
        .collect();
    let mut gbps: Vec<f64> = Vec::with_capacity(half);
    let mut gbit = 0.0;
    for f in flows {
        let run = f.join().expect("flow thread").expect("iperf3 flow");
        gbps.push(run.gbps);
        gbit += run.gbit;
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid) - cpu_before;
    gbps.sort_by(|a, b| a.total_cmp(b));
    println!(
        "\n{half} flows at once between {n} pods (HBONE, all through the one shared proxy, {secs} s, congestion control {cc}):"
    );
    println!(
        "  total {:.2} Gbit/s; per flow min {:.3}, median {:.3}, max {:.3} Gbit/s",
        gbps.iter().sum::<f64>(),
        gbps[0],
        gbps[half / 2],
        gbps[half - 1]
    );
    println!(
        "  shared proxy CPU {:.2} cpu-s over {wall:.1} s ({:.3} cpu-s per Gbit), RSS {} kB",
        cpu,
        cpu / gbit.max(1e-9),
        rss_kb(pid)
    );
}
