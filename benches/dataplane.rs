//! Data-path benchmark (not a timed test). One lab node per congestion
//! control; in it, every path runs side by side and interleaved:
//! - direct: no proxy, no rules;
//! - for Ambit, and for a second proxy binary when `AMBIT_BENCH_PEER` names
//!   one (ztunnel): HBONE (a dedicated proxy in each pod, mTLS + HTTP/2
//!   CONNECT) and passthrough (meshed client, destination outside the mesh).
//!
//! Every leg of every path runs the same TCP congestion control: the bench
//! sets it in every netns of the lab and on Ambit's sockets, and prints it.
//! It runs the node's default and then CUBIC everywhere.
//!
//! Measures: iperf3 throughput (1, 8 and 64 streams), CPU per byte of the
//! processes involved (iperf3 client and server, the path's proxies, and the
//! machine's irq + softirq time of the run), 1-byte ping-pong latency and
//! connect + echo + close rate (blocking std sockets on plain threads, no
//! async runtime in the measuring loop), memory per idle HBONE connection,
//! and each proxy's RSS. Each value is printed with its ratio to direct,
//! and the peer's with Ambit ÷ peer. Ratios hold within one run only.
//!
//! Run: `cargo bench --bench dataplane` (as root). Settings (env):
//! `AMBIT_BENCH_SECS` iperf3 seconds (5), `AMBIT_BENCH_ROUNDS` interleaved
//! rounds (3), `AMBIT_BENCH_CC` congestion controls (`default,cubic`),
//! `AMBIT_BENCH_IDLE` idle connections (1000), `AMBIT_BENCH_PEER` other
//! proxy binaries (comma-separated: ztunnel, the floor proxy of
//! `benches/floor-proxy/`) and `AMBIT_BENCH_PEER_ENV` their extra `K=V`
//! settings (space-separated), `AMBIT_BENCH_WORKERS` extra Ambit worker-thread
//! counts to run as more paths (e.g. `1`), `AMBIT_BENCH_VARIANTS` Ambit with
//! other settings as more paths (`name:K=V K=V;name2:K=V`),
//! `AMBIT_BENCH_BASELINE` another `ambit` binary (an earlier commit's) as one more path,
//! `AMBIT_BENCH_MESSAGE` the ping-pong's message size (1), `AMBIT_BENCH_ONLY` some of
//! `memory,throughput,streams,latency,connections` (all), `AMBIT_BENCH_PROFILE`
//! a directory where each proxied path's proxies are sampled by `perf record`
//! over one more ping-pong run and one more 1-, 8- and 64-stream run (and the
//! report printed), `AMBIT_BENCH_CROSS`
//! (set) paths from Ambit's client side to the first peer's server side and back,
//! with `AMBIT_BENCH_CA=cert.pem:key.pem` the root Ambit issues from (the
//! peer's), `AMBIT_BENCH_LOAD` busy loops at nice 19 kept running through
//! the run (0), `AMBIT_BENCH_POOL=off` every proxy with HBONE pooling off, so
//! that each connection is a new mTLS handshake between the proxies (Ambit:
//! `POOL_UNUSED_RELEASE_TIMEOUT=0s`; peers: `POOL_MAX_STREAMS_PER_CONNECTION=1`,
//! with which ztunnel never returns a connection to its pool); the
//! connection figures then count the handshakes each connection cost.
//! The direct path's rounds warn (`UNSTEADY`) when they spread
//! past 1.5×. After the memory figures (taken on proxies that have carried
//! no bulk flow) and before any other, 32 MB go through each proxied
//! path's echo server and must come back intact.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ambit::lab::{
    anon_kb, close_first_echo, connect_from, cpu_seconds, iperf3, passive_opens, rss_kb,
    set_default_congestion_control, short_connection, write_ca, BusyLoops, EchoServer, Ends, Lab,
    LabPod, ProxySpec,
};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The machine's irq + softirq seconds so far: the kernel's packet work,
/// which is not charged to any process.
fn irq_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let t: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (t.get(5).copied().unwrap_or(0) + t.get(6).copied().unwrap_or(0)) as f64 / hz
}

/// CPU seconds of this process's children that have been waited for (the
/// iperf3 clients).
fn children_cpu() -> f64 {
    // SAFETY: rusage is plain data, valid all zero; getrusage writes into
    // the struct we own.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru);
        ru
    };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(ru.ru_utime) + s(ru.ru_stime)
}

/// Nanoseconds the threads of `pid` have run on a CPU, from their
/// `schedstat` (to the nanosecond; `/proc/<pid>/stat` counts 10 ms ticks).
fn run_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// A proxy to measure: Ambit at its defaults, Ambit with other settings, or
/// another binary that reads ztunnel's settings.
#[derive(Clone)]
struct Kind {
    name: String,
    binary: PathBuf,
    env: Vec<(String, String)>,
    ambit: bool,
}

/// One path: who sends, who receives, and the processes that carry it.
struct Path {
    name: String,
    kind: Option<usize>,
    client: LabPod,
    server: LabPod,
    proxies: Vec<String>,
    echo: SocketAddr,
    short: SocketAddr,
}

impl Path {
    fn pids(&self, lab: &Lab) -> Vec<u32> {
        let mut labels = self.proxies.clone();
        labels.push(format!("iperf3-{}", self.server.name));
        labels.iter().filter_map(|l| lab.pid(l)).collect()
    }
}

/// One iperf3 run: Gbit/s, and CPU seconds per Gbit of the processes
/// involved plus the kernel's packet work.
fn iperf(lab: &Lab, path: &Path, secs: u64, streams: u32) -> (f64, f64) {
    let pids = path.pids(lab);
    let cpu = || pids.iter().map(|&p| cpu_seconds(p)).sum::<f64>() + irq_cpu() + children_cpu();
    let before = cpu();
    let p = streams.to_string();
    let extra: Vec<&str> = if streams > 1 { vec!["-P", &p] } else { vec![] };
    let run = iperf3(&path.client, path.server.ip, secs, &extra)
        .unwrap_or_else(|e| panic!("iperf3 on {}: {e}", path.name));
    (run.gbps, (cpu() - before).max(0.0) / run.gbit.max(1e-9))
}

