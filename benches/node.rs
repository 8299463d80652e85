//! Node benchmark (not a timed test): a node full of pods. `ambit agent`
//! and a shared proxy run in a node netns; the bench creates pods through
//! the real CNI chain (bridge + host-local + ambit-cni), `AMBIT_BENCH_PARALLEL`
//! at a time as kubelet starts the pods scheduled to a node, and measures:
//!
//! - enrolment: each pod's CNI ADD (the ADD returns once the proxy has
//!   acked the pod, i.e. bound its listeners), and the time from its ADD to
//!   its first connection each way through the proxy (out to an anchor
//!   pod, and in from it): served;
//! - the proxy's memory and descriptors per enrolled pod;
//! - the proxy's idle cost with every pod enrolled and nothing flowing: CPU
//!   and wake-ups (its threads' runs, from `schedstat`) per second;
//! - one iperf3 flow per pair of the first pods, all at once, all HBONE
//!   through the one proxy: the total, the spread, CPU per Gbit;
//! - many idle connections spread over all pods (each pod holds some to
//!   the next pod, each with one round trip): the proxy's memory and
//!   descriptors per connection, and its wake-ups with them held.
//!
//! With `AMBIT_BENCH_PEER=<binary>` the same runs again, on a fresh node,
//! with that binary as the shared proxy (ztunnel reads the same
//! environment: `INPOD_UDS`, `LOCAL_XDS_PATH`, the admin ports) and
//! `AMBIT_BENCH_PEER_ENV` added to its environment, so both are measured
//! by one run; the bench ends with peer ÷ Ambit.
//!
//! Run: `cargo bench --bench node` (as root). `AMBIT_BENCH_PODS` (1000, at
//! most 1020), `AMBIT_BENCH_PARALLEL` (8), `AMBIT_BENCH_FLOW_PODS` (100,
//! even), `AMBIT_BENCH_SECS` (the flows' seconds, 10), `AMBIT_BENCH_CONNS`
//! (idle connections, 100000), `AMBIT_BENCH_IDLE_SECS` (each idle
//! window, 10). `AMBIT_BENCH_HEAP=<file>`: where Ambit's memory per pod
//! goes, a heap profile (pprof) of what the pods after the first hold.
//!
//! Rules back ends: `AMBIT_BENCH_RULES` (`iptables`, `nftables` or `both`;
//! iptables) picks what Ambit's agent writes the rules with; with `both`
//! the node runs twice, once in each mode (nftables on a `PATH` without
//! iptables, as the tests run it). First, for each mode picked, the cost
//! of one ADD's rules alone: `AMBIT_BENCH_RULES_PODS` (200) fresh netns,
//! each given its rules the way the agent does (`RedirectRules::apply`),
//! then each pod's entry added to the host's probe set in a scratch host
//! netns; median and p99 of each.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ambit::cni::hostprobe::HostProbes;
use ambit::cni::redirect::{Backend, RedirectOptions, RedirectRules};
use ambit::lab::node::{Node, RulesMode};
use ambit::lab::{cpu_seconds, iperf3, rss_kb, EchoServer, LabPod};
use ambit::netns::Netns;

/// The port every pod's application listens on.
const APP_PORT: u16 = 7000;
/// The anchor pod's echo server, which each new pod's first connection reaches.
const ANCHOR_PORT: u16 = 7001;
/// How long a pod may take from its ADD to being served before the bench gives up.
const SERVED_WITHIN: Duration = Duration::from_secs(120);
/// The pods' network: a /22 from here (the bridge holds `.1`).
const SUBNET: &str = "10.116.0";

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The `i`-th address host-local hands out in [`SUBNET`]`/22` (from `.2`).
fn pod_ip(i: usize) -> Ipv4Addr {
    let base: Ipv4Addr = format!("{SUBNET}.0").parse().expect("SUBNET");
    let base = u32::from(base);
    Ipv4Addr::from(base + 2 + i as u32)
}

