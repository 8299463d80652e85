//! Finding the netns of pods the agent should hold but got no CNI ADD for
//! (they predate it, or a label flipped on a running pod), the way kubelet
//! leaves them: a pod's netns is one that a process of that pod holds, and a
//! process belongs to the pod whose UID its cgroup names. Only the host's
//! processes are walked: never named network namespaces (`/var/run/netns`),
//! and never a netns that no pod's process holds, since anyone able to make
//! a netns can give it a pod's IP. The parsers and the match are pure.

use std::collections::HashSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use super::store::PodRecord;
use crate::cni::kube::Wanted;
use crate::cni::plugin::Enrollment;
use crate::config::agent::AgentConfig;
use crate::netns::Netns;
use crate::xds::State;

/// A network namespace a pod's process holds.
struct HeldNetns {
    /// `<proc>/<pid>/ns/net` of the pod's oldest process in it: its
    /// sandbox, which lives as long as the pod (an app container's process
    /// may restart and take its path with it).
    path: PathBuf,
    ns: Netns,
    /// The pod UID that process's cgroup names.
    uid: String,
}

/// Every network namespace other than `own` that a process of a Kubernetes
/// pod holds, once per (netns, pod). Processes whose cgroup names no pod are
/// passed over without opening their netns.
fn pod_netns(proc_dir: &Path, own: (u64, u64)) -> Vec<HeldNetns> {
    let mut procs: Vec<(u64, u32, PathBuf, String)> = std::fs::read_dir(proc_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let dir = e.path();
            let uid = pod_uid_from_cgroup(&std::fs::read_to_string(dir.join("cgroup")).ok()?)?;
            let started = start_time_from_stat(&std::fs::read_to_string(dir.join("stat")).ok()?)?;
            Some((started, pid, dir, uid))
        })
        .collect();
    // Oldest first, so each netns is reached through its pod's sandbox.
    procs.sort();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (_, _, dir, uid) in procs {
        let path = dir.join("ns/net");
        let Ok(ns) = Netns::open(&path) else { continue };
        let Ok(id) = ns.id() else { continue };
        if id != own && seen.insert((id, uid.clone())) {
            out.push(HeldNetns { path, ns, uid });
        }
    }
    out
}

/// Pods that exist but the agent does not hold (it started after them, or
/// lost its state): local-config workloads selected by the rule.
pub(super) fn discover(
    cfg: &AgentConfig,
    state: &State,
    enroll: &Enrollment,
    held: &[PodRecord],
) -> Vec<(PodRecord, Netns)> {
    let wanted: Vec<Wanted> = state
        .workloads()
        .filter(|w| {
            !cfg.exclude_namespaces.iter().any(|n| *n == w.namespace)
                && enroll.selects(&w.namespace, &w.name)
        })
        .filter(|w| {
            !held
                .iter()
                .any(|h| h.uid == w.uid || (h.name == w.name && h.namespace == w.namespace))
        })
        // On a node that knows its name, only its own workloads can be here.
        .filter(|w| cfg.node_name.is_empty() || w.node.is_empty() || w.node == cfg.node_name)
        .map(|w| Wanted {
            uid: w.uid.to_string(),
            name: w.name.to_string(),
            namespace: w.namespace.to_string(),
            service_account: w.service_account.to_string(),
            ips: w.workload_ips.to_vec(),
            overrides: Default::default(),
        })
        .collect();
    find_netns(&cfg.host_proc, &wanted)
}

/// The pod UID in a `/proc/<pid>/cgroup` text, as kubelet's cgroup drivers
/// write it: `.../pod<uid>/...` (cgroupfs) or `...-pod<uid with _>.slice/...`
/// (systemd).
pub fn pod_uid_from_cgroup(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        line.match_indices("pod").find_map(|(i, _)| {
            let cand: String = line[i + 3..].chars().take(36).collect();
            let uid = cand.replace('_', "-");
            let ok = uid.len() == 36
                && uid.char_indices().all(|(k, c)| match k {
                    8 | 13 | 18 | 23 => c == '-',
                    _ => c.is_ascii_hexdigit(),
                });
            ok.then_some(uid)
        })
    })
}

