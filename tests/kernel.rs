//! End-to-end: how the proxy uses the kernel under load and faults, through
//! the real binary, pods in network namespaces: unsent data on HBONE
//! connections, reused ports of short connections, memory given back,
//! congestion control, the open-file limit, a stalled destination.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use ambit::lab::{
    aborts, anon_kb, close_first_echo, connect_from, echo_roundtrip, established,
    set_default_congestion_control, short_connections, time_waits, EchoServer, Ends, LabPod,
};
use common::{wait_until, workload, Mesh};

/// Long enough for a loaded machine; the waits end as soon as the state is there.
const SETTLE: Duration = Duration::from_secs(10);

/// The most bytes `ss` saw unsent on `pod`'s connections to port 15008 while
/// `during` ran (sampled every 50 ms), and `during`'s result.
fn max_unsent_to_hbone<T>(pod: &ambit::lab::LabPod, during: impl FnOnce() -> T) -> (usize, T) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (pod, stop) = (pod.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut max = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let out = pod
                    .ns
                    .command("ss")
                    .args(["-tniH", "dport", "=", ":15008"])
                    .output()
                    .expect("ss (iproute2)");
                for tok in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    if let Some(n) = tok.strip_prefix("notsent:") {
                        max = max.max(n.parse().unwrap_or(0));
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            max
        })
    };
    let result = during();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    (sampler.join().unwrap(), result)
}

#[test]
fn on_a_slow_link_an_hbone_connection_queues_little_unsent_data_in_the_kernel() {
    let mut m = Mesh::new("unsent");
    let (capped, uncapped, server) = (m.pod("capped"), m.pod("uncapped"), m.pod("server"));
    m.write_config(&format!(
        "workloads:\n{}{}{}",
        workload(&capped, "capped-sa", "HBONE"),
        workload(&uncapped, "uncapped-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE")
    ));
    m.mesh(&capped, "capped-sa");
    m.mesh_env(
        &uncapped,
        "uncapped-sa",
        &[("AMBIT_HBONE_UNSENT_LIMIT", "0")],
    );
    m.mesh(&server, "server-sa");
    m.lab.start_iperf3_server(&server).unwrap();

    let mut unsent = Vec::new();
    for pod in [&capped, &uncapped] {
        // A 200 Mbit/s link out of the pod: the network, not the proxy, is the bottleneck.
        let tc = pod
            .ns
            .command("tc")
            .args("qdisc add dev eth0 root tbf rate 200mbit burst 64kb latency 20ms".split(' '))
            .status()
            .unwrap();
        assert!(tc.success(), "tc tbf on {}'s eth0", pod.name);
        let (max, run) = max_unsent_to_hbone(pod, || ambit::lab::iperf3(pod, server.ip, 3, &[]));
        let run = run.unwrap();
        assert!(
            (0.1..0.25).contains(&run.gbps),
            "{} reached the server over HBONE at the link's rate: {} Gbit/s",
            pod.name,
            run.gbps
        );
        unsent.push(max);
    }
    let (capped_max, uncapped_max) = (unsent[0], unsent[1]);
    assert!(
        capped_max > 0,
        "ss never saw unsent bytes on the capped HBONE connection"
    );
    // The default cap (128 KiB), plus at most the one buffer a write was
    // filling: 64 KiB, eth0's GSO limit (the lab raises it only on lo).
    // "0" means the kernel default, unless net.ipv4.tcp_notsent_lowat is set.
    assert!(
        capped_max <= (128 + 128) * 1024,
        "with the default cap the kernel held up to {capped_max} bytes unsent"
    );
    assert!(
        uncapped_max > 2 * capped_max.max(128 * 1024),
        "with AMBIT_HBONE_UNSENT_LIMIT=0 the kernel queued up to {uncapped_max} bytes (capped: {capped_max})"
    );
}