struct Settings {
    pods: usize,
    parallel: usize,
    flow_pods: usize,
    secs: u64,
    conns: usize,
    idle_secs: u64,
    cc: String,
    /// Where to write the heap profile of the pods after the first.
    heap: Option<PathBuf>,
    /// The rules back ends Ambit's node runs with, one run each.
    modes: Vec<RulesMode>,
    /// Fresh netns for the rules-alone cost.
    rules_pods: usize,
}

/// One proxy under test: Ambit's own, or a peer binary.
struct Proxy {
    name: String,
    binary: Option<PathBuf>,
    env: Vec<(String, String)>,
    rules: RulesMode,
}

/// What one run measured.
#[derive(Default)]
struct Report {
    add_ms: Vec<f64>,
    served_ms: Vec<f64>,
    all_served_s: f64,
    rss_empty_kb: u64,
    rss_one_kb: u64,
    rss_pods_kb: u64,
    fds_empty: usize,
    fds_one: usize,
    fds_pods: usize,
    threads: usize,
    idle_cpu_pct: f64,
    idle_wakeups: f64,
    flows: Option<Flows>,
    conns: usize,
    conns_open_s: f64,
    rss_conns_kb: u64,
    fds_conns: usize,
    conns_cpu_pct: f64,
    conns_wakeups: f64,
}

struct Flows {
    count: usize,
    total: f64,
    min: f64,
    median: f64,
    max: f64,
    cpu_per_gbit: f64,
    rss_kb: u64,
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let pods: usize = env_or("AMBIT_BENCH_PODS", 1000).clamp(2, 1020);
    let settings = Settings {
        pods,
        parallel: env_or("AMBIT_BENCH_PARALLEL", 8).max(1),
        flow_pods: env_or("AMBIT_BENCH_FLOW_PODS", 100).min(pods) / 2 * 2,
        secs: env_or("AMBIT_BENCH_SECS", 10),
        conns: env_or("AMBIT_BENCH_CONNS", 100_000),
        idle_secs: env_or("AMBIT_BENCH_IDLE_SECS", 10).max(1),
        heap: std::env::var_os("AMBIT_BENCH_HEAP").map(PathBuf::from),
        modes: match std::env::var("AMBIT_BENCH_RULES").as_deref() {
            Ok("nftables") => vec![RulesMode::Nftables],
            Ok("both") => vec![RulesMode::Iptables, RulesMode::Nftables],
            _ => vec![RulesMode::Iptables],
        },
        rules_pods: env_or("AMBIT_BENCH_RULES_PODS", 200).max(1),
        cc: std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
            .unwrap_or_default()
            .trim()
            .to_string(),
    };
    prepare_host(&settings);
    let mut ambit_env = vec![("AMBIT_CONGESTION_CONTROL".into(), settings.cc.clone())];
    if settings.heap.is_some() {
        // Armed, off until the first pod is served; a sample per 4 KiB
        // allocated on average, so a pod's few allocations are seen.
        ambit_env.push((
            "_RJEM_MALLOC_CONF".into(),
            "prof:true,prof_active:false,lg_prof_sample:12".into(),
        ));
    }
    for &mode in &settings.modes {
        rules_cost(mode, settings.rules_pods);
    }
    let mut proxies: Vec<Proxy> = settings
        .modes
        .iter()
        .map(|&rules| Proxy {
            name: match rules {
                RulesMode::Iptables => "Ambit".into(),
                RulesMode::Nftables => "Ambit (nftables)".into(),
            },
            binary: None,
            env: ambit_env.clone(),
            rules,
        })
        .collect();
    if let Ok(peer) = std::env::var("AMBIT_BENCH_PEER") {
        let peer = PathBuf::from(peer);
        let name = peer
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "peer".into());
        let env = std::env::var("AMBIT_BENCH_PEER_ENV")
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        proxies.push(Proxy {
            name,
            binary: Some(peer),
            env,
            rules: RulesMode::Iptables,
        });
    }
    println!(
        "ambit node benchmark: {} pods through bridge + host-local + ambit-cni ({} ADDs at a time), one shared proxy; \
         {} idle connections; congestion control {} on every leg\n",
        settings.pods, settings.parallel, settings.conns, settings.cc
    );
    let reports: Vec<(String, Report)> = proxies
        .iter()
        .map(|p| (p.name.clone(), run(&settings, p)))
        .collect();
    for (name, r) in &reports {
        print_report(name, &settings, r);
    }
    // Each of Ambit's runs against the peer's (the last run, when there is one).
    if let Some(((peer, b), ours)) = proxies
        .last()
        .filter(|p| p.binary.is_some())
        .and_then(|_| reports.split_last())
    {
        for (name, a) in ours {
            print_ratios(name, a, peer, b, &settings);
        }
    }
}