/// `rounds` interleaved rounds of [`iperf`] over every path: each path's
/// Gbit/s and CPU per byte, a value per round.
fn iperf_rounds(
    lab: &Lab,
    paths: &[Path],
    rounds: usize,
    secs: u64,
    streams: u32,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let (mut gbps, mut cost) = (vec![Vec::new(); paths.len()], vec![Vec::new(); paths.len()]);
    for _ in 0..rounds {
        for (i, p) in paths.iter().enumerate() {
            let (g, c) = iperf(lab, p, secs, streams);
            gbps[i].push(g);
            cost[i].push(c);
        }
    }
    (gbps, cost)
}

/// The path's proxies' system calls and context switches per MB received
/// in one more single-stream iperf3 run, counted by `perf stat` (none
/// without a proxy or `perf`). Apart from the timed rounds: counting slows
/// every system call a little.
fn iperf_counted(lab: &Lab, path: &Path, secs: u64) -> Option<(f64, f64)> {
    let (run, counts) = counted(&proxy_pids(lab, path), || {
        iperf3(&path.client, path.server.ip, secs, &[])
            .unwrap_or_else(|e| panic!("iperf3 on {}: {e}", path.name))
    });
    let mb = run.gbit.max(1e-9) * 125.0;
    counts.map(|c| (c.syscalls / mb, c.switches / mb))
}

/// The pids of a path's proxies.
fn proxy_pids(lab: &Lab, path: &Path) -> Vec<u32> {
    path.proxies.iter().filter_map(|l| lab.pid(l)).collect()
}

/// Connections per second, one after another from the path's client, and
/// how many were made in all (warm-up included).
/// Connections per second for `secs`, connections made (warm-ups
/// included), and the HBONE connections the server's side accepted per
/// connection made (0 for paths with no proxy at the server).
fn connect_rate(path: &Path, secs: f64) -> (f64, f64, f64) {
    let target = path.short;
    let accepted_before = passive_opens(&path.server).unwrap();
    let (rate, made) = path
        .client
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
            (n as f64 / start.elapsed().as_secs_f64(), (n + 50) as f64)
        })
        .unwrap();
    // Each connection made is one the server app accepted; any more the
    // pod's netns accepted were its proxy's, HBONE connections.
    let more = passive_opens(&path.server)
        .unwrap()
        .saturating_sub(accepted_before) as f64
        - made;
    (rate, made, (more / made).max(0.0))
}

/// p50 and p99 of `rounds` round trips of `size`-byte messages on one
/// connection.
/// The connection is returned open, so that a caller counting the proxies'
/// threads' CPU time counts it before a proxy with a thread per connection
/// (the floor proxy) lets its threads go.
fn ping_pong(path: &Path, rounds: usize, size: usize) -> (f64, f64, TcpStream) {
    let mut s = connect_from(&path.client, path.echo).unwrap();
    s.set_nodelay(true).unwrap();
    let message = vec![b'x'; size];
    let mut b = vec![0u8; size];
    let mut once = |s: &mut TcpStream| {
        let t = Instant::now();
        s.write_all(&message).unwrap();
        s.read_exact(&mut b).unwrap();
        t.elapsed()
    };
    for _ in 0..500 {
        once(&mut s);
    }
    let mut samples: Vec<Duration> = (0..rounds).map(|_| once(&mut s)).collect();
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    (us(samples[rounds / 2]), us(samples[rounds * 99 / 100]), s)
}

/// Sends `bytes` of a pattern to the path's echo server while reading them
/// back, and panics, with the proxies' logs, unless every byte comes back
/// in order: a path that mangles data has no figures worth printing.
fn echo_intact(lab: &Lab, path: &Path, bytes: usize) {
    let failed = |why: String| -> ! {
        let logs: Vec<String> = path
            .proxies
            .iter()
            .map(|l| {
                let log = std::fs::read_to_string(lab.log_path(l)).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- {l} ---\n{}", tail.join("\n"))
            })
            .collect();
        panic!("{}: {why}\n{}", path.name, logs.join("\n"));
    };
    let mut s = connect_from(&path.client, path.echo).unwrap_or_else(|e| failed(e.to_string()));
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut w = s.try_clone().unwrap();
    let byte = |i: usize| (i.wrapping_mul(2_654_435_761) >> 13) as u8;
    let writer = std::thread::spawn(move || {
        let mut chunk = vec![0u8; 100_003];
        let mut sent = 0;
        while sent < bytes {
            let n = chunk.len().min(bytes - sent);
            for (j, b) in chunk[..n].iter_mut().enumerate() {
                *b = byte(sent + j);
            }
            if w.write_all(&chunk[..n]).is_err() {
                return;
            }
            sent += n;
        }
    });
    let mut buf = vec![0u8; 65_536];
    let mut got = 0;
    while got < bytes {
        let n = match s.read(&mut buf) {
            Ok(0) => failed(format!("echo closed after {got} bytes")),
            Ok(n) => n,
            Err(e) => failed(format!("echo after {got} bytes: {e}")),
        };
        if let Some(j) = (0..n).find(|&j| buf[j] != byte(got + j)) {
            failed(format!("byte {} came back wrong", got + j));
        }
        got += n;
    }
    writer.join().unwrap();
    println!("{}: {bytes} bytes echoed intact", path.name);
}

/// RSS in kB of the path's proxies together. A proxy that is gone stops
/// the run: its RSS would read as 0, a win that is not one.
fn proxies_rss(lab: &Lab, path: &Path) -> (u64, u64) {
    path.proxies
        .iter()
        .map(|l| alive(lab, l))
        .fold((0, 0), |(r, a), p| (r + rss_kb(p), a + anon_kb(p)))
}

/// The pid of the proxy `label`, which must still run (not exited, not a
/// zombie); else the bench stops, with the proxy's log.
fn alive(lab: &Lab, label: &str) -> u32 {
    let running = lab.pid(label).filter(|p| {
        std::fs::read_to_string(format!("/proc/{p}/status")).is_ok_and(|s| {
            s.lines()
                .any(|l| l.starts_with("State:") && !l.contains("zombie"))
        })
    });
    running.unwrap_or_else(|| {
        let log = std::fs::read_to_string(lab.log_path(label)).unwrap_or_default();
        panic!("proxy {label} is not running: its figures would be read as zeros; its log:\n{log}")
    })
}

