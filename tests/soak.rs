//! Faults and churn (issue #19): one lab node (`ambit agent` and `ambit
//! proxy` as processes of their own, the real CNI chain) carries continuous
//! traffic between two meshed pods, short connections and one long flow,
//! while a driver creates and deletes pods, edits the local config, and
//! sends SIGKILL to the proxy, to the agent, and to `ambit-cni` in the
//! middle of an ADD. What must hold is checked as it goes and at the end,
//! and printed as a table.
//!
//! `soak_short` runs with the other tests (about a minute). The long soak
//! is ignored by default:
//!
//! ```text
//! AMBIT_SOAK_SECS=600 cargo test --test soak -- --ignored --nocapture
//! ```

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ambit::lab::node::Node;
use ambit::lab::{connect_from, echo_roundtrip, pod_uid, EchoServer, LabPod};
use common::node::{fd_kinds, ipset_members, proxy_uids, served, state_uids, veth_count};
use common::wait_until;

const BIN: &str = env!("CARGO_BIN_EXE_ambit");

/// How long a pod whose ADD succeeded may take to be served over HBONE.
const SERVE_LIMIT: Duration = Duration::from_secs(10);

/// After a proxy is killed, how long new connections may fail: until the
/// new proxy is ready and has taken the pods, plus this for the kernel to
/// hand the listeners over.
const HANDOVER_SLACK: Duration = Duration::from_secs(1);

/// The marker every short connection sends: seen in clear on the bridge
/// means a meshed connection left in plaintext.
const MARKER: &[u8] = b"AMBIT-SOAK-CLEAR-7f3a";

#[test]
fn soak_short() {
    soak("soak", Duration::from_secs(45), 19, false);
}

/// The same with the node's mesh state and certificates from `ambit
/// control-plane`, which is killed too.
#[test]
fn soak_short_with_a_control_plane() {
    soak("soakcp", Duration::from_secs(30), 7, true);
}

#[test]
#[ignore = "long: AMBIT_SOAK_SECS (default 600) of churn and kills"]
fn soak_long() {
    let secs = std::env::var("AMBIT_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    soak("soaklong", Duration::from_secs(secs), 20_261_130, false);
    soak("soaklongcp", Duration::from_secs(secs), 20_261_131, true);
}

/// One attempt of the short-connection loop.
struct Attempt {
    at: Instant,
    error: Option<String>,
}

/// When new connections may fail: a proxy's death until its successor
/// serves the pods again.
#[derive(Clone, Copy)]
struct Window {
    from: Instant,
    to: Instant,
}

/// A process sample: (when, descriptors, threads, RSS kB).
type Sample = (Instant, usize, usize, u64);

#[derive(Default)]
struct Counts {
    adds: usize,
    adds_failed: usize,
    deletes: usize,
    proxy_kills: usize,
    agent_kills: usize,
    cni_kills: usize,
    cni_kill_tries: usize,
    cp_kills: usize,
    config_edits: usize,
    state_checks: usize,
    slowest_serve: Duration,
}

fn kill9(pid: u32) {
    // SAFETY: kill(2) on a pid this test spawned (or found as ambit-cni).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
}

fn sample(pid: u32) -> Option<Sample> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.count();
    Some((Instant::now(), fds, threads, ambit::lab::rss_kb(pid)))
}