/// The host-wide tables a thousand pods and their connections fill: the
/// neighbour table (one per host, 1,024 entries by default) and conntrack.
/// Raised when lower, said in the output; descriptors for the bench and
/// the proxies it starts (they inherit the hard limit).
fn prepare_host(s: &Settings) {
    for (path, want) in [
        ("/proc/sys/net/ipv4/neigh/default/gc_thresh1", 4096),
        ("/proc/sys/net/ipv4/neigh/default/gc_thresh2", 8192),
        ("/proc/sys/net/ipv4/neigh/default/gc_thresh3", 16384),
        (
            "/proc/sys/net/netfilter/nf_conntrack_max",
            4 * s.conns as u64 + 65536,
        ),
        // A broadcast (ARP) on a bridge of 1,000 ports queues a copy per
        // port on one CPU's backlog at once: past 1,000 (the default) the
        // rest are dropped, and a new pod's first dial fails after 3 s.
        ("/proc/sys/net/core/netdev_max_backlog", 16384),
    ] {
        let now: u64 = std::fs::read_to_string(path)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if now < want {
            match std::fs::write(path, want.to_string()) {
                Ok(()) => println!("host: {path} {now} -> {want}"),
                Err(e) => println!("host: cannot raise {path} from {now} to {want}: {e}"),
            }
        }
    }
    // Raising the hard limit takes CAP_SYS_RESOURCE, which these machines'
    // root lacks (a hard limit of 20,000 here): the soft one goes to it,
    // and the bench holds as many connections as the limit lets both the
    // proxy and itself hold.
    let (soft, hard) = nofile();
    if soft < hard {
        nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard)
            .unwrap_or_else(|e| panic!("RLIMIT_NOFILE soft {soft} -> {hard}: {e}"));
    }
}

fn nofile() -> (u64, u64) {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .expect("RLIMIT_NOFILE")
}

/// The local config: the anchor (pod index 0) and the pods, each with a
/// service account of its own, at the addresses they are given.
fn mesh(pods: usize) -> String {
    let mut mesh = String::from("workloads:\n");
    for i in 0..=pods {
        mesh += &format!(
            "- {{uid: \"Kubernetes//Pod/default/{}\", name: {}, namespace: default, serviceAccount: sa{i}, workloadIps: [\"{}\"], protocol: HBONE, services: {{}}}}\n",
            pod_name(i),
            pod_name(i),
            pod_ip(i)
        );
    }
    mesh
}

fn pod_name(i: usize) -> String {
    if i == 0 {
        "anchor".into()
    } else {
        format!("pod{i}")
    }
}