#[test]
fn short_connections_never_stall_on_a_reused_port_even_when_they_fail() {
    let (mut m, client, server, _echo) = common::meshed_pair("tw");
    let outsider = m.pod("outsider");
    // Both destinations close first, as HTTP/1.0 servers do: the proxy then
    // closes the application's connection first. Nothing listens on 7999:
    // the proxy accepts, cannot carry the connection (a refused dial, an
    // HBONE 503), and closes first too, after the byte the application sent.
    let meshed = close_first_echo(&server, 7001).unwrap();
    let outside = close_first_echo(&outsider, 7001).unwrap();
    let nowhere = |pod: &LabPod| SocketAddr::new(pod.ip.into(), 7999);
    let targets = [
        (meshed, Ends::Echo),
        (outside, Ends::Echo),
        (nowhere(&outsider), Ends::Closed),
        (nowhere(&server), Ends::Closed),
    ];
    let run = short_connections(&client, &targets, 4000).unwrap();
    assert_eq!(run.syn_retries, 0, "no SYN had to be sent again: {run:?}");
    assert!(run.slowest_connect < Duration::from_millis(500), "{run:?}");
    assert_eq!(
        run.aborts, 0,
        "every connection ended without a reset: {run:?}"
    );
    let held = time_waits(&client, 15001).unwrap();
    assert!(held.is_empty(), "the proxy keeps no TIME_WAIT:\n{held}");

    // Inbound from outside the mesh: every port of the server pod lands on
    // its proxy's 15006, whose TIME_WAITs stay (the peer is across the
    // network, where TIME_WAIT guards against late segments). The sender's
    // timestamps run on one clock per pair of addresses, so a TIME_WAIT
    // refuses its next SYN only when both fall in the same millisecond and
    // the new sequence number happens to be lower: 0 to 2 in 3,000 under
    // load, each a ~10 ms stall. (Outbound, whose clocks differ per
    // destination, stalled up to 1 s before the proxy removed its TIME_WAITs.)
    let other_port = close_first_echo(&server, 7002).unwrap();
    let inbound = [
        (meshed, Ends::Echo),
        (other_port, Ends::Echo),
        (nowhere(&server), Ends::Closed),
    ];
    let aborted = aborts(&server).unwrap();
    let run = short_connections(&outsider, &inbound, 3000).unwrap();
    assert!(run.syn_retries <= 5, "inbound: {run:?}");
    assert!(
        run.slowest_connect < Duration::from_millis(500),
        "inbound: {run:?}"
    );
    assert_eq!(
        aborts(&server).unwrap(),
        aborted,
        "the server's proxy ended every inbound connection without a reset"
    );
}

/// What an idle proxy may keep of a bulk transfer's memory: its worker
/// threads' allocator caches, which an idle thread never gives back
/// (jemalloc's 20 objects per size class, 16–32 KiB each in the classes
/// TLS records and copy buffers use; measured +0.36–0.69 MB for the whole
/// proxy, against a peak 3–5 MB above the start).
const KEPT_KB: u64 = 1536;

/// After a bulk HBONE transfer, idle proxies give back the memory its
/// buffers took (jemalloc hands pages back 2 s after their last use),
/// though the pooled HBONE connection stays open.
#[test]
fn after_a_bulk_transfer_idle_proxies_give_the_memory_back() {
    let (m, client, server, _echo) = common::meshed_pair("trim");
    m.lab.start_iperf3_server(&server).unwrap();
    let pids = [&client, &server].map(|p| m.lab.pid(&format!("proxy-{}", p.name)).unwrap());
    let private = || pids.map(anon_kb);
    // What the first connection leaves for good (the pooled HBONE
    // connection, both certificates, the metric series) is state, not
    // buffers: a short transfer makes it before the baseline is read.
    ambit::lab::iperf3(&client, server.ip, 1, &["-b", "1M"]).unwrap();
    let before = private();
    assert!(before.iter().all(|&kb| kb > 0), "both proxies running");
    // The peak is sampled while the transfer runs: what is left once
    // iperf3 has ended depends on how fast this machine moved the bytes.
    let running = std::sync::atomic::AtomicBool::new(true);
    let (run, loaded) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut peak = before;
            while running.load(std::sync::atomic::Ordering::Relaxed) {
                for (p, now) in peak.iter_mut().zip(private()) {
                    *p = (*p).max(now);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            peak
        });
        let run = ambit::lab::iperf3(&client, server.ip, 3, &[]);
        running.store(false, std::sync::atomic::Ordering::Relaxed);
        (run.unwrap(), sampler.join().unwrap())
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut idle = private();
    while idle.iter().zip(before).any(|(i, b)| *i > b + KEPT_KB)
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(500));
        idle = private();
    }
    eprintln!(
        "private kB before {before:?}, peak at {} Gbit/s {loaded:?}, idle {idle:?}",
        run.gbps
    );
    assert!(
        loaded.iter().zip(before).any(|(l, b)| *l > b + 2048),
        "the transfer grew a proxy's memory (else this shows nothing): {before:?} -> {loaded:?}"
    );
    assert!(idle.iter().all(|&kb| kb > 0), "both proxies still running");
    for (i, b) in idle.iter().zip(before) {
        assert!(*i <= b + KEPT_KB, "idle proxies are back within {KEPT_KB} kB of their start: {before:?} -> {loaded:?} -> {idle:?}");
    }
}

