//! Data-path benchmark (not a timed test): in one lab node, iperf3
//! single-stream throughput, 1-byte ping-pong latency and the rate of
//! short connections (connect, 1-byte echo, close), direct (no proxy,
//! no rules) vs through HBONE (a dedicated ambit proxy in each pod) vs
//! passthrough (meshed client, destination outside the mesh). Every number
//! is printed as a ratio to direct, measured side by side on this machine,
//! and so is the CPU the whole machine spent per byte on each path.
//!
//! Run: `cargo bench --bench dataplane` (as root). `AMBIT_BENCH_SECS` sets
//! the iperf3 duration (default 5).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ambit::lab::{
    anon_kb, close_first_echo, connect_from, iperf3, rss_kb, short_connection, write_ca,
    EchoServer, Ends, Lab, LabPod, ProxySpec,
};

/// Busy CPU seconds of the whole machine so far (`/proc/stat`, all CPUs):
/// user, nice, system, irq and softirq. Idle, iowait and steal are not ours;
/// guest time is already inside user and nice.
fn busy_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let busy: u64 = [0, 1, 2, 5, 6]
        .iter()
        .map(|&i| ticks.get(i).copied().unwrap_or(0))
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    busy as f64 / hz as f64
}

/// One iperf3 run: Gbit/s received, and the machine's busy CPU seconds per
/// Gbit received (over the whole run, set-up included, which is small).
fn iperf(client: &LabPod, server: &LabPod, secs: u64) -> (f64, f64) {
    let before = busy_cpu_seconds();
    let run = iperf3(client, server.ip, secs, &[]).expect("iperf3");
    let busy = (busy_cpu_seconds() - before).max(0.0);
    (run.gbps, busy / run.gbit.max(1e-9))
}

/// The three paths, in the order every table lists them.
const PATHS: [&str; 3] = [
    "direct (no proxy)",
    "HBONE (mTLS + HTTP/2 CONNECT)",
    "passthrough (splice)",
];

/// Prints a table of the three paths' values, each also as a ratio to direct.
fn table(title: &str, unit: &str, values: [f64; 3], decimals: usize) {
    println!("\n{title:<34} {unit:>10} {:>10}", "vs direct");
    for (name, v) in PATHS.iter().zip(values) {
        println!("{name:<34} {v:>10.decimals$} {:>9.2}x", v / values[0]);
    }
}

/// Connections per second, one after another from `client`: connect, send a
/// byte, read it back, read the server's close, close.
fn connect_rate(client: &LabPod, target: SocketAddr, secs: f64) -> f64 {
    client
        .ns
        .run(move || {
            let once = || short_connection(target, Ends::Echo).unwrap();
            for _ in 0..50 {
                once(); // warm: pooled HBONE connection, caches
            }
            let (start, mut n) = (Instant::now(), 0u64);
            while start.elapsed().as_secs_f64() < secs {
                once();
                n += 1;
            }
            n as f64 / start.elapsed().as_secs_f64()
        })
        .unwrap()
}