fn run(s: &Settings, proxy: &Proxy) -> Report {
    println!("--- {}: starting a node", proxy.name);
    let tag = if proxy.binary.is_some() {
        "benchpeer"
    } else {
        "benchnode"
    };
    let mut node = Node::prepare_sized(
        env!("CARGO_BIN_EXE_ambit"),
        tag,
        "all",
        SUBNET,
        22,
        &mesh(s.pods),
        None,
    );
    node.extra_env = proxy.env.clone();
    node.extra_env
        .extend(Node::rules_env(&node.dir, proxy.rules));
    node.lab.spawn("agent", node.command("agent")).unwrap();
    let proxy_cmd = match &proxy.binary {
        Some(binary) => node.command_of(binary, "proxy", &[]),
        None => node.command("proxy"),
    };
    node.lab.spawn("proxy", proxy_cmd).unwrap();
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");
    let pid = node.lab.pid("proxy").expect("proxy pid");
    let mut r = Report::default();
    settle(pid);
    (r.rss_empty_kb, r.fds_empty) = (rss_kb(pid), fds(pid));

    // The anchor first: every other pod's first connections go to it and come from it.
    let anchor = node
        .add_pods(&[(pod_name(0), pod_ip(0))], "default", 1, |_| ())
        .pop()
        .expect("one pod")
        .unwrap_or_else(|e| panic!("anchor ADD: {e}\n{}", node.log()))
        .0;
    let _echo = EchoServer::start(&anchor, ANCHOR_PORT).expect("anchor's echo server");

    // The first pod alone: once it is served (a connection each way), the
    // code every pod runs is mapped in, so what each further pod adds is
    // what it holds. The rest arrive `parallel` at a time.
    let wanted: Vec<(String, Ipv4Addr)> = (1..=s.pods).map(|i| (pod_name(i), pod_ip(i))).collect();
    let served_check = |pod: &LabPod| {
        let t = Instant::now();
        let listener = served(pod, &anchor);
        (listener, t.elapsed())
    };
    let mut added = node.add_pods(&wanted[..1], "default", 1, served_check);
    settle(pid);
    (r.rss_one_kb, r.fds_one) = (rss_kb(pid), fds(pid));
    let heap = s.heap.as_ref().filter(|_| proxy.binary.is_none());
    if heap.is_some() {
        admin(&node, "/debug/pprof/heap/profiling?activate=true")
            .unwrap_or_else(|e| panic!("heap profiling: {e}"));
    }
    let started = Instant::now();
    added.extend(node.add_pods(&wanted[1..], "default", s.parallel, served_check));
    r.all_served_s = started.elapsed().as_secs_f64();
    let mut pods: Vec<LabPod> = Vec::with_capacity(s.pods);
    let mut listeners: Vec<TcpListener> = Vec::with_capacity(s.pods);
    for (i, a) in added.into_iter().enumerate() {
        let (pod, add, (listener, first)) =
            a.unwrap_or_else(|e| panic!("ADD of {}: {e}\n{}", pod_name(i + 1), node.log()));
        assert_eq!(
            pod.ip,
            pod_ip(i + 1),
            "host-local gave {} another address",
            pod.name
        );
        let listener = listener.unwrap_or_else(|e| {
            panic!(
                "{} not served through the proxy: {e}\n{}",
                pod.name,
                node.log()
            )
        });
        // Served: from the ADD's start to both first connections.
        r.add_ms.push(add.as_secs_f64() * 1e3);
        r.served_ms.push((add + first).as_secs_f64() * 1e3);
        pods.push(pod);
        listeners.push(listener);
    }
    println!(
        "{}: {} pods enrolled and served in {:.1} s after the first",
        proxy.name,
        s.pods - 1,
        r.all_served_s
    );
    settle(pid);
    (r.rss_pods_kb, r.fds_pods) = (rss_kb(pid), fds(pid));
    if let Some(path) = heap {
        let profile = admin(&node, "/debug/pprof/heap").unwrap_or_else(|e| panic!("heap: {e}"));
        std::fs::write(path, profile).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        println!(
            "{}: the heap the pods after the first hold, sampled: {path} (go tool pprof -top -sample_index=inuse_space {path})",
            proxy.name,
            path = path.display()
        );
    }
    r.threads = threads(pid).len();
    (r.idle_cpu_pct, r.idle_wakeups) = idle(pid, s.idle_secs);

    if s.flow_pods >= 2 {
        r.flows = Some(flows(&node, pid, &pods[..s.flow_pods], s.secs));
    }

    // Each connection is two descriptors in the proxy (the client's
    // accepted, the one to the server's app) and two in the bench; the
    // first between two pods is two more in the proxy (their pooled HBONE
    // connection, both ends).
    let limit = nofile().1 as usize;
    let room = limit.saturating_sub(fds(pid).max(fds(std::process::id())) + 2000);
    let fit = if room / 4 <= pods.len() {
        room / 4
    } else {
        pods.len() + (room - 4 * pods.len()) / 2
    };
    r.conns = s.conns.min(fit);
    if r.conns < s.conns {
        println!(
            "{}: {} idle connections, not {}: the proxy holds {} descriptors and RLIMIT_NOFILE's hard limit here is {limit} (raising it takes CAP_SYS_RESOURCE)",
            proxy.name,
            r.conns,
            s.conns,
            fds(pid)
        );
    }
    let t = Instant::now();
    let held = hold_connections(&pods, &listeners, r.conns)
        .unwrap_or_else(|e| panic!("{}: idle connections: {e}\n{}", proxy.name, node.log()));
    r.conns_open_s = t.elapsed().as_secs_f64();
    settle(pid);
    (r.rss_conns_kb, r.fds_conns) = (rss_kb(pid), fds(pid));
    (r.conns_cpu_pct, r.conns_wakeups) = idle(pid, s.idle_secs);
    drop(held);
    drop(listeners);
    drop(_echo);
    r
}