/// Each of the path's proxies' RSS and its private part, for the log.
fn each_rss(lab: &Lab, path: &Path) -> String {
    let each: Vec<String> = path
        .proxies
        .iter()
        .filter_map(|l| Some((l, lab.pid(l)?)))
        .map(|(l, p)| format!("{l} {} kB ({} kB private)", rss_kb(p), anon_kb(p)))
        .collect();
    each.join(", ")
}

/// Opens `n` connections through the path, each with one round trip, and
/// returns the proxies' RSS growth per connection in kB while they are held,
/// and what they still hold (kB, both together) 12 s after all closed:
/// what the burst left behind once each allocator had its chance to give
/// free memory back (Ambit trims every 10 s; jemalloc, ztunnel's, decays
/// its free pages over 10 s).
/// One connection opened and closed first maps the code a connection runs
/// into both proxies (a proxy that unmaps its start-up code, as Ambit does,
/// would otherwise count it here), so the growth is what each one holds.
fn idle_connections(lab: &Lab, path: &Path, n: usize) -> (f64, f64) {
    let target = path.echo;
    let open = move |i: usize| -> std::io::Result<TcpStream> {
        let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"x")?;
        s.read_exact(&mut [0u8; 1])
            .map_err(|e| std::io::Error::other(format!("connection {i}: {e}")))?;
        Ok(s)
    };
    path.client
        .ns
        .run(move || open(0).map(drop))
        .unwrap()
        .unwrap_or_else(|e| panic!("warm-up connection on {}: {e}", path.name));
    // What both proxies hold now (kB), said in the log with `when`.
    let rss = |when: &str| {
        println!("{} {when}: {}", path.name, each_rss(lab, path));
        proxies_rss(lab, path).0
    };
    std::thread::sleep(Duration::from_millis(200));
    let before = rss("before");
    let held = path
        .client
        .ns
        .run(move || {
            (0..n)
                .map(open)
                .collect::<std::io::Result<Vec<TcpStream>>>()
        })
        .unwrap()
        .unwrap_or_else(|e| panic!("{n} idle connections on {}: {e}", path.name));
    std::thread::sleep(Duration::from_millis(500));
    let after = rss(&format!("with {n} idle connections"));
    drop(held);
    std::thread::sleep(Duration::from_secs(12));
    let closed = rss("12 s after they closed");
    (
        after.saturating_sub(before) as f64 / n as f64,
        closed.saturating_sub(before) as f64,
    )
}

/// Runs `f` while `perf <args> -p <pids>` watches `pids` (all their
/// threads), stopped with SIGINT after `f`; returns `f`'s value and what
/// perf wrote to stderr, or none when there is no proxy or no perf.
fn under_perf<T>(args: &[&str], pids: &[u32], f: impl FnOnce() -> T) -> (T, Option<String>) {
    if pids.is_empty() {
        return (f(), None);
    }
    let list: Vec<String> = pids.iter().map(|p| p.to_string()).collect();
    let perf = std::process::Command::new("perf")
        .args(args)
        .arg("-p")
        .arg(list.join(","))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn();
    // No perf is no figure, said loudly: a count of 0 would read as a win.
    let perf = perf.unwrap_or_else(|e| {
        panic!("cannot run perf ({e}): the bench counts the proxies' system calls and context switches with it (Debian: linux-perf)")
    });
    std::thread::sleep(Duration::from_millis(500)); // perf attaches
    let value = f();
    // SAFETY: kill(2) on the child we spawned and have not reaped.
    unsafe { libc::kill(perf.id() as libc::pid_t, libc::SIGINT) };
    let text = perf
        .wait_with_output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stderr).into_owned());
    (value, text)
}

/// What `perf stat` counted for a path's proxies over a run.
struct Counts {
    syscalls: f64,
    switches: f64,
    migrations: f64,
    /// Context switches by thread (`name-tid`), the busiest first: which
    /// threads a round trip wakes.
    by_thread: Vec<(String, f64)>,
}

/// Runs `f` while `perf stat` counts the system calls, context switches
/// and CPU migrations of `pids`, and (a second `perf stat`, per thread)
/// the context switches of each of their threads; returns `f`'s value and
/// the counts, or none when there is no proxy or no perf.
fn counted<T>(pids: &[u32], f: impl FnOnce() -> T) -> (T, Option<Counts>) {
    let events = "raw_syscalls:sys_enter,context-switches,cpu-migrations";
    let list: Vec<String> = pids.iter().map(|p| p.to_string()).collect();
    // The per-thread count runs beside the totals, on the same pids.
    let per_thread = (!pids.is_empty())
        .then(|| {
            std::process::Command::new("perf")
                .args([
                    "stat",
                    "--per-thread",
                    "-x",
                    ",",
                    "-e",
                    "context-switches",
                    "-p",
                ])
                .arg(list.join(","))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .ok()
        })
        .flatten();
    let (value, text) = under_perf(&["stat", "-x", ",", "-e", events], pids, f);
    let threads = per_thread.map(|p| {
        // SAFETY: kill(2) on the child we spawned and have not reaped.
        unsafe { libc::kill(p.id() as libc::pid_t, libc::SIGINT) };
        p.wait_with_output()
            .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
            .unwrap_or_default()
    });
    let text = text.unwrap_or_default();
    let count = |event: &str| {
        text.lines()
            .find(|l| l.contains(event))
            .and_then(|l| l.split(',').next()?.parse::<f64>().ok())
    };
    let mut by_thread: std::collections::BTreeMap<String, f64> = Default::default();
    // Lines "name-tid,count,,context-switches,...": kept by thread (tid),
    // so that each process's threads are told apart.
    for l in threads.unwrap_or_default().lines() {
        let f: Vec<&str> = l.split(',').collect();
        if let [thread, n, ..] = f.as_slice() {
            if let Ok(n) = n.parse::<f64>() {
                *by_thread.entry(thread.trim().to_string()).or_default() += n;
            }
        }
    }
    let mut by_thread: Vec<(String, f64)> = by_thread.into_iter().filter(|t| t.1 > 0.0).collect();
    by_thread.sort_by(|a, b| b.1.total_cmp(&a.1));
    let counts = match (
        count("raw_syscalls:sys_enter"),
        count("context-switches"),
        count("cpu-migrations"),
    ) {
        (Some(syscalls), Some(switches), Some(migrations)) => Some(Counts {
            syscalls,
            switches,
            migrations,
            by_thread,
        }),
        _ => None,
    };
    if counts.is_none() && !pids.is_empty() {
        panic!("perf stat counted nothing for {pids:?} (a proxy gone, or perf not allowed to count): {text}");
    }
    (value, counts)
}