/// When a process started (clock ticks after boot), from its
/// `/proc/<pid>/stat`: field 22, counted after the command name, which may
/// itself hold spaces and parentheses.
fn start_time_from_stat(text: &str) -> Option<u64> {
    let (_, rest) = text.rsplit_once(')')?;
    // `rest` starts at field 3 (the state).
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// The wanted pod a netns belongs to: the one whose UID the cgroup of a
/// process holding the netns names (`cgroup_uid`), if the netns holds one
/// of its IPs. A netns no pod's process holds is nobody's, whatever its IPs.
fn owner_of<'a>(
    wanted: &[&'a Wanted],
    ips: &[IpAddr],
    cgroup_uid: Option<&str>,
) -> Option<&'a Wanted> {
    let uid = cgroup_uid?;
    wanted
        .iter()
        .find(|w| w.uid == uid && w.ips.iter().any(|ip| ips.contains(ip)))
        .copied()
}

/// Finds the netns of each wanted pod: one that a process of that pod
/// holds, with an interface holding one of the pod's IPs.
pub(super) fn find_netns(proc_dir: &Path, wanted: &[Wanted]) -> Vec<(PodRecord, Netns)> {
    let wanted: Vec<&Wanted> = wanted.iter().filter(|w| !w.ips.is_empty()).collect();
    if wanted.is_empty() {
        return Vec::new();
    }
    let Ok(own) = Netns::current().and_then(|n| n.id()) else {
        return Vec::new();
    };
    let mut found: Vec<(PodRecord, Netns)> = Vec::new();
    for HeldNetns { path, ns, uid } in pod_netns(proc_dir, own) {
        // Another pod's netns, or one already found: not entered.
        if !wanted.iter().any(|w| w.uid == uid) || found.iter().any(|(r, _)| r.uid == uid) {
            continue;
        }
        let Ok(Ok(addrs)) = ns.run(|| {
            nix::ifaddrs::getifaddrs().map(|a| a.filter_map(|i| i.address).collect::<Vec<_>>())
        }) else {
            continue;
        };
        let ips: Vec<IpAddr> = addrs
            .iter()
            .filter_map(|s| {
                s.as_sockaddr_in()
                    .map(|v| v.ip().into())
                    .or_else(|| s.as_sockaddr_in6().map(|v| v.ip().into()))
            })
            .collect();
        let Some(w) = owner_of(&wanted, &ips, Some(uid.as_str())) else {
            continue;
        };
        let Ok(netns_id) = ns.id() else { continue };
        let record = PodRecord {
            uid: w.uid.clone(),
            name: w.name.clone(),
            namespace: w.namespace.clone(),
            service_account: w.service_account.clone(),
            netns_path: path,
            netns_id,
            ips: w.ips.iter().map(|i| i.to_string()).collect(),
            overrides: w.overrides.clone(),
        };
        found.push((record, ns));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID_A: &str = "0d3e7c59-6a8b-4f57-9a0e-2f1c7b9d4e21";
    const UID_B: &str = "7a1f0c2e-93b4-4d6a-8e5f-1b2c3d4e5f60";

    #[test]
    fn pod_uid_comes_from_either_cgroup_driver() {
        let systemd = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0d3e7c59_6a8b_4f57_9a0e_2f1c7b9d4e21.slice/cri-containerd-7f2a.scope\n";
        let cgroupfs =
            "12:memory:/kubepods/besteffort/pod0d3e7c59-6a8b-4f57-9a0e-2f1c7b9d4e21/4c1d\n0::/\n";
        assert_eq!(pod_uid_from_cgroup(systemd).as_deref(), Some(UID_A));
        assert_eq!(pod_uid_from_cgroup(cgroupfs).as_deref(), Some(UID_A));
        assert_eq!(
            pod_uid_from_cgroup("0::/user.slice/user-0.slice/session-3.scope\n"),
            None
        );
        assert_eq!(pod_uid_from_cgroup("0::/kubepods/podnothex/x\n"), None);
        assert_eq!(pod_uid_from_cgroup(""), None);
        // A "pod" earlier in the path that is no UID does not hide the real one.
        assert_eq!(
            pod_uid_from_cgroup(&format!("0::/ambit-podman-7/kubepods/pod{UID_A}\n")).as_deref(),
            Some(UID_A)
        );
    }

    #[test]
    fn start_time_is_field_22_whatever_the_command_name() {
        let stat = |comm: &str| {
            format!("4242 ({comm}) S 1 4242 4242 0 -1 4194560 120 0 0 0 3 1 0 0 20 0 1 0 987654 8544256 200 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0")
        };
        assert_eq!(start_time_from_stat(&stat("pause")), Some(987654));
        assert_eq!(start_time_from_stat(&stat("a) b (c")), Some(987654));
        assert_eq!(start_time_from_stat("4242 (short) S 1"), None);
        assert_eq!(start_time_from_stat(""), None);
    }

    fn pod(uid: &str, ip: &str) -> Wanted {
        Wanted {
            uid: uid.into(),
            name: uid.into(),
            namespace: "default".into(),
            service_account: "default".into(),
            ips: vec![ip.parse().unwrap()],
            overrides: Default::default(),
        }
    }

    fn ips(s: &str) -> Vec<IpAddr> {
        vec![s.parse().unwrap()]
    }

    #[test]
    fn a_netns_belongs_to_the_pod_its_cgroup_names_and_whose_ip_it_holds() {
        let (a, b) = (pod(UID_A, "10.0.0.2"), pod(UID_B, "10.0.0.3"));
        let wanted = [&a, &b];
        assert_eq!(
            owner_of(&wanted, &ips("10.0.0.2"), Some(UID_A)).map(|w| &w.uid),
            Some(&a.uid)
        );
        // A process of another pod holds it: not this pod's, whatever its IPs.
        assert!(owner_of(&wanted, &ips("10.0.0.3"), Some(UID_A)).is_none());
        // The right pod's process, but none of the pod's IPs in it.
        assert!(owner_of(&wanted, &ips("10.0.0.9"), Some(UID_A)).is_none());
    }

    #[test]
    fn a_netns_whose_cgroup_names_no_pod_is_nobodys() {
        let a = pod(UID_A, "10.0.0.2");
        let wanted = [&a];
        // It carries the pod's IP, but no pod's process holds it (a named
        // netns, or a process outside any pod's cgroup).
        for cgroup in [
            "0::/user.slice/user-0.slice/session-3.scope\n",
            "0::/\n",
            "",
        ] {
            let uid = pod_uid_from_cgroup(cgroup);
            assert!(
                owner_of(&wanted, &ips("10.0.0.2"), uid.as_deref()).is_none(),
                "{cgroup:?}"
            );
        }
    }

    /// A `/proc` stand-in: each process a cgroup text, a start time, and
    /// `ns/net` pointing at this test's own netns.
    fn fake_proc(dir: &Path, procs: &[(u32, &str, u64)]) {
        for (pid, cgroup, started) in procs {
            let p = dir.join(pid.to_string());
            std::fs::create_dir_all(p.join("ns")).unwrap();
            std::fs::write(p.join("cgroup"), cgroup).unwrap();
            let stat = format!("{pid} (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {started} 0 0");
            std::fs::write(p.join("stat"), stat).unwrap();
            std::os::unix::fs::symlink("/proc/thread-self/ns/net", p.join("ns/net")).unwrap();
        }
    }

    #[test]
    fn only_netns_held_by_a_pods_process_are_walked_and_through_its_oldest_process() {
        let dir = std::env::temp_dir().join(format!("ambit-discover-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (app, sandbox) = (
            format!("0::/kubepods/pod{UID_A}/app\n"),
            format!("0::/kubepods/pod{UID_A}/sandbox\n"),
        );
        fake_proc(
            &dir,
            &[
                // Not a pod's process: its netns is not listed.
                (10, "0::/user.slice/session-3.scope\n", 100),
                (11, "0::/\n", 50),
                // The pod's app container, then its sandbox (older).
                (30, app.as_str(), 900),
                (31, sandbox.as_str(), 800),
            ],
        );
        std::fs::create_dir_all(dir.join("self")).unwrap();
        // `own` is a netns no fake process is in, so nothing is skipped as the agent's.
        let found = pod_netns(&dir, (0, 0));
        let listed: Vec<(&str, &Path)> = found
            .iter()
            .map(|h| (h.uid.as_str(), h.path.as_path()))
            .collect();
        let through_sandbox = dir.join("31/ns/net");
        assert_eq!(listed, [(UID_A, through_sandbox.as_path())]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