/// The cost of one ADD's rules alone under `mode`: `n` fresh netns, each
/// given the rules as the agent gives them, then each pod's address added
/// to the probe set of a scratch host netns. Prints the median and p99.
fn rules_cost(mode: RulesMode, n: usize) {
    let backend = match mode {
        RulesMode::Iptables => Backend::Iptables,
        RulesMode::Nftables => Backend::Nftables,
    };
    let name = |i: usize| format!("ambit-bench-rules-{}-{i}", std::process::id());
    let netns = |n: &str| {
        let ok = std::process::Command::new("ip")
            .args(["netns", "add", n])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "ip netns add {n}");
        let ok = std::process::Command::new("ip")
            .args(["-n", n, "link", "set", "lo", "up"])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "lo up in {n}");
        Netns::named(n).unwrap()
    };
    let rules = RedirectRules::new(RedirectOptions {
        backend,
        ..RedirectOptions::default()
    });
    let mut apply_ms = Vec::with_capacity(n);
    for i in 0..n {
        let ns = netns(&name(i));
        let t = Instant::now();
        rules
            .apply(&ns)
            .unwrap_or_else(|e| panic!("{mode:?} rules: {e}"));
        apply_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let host = netns(&name(n));
    let probes = HostProbes {
        backend,
        ipv6: true,
    };
    let probe_ms: Vec<f64> = host
        .run(move || {
            probes.install().unwrap();
            (0..n)
                .map(|i| {
                    let t = Instant::now();
                    probes
                        .add_pod(&format!("uid-{i}"), &[pod_ip(i).into()])
                        .unwrap();
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect()
        })
        .unwrap();
    for i in 0..=n {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &name(i)])
            .status();
    }
    println!(
        "rules: backend={mode:?} pods={n} apply_p50_ms={:.2} apply_p99_ms={:.2} probe_add_p50_ms={:.2} probe_add_p99_ms={:.2}",
        percentile(&apply_ms, 0.5),
        percentile(&apply_ms, 0.99),
        percentile(&probe_ms, 0.5),
        percentile(&probe_ms, 0.99)
    );
}

/// A GET to the proxy's admin port (in the node's netns): the body, when
/// it answers 200.
fn admin(node: &Node, path: &str) -> std::io::Result<Vec<u8>> {
    let path = path.to_string();
    node.lab.node.run(move || {
        let mut s = TcpStream::connect("127.0.0.1:15000")?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp)?;
        let end = resp
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| std::io::Error::other("no HTTP header"))?;
        let head = String::from_utf8_lossy(&resp[..end]).into_owned();
        if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
            let body = String::from_utf8_lossy(&resp[end + 4..]).into_owned();
            return Err(std::io::Error::other(format!("{path}: {head} {body}")));
        }
        Ok(resp.split_off(end + 4))
    })?
}

