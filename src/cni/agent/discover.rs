//! Finding the netns of pods the agent should hold but got no CNI ADD for
//! (they predate it, or a label flipped on a running pod): walk the host's
//! network namespaces and match them to wanted pods by IP and, for a netns a
//! process holds, by the pod UID its cgroup names. The parsers are pure.

use std::path::{Path, PathBuf};

use super::store::PodRecord;
use crate::cni::kube::Wanted;
use crate::cni::plugin::Enrollment;
use crate::config::agent::AgentConfig;
use crate::netns::Netns;
use crate::xds::State;

/// Every network namespace on the host other than `own`, with a path to it:
/// named ones (`/var/run/netns`) first, then those only a process holds.
fn host_netns(proc_dir: &Path, own: (u64, u64)) -> Vec<(PathBuf, Netns)> {
    let mut seen = std::collections::HashSet::from([own]);
    let mut out = Vec::new();
    let named = std::fs::read_dir("/var/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path());
    let procs = std::fs::read_dir(proc_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .map(|e| e.path().join("ns/net"));
    for path in named.chain(procs) {
        let Ok(ns) = Netns::open(&path) else { continue };
        let Ok(id) = ns.id() else { continue };
        if seen.insert(id) {
            out.push((path, ns));
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
            !cfg.exclude_namespaces.contains(&w.namespace) && enroll.selects(&w.namespace, &w.name)
        })
        .filter(|w| {
            !held
                .iter()
                .any(|h| h.uid == w.uid || (h.name == w.name && h.namespace == w.namespace))
        })
        // On a node that knows its name, only its own workloads can be here.
        .filter(|w| cfg.node_name.is_empty() || w.node.is_empty() || w.node == cfg.node_name)
        .map(|w| Wanted {
            uid: w.uid.clone(),
            name: w.name.clone(),
            namespace: w.namespace.clone(),
            service_account: w.service_account.clone(),
            ips: w.workload_ips.clone(),
            overrides: Default::default(),
        })
        .collect();
    find_netns(&cfg.host_proc, &wanted)
}

/// Finds the netns of each wanted pod: one on this host with an interface
/// holding one of the pod's IPs.
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

/// The wanted pod a netns belongs to: one with an IP the netns holds and,
/// for a netns a pod's process holds, the UID that process's cgroup names.
fn owner_of<'a>(
    wanted: &[&'a Wanted],
    ips: &[std::net::IpAddr],
    cgroup_uid: Option<&str>,
) -> Option<&'a Wanted> {
    wanted
        .iter()
        .find(|w| {
            w.ips.iter().any(|ip| ips.contains(ip)) && cgroup_uid.is_none_or(|uid| uid == w.uid)
        })
        .copied()
}

pub(super) fn find_netns(proc_dir: &Path, wanted: &[Wanted]) -> Vec<(PodRecord, Netns)> {
    let wanted: Vec<&Wanted> = wanted.iter().filter(|w| !w.ips.is_empty()).collect();
    if wanted.is_empty() {
        return Vec::new();
    }
    let Ok(own) = Netns::current().and_then(|n| n.id()) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for (path, ns) in host_netns(proc_dir, own) {
        let Ok(Ok(addrs)) = ns.run(|| {
            nix::ifaddrs::getifaddrs().map(|a| a.filter_map(|i| i.address).collect::<Vec<_>>())
        }) else {
            continue;
        };
        let ips: Vec<std::net::IpAddr> = addrs
            .iter()
            .filter_map(|s| {
                s.as_sockaddr_in()
                    .map(|v| v.ip().into())
                    .or_else(|| s.as_sockaddr_in6().map(|v| v.ip().into()))
            })
            .collect();
        // A netns held by a process of a Kubernetes pod belongs to that pod
        // only: its cgroup names the pod's UID.
        let owner = Some(path.as_path())
            .filter(|p| p.starts_with(proc_dir))
            .and_then(Path::parent)
            .and_then(Path::parent)
            .and_then(|pid_dir| std::fs::read_to_string(pid_dir.join("cgroup")).ok())
            .and_then(|text| pod_uid_from_cgroup(&text));
        let Some(w) = owner_of(&wanted, &ips, owner.as_deref()) else {
            continue;
        };
        if found
            .iter()
            .any(|(r, _): &(PodRecord, Netns)| r.uid == w.uid)
        {
            continue;
        }
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

    #[test]
    fn pod_uid_comes_from_either_cgroup_driver() {
        let uid = "0d3e7c59-6a8b-4f57-9a0e-2f1c7b9d4e21";
        let systemd = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0d3e7c59_6a8b_4f57_9a0e_2f1c7b9d4e21.slice/cri-containerd-7f2a.scope\n";
        let cgroupfs =
            "12:memory:/kubepods/besteffort/pod0d3e7c59-6a8b-4f57-9a0e-2f1c7b9d4e21/4c1d\n0::/\n";
        assert_eq!(pod_uid_from_cgroup(systemd).as_deref(), Some(uid));
        assert_eq!(pod_uid_from_cgroup(cgroupfs).as_deref(), Some(uid));
        assert_eq!(
            pod_uid_from_cgroup("0::/user.slice/user-0.slice/session-3.scope\n"),
            None
        );
        assert_eq!(pod_uid_from_cgroup("0::/kubepods/podnothex/x\n"), None);
        assert_eq!(pod_uid_from_cgroup(""), None);
    }

    #[test]
    fn a_netns_belongs_to_the_pod_with_its_ip_and_its_cgroup_uid() {
        let pod = |uid: &str, ip: &str| Wanted {
            uid: uid.into(),
            name: uid.into(),
            namespace: "default".into(),
            service_account: "default".into(),
            ips: vec![ip.parse().unwrap()],
            overrides: Default::default(),
        };
        let (a, b) = (pod("uid-a", "10.0.0.2"), pod("uid-b", "10.0.0.3"));
        let wanted = [&a, &b];
        let ip = |s: &str| vec![s.parse::<std::net::IpAddr>().unwrap()];
        // By IP, when no pod process claims the netns.
        assert_eq!(
            owner_of(&wanted, &ip("10.0.0.3"), None).map(|w| &w.uid),
            Some(&b.uid)
        );
        // A process of another pod holds it: not this pod's, whatever its IPs.
        assert!(owner_of(&wanted, &ip("10.0.0.3"), Some("uid-a")).is_none());
        assert_eq!(
            owner_of(&wanted, &ip("10.0.0.2"), Some("uid-a")).map(|w| &w.uid),
            Some(&a.uid)
        );
        // No IP of a wanted pod: nobody's.
        assert!(owner_of(&wanted, &ip("10.0.0.9"), None).is_none());
    }
}