fn netns_count() -> usize {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// Kills the process `label` with SIGKILL, starts it again and waits until
/// it is ready; returns when it died and when its successor was ready.
fn kill_and_restart(node: &Node, label: &str, ready: (&str, &str)) -> Window {
    let pid = node.lab.pid(label).expect("process running");
    let from = Instant::now();
    kill9(pid);
    node.lab.stop(label); // reaps it
    node.lab.spawn(label, node.command(label)).unwrap();
    node.wait_ready(ready.0, ready.1);
    Window {
        from,
        to: Instant::now(),
    }
}

/// Where the control plane listens, in the node's netns.
const CP: &str = "127.0.0.1:15012";

/// `ambit control-plane` for `node`: its mesh file, its CA, a serving root
/// of its own and an any-node token.
fn control_plane(node: &Node) -> Command {
    let dir = &node.dir;
    let mut cmd = node.lab.node.command(BIN);
    cmd.arg("control-plane")
        .env("LOCAL_XDS_PATH", dir.join("mesh.yaml"))
        .env("AMBIT_CA_CERT", dir.join("ca-cert.pem"))
        .env("AMBIT_CA_KEY", dir.join("ca-key.pem"))
        .env("AMBIT_CP_SERVING_CA_CERT", dir.join("serving-ca-cert.pem"))
        .env("AMBIT_CP_SERVING_CA_KEY", dir.join("serving-ca-key.pem"))
        .env("AMBIT_CP_LISTEN", CP)
        .env("AMBIT_CP_TLS_SANS", "127.0.0.1")
        .env("AMBIT_CP_TOKEN_FILE", dir.join("token"));
    cmd
}

fn cp_listening(node: &Node) -> bool {
    let addr: SocketAddr = CP.parse().unwrap();
    node.lab
        .node
        .run(move || {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        })
        .unwrap_or(false)
}

/// A node whose proxy takes its state and certificates from a control plane
/// on the node (churned pods are `default/default`, a workload it knows).
fn node_with_control_plane(tag: &str) -> Node {
    let subnet = "10.150.0";
    let mesh = format!(
        "workloads:\n\
         - {{name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"{subnet}.2\"], protocol: HBONE}}\n\
         - {{name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{subnet}.3\"], protocol: HBONE}}\n\
         - {{name: churn, namespace: default, serviceAccount: default, workloadIps: [\"10.200.0.8\"], protocol: HBONE}}\n"
    );
    let mut node = Node::prepare(BIN, tag, "namespaces:default", subnet, &mesh, None);
    std::fs::write(node.dir.join("token"), "soak-token").unwrap();
    node.extra_env = vec![
        ("XDS_ADDRESS".into(), format!("https://{CP}")),
        ("CA_ADDRESS".into(), format!("https://{CP}")),
        (
            "XDS_ROOT_CA".into(),
            node.dir.join("serving-ca-cert.pem").display().to_string(),
        ),
        (
            "AMBIT_MESH_ROOT_CA".into(),
            node.dir.join("ca-cert.pem").display().to_string(),
        ),
        (
            "AUTH_TOKEN".into(),
            node.dir.join("token").display().to_string(),
        ),
        ("AMBIT_CA_KEY".into(), "/nonexistent".into()),
    ];
    node.lab.spawn("cp", control_plane(&node)).unwrap();
    wait_until(
        "the control plane listening",
        Duration::from_secs(20),
        || cp_listening(&node),
    );
    node.launch(false);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");
    node
}

fn soak(tag: &str, length: Duration, seed: u64, with_cp: bool) {
    let mut node = if with_cp {
        node_with_control_plane(tag)
    } else {
        Node::start_with(BIN, tag, "namespaces:default", false)
    };
    let netns_before = netns_count();
    let veths_before = veth_count(&node);
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    let target = echo.addr;

    let pcap = node.dir.join("bridge.pcap");
    let mut cmd = node.lab.node.command("tcpdump");
    cmd.args(["-i", "cni0", "-U", "-s", "0", "-w"]).arg(&pcap);
    node.lab.spawn("tcpdump", cmd).unwrap();
    wait_until("tcpdump listening", Duration::from_secs(10), || {
        std::fs::read_to_string(node.lab.log_path("tcpdump"))
            .unwrap_or_default()
            .contains("listening on")
    });

    // Short connections, back to back.
    let stop = Arc::new(AtomicBool::new(false));
    let (s, c) = (stop.clone(), client.clone());
    let shorts = std::thread::spawn(move || {
        let mut attempts = Vec::new();
        while !s.load(Ordering::Relaxed) {
            let at = Instant::now();
            let r = connect_from(&c, target).and_then(|mut conn| echo_roundtrip(&mut conn, MARKER));
            let error = match r {
                Ok(b) if b == MARKER => None,
                Ok(b) => Some(format!("echoed {} bytes", b.len())),
                Err(e) => Some(e.to_string()),
            };
            attempts.push(Attempt { at, error });
            std::thread::sleep(Duration::from_millis(20));
        }
        attempts
    });
    // One long flow: a round trip every 100 ms; a break is counted and the
    // flow starts again.
    let (s, c) = (stop.clone(), client.clone());
    let long = std::thread::spawn(move || {
        let (mut trips, mut breaks) = (0usize, 0usize);
        let mut conn = None;
        while !s.load(Ordering::Relaxed) {
            if conn.is_none() {
                conn = connect_from(&c, target).ok();
            }
            if let Some(k) = conn.as_mut() {
                k.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                match echo_roundtrip_keep(k, b"long-flow") {
                    Ok(()) => trips += 1,
                    Err(_) => {
                        breaks += 1;
                        conn = None;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        (trips, breaks)
    });

    let mut rng = fastrand::Rng::with_seed(seed);
    let mut counts = Counts::default();
    let mut live: Vec<LabPod> = Vec::new();
    let mut gone: Vec<String> = Vec::new();
    let mut proxy_windows: Vec<Window> = Vec::new();
    let mut agent_windows: Vec<Window> = Vec::new();
    let mut serve_failures = Vec::new();
    let mut next = 0usize;
    let start = Instant::now();
    // Kills only in the first 60%: the rest is churn without faults, over
    // which the processes' descriptors, threads and memory must stay flat.
    let faults_end = length.mul_f64(0.6);
    let mut baseline: Option<Vec<(u32, Sample)>> = None;
    let mut steady_churn = 0usize;
    while start.elapsed() < length {
        let faults = start.elapsed() < faults_end;
        if !faults && baseline.is_none() {
            // Faults over: back to the two pods, then the processes' baseline.
            for pod in std::mem::take(&mut live) {
                let _ = node.delete_pod(&pod.name, "default");
                gone.push(pod_uid(&pod.name));
                counts.deletes += 1;
            }
            baseline = Some(settled_sample(&node, &[&client, &server]));
            steady_churn = counts.adds + counts.deletes;
        }
        let roll = match rng.u32(0..100) {
            55..=84 if !faults => rng.u32(0..55),
            r => r,
        };
        match roll {
            // A pod comes.
            0..=34 if live.len() < 12 => {
                next += 1;
                let name = format!("churn-{next}");
                match node.add_pod(&name, "default") {
                    Ok(pod) => {
                        counts.adds += 1;
                        let t = Instant::now();
                        let mut ok = false;
                        while t.elapsed() < SERVE_LIMIT && !ok {
                            ok = served(&node, &pod, target);
                            if !ok {
                                std::thread::sleep(Duration::from_millis(100));
                            }
                        }
                        counts.slowest_serve = counts.slowest_serve.max(t.elapsed());
                        if !ok {
                            serve_failures.push(name.clone());
                        }
                        live.push(pod);
                    }
                    Err(e) => {
                        counts.adds_failed += 1;
                        eprintln!("ADD of {name} failed: {e}");
                        let _ = node.delete_pod(&name, "default");
                        gone.push(pod_uid(&name));
                    }
                }
            }
            // A pod goes (as a runtime deletes it: CNI DEL, then its netns).
            0..=54 if !live.is_empty() => {
                let pod = live.swap_remove(rng.usize(0..live.len()));
                let _ = node.delete_pod(&pod.name, "default");
                gone.push(pod_uid(&pod.name));
                counts.deletes += 1;
            }
            55..=64 => {
                proxy_windows.push(kill_and_restart(
                    &node,
                    "proxy",
                    ("127.0.0.1:15021", "/healthz/ready"),
                ));
                counts.proxy_kills += 1;
            }
            65..=74 if with_cp && roll % 2 == 0 => {
                let pid = node.lab.pid("cp").expect("control plane running");
                kill9(pid);
                node.lab.stop("cp");
                node.lab.spawn("cp", control_plane(&node)).unwrap();
                wait_until("the control plane back", Duration::from_secs(20), || {
                    cp_listening(&node)
                });
                counts.cp_kills += 1;
            }
            65..=74 => {
                agent_windows.push(kill_and_restart(
                    &node,
                    "agent",
                    ("127.0.0.1:8000", "/readyz"),
                ));
                counts.agent_kills += 1;
                state_uids(&node);
                counts.state_checks += 1;
            }
            // ambit-cni killed in the middle of an ADD: the runtime sees the
            // ADD fail and deletes the pod.
            75..=84 => {
                next += 1;
                let name = format!("cnikill-{next}");
                let hunter_stop = Arc::new(AtomicBool::new(false));
                let hs = hunter_stop.clone();
                let lab_id = node.lab.id.clone();
                let hunter = std::thread::spawn(move || {
                    while !hs.load(Ordering::Relaxed) {
                        if let Some(pid) = find_process("ambit-cni", &lab_id) {
                            kill9(pid);
                            return true;
                        }
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    false
                });
                let added = node.add_pod(&name, "default");
                hunter_stop.store(true, Ordering::Relaxed);
                let killed = hunter.join().unwrap();
                counts.cni_kill_tries += 1;
                match added {
                    Ok(pod) => live.push(pod),
                    Err(e) => {
                        // Only an ADD that failed for the kill counts as killed mid-ADD.
                        // Killed before reading its stdin, the runtime sees a broken pipe.
                        if killed && (e.contains("signal: 9") || e.contains("Broken pipe")) {
                            counts.cni_kills += 1;
                        } else {
                            eprintln!("ADD of {name} failed: {e}");
                        }
                        counts.adds_failed += 1;
                        let _ = node.delete_pod(&name, "default");
                        gone.push(pod_uid(&name));
                    }
                }
            }
            // The local config changes (a workload comes or goes).
            85..=99 => {
                let path = node.dir.join("mesh.yaml");
                let mut text = std::fs::read_to_string(&path).unwrap();
                let extra = "- {name: ghost, namespace: other, serviceAccount: ghost, workloadIps: [\"10.200.0.9\"], protocol: HBONE}\n";
                text = if text.contains("ghost") {
                    text.replace(extra, "")
                } else {
                    text + extra
                };
                let tmp = node.dir.join("mesh.yaml.tmp");
                std::fs::write(&tmp, text).unwrap();
                std::fs::rename(&tmp, &path).unwrap();
                counts.config_edits += 1;
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(rng.u64(50..300)));
    }
    let churn_secs = start.elapsed().as_secs_f64();
    // Let traffic run on the settled node for a moment, then stop it.
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    let attempts = shorts.join().unwrap();
    let (trips, breaks) = long.join().unwrap();

    // What the node holds once settled: the live pods, nothing deleted.
    let want: BTreeSet<String> = ["client", "server"]
        .iter()
        .map(|n| pod_uid(n))
        .chain(live.iter().map(|p| pod_uid(&p.name)))
        .collect();
    let want_ips: BTreeSet<String> = [&client, &server]
        .into_iter()
        .chain(live.iter())
        .map(|p| p.ip.to_string())
        .collect();
    let mut settled = Duration::ZERO;
    let t = Instant::now();
    let held_right = |node: &Node| {
        state_uids(node) == want
            && proxy_uids(node).is_some_and(|p| p == want)
            && ipset_members(node) == want_ips
    };
    while !held_right(&node) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "after the churn the node holds other pods than the live ones:\n want {want:?}\n agent {:?}\n proxy {:?}\n ipset {:?} (want {want_ips:?})",
            state_uids(&node),
            proxy_uids(&node),
            ipset_members(&node)
        );
        std::thread::sleep(Duration::from_millis(200));
        settled = t.elapsed();
    }
    let held: BTreeSet<String> = state_uids(&node)
        .into_iter()
        .chain(proxy_uids(&node).unwrap_or_default())
        .collect();
    let gone_held: Vec<&String> = gone.iter().filter(|u| held.contains(*u)).collect();

    // New connections: none may fail outside the windows of a proxy kill.
    let in_window = |a: &Attempt| {
        proxy_windows
            .iter()
            .any(|w| a.at + Duration::from_secs(1) >= w.from && a.at <= w.to + HANDOVER_SLACK)
    };
    let failed_in: Vec<&Attempt> = attempts
        .iter()
        .filter(|a| a.error.is_some() && in_window(a))
        .collect();
    let failed_out: Vec<&Attempt> = attempts
        .iter()
        .filter(|a| a.error.is_some() && !in_window(a))
        .collect();
    let during_agent_kill = attempts
        .iter()
        .filter(|a| {
            a.error.is_some()
                && !in_window(a)
                && agent_windows.iter().any(|w| a.at >= w.from && a.at <= w.to)
        })
        .count();

    // Nothing in clear on the bridge.
    node.lab.stop("tcpdump");
    let raw = std::fs::read(&pcap).unwrap();
    let clear = raw.windows(MARKER.len()).filter(|w| *w == MARKER).count();

    // Descriptors, threads and memory: back to the baseline once the pods
    // churned without faults are gone.
    steady_churn = counts.adds + counts.deletes - steady_churn;
    for pod in std::mem::take(&mut live) {
        let _ = node.delete_pod(&pod.name, "default");
    }
    let end = settled_sample(&node, &[&client, &server]);

    let baseline = baseline.expect("a phase without faults");

    // Every pod deleted: the host is back to where it started.
    let _ = node.delete_pod("client", "default");
    let _ = node.delete_pod("server", "default");
    let mut leftovers = (0, 0);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        leftovers = (
            netns_count().saturating_sub(netns_before),
            veth_count(&node).saturating_sub(veths_before),
        );
        if leftovers == (0, 0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    let failed_total = failed_in.len() + failed_out.len();
    let source = if with_cp {
        "from ambit control-plane"
    } else {
        "from the local config"
    };
    println!("\nsoak {tag}: {churn_secs:.0} s of churn, seed {seed}, mesh state {source}");
    println!("| measure | value |\n|---|---|");
    println!(
        "| pods added (ADD ok) / failed ADDs | {} / {} |",
        counts.adds, counts.adds_failed
    );
    println!("| pods deleted | {} |", counts.deletes);
    println!(
        "| SIGKILLs: proxy / agent / ambit-cni mid-ADD (of tries) | {} / {} / {} ({}) |",
        counts.proxy_kills, counts.agent_kills, counts.cni_kills, counts.cni_kill_tries
    );
    println!("| control plane SIGKILLs | {} |", counts.cp_kills);
    println!("| mesh config edits | {} |", counts.config_edits);
    println!(
        "| short connections / failed in a proxy kill window / failed outside | {} / {} / {} |",
        attempts.len(),
        failed_in.len(),
        failed_out.len()
    );
    println!("| failed while the agent was down | {during_agent_kill} |");
    println!("| long flow round trips / breaks | {trips} / {breaks} |");
    println!(
        "| slowest ADD-to-served (limit {SERVE_LIMIT:?}) | {:?} |",
        counts.slowest_serve
    );
    println!("| pods never served | {} |", serve_failures.len());
    println!(
        "| deleted pods still held after settling ({settled:?}) | {} |",
        gone_held.len()
    );
    println!("| marker seen in clear on the bridge | {clear} |");
    println!(
        "| agent state parsed after each agent kill | {} |",
        counts.state_checks
    );
    for (label, (b, e)) in ["agent", "proxy"].iter().zip(baseline.iter().zip(&end)) {
        println!(
            "| {label} before and after {steady_churn} pod adds and deletes without faults: fds / threads / RSS | {} → {} / {} → {} / {} → {} kB |",
            b.1 .1, e.1 .1, b.1 .2, e.1 .2, b.1 .3, e.1 .3
        );
    }
    println!(
        "| netns / veths left over at the end | {} / {} |",
        leftovers.0, leftovers.1
    );
    println!(
        "(all {failed_total} failed connections: {:?})",
        attempts
            .iter()
            .filter_map(|a| a.error.clone())
            .take(5)
            .collect::<Vec<_>>()
    );

    assert!(
        serve_failures.is_empty(),
        "pods never served: {serve_failures:?}"
    );
    assert!(
        gone_held.is_empty(),
        "deleted pods still held: {gone_held:?}"
    );
    assert_eq!(clear, 0, "a meshed connection left in plaintext");
    assert!(
        failed_out.is_empty(),
        "{} new connections failed outside a proxy kill",
        failed_out.len()
    );
    assert_eq!(during_agent_kill, 0);
    assert_eq!(leftovers, (0, 0), "netns or veths left over");
    assert!(
        attempts.len() > 100,
        "too little traffic: {}",
        attempts.len()
    );
    for (label, (b, e)) in ["agent", "proxy"].iter().zip(baseline.iter().zip(&end)) {
        assert_eq!(b.0, e.0, "{label} restarted without a fault");
        assert!(
            e.1 .1 <= b.1 .1 + 2 && e.1 .2 <= b.1 .2 + 2,
            "{label}: descriptors or threads grew over the churn: {:?} → {:?}; open now: {:?}",
            (b.1 .1, b.1 .2),
            (e.1 .1, e.1 .2),
            fd_kinds(e.0)
        );
        assert!(
            e.1 .3 <= b.1 .3 + 8 * 1024,
            "{label}: RSS grew over the churn: {} → {} kB",
            b.1 .3,
            e.1 .3
        );
    }
}

/// Waits until the agent and the proxy hold just `pods`, lets them rest a
/// second, and samples both: (pid, sample) for the agent, then the proxy.
fn settled_sample(node: &Node, pods: &[&LabPod]) -> Vec<(u32, Sample)> {
    let want: BTreeSet<String> = pods.iter().map(|p| pod_uid(&p.name)).collect();
    wait_until("the node back to its pods", Duration::from_secs(20), || {
        state_uids(node) == want && proxy_uids(node).is_some_and(|p| p == want)
    });
    std::thread::sleep(Duration::from_secs(1));
    ["agent", "proxy"]
        .iter()
        .map(|l| {
            let pid = node.lab.pid(l).unwrap();
            (pid, sample(pid).unwrap())
        })
        .collect()
}

/// The pid of a running process named `comm` whose environment mentions
/// `lab_id` (a CNI plugin gets its pod's netns path, named after the lab):
/// this lab's, never another test's running beside it.
fn find_process(comm: &str, lab_id: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        // `stat` is "pid (comm) state ...": a running one, not a zombie.
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        let (name, rest) = stat.split_once('(')?.1.rsplit_once(')')?;
        if name != comm || rest.trim_start().starts_with('Z') {
            return None;
        }
        let environ = std::fs::read(e.path().join("environ")).ok()?;
        let netns_of_this_lab = format!("{lab_id}-");
        let ours = environ
            .split(|&b| b == 0)
            .any(|var| String::from_utf8_lossy(var).contains(&netns_of_this_lab));
        ours.then_some(pid)
    })
}

fn echo_roundtrip_keep(s: &mut std::net::TcpStream, msg: &[u8]) -> std::io::Result<()> {
    use std::io::{Read, Write};
    s.write_all(msg)?;
    let mut buf = vec![0u8; msg.len()];
    s.read_exact(&mut buf)?;
    if buf == msg {
        Ok(())
    } else {
        Err(std::io::Error::other("echoed something else"))
    }
}

/// Found by the soak: a pod that made an HBONE connection and was then
/// deleted left two sockets in the shared proxy, its pooled connection
/// (until the pool's 5 min idle timeout) and the server side of it (until
/// TCP keepalive, since the pod's FIN never got out of its deleted veth),
/// and with them the deleted pod's netns. Both now go with the pod.
#[test]
fn a_deleted_pod_leaves_no_descriptor_in_the_shared_proxy() {
    let mut node = Node::start_with(BIN, "podfds", "namespaces:default", false);
    let _client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    let pid = node.lab.pid("proxy").unwrap();
    let sockets = || fd_kinds(pid).get("socket").copied().unwrap_or(0);
    let before = sockets();
    for round in 0..3 {
        let name = format!("churn-{round}");
        let pod = node.add_pod(&name, "default").unwrap();
        wait_until("the pod served over HBONE", SERVE_LIMIT, || {
            served(&node, &pod, echo.addr)
        });
        node.delete_pod(&name, "default").unwrap();
    }
    wait_until(
        "the proxy's sockets back to what it held before the pods came",
        Duration::from_secs(10),
        || sockets() == before,
    );
}