/// Waits for the proxy's memory to stop moving (half a second between two
/// equal readings, 10 s at most), so a reading is not taken mid-burst.
fn settle(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = rss_kb(pid);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        let now = rss_kb(pid);
        if now == last {
            return;
        }
        last = now;
    }
}

/// A new pod's first connections through the proxy: out to the anchor's
/// echo server, and in from the anchor to the pod's application (a
/// listener the bench opens in the pod, kept for the idle connections).
/// Retried until [`SERVED_WITHIN`]; the listener on success.
fn served(pod: &LabPod, anchor: &LabPod) -> std::io::Result<TcpListener> {
    let home = Netns::current()?;
    let listener = pod.ns.with(&home, || {
        TcpListener::bind((Ipv4Addr::UNSPECIFIED, APP_PORT))
    })?;
    socket2::SockRef::from(&listener).set_read_timeout(Some(Duration::from_secs(5)))?;
    let deadline = Instant::now() + SERVED_WITHIN;
    let to_anchor = SocketAddr::new(anchor.ip.into(), ANCHOR_PORT);
    let to_pod = SocketAddr::new(pod.ip.into(), APP_PORT);
    let mut out = pod.ns.with(&home, || round_trip_out(to_anchor));
    while let Err(e) = &out {
        if Instant::now() > deadline {
            return Err(std::io::Error::other(format!("out to the anchor: {e}")));
        }
        std::thread::sleep(Duration::from_millis(20));
        out = pod.ns.with(&home, || round_trip_out(to_anchor));
    }
    loop {
        let inbound = anchor
            .ns
            .with(&home, || {
                TcpStream::connect_timeout(&to_pod, Duration::from_secs(5))
            })
            .and_then(|c| round_trip_in(c, &listener));
        match inbound {
            Ok(_) => return Ok(listener),
            Err(e) if Instant::now() > deadline => {
                return Err(std::io::Error::other(format!("in from the anchor: {e}")))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Connects to an echo server and takes one byte back.
fn round_trip_out(to: SocketAddr) -> std::io::Result<()> {
    let mut c = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.write_all(b"x")?;
    c.read_exact(&mut [0u8; 1])
}

/// A token over `client`, taken off `listener`'s next connection that
/// carries it and sent back: the connection crossed the proxy both ways.
/// Returns both ends. A connection of an earlier attempt, given up on
/// before it arrived, is passed over.
fn round_trip_in(
    mut client: TcpStream,
    listener: &TcpListener,
) -> std::io::Result<(TcpStream, TcpStream)> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let token = NEXT
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        .to_le_bytes();
    client.set_read_timeout(Some(Duration::from_secs(5)))?;
    client.write_all(&token)?;
    let mut got = [0u8; 8];
    let server = loop {
        let (mut server, _) = listener
            .accept()
            .map_err(|e| std::io::Error::other(format!("accept: {e}")))?;
        server.set_read_timeout(Some(Duration::from_secs(5)))?;
        if server.read_exact(&mut got).is_ok() && got == token {
            break server;
        }
    };
    (&server).write_all(&got)?;
    client
        .read_exact(&mut got)
        .map_err(|e| std::io::Error::other(format!("client's read: {e}")))?;
    Ok((client, server))
}

/// `n` connections spread over the pods, each pod's to the next pod's
/// application, each with one round trip; both ends held open. Sequential,
/// so a listener's next connection is the one just made.
fn hold_connections(
    pods: &[LabPod],
    listeners: &[TcpListener],
    n: usize,
) -> std::io::Result<Vec<(TcpStream, TcpStream)>> {
    let home = Netns::current()?;
    let mut held = Vec::with_capacity(n);
    for k in 0..n {
        let i = k % pods.len();
        let j = (i + 1) % pods.len();
        let to = SocketAddr::new(pods[j].ip.into(), APP_PORT);
        let client = pods[i]
            .ns
            .with(&home, || {
                TcpStream::connect_timeout(&to, Duration::from_secs(5))
            })
            .map_err(|e| {
                std::io::Error::other(format!("connection {k}, {} to {to}: {e}", pods[i].name))
            })?;
        held.push(round_trip_in(client, &listeners[j]).map_err(|e| {
            std::io::Error::other(format!("connection {k}, {} to {to}: {e}", pods[i].name))
        })?);
        if (k + 1) % 20_000 == 0 {
            println!("  {} connections held", k + 1);
        }
    }
    Ok(held)
}

/// One iperf3 flow from each pod of the first half to one of the second,
/// all at once.
fn flows(node: &Node, pid: u32, pods: &[LabPod], secs: u64) -> Flows {
    let half = pods.len() / 2;
    for server in &pods[half..] {
        node.lab.start_iperf3_server(server).expect("iperf3 -s");
    }
    let cpu_before = cpu_seconds(pid);
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
    let cpu = cpu_seconds(pid) - cpu_before;
    gbps.sort_by(|a, b| a.total_cmp(b));
    Flows {
        count: half,
        total: gbps.iter().sum(),
        min: gbps[0],
        median: gbps[half / 2],
        max: gbps[half - 1],
        cpu_per_gbit: cpu / gbit.max(1e-9),
        rss_kb: rss_kb(pid),
    }
}

/// The proxy's CPU (percent of one core) and wake-ups per second over
/// `secs` with nothing flowing: its threads' time on a CPU and their runs
/// on one (`schedstat`'s first and third fields, to the nanosecond, summed
/// over the threads alive at both ends).
fn idle(pid: u32, secs: u64) -> (f64, f64) {
    let before = schedstat(pid);
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let wall = t.elapsed().as_secs_f64();
    let after = schedstat(pid);
    let (mut ns, mut runs) = (0u64, 0u64);
    for (tid, (ns1, runs1)) in &after {
        if let Some((ns0, runs0)) = before.get(tid) {
            ns += ns1.saturating_sub(*ns0);
            runs += runs1.saturating_sub(*runs0);
        }
    }
    (ns as f64 / 1e9 / wall * 100.0, runs as f64 / wall)
}

fn threads(pid: u32) -> Vec<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Each thread's time on a CPU (ns) and the times it was run on one.
fn schedstat(pid: u32) -> std::collections::HashMap<u32, (u64, u64)> {
    threads(pid)
        .into_iter()
        .filter_map(|tid| {
            let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?;
            let mut f = text.split_whitespace().map(|v| v.parse::<u64>().ok());
            let ns = f.next()??;
            let runs = f.nth(1)??;
            Some((tid, (ns, runs)))
        })
        .collect()
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 * p).ceil() as usize)
        .saturating_sub(1)
        .min(v.len() - 1)]
}