fn ping_pong(client: &LabPod, target: SocketAddr, rounds: usize) -> Duration {
    let mut s = connect_from(client, target).unwrap();
    s.set_nodelay(true).unwrap();
    let mut b = [0u8; 1];
    for _ in 0..200 {
        s.write_all(b"x").unwrap();
        s.read_exact(&mut b).unwrap();
    }
    let mut samples: Vec<Duration> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            s.write_all(b"x").unwrap();
            s.read_exact(&mut b).unwrap();
            t.elapsed()
        })
        .collect();
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let secs: u64 = std::env::var("AMBIT_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let mut lab = Lab::new("bench", env!("CARGO_BIN_EXE_ambit")).expect("lab (run as root)");
    let client = lab.add_pod("client").unwrap();
    let server = lab.add_pod("server").unwrap();
    let plain_client = lab.add_pod("plainclient").unwrap();
    let outsider = lab.add_pod("outsider").unwrap();
    let (ca_cert, ca_key) = write_ca(&lab.dir, "ca", "cluster.local").unwrap();
    let cfg = lab.dir.join("mesh.yaml");
    std::fs::write(
        &cfg,
        format!(
            "workloads:\n- {{name: client, namespace: default, serviceAccount: client, workloadIps: [\"{}\"], protocol: HBONE}}\n- {{name: server, namespace: default, serviceAccount: server, workloadIps: [\"{}\"], protocol: HBONE}}\n",
            client.ip, server.ip
        ),
    )
    .unwrap();
    for (pod, sa) in [(&client, "client"), (&server, "server")] {
        lab.redirect(pod).unwrap();
        let spec = ProxySpec {
            config: cfg.clone(),
            ca_cert: ca_cert.clone(),
            ca_key: ca_key.clone(),
            workload_info: format!("default/{}/{sa}", pod.name),
            trust_domain: "cluster.local".into(),
            extra_env: vec![("RUST_LOG".into(), "warn".into())],
        };
        lab.start_proxy(pod, &spec).unwrap();
    }
    for pod in [&server, &outsider] {
        lab.start_iperf3_server(pod).unwrap();
    }

    let rounds_n: usize = std::env::var("AMBIT_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    // The ratios depend on it: BBR without fq paces every socket with timers.
    let cc =
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap_or_default();
    println!("ambit data-path benchmark: iperf3 single stream, {secs}s per path, {rounds_n} interleaved rounds (median); 20000 1-byte round trips; TCP congestion control {}\n", cc.trim());
    let (mut ds, mut hs, mut ps) = (Vec::new(), Vec::new(), Vec::new());
    let (mut dc, mut hc, mut pc) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds_n {
        for (rate, cost, c, s) in [
            (&mut ds, &mut dc, &plain_client, &outsider),
            (&mut hs, &mut hc, &client, &server),
            (&mut ps, &mut pc, &client, &outsider),
        ] {
            let (gbps, cpu) = iperf(c, s, secs);
            rate.push(gbps);
            cost.push(cpu);
        }
    }
    let ratios = |v: &[f64], d: &[f64]| {
        v.iter()
            .zip(d)
            .map(|(x, y)| format!("{:.2}", x / y))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "per-round ratios to direct: HBONE {} | passthrough {}\n",
        ratios(&hs, &ds),
        ratios(&ps, &ds)
    );
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let (direct, hbone, pass) = (median(ds), median(hs), median(ps));
    table(
        "throughput (iperf3, 1 stream)",
        "Gbit/s",
        [direct, hbone, pass],
        2,
    );
    // Throughput hides how much of the machine a path uses (BBR paces; a
    // path may leave a core idle): CPU per byte does not.
    table(
        "CPU per byte (whole machine)",
        "cpu-s/Gbit",
        [median(dc), median(hc), median(pc)],
        3,
    );

    let echo_server = EchoServer::start(&server, 7000).unwrap();
    let echo_outsider = EchoServer::start(&outsider, 7000).unwrap();
    let rounds = 20_000;
    let d = ping_pong(&plain_client, echo_outsider.addr, rounds);
    let h = ping_pong(&client, echo_server.addr, rounds);
    let p = ping_pong(&client, echo_outsider.addr, rounds);
    table(
        "latency (1-byte ping-pong, p50)",
        "µs",
        [d, h, p].map(|t| t.as_secs_f64() * 1e6),
        1,
    );
    // Short connections: the per-connection cost (accept, original
    // destination, an HBONE stream on the pooled connection, dial, close).
    let short_server = close_first_echo(&server, 7001).unwrap();
    let short_outsider = close_first_echo(&outsider, 7001).unwrap();
    let (mut cd, mut ch, mut cp) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds_n {
        cd.push(connect_rate(&plain_client, short_outsider, 2.0));
        ch.push(connect_rate(&client, short_server, 2.0));
        cp.push(connect_rate(&client, short_outsider, 2.0));
    }
    table(
        "short connections (connect+echo+close)",
        "conn/s",
        [median(cd), median(ch), median(cp)],
        0,
    );
    // Right after the load, then once the proxies have been idle past their
    // allocator trim (src/proxy/mod.rs): VmRSS, and its private part.
    let pids: Vec<u32> = ["proxy-client", "proxy-server"]
        .iter()
        .filter_map(|l| lab.pid(l))
        .collect();
    let memory = |when: &str| {
        let each: Vec<String> = pids
            .iter()
            .map(|&p| format!("{} kB ({} kB private)", rss_kb(p), anon_kb(p)))
            .collect();
        println!("proxy RSS {when}: {}", each.join(" / "));
    };
    println!();
    memory("after the run");
    std::thread::sleep(Duration::from_secs(12));
    memory("12 s later, idle");
    println!(
        "\nbar (issue #2): HBONE >= 0.40x and passthrough >= 0.80x direct throughput: {}",
        if hbone / direct >= 0.40 && pass / direct >= 0.80 {
            "met"
        } else {
            "NOT met"
        }
    );
}
