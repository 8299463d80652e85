//! Kernel probes: what a pod's or a process's kernel state says (rules in
//! force, TCP abort counters, established connections and their congestion
//! control, TIME_WAITs, memory). One helper per probe, read-only except for
//! setting a pod's default congestion control.

use std::io::{self};
use std::time::{Duration, Instant};

use super::LabPod;
use crate::netns::Netns;

/// `iptables-save` inside `ns`: the IPv4 rules in force there. Panics if
/// it cannot run, so "no rules" is never read from a failed call.
pub fn iptables_save(ns: &Netns) -> String {
    match ns.command("iptables-save").output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        other => panic!("iptables-save in {}: {other:?}", ns.path().display()),
    }
}

/// What `prog args` prints in `ns`; panics, naming the command, if it
/// cannot run or fails.
pub fn stdout_in(ns: &Netns, prog: &str, args: &[&str]) -> String {
    match ns.command(prog).args(args).output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        other => panic!("{prog} {args:?} in {}: {other:?}", ns.path().display()),
    }
}

/// How many of the pod's rules are Istio's, in either back end: lines of
/// its IPv4 iptables rules naming an `ISTIO` chain, plus rules in its
/// nftables `istio-ambient-*` tables (0: not captured).
pub fn istio_rules(pod: &LabPod) -> usize {
    iptables_save(&pod.ns)
        .lines()
        .filter(|l| l.contains("ISTIO"))
        .count()
        + nft_istio_rules(&pod.ns).len()
}

/// The rules (statements, no headers) in `ns`'s nftables tables named
/// `istio-ambient-*`, as `nft list ruleset` prints them. Panics if `nft`
/// cannot run.
pub fn nft_istio_rules(ns: &Netns) -> Vec<String> {
    let mut ours = false;
    let mut rules = Vec::new();
    for line in stdout_in(ns, "nft", &["list", "ruleset"]).lines() {
        let l = line.trim();
        if let Some(t) = l.strip_prefix("table ") {
            ours = t
                .split_whitespace()
                .nth(1)
                .is_some_and(|n| n.starts_with("istio-ambient-"));
            continue;
        }
        let header = l.is_empty()
            || l == "}"
            || l.starts_with("chain ")
            || l.starts_with("type ")
            || l.starts_with("set ")
            || l.starts_with("elements ");
        if ours && !header {
            rules.push(l.to_string());
        }
    }
    rules
}

/// Resets `pod`'s kernel sent to abort connections: closed with data unread
/// (`TCPAbortOnClose`), data arriving after the close (`TCPAbortOnData`),
/// or `SO_LINGER` 0 (`TCPAbortOnLinger`). A reset read after an end of
/// stream goes unseen by the reader; these count it.
pub fn aborts(pod: &LabPod) -> io::Result<u64> {
    pod.ns.run(aborts_here)?
}

pub(super) fn aborts_here() -> io::Result<u64> {
    Ok(tcp_ext("TCPAbortOnClose")? + tcp_ext("TCPAbortOnData")? + tcp_ext("TCPAbortOnLinger")?)
}

/// A `TcpExt` counter of the calling thread's netns.
pub(super) fn tcp_ext(name: &str) -> io::Result<u64> {
    counter("netstat", "TcpExt:", name)
}

/// The TCP connections a pod's netns has accepted so far (`PassiveOpens`):
/// its applications' and its proxy's.
pub fn passive_opens(pod: &LabPod) -> io::Result<u64> {
    pod.ns.run(|| counter("snmp", "Tcp:", "PassiveOpens"))?
}

/// Counter `name` of the `prefix` table of `/proc/net/<file>`, for the
/// calling thread's netns (`/proc/self/net` is the process's).
fn counter(file: &str, prefix: &str, name: &str) -> io::Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/thread-self/net/{file}"))?;
    let mut lines = text.lines().filter(|l| l.starts_with(prefix));
    let (keys, values) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""));
    keys.split_whitespace()
        .position(|k| k == name)
        .and_then(|at| values.split_whitespace().nth(at)?.parse().ok())
        .ok_or_else(|| io::Error::other(format!("no {prefix} {name} in /proc/net/{file}")))
}

/// An established TCP connection as `ss` shows it.
#[derive(Debug, Clone)]
pub struct Established {
    /// Owned by an `ambit` process (the proxy), not the application.
    pub proxy: bool,
    pub local: String,
    pub peer: String,
    /// Its congestion control algorithm, e.g. `cubic`.
    pub congestion_control: String,
}

/// Sets the default TCP congestion control of a pod's (or any) netns: what
/// its applications' sockets get.
pub fn set_default_congestion_control(ns: &Netns, algorithm: &str) -> io::Result<()> {
    let set = ns
        .command("sysctl")
        .args([
            "-qw",
            &format!("net.ipv4.tcp_congestion_control={algorithm}"),
        ])
        .status()?;
    if !set.success() {
        return Err(io::Error::other(format!("sysctl: {set}")));
    }
    Ok(())
}

/// The established TCP connections in `pod` (`ss -HOtnpi`, one line each).
pub fn established(pod: &LabPod) -> io::Result<Vec<Established>> {
    let out = pod
        .ns
        .command("ss")
        .args(["-HOtnpi", "state", "established"])
        .output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!("ss: {out:?}")));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .map(|line| {
            // Recv-Q Send-Q Local Peer [users:((..))] <algorithm> <details>...
            let f: Vec<&str> = line.split_whitespace().collect();
            let field = |i: usize| {
                f.get(i)
                    .map(|s| s.to_string())
                    .ok_or_else(|| io::Error::other(format!("ss line too short: {line}")))
            };
            let algorithm = f.iter().skip(4).find(|t| !t.starts_with("users:"));
            Ok(Established {
                proxy: line.contains("((\"ambit\""),
                local: field(2)?,
                peer: field(3)?,
                congestion_control: algorithm.map(|s| s.to_string()).unwrap_or_default(),
            })
        })
        .collect()
}

/// The TIME_WAITs on local port `port` in `pod` once they stop going away
/// (a proxy removes the last one just after the application's close), or
/// after 3 s: `ss` lines, empty when there are none.
pub fn time_waits(pod: &LabPod, port: u16) -> io::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let out = pod
            .ns
            .command("ss")
            .args([
                "-Htan",
                "state",
                "time-wait",
                &format!("( sport = :{port} )"),
            ])
            .output()?;
        let held = String::from_utf8_lossy(&out.stdout).into_owned();
        if held.trim().is_empty() || Instant::now() > deadline {
            return Ok(held);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Resident memory of a process in kB (`/proc/<pid>/status` VmRSS; 0 if unknown).
pub fn rss_kb(pid: u32) -> u64 {
    status_kb(pid, "VmRSS")
}

/// User + system CPU seconds of process `pid` so far, all its threads.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command name (which may hold spaces): utime and stime are
    // the 12th and 13th fields.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let ticks: u64 = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|t| t.parse::<u64>().ok())
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    ticks as f64 / hz as f64
}

/// The private (anonymous) part of [`rss_kb`], `RssAnon`: what one more such
/// process costs, where the rest is the binary's pages, shared with others.
pub fn anon_kb(pid: u32) -> u64 {
    status_kb(pid, "RssAnon")
}

fn status_kb(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.split(':').next() == Some(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}