/// What each pod after the first adds to the proxy's RSS, in kB.
fn per_pod_kb(r: &Report, s: &Settings) -> f64 {
    r.rss_pods_kb.saturating_sub(r.rss_one_kb) as f64 / (s.pods - 1) as f64
}

/// What each pod after the first adds to the proxy's descriptors.
fn per_pod_fds(r: &Report, s: &Settings) -> f64 {
    r.fds_pods.saturating_sub(r.fds_one) as f64 / (s.pods - 1) as f64
}

fn per_conn_kb(r: &Report) -> f64 {
    r.rss_conns_kb.saturating_sub(r.rss_pods_kb) as f64 / r.conns.max(1) as f64
}

fn per_conn_fds(r: &Report) -> f64 {
    r.fds_conns.saturating_sub(r.fds_pods) as f64 / r.conns.max(1) as f64
}

fn print_report(name: &str, s: &Settings, r: &Report) {
    println!("\n== {name} as the shared proxy ==");
    println!(
        "CNI ADD (sandbox + whole chain, until the proxy acked the pod): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        percentile(&r.add_ms, 0.5),
        percentile(&r.add_ms, 0.99),
        percentile(&r.add_ms, 1.0)
    );
    println!(
        "served (ADD's start to a connection out and one in through the proxy): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; the {} after the first, {} at a time, in {:.1} s",
        percentile(&r.served_ms, 0.5),
        percentile(&r.served_ms, 0.99),
        percentile(&r.served_ms, 1.0),
        s.pods - 1,
        s.parallel,
        r.all_served_s
    );
    println!(
        "proxy RSS: {} kB with no pods, {} kB with the anchor and the first pod served, {} kB with all {} ({:.1} kB per further pod)",
        r.rss_empty_kb,
        r.rss_one_kb,
        r.rss_pods_kb,
        s.pods + 1,
        per_pod_kb(r, s)
    );
    println!(
        "proxy descriptors: {} with no pods, {} with the anchor and the first pod, {} with all ({:.2} per further pod); {} threads",
        r.fds_empty,
        r.fds_one,
        r.fds_pods,
        per_pod_fds(r, s),
        r.threads
    );
    println!(
        "idle with {} pods, nothing flowing, {} s: CPU {:.2}% of a core, {:.1} wake-ups/s",
        s.pods, s.idle_secs, r.idle_cpu_pct, r.idle_wakeups
    );
    if let Some(f) = &r.flows {
        println!(
            "{} iperf3 flows at once ({} s): total {:.2} Gbit/s; per flow min {:.3}, median {:.3}, max {:.3}; proxy {:.3} cpu-s per Gbit, RSS {} kB",
            f.count, s.secs, f.total, f.min, f.median, f.max, f.cpu_per_gbit, f.rss_kb
        );
    }
    println!(
        "{} idle connections (pod i to pod i+1, one round trip each) opened in {:.1} s: proxy RSS {} kB ({:.2} kB per connection), {} descriptors ({:.2} per connection)",
        r.conns,
        r.conns_open_s,
        r.rss_conns_kb,
        per_conn_kb(r),
        r.fds_conns,
        per_conn_fds(r)
    );
    println!(
        "idle with {} connections held, {} s: CPU {:.2}% of a core, {:.1} wake-ups/s",
        r.conns, s.idle_secs, r.conns_cpu_pct, r.conns_wakeups
    );
    println!(
        "node: proxy={name} pods={} conns={} all_served_s={:.1} served_p99_ms={:.1} kb_per_pod={:.1} fds_per_pod={:.2} idle_wakeups_per_s={:.1} kb_per_conn={:.2}",
        s.pods,
        r.conns,
        r.all_served_s,
        percentile(&r.served_ms, 0.99),
        per_pod_kb(r, s),
        per_pod_fds(r, s),
        r.idle_wakeups,
        per_conn_kb(r)
    );
}