/// `name` as a file name: every character but ASCII letters and digits a `-`.
fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

/// Runs `f` while `perf record` samples `pids` (user and kernel, 4,999 Hz,
/// and `AMBIT_BENCH_PROFILE_ARGS`, e.g. `--call-graph dwarf`) into `out`;
/// then prints where their time went, by binary and by function, from
/// `perf report`.
fn profiled<T>(pids: &[u32], out: &std::path::Path, f: impl FnOnce() -> T) -> T {
    let extra = std::env::var("AMBIT_BENCH_PROFILE_ARGS").unwrap_or_default();
    let out_arg = out.display().to_string();
    let mut args = vec!["record", "-F", "4999", "-o", &out_arg];
    args.extend(extra.split_whitespace());
    let (value, _) = under_perf(&args, pids, f);
    // The cipher's share, summed over its functions (ring's, aws-lc's and
    // OpenSSL-derived names: AES rounds, CTR, GHASH, the fused GCM loops).
    let symbols = std::process::Command::new("perf")
        .args(["report", "--stdio", "--no-children", "--sort", "sym", "-i"])
        .arg(out)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let cipher: f64 = symbols
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("aes") || l.contains("gcm") || l.contains("ghash")
        })
        .filter_map(|l| {
            l.split_whitespace()
                .next()?
                .strip_suffix('%')?
                .parse::<f64>()
                .ok()
        })
        .fold(0.0, |sum, share| sum + share);
    println!("    AES-GCM: {cipher:.1}% of the samples");
    for (sort, limit) in [("dso", "0.5"), ("dso,sym", "0.7")] {
        let report = std::process::Command::new("perf")
            .args(["report", "--stdio", "--no-children", "--sort", sort])
            .args(["--percent-limit", limit, "-i"])
            .arg(out)
            .output();
        let text = report
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        {
            println!("    {line}");
        }
    }
    value
}

/// Runs `f` while `perf trace -s` counts the system calls of `pids` by
/// name; then prints the counts, summed over threads.
fn traced<T>(pids: &[u32], f: impl FnOnce() -> T) -> T {
    let (value, text) = under_perf(&["trace", "-s"], pids, f);
    // Lines "   name   calls  errors  total ..." under each thread.
    let mut calls: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    for line in text.unwrap_or_default().lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [name, n, errors, ..] = f.as_slice() {
            if let (Ok(n), Ok(e)) = (n.parse::<u64>(), errors.parse::<u64>()) {
                let c = calls.entry(name.to_string()).or_default();
                c.0 += n;
                c.1 += e;
            }
        }
    }
    let mut sorted: Vec<_> = calls.into_iter().collect();
    sorted.sort_by_key(|c| std::cmp::Reverse(c.1 .0));
    for (name, (n, e)) in sorted {
        println!("    {name:<20} {n:>9} calls {e:>7} errors");
    }
    value
}

/// With `AMBIT_BENCH_PROFILE` set: one more iperf3 run of `streams` on
/// each proxied path under `perf record` of its proxies, and one under
/// `perf trace -s`.
fn profile_iperf(lab: &Lab, paths: &[Path], cc: &str, secs: u64, streams: u32) {
    let Ok(dir) = std::env::var("AMBIT_BENCH_PROFILE") else {
        return;
    };
    let what = match streams {
        1 => "1 stream".to_string(),
        n => format!("{n} streams"),
    };
    for p in paths.iter().filter(|p| p.kind.is_some()) {
        let out = PathBuf::from(&dir).join(format!("{cc}-{}-{streams}.data", slug(&p.name)));
        let run = || iperf(lab, p, secs, streams);
        let pids = proxy_pids(lab, p);
        println!("{} ({what}) under perf record ({}):", p.name, out.display());
        profiled(&pids, &out, run);
        println!("{} ({what}) under perf trace -s, per {secs} s:", p.name);
        traced(&pids, run);
    }
}

/// Above this spread (largest ÷ smallest round) of the direct path, whose
/// code no change touches, the machine itself moved during the run: one
/// run's unchanged passthrough path once read 1.9× apart between its two
/// halves. Ratios from such a run are not a change's before and after.
const UNSTEADY_SPREAD: f64 = 1.5;