#[test]
fn the_proxy_s_own_connections_use_its_congestion_control_and_apps_keep_theirs() {
    let mut m = Mesh::new("cc");
    let (client, server, outsider) = (m.pod("client"), m.pod("server"), m.pod("outsider"));
    // Every pod's default is reno (built into every kernel): what the
    // applications' own sockets must keep.
    for pod in [&client, &server, &outsider] {
        set_default_congestion_control(&pod.ns, "reno").unwrap();
    }
    m.write_config(&format!(
        "workloads:\n{}{}",
        workload(&client, "client-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE")
    ));
    // The client's proxy as shipped (cubic); the server's keeps the kernel's.
    m.mesh(&client, "client-sa");
    m.mesh_env(&server, "server-sa", &[("AMBIT_CONGESTION_CONTROL", "")]);
    let meshed = EchoServer::start(&server, 9000).unwrap();
    let outside = EchoServer::start(&outsider, 9001).unwrap();
    let mut hbone = connect_from(&client, meshed.addr).unwrap();
    let mut passthrough = connect_from(&client, outside.addr).unwrap();
    // Kept open while `ss` looks: one byte there and back.
    for conn in [&mut hbone, &mut passthrough] {
        let mut back = [0u8; 1];
        conn.write_all(b"x").unwrap();
        conn.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"x");
    }

    let at_client = established(&client).unwrap();
    let proxy: Vec<_> = at_client.iter().filter(|c| c.proxy).collect();
    let apps: Vec<_> = at_client.iter().filter(|c| !c.proxy).collect();
    // The proxy's: two accepted on 15001, one HBONE connection to the
    // server's 15008, one passthrough dial to the outsider.
    assert_eq!(proxy.len(), 4, "{at_client:?}");
    assert!(
        proxy.iter().all(|c| c.congestion_control == "cubic"),
        "the proxy's listeners and dials use cubic: {at_client:?}"
    );
    assert!(
        proxy.iter().any(|c| c.peer.ends_with(":15008"))
            && proxy.iter().any(|c| c.peer.ends_with(":9001")),
        "{at_client:?}"
    );
    assert_eq!(apps.len(), 2, "{at_client:?}");
    assert!(
        apps.iter().all(|c| c.congestion_control == "reno"),
        "the application's own sockets keep the pod's default: {at_client:?}"
    );
    let at_server = established(&server).unwrap();
    assert!(
        at_server.iter().filter(|c| c.proxy).count() == 2
            && at_server.iter().all(|c| c.congestion_control == "reno"),
        "with an empty setting, the proxy keeps the kernel's default: {at_server:?}"
    );
}

/// A node proxy holds two descriptors per connection for every pod of its
/// node: it starts with its open-file limit raised to the hard limit.
#[test]
fn the_proxy_raises_its_open_file_limit_to_the_hard_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    // Children inherit this process's limits: start the proxy below the hard one.
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    assert!(hard >= 2048, "hard limit {hard} too low to test");
    let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, 1024, hard).unwrap();
    let pair = std::panic::catch_unwind(|| common::meshed_pair("nofile"));
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    let (m, _client, _server, _echo) = pair.unwrap_or_else(|e| std::panic::resume_unwind(e));
    let pid = m.lab.pid("proxy-client").unwrap();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        (cols[3], cols[4]),
        (hard.to_string().as_str(), hard.to_string().as_str()),
        "{line}"
    );
}

/// A destination that accepts TCP on 15008 and then never speaks: callers
/// to it fail within the HBONE deadline (all of them, not one after the
/// other), and callers to other destinations are not held up meanwhile.
#[test]
fn a_stalled_destination_fails_its_callers_in_time_and_delays_no_one_else() {
    let mut m = common::Mesh::new("stall");
    let (client, server, staller) = (m.pod("client"), m.pod("server"), m.pod("staller"));
    m.write_config(&format!(
        "workloads:\n{}{}{}",
        workload(&client, "client-sa", "HBONE"),
        workload(&server, "server-sa", "HBONE"),
        workload(&staller, "staller-sa", "HBONE"),
    ));
    m.mesh(&client, "client-sa");
    m.mesh(&server, "server-sa");
    let echo = EchoServer::start(&server, 8080).unwrap();
    // Accepts, holds, never answers the TLS handshake.
    let listener = staller
        .ns
        .run(|| std::net::TcpListener::bind(("0.0.0.0", 15008)))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        let held: Vec<_> = listener.incoming().flatten().collect();
        drop(held);
    });

    let stalled = SocketAddr::new(staller.ip.into(), 8080);
    let callers: Vec<_> = (0..2)
        .map(|_| {
            let client = client.clone();
            std::thread::spawn(move || {
                let started = std::time::Instant::now();
                let got = connect_from(&client, stalled).and_then(|mut c| {
                    c.set_read_timeout(Some(Duration::from_secs(30)))?;
                    echo_roundtrip(&mut c, b"hello?")
                });
                (got.map_or(true, |b| b.is_empty()), started.elapsed())
            })
        })
        .collect();
    // Meanwhile another destination is served at once.
    std::thread::sleep(Duration::from_millis(500)); // the stalled dials are under way
    let started = std::time::Instant::now();
    let mut c = connect_from(&client, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut c, b"not held up").unwrap(),
        b"not held up"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    for caller in callers {
        let (failed, took) = caller.join().unwrap();
        assert!(failed, "a stalled destination cannot carry bytes");
        assert!(took < Duration::from_secs(15), "failed only after {took:?}");
    }
    wait_until("the deadline named in the access log", SETTLE, || {
        m.proxy_log(&client)
            .matches("not established within")
            .count()
            == 2
    });
}