fn print_ratios(ours: &str, a: &Report, peer: &str, b: &Report, s: &Settings) {
    let ratio = |x: f64, y: f64| if y > 0.0 { x / y } else { f64::NAN };
    println!("\n== {ours} ÷ {peer}, same run ==");
    println!(
        "all pods served: {:.2}×; served p99: {:.2}×",
        ratio(a.all_served_s, b.all_served_s),
        ratio(
            percentile(&a.served_ms, 0.99),
            percentile(&b.served_ms, 0.99)
        )
    );
    println!(
        "memory per pod: {:.2}×; descriptors per pod: {:.2}×",
        ratio(per_pod_kb(a, s), per_pod_kb(b, s)),
        ratio(per_pod_fds(a, s), per_pod_fds(b, s))
    );
    println!(
        "idle wake-ups/s with the pods: {:.2}×; idle CPU: {:.2}×",
        ratio(a.idle_wakeups, b.idle_wakeups),
        ratio(a.idle_cpu_pct, b.idle_cpu_pct)
    );
    println!(
        "memory per idle connection: {:.2}×; wake-ups/s with them held: {:.2}×",
        ratio(per_conn_kb(a), per_conn_kb(b)),
        ratio(a.conns_wakeups, b.conns_wakeups)
    );
    if let (Some(x), Some(y)) = (&a.flows, &b.flows) {
        println!(
            "flows total: {:.2}×; CPU per Gbit: {:.2}×",
            ratio(x.total, y.total),
            ratio(x.cpu_per_gbit, y.cpu_per_gbit)
        );
    }
}