/// Warnings for the end of the run, where the ratios are printed.
static UNSTEADY: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Prints one path's rounds and their spread; for the direct path, warns
/// (there and again at the end) when the spread says the machine was not
/// steady.
fn print_rounds(
    cc: &str,
    what: &str,
    name: &str,
    values: &[f64],
    decimals: usize,
    unit: &str,
    direct: bool,
) {
    let r: Vec<String> = values.iter().map(|v| format!("{v:.decimals$}")).collect();
    let (lo, hi) = values
        .iter()
        .fold((f64::MAX, 0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let spread = if lo > 0.0 { hi / lo } else { 0.0 };
    println!(
        "{name:<42} rounds: {} {unit} (spread {spread:.2}×)",
        r.join(" ")
    );
    if direct && spread > UNSTEADY_SPREAD {
        let warning = format!(
            "UNSTEADY: {cc} {what}: the direct path's rounds spread {spread:.2}× (above {UNSTEADY_SPREAD}×); \
             the machine moved during the run, so its ratios move with it"
        );
        println!("{warning}");
        UNSTEADY
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(warning);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Values of one measure, a row per path.
struct Measure {
    title: String,
    unit: &'static str,
    decimals: usize,
    /// For the summary: whether a larger value is better.
    higher_is_better: bool,
    values: Vec<f64>,
}

fn print_measure(m: &Measure, paths: &[Path], kinds: &[Kind]) {
    println!(
        "\n{:<42} {:>10} {:>10} {:>12}",
        m.title, m.unit, "vs direct", "Ambit ÷ it"
    );
    for (i, (p, v)) in paths.iter().zip(&m.values).enumerate() {
        let d = m.decimals;
        let vs_ambit = match p.kind {
            Some(k) if !kinds[k].ambit => {
                // The Ambit path of the same shape (HBONE or passthrough).
                let shape = if p.name.ends_with("HBONE") {
                    "HBONE"
                } else {
                    "passthrough"
                };
                paths
                    .iter()
                    .zip(&m.values)
                    .find(|(q, _)| q.kind == Some(0) && q.name.ends_with(shape))
                    .map(|(_, a)| format!("{:>11.2}x", a / v))
                    .unwrap_or_default()
            }
            _ => String::new(),
        };
        let vs_direct = if i == 0 || m.values[0] == 0.0 {
            String::new()
        } else {
            format!("{:>9.2}x", v / m.values[0])
        };
        println!("{:<42} {v:>10.d$} {vs_direct:>10} {vs_ambit:>12}", p.name);
    }
}

const ALLOWED_CC: &str = "/proc/sys/net/ipv4/tcp_allowed_congestion_control";

/// A netns other than the host's may only default to an algorithm the
/// host allows; `allow` adds `ccs` to that list for the run and the drop
/// puts the host's list back.
struct AllowedCc(String);

impl AllowedCc {
    fn allow(ccs: &[String]) -> AllowedCc {
        let before = std::fs::read_to_string(ALLOWED_CC).unwrap_or_default();
        let mut list: Vec<&str> = before.split_whitespace().collect();
        for cc in ccs {
            if !list.contains(&cc.as_str()) {
                list.push(cc);
            }
        }
        std::fs::write(ALLOWED_CC, list.join(" ")).expect("allowing the congestion controls");
        AllowedCc(before.trim().to_string())
    }
}

impl Drop for AllowedCc {
    fn drop(&mut self) {
        let _ = std::fs::write(ALLOWED_CC, &self.0);
    }
}

/// Sets `cc` as the default congestion control of every netns of the lab.
fn set_cc(lab: &Lab, cc: &str) {
    let pods = lab.pods().iter().map(|p| &p.ns);
    for ns in std::iter::once(&lab.node).chain(pods) {
        set_default_congestion_control(ns, cc).unwrap_or_else(|e| panic!("setting {cc}: {e}"));
    }
}

/// Builds the lab for one congestion control and measures every path.
/// Returns the measures and the paths, for the summary.
fn phase(
    cc: &str,
    kinds: &[Kind],
    secs: u64,
    rounds: usize,
    idle: usize,
) -> (Vec<Measure>, Vec<Path>) {
    let mut lab = Lab::new("bench", env!("CARGO_BIN_EXE_ambit")).expect("lab (run as root)");
    let plain = lab.add_pod("plainclient").unwrap();
    let outsider = lab.add_pod("outsider").unwrap();
    let mut pairs = Vec::new();
    for k in 0..kinds.len() {
        pairs.push((
            lab.add_pod(&format!("c{k}")).unwrap(),
            lab.add_pod(&format!("s{k}")).unwrap(),
        ));
    }
    set_cc(&lab, cc);
    // `AMBIT_BENCH_CA=cert.pem:key.pem`: Ambit's certificates from this root
    // instead of a fresh one (the peer's test root, for the cross paths).
    let (ca_cert, ca_key) = match std::env::var("AMBIT_BENCH_CA") {
        Ok(v) => {
            let (c, k) = v
                .split_once(':')
                .expect("AMBIT_BENCH_CA is cert.pem:key.pem");
            (PathBuf::from(c), PathBuf::from(k))
        }
        Err(_) => write_ca(&lab.dir, "ca", "cluster.local").unwrap(),
    };
    let cfg = lab.dir.join("mesh.yaml");
    let mut yaml = String::from("workloads:\n");
    for (c, s) in &pairs {
        for p in [c, s] {
            yaml += &format!(
                "- {{uid: {0}, name: {0}, namespace: default, serviceAccount: {0}, trustDomain: cluster.local, workloadIps: [\"{1}\"], protocol: HBONE, services: {{}}}}\n",
                p.name, p.ip
            );
        }
    }
    std::fs::write(&cfg, yaml).unwrap();
    for (kind, (c, s)) in kinds.iter().zip(&pairs) {
        for pod in [c, s] {
            lab.redirect(pod).unwrap();
            let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
            let mut extra_env = vec![("RUST_LOG".to_string(), log)];
            if kind.ambit {
                extra_env.push(("AMBIT_CONGESTION_CONTROL".into(), cc.into()));
            }
            extra_env.extend(kind.env.iter().cloned());
            if pool_off() {
                extra_env.push(if kind.ambit {
                    ("POOL_UNUSED_RELEASE_TIMEOUT".into(), "0s".into())
                } else {
                    ("POOL_MAX_STREAMS_PER_CONNECTION".into(), "1".into())
                });
            }
            let spec = ProxySpec {
                config: cfg.clone(),
                ca_cert: ca_cert.clone(),
                ca_key: ca_key.clone(),
                workload_info: format!("default/{0}/{0}", pod.name),
                trust_domain: "cluster.local".into(),
                extra_env,
            };
            lab.start_proxy_from(&kind.binary, pod, &spec)
                .unwrap_or_else(|e| panic!("{}: {e}", kind.name));
        }
    }
    let echo_out = EchoServer::start(&outsider, 7000).unwrap();
    let short_out = close_first_echo(&outsider, 7001).unwrap();
    lab.start_iperf3_server(&outsider).unwrap();
    let mut paths = vec![Path {
        name: "direct (no proxy)".into(),
        kind: None,
        client: plain.clone(),
        server: outsider.clone(),
        proxies: vec![],
        echo: echo_out.addr,
        short: short_out,
    }];
    let mut echoes = vec![echo_out];
    for (k, (kind, (c, s))) in kinds.iter().zip(&pairs).enumerate() {
        lab.start_iperf3_server(s).unwrap();
        let echo = EchoServer::start(s, 7000).unwrap();
        paths.push(Path {
            name: format!("{} HBONE", kind.name),
            kind: Some(k),
            client: c.clone(),
            server: s.clone(),
            proxies: vec![format!("proxy-{}", c.name), format!("proxy-{}", s.name)],
            echo: echo.addr,
            short: close_first_echo(s, 7001).unwrap(),
        });
        echoes.push(echo);
        paths.push(Path {
            name: format!("{} passthrough", kind.name),
            kind: Some(k),
            client: c.clone(),
            server: outsider.clone(),
            proxies: vec![format!("proxy-{}", c.name)],
            echo: echoes[0].addr,
            short: short_out,
        });
    }

    // Across the two proxies, both ways (`AMBIT_BENCH_CROSS`): Ambit's
    // client side against the peer's server side and back, on the peer's
    // pods' servers. Their certificates must chain to one root.
    let peer = kinds.iter().position(|k| !k.ambit);
    if let (Some(z), true) = (peer, std::env::var_os("AMBIT_BENCH_CROSS").is_some()) {
        let hbone = |paths: &[Path], k: usize| {
            paths
                .iter()
                .find(|p| p.kind == Some(k) && p.name.ends_with("HBONE"))
                .map(|p| (p.echo, p.short))
                .unwrap()
        };
        for (from, to) in [(0, z), (z, 0)] {
            let (echo, short) = hbone(&paths, to);
            let (c, s) = (&pairs[from].0, &pairs[to].1);
            paths.push(Path {
                name: format!("{} → {} (cross)", kinds[from].name, kinds[to].name),
                kind: None,
                client: c.clone(),
                server: s.clone(),
                proxies: vec![format!("proxy-{}", c.name), format!("proxy-{}", s.name)],
                echo,
                short,
            });
        }
    }

    println!("\n=== TCP congestion control {cc} on every leg: every netns of the lab and Ambit's sockets ===");
    let n = paths.len();
    let only = std::env::var("AMBIT_BENCH_ONLY").unwrap_or_default();
    let wanted = |what: &str| only.is_empty() || only.split(',').any(|w| w == what);
    let mut measures = Vec::new();
    let proxy_pids = |p: &Path| proxy_pids(&lab, p);
    // Memory first, on proxies that have carried no load yet: what one more
    // idle connection costs, not what an allocator kept from a bulk flow.
    if wanted("memory") {
        let (per_conn, kept): (Vec<f64>, Vec<f64>) = paths
            .iter()
            .map(|p| match p.kind {
                Some(_) if p.name.ends_with("HBONE") => idle_connections(&lab, p, idle),
                _ => (0.0, 0.0),
            })
            .unzip();
        measures.push(Measure {
            title: format!("RSS per idle connection ({idle} held)"),
            unit: "kB",
            decimals: 2,
            higher_is_better: false,
            values: per_conn,
        });
        measures.push(Measure {
            title: format!("  RSS kept 12 s after the {idle} closed"),
            unit: "kB",
            decimals: 0,
            higher_is_better: false,
            values: kept,
        });
    }
    // Every proxied path's bytes checked before any figure of bytes: after
    // the memory figures, whose proxies must not have carried a bulk flow
    // yet (its heap is what a first connection then reuses).
    for p in paths.iter().skip(1) {
        echo_intact(&lab, p, 32 << 20);
    }
    if wanted("throughput") {
        let (gbps, cost) = iperf_rounds(&lab, &paths, rounds, secs, 1);
        let per_mb: Vec<(f64, f64)> = paths
            .iter()
            .map(|p| iperf_counted(&lab, p, secs).unwrap_or_default())
            .collect();
        for (i, p) in paths.iter().enumerate() {
            print_rounds(cc, "throughput", &p.name, &gbps[i], 2, "Gbit/s", i == 0);
        }
        profile_iperf(&lab, &paths, cc, secs, 1);
        measures.push(Measure {
            title: "throughput (iperf3, 1 stream, median)".into(),
            unit: "Gbit/s",
            decimals: 2,
            higher_is_better: true,
            values: gbps.into_iter().map(median).collect(),
        });
        measures.push(Measure {
            title: "CPU per byte (processes + irq/softirq)".into(),
            unit: "cpu-s/Gbit",
            decimals: 3,
            higher_is_better: false,
            values: cost.into_iter().map(median).collect(),
        });
        measures.push(Measure {
            title: "  proxies' syscalls per MB (1 stream)".into(),
            unit: "",
            decimals: 1,
            higher_is_better: false,
            values: per_mb.iter().map(|c| c.0).collect(),
        });
        measures.push(Measure {
            title: "  proxies' context switches per MB (1 stream)".into(),
            unit: "",
            decimals: 2,
            higher_is_better: false,
            values: per_mb.iter().map(|c| c.1).collect(),
        });
    }
    if wanted("streams") {
        for streams in [8, 64] {
            // Interleaved rounds, as for one stream: one sample per path
            // read 0.32x and 1.11x of ztunnel in two runs the same hour.
            let (gbps, cost) = iperf_rounds(&lab, &paths, rounds, secs, streams);
            let what = format!("{streams} streams");
            for (i, p) in paths.iter().enumerate() {
                print_rounds(cc, &what, &p.name, &gbps[i], 2, "Gbit/s", i == 0);
            }
            profile_iperf(&lab, &paths, cc, secs, streams);
            measures.push(Measure {
                title: format!("throughput (iperf3, {streams} streams)"),
                unit: "Gbit/s",
                decimals: 2,
                higher_is_better: true,
                values: gbps.into_iter().map(median).collect(),
            });
            measures.push(Measure {
                title: format!("CPU per byte ({streams} streams)"),
                unit: "cpu-s/Gbit",
                decimals: 3,
                higher_is_better: false,
                values: cost.into_iter().map(median).collect(),
            });
        }
    }
    if wanted("latency") {
        // 20,000 round trips per path, split over interleaved rounds: one
        // run per path moved by up to 15% from one path to the next (the
        // same code measured twice in one run: 177 and 208 µs). Timed
        // apart from the counted run, since counting slows every system
        // call a little.
        const ROUND_TRIPS: usize = 20_000;
        let per_round = (ROUND_TRIPS / rounds.max(1)).max(2_000);
        let message: usize = env_or("AMBIT_BENCH_MESSAGE", 1);
        let (mut p50s, mut p99s) = (vec![Vec::new(); n], vec![Vec::new(); n]);
        // The proxies' CPU time over the timed rounds, warm-ups included.
        let mut cpu_ns = vec![0u64; n];
        for _ in 0..rounds {
            for (i, p) in paths.iter().enumerate() {
                let pids = proxy_pids(p);
                let ran = || pids.iter().map(|&pid| run_ns(pid)).sum::<u64>();
                let before = ran();
                let (p50, p99, open) = ping_pong(p, per_round, message);
                cpu_ns[i] += ran().saturating_sub(before);
                drop(open);
                p50s[i].push(p50);
                p99s[i].push(p99);
            }
        }
        let trips = (rounds.max(1) * (per_round + 500)) as f64;
        for (i, p) in paths.iter().enumerate() {
            print_rounds(cc, "p50", &p.name, &p50s[i], 1, "µs p50", i == 0);
        }
        if let Ok(dir) = std::env::var("AMBIT_BENCH_PROFILE") {
            for p in paths.iter().filter(|p| p.kind.is_some()) {
                let out = PathBuf::from(&dir).join(format!("{cc}-{}.data", slug(&p.name)));
                println!("{} under perf record ({}):", p.name, out.display());
                profiled(&proxy_pids(p), &out, || ping_pong(p, per_round, message));
                println!(
                    "{} under perf trace -s, per {} round trips:",
                    p.name,
                    per_round + 500
                );
                traced(&proxy_pids(p), || ping_pong(p, per_round, message));
            }
        }
        let costs: Vec<Option<Counts>> = paths
            .iter()
            .map(|p| counted(&proxy_pids(p), || ping_pong(p, per_round, message)).1)
            .collect();
        let per = |f: fn(&Counts) -> f64| -> Vec<f64> {
            costs
                .iter()
                .map(|c| {
                    c.as_ref()
                        .map(|c| f(c) / (per_round + 500) as f64)
                        .unwrap_or(0.0)
                })
                .collect()
        };
        // Which threads each round trip wakes (context switches per round
        // trip, by thread, the path's proxies together).
        for (p, c) in paths.iter().zip(&costs) {
            if let Some(c) = c {
                let threads: Vec<String> = c
                    .by_thread
                    .iter()
                    .take(6)
                    .map(|(name, n)| format!("{name} {:.2}", n / (per_round + 500) as f64))
                    .collect();
                println!(
                    "{cc}: {} context switches per round trip by thread: {}",
                    p.name,
                    threads.join(", ")
                );
            }
        }
        measures.push(Measure {
            title: format!("latency ({message}-byte ping-pong, p50)"),
            unit: "µs",
            decimals: 1,
            higher_is_better: false,
            values: p50s.into_iter().map(median).collect(),
        });
        measures.push(Measure {
            title: format!("latency ({message}-byte ping-pong, p99)"),
            unit: "µs",
            decimals: 1,
            higher_is_better: false,
            values: p99s.into_iter().map(median).collect(),
        });
        measures.push(Measure {
            title: "  proxies' CPU per round trip".into(),
            unit: "µs",
            decimals: 1,
            higher_is_better: false,
            values: cpu_ns.iter().map(|&ns| ns as f64 / 1e3 / trips).collect(),
        });
        measures.push(Measure {
            title: "  proxies' syscalls per round trip".into(),
            unit: "",
            decimals: 1,
            higher_is_better: false,
            values: per(|c| c.syscalls),
        });
        measures.push(Measure {
            title: "  proxies' context switches per round trip".into(),
            unit: "",
            decimals: 2,
            higher_is_better: false,
            values: per(|c| c.switches),
        });
        measures.push(Measure {
            title: "  proxies' CPU migrations per round trip".into(),
            unit: "",
            decimals: 2,
            higher_is_better: false,
            values: per(|c| c.migrations),
        });
    }
    if wanted("connections") {
        let (mut rates, mut handshakes) = (vec![Vec::new(); n], vec![Vec::new(); n]);
        for _ in 0..rounds {
            for (i, p) in paths.iter().enumerate() {
                let (rate, _, hbone) = connect_rate(p, 2.0);
                rates[i].push(rate);
                handshakes[i].push(hbone);
            }
        }
        // Counted apart from the timed rounds, as above.
        let costs: Vec<Option<(f64, f64)>> = paths
            .iter()
            .map(|p| {
                let ((_, made, _), c) = counted(&proxy_pids(p), || connect_rate(p, 2.0));
                c.map(|c| (c.syscalls / made, c.switches / made))
            })
            .collect();
        let pooling = if pool_off() { " (pool off)" } else { "" };
        measures.push(Measure {
            title: format!("connect + 1-byte echo + close{pooling}"),
            unit: "conn/s",
            decimals: 0,
            higher_is_better: true,
            values: rates.into_iter().map(median).collect(),
        });
        measures.push(Measure {
            title: "  proxy-to-proxy connections per connection".into(),
            unit: "",
            decimals: 3,
            higher_is_better: false,
            values: handshakes.into_iter().map(median).collect(),
        });
        measures.push(Measure {
            title: "  proxies' syscalls per connection".into(),
            unit: "",
            decimals: 1,
            higher_is_better: false,
            values: costs
                .iter()
                .map(|c| c.map(|c| c.0).unwrap_or(0.0))
                .collect(),
        });
        measures.push(Measure {
            title: "  proxies' context switches per connection".into(),
            unit: "",
            decimals: 2,
            higher_is_better: false,
            values: costs
                .iter()
                .map(|c| c.map(|c| c.1).unwrap_or(0.0))
                .collect(),
        });
    }
    let after: Vec<(u64, u64)> = paths.iter().map(|p| proxies_rss(&lab, p)).collect();
    measures.push(Measure {
        title: "proxies' RSS after the run (both ends)".into(),
        unit: "MB",
        decimals: 1,
        higher_is_better: false,
        values: after.iter().map(|a| a.0 as f64 / 1024.0).collect(),
    });
    // Without the pages of the binary and libraries, which every process
    // of the binary on the node shares: what the proxy itself holds.
    measures.push(Measure {
        title: "  of it private (heap, stacks; both ends)".into(),
        unit: "MB",
        decimals: 1,
        higher_is_better: false,
        values: after.iter().map(|a| a.1 as f64 / 1024.0).collect(),
    });
    for m in &measures {
        print_measure(m, &paths, kinds);
    }
    drop(echoes);
    (measures, paths)
}

/// What the project aims for against the peer, per measure title prefix and
/// path shape: (measure, shape, aim as Ambit ÷ peer).
const AIMS: [(&str, &str, f64); 6] = [
    ("throughput (iperf3, 1 stream", "HBONE", 1.5),
    ("CPU per byte (processes", "HBONE", 0.7),
    ("latency (1-byte ping-pong, p50", "HBONE", 0.7),
    ("connect + 1-byte echo", "HBONE", 1.3),
    // Private memory: RSS also counts each binary's mapped code, which
    // every process of it on the node shares.
    ("  of it private", "HBONE", 0.5),
    ("throughput (iperf3, 1 stream", "passthrough", 1.5),
];

/// `AMBIT_BENCH_POOL=off`: no proxy pools HBONE connections.
fn pool_off() -> bool {
    std::env::var("AMBIT_BENCH_POOL").is_ok_and(|v| v == "off")
}

/// `K=V K=V` (space-separated) as pairs.
fn key_values(text: &str) -> Vec<(String, String)> {
    text.split_whitespace()
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // Idle connections and 64 streams need descriptors.
    // SAFETY: setrlimit with a struct we own.
    unsafe {
        let mut l: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
    }
    let secs: u64 = env_or("AMBIT_BENCH_SECS", 5);
    let rounds: usize = env_or("AMBIT_BENCH_ROUNDS", 3);
    let idle: usize = env_or("AMBIT_BENCH_IDLE", 1000);
    let node_cc = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .unwrap_or_default()
        .trim()
        .to_string();
    let mut ccs: Vec<String> = std::env::var("AMBIT_BENCH_CC")
        .unwrap_or_else(|_| "default,cubic".into())
        .split(',')
        .map(|c| {
            if c == "default" {
                node_cc.clone()
            } else {
                c.trim().to_string()
            }
        })
        .collect();
    ccs.dedup();
    let ambit = PathBuf::from(env!("CARGO_BIN_EXE_ambit"));
    let mut kinds = vec![Kind {
        name: "Ambit".into(),
        binary: ambit.clone(),
        env: vec![],
        ambit: true,
    }];
    for w in std::env::var("AMBIT_BENCH_WORKERS")
        .unwrap_or_default()
        .split(',')
    {
        if !w.trim().is_empty() {
            kinds.push(Kind {
                name: format!("Ambit ({} workers)", w.trim()),
                binary: ambit.clone(),
                env: vec![("AMBIT_WORKER_THREADS".into(), w.trim().into())],
                ambit: true,
            });
        }
    }
    // Ambit with other settings, side by side: `name:K=V K=V;name2:K=V`.
    for variant in std::env::var("AMBIT_BENCH_VARIANTS")
        .unwrap_or_default()
        .split(';')
    {
        let Some((name, settings)) = variant.split_once(':') else {
            continue;
        };
        kinds.push(Kind {
            name: format!("Ambit ({})", name.trim()),
            binary: ambit.clone(),
            env: key_values(settings),
            ambit: true,
        });
    }
    // Another build of Ambit (an earlier commit's), for a change's before
    // and after in one run.
    if let Ok(baseline) = std::env::var("AMBIT_BENCH_BASELINE") {
        kinds.push(Kind {
            name: "Ambit (baseline)".into(),
            binary: baseline.trim().into(),
            env: vec![],
            ambit: true,
        });
    }
    // Other proxy binaries, comma-separated: ztunnel, or the floor proxy
    // (`benches/floor-proxy/`), or both.
    let env = key_values(&std::env::var("AMBIT_BENCH_PEER_ENV").unwrap_or_default());
    for peer in std::env::var("AMBIT_BENCH_PEER")
        .unwrap_or_default()
        .split(',')
        .filter(|p| !p.trim().is_empty())
    {
        let name = std::path::Path::new(peer.trim())
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "peer".into());
        kinds.push(Kind {
            name,
            binary: peer.trim().into(),
            env: env.clone(),
            ambit: false,
        });
    }
    println!(
        "ambit data-path benchmark: iperf3 {secs}s per path, {rounds} interleaved rounds (median); \
         20000 1-byte round trips; {idle} idle connections; node default congestion control {node_cc}; \
         proxies: {}",
        kinds.iter().map(|k| k.name.as_str()).collect::<Vec<_>>().join(", ")
    );
    let load: usize = env_or("AMBIT_BENCH_LOAD", 0);
    if load > 0 {
        println!("background load: {load} busy loop(s) at nice 19 for the whole run (a node whose CPUs are never idle)");
    }
    let _load = BusyLoops::start(load);
    let _allowed = AllowedCc::allow(&ccs);
    let mut summary = Vec::new();
    for cc in &ccs {
        let (measures, paths) = phase(cc, &kinds, secs, rounds, idle);
        summary.push((cc.clone(), measures, paths));
    }
    for warning in UNSTEADY.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        println!("\n{warning}");
    }
    // Ambit ÷ its other settings and builds, Ambit ÷ each peer, and each
    // peer ÷ the peers after it.
    for other in (1..kinds.len()).filter(|&k| kinds[k].ambit) {
        aims(&kinds, &summary, 0, other);
    }
    let peers: Vec<usize> = (0..kinds.len()).filter(|&k| !kinds[k].ambit).collect();
    for (i, &peer) in peers.iter().enumerate() {
        let over = std::iter::once(0).chain(peers[..i].iter().copied());
        for num in over {
            aims(&kinds, &summary, num, peer);
        }
    }
}

/// Prints `kinds[num]` ÷ `kinds[den]` for each aim of issue #20.
fn aims(kinds: &[Kind], summary: &[(String, Vec<Measure>, Vec<Path>)], num: usize, den: usize) {
    println!(
        "\n=== {} ÷ {}, same run, aims of issue #20 ===",
        kinds[num].name, kinds[den].name
    );
    println!(
        "{:<10} {:<42} {:<12} {:>8} {:>6}  reached",
        "cc", "measure", "path", "ratio", "aim"
    );
    for (cc, measures, paths) in summary {
        for (prefix, shape, aim) in AIMS {
            let Some(m) = measures.iter().find(|m| m.title.starts_with(prefix)) else {
                continue;
            };
            let value = |k: usize| {
                paths
                    .iter()
                    .zip(&m.values)
                    .find(|(p, _)| p.kind == Some(k) && p.name.ends_with(shape))
                    .map(|(_, v)| *v)
            };
            if let (Some(a), Some(z)) = (value(num), value(den)) {
                let ratio = a / z;
                let met = if m.higher_is_better {
                    ratio >= aim
                } else {
                    ratio <= aim
                };
                println!(
                    "{cc:<10} {:<42} {shape:<12} {ratio:>7.2}x {aim:>5.1}x  {}",
                    m.title,
                    if met { "yes" } else { "no" }
                );
            }
        }
    }
}
