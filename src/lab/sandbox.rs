//! Pod sandboxes as kubelet leaves them on a node: a pod's netns is held by
//! a process of the pod (here a `sleep infinity` standing in for the pause
//! container) that sits in a cgroup whose path names the pod's UID the way
//! kubelet's cgroupfs driver writes it (`<lab id>/kubepods/pod<uid>`). The
//! agent finds a pod that predates it, or whose labels flip, only through
//! such a process, so every lab pod has one. This file owns the UIDs the lab
//! gives its pods, the lab's cgroups and the holder processes; it decides
//! nothing about enrollment.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::netns::Netns;

/// The UID the lab gives pod `name`: shaped like a Kubernetes UID (a UUID)
/// and the same on every call, so that the CNI arguments, the fake API
/// server's pod and the sandbox's cgroup all carry the same one. Pods of one
/// name in two labs share it; the agent tells them apart by their IPs.
pub fn pod_uid(name: &str) -> String {
    // FNV-1a from two bases: the same on every Rust release, unlike std's hasher.
    let fnv = |basis: u64| {
        name.bytes().fold(basis, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    };
    let hex = format!(
        "{:016x}{:016x}",
        fnv(0xcbf2_9ce4_8422_2325),
        fnv(0x8422_2325_cbf2_9ce4)
    );
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// Where the lab puts its pods' cgroups, from a `/proc/self/mountinfo`
/// text: the cgroup v2 hierarchy, or on a host with only v1 the
/// controller-less `name=systemd` one.
fn cgroup_mount(mountinfo: &str) -> Option<PathBuf> {
    // `<id> <parent> <dev> <root> <mount point> <options> [optional...] - <type> <source> <super options>`
    let mounts: Vec<(&str, &str, &str)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let point = left.split(' ').nth(4)?;
            let mut right = right.split(' ');
            let fstype = right.next()?;
            let options = right.nth(1).unwrap_or_default();
            Some((point, fstype, options))
        })
        .collect();
    let v1_named = |options: &str| options.split(',').any(|o| o == "name=systemd");
    mounts
        .iter()
        .find(|(_, fstype, _)| *fstype == "cgroup2")
        .or_else(|| {
            mounts
                .iter()
                .find(|(_, fstype, options)| *fstype == "cgroup" && v1_named(options))
        })
        .map(|(point, _, _)| PathBuf::from(*point))
}

/// One pod's sandbox: the process holding its netns, in the pod's cgroup.
struct Sandbox {
    netns_name: String,
    holder: Child,
    cgroup: PathBuf,
}

impl Sandbox {
    /// Kills and reaps the holder; the cgroup stays.
    fn stop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// The sandboxes of one lab, in `<cgroup mount>/<lab id>/kubepods/pod<uid>`.
/// Dropped, it kills every holder and removes the lab's cgroups.
pub(super) struct Sandboxes {
    lab_id: String,
    /// `<cgroup mount>/<lab id>`, once the first sandbox is made.
    root: Option<PathBuf>,
    held: Vec<Sandbox>,
}

impl Sandboxes {
    pub(super) fn new(lab_id: &str) -> Self {
        Sandboxes {
            lab_id: lab_id.to_string(),
            root: None,
            held: Vec::new(),
        }
    }

    /// Holds `ns` (the netns named `netns_name`) by a new process in the
    /// cgroup of pod `uid`.
    pub(super) fn hold(&mut self, netns_name: &str, ns: &Netns, uid: &str) -> io::Result<()> {
        let root = match self.root.clone() {
            Some(root) => root,
            None => {
                let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
                let mount = cgroup_mount(&mountinfo).ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::NotFound,
                        "no cgroup v2 (or v1 name=systemd) hierarchy is mounted: lab pods \
                         need one for their sandboxes, as kubelet does",
                    )
                })?;
                // Kept before anything is made, so a drop removes a partial tree.
                let root = mount.join(&self.lab_id);
                self.root = Some(root.clone());
                root
            }
        };
        let cgroup = root.join("kubepods").join(format!("pod{uid}"));
        let at = |e: io::Error, what: &str| {
            io::Error::new(e.kind(), format!("{what} {}: {e}", cgroup.display()))
        };
        std::fs::create_dir_all(&cgroup).map_err(|e| at(e, "pod cgroup"))?;
        let mut holder = match ns
            .command("sleep")
            .arg("infinity")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(child) => child,
            Err(e) => {
                remove_cgroup(&cgroup);
                return Err(at(e, "sandbox process for"));
            }
        };
        if let Err(e) = std::fs::write(cgroup.join("cgroup.procs"), holder.id().to_string()) {
            let _ = holder.kill();
            let _ = holder.wait();
            remove_cgroup(&cgroup);
            return Err(at(e, "moving the sandbox process into"));
        }
        self.held.push(Sandbox {
            netns_name: netns_name.to_string(),
            holder,
            cgroup,
        });
        Ok(())
    }

    /// Ends the sandbox holding the netns named `netns_name`, if any: its
    /// process is killed, and the pod's cgroup removed unless another
    /// sandbox of the pod is in it (kubelet's second sandbox for a pod
    /// shares the pod's cgroup with the first until that one goes).
    pub(super) fn release(&mut self, netns_name: &str) {
        let Some(at) = self.held.iter().position(|s| s.netns_name == netns_name) else {
            return;
        };
        let mut sandbox = self.held.remove(at);
        sandbox.stop();
        if !self.held.iter().any(|s| s.cgroup == sandbox.cgroup) {
            remove_cgroup(&sandbox.cgroup);
        }
    }
}

impl Drop for Sandboxes {
    fn drop(&mut self) {
        for s in &mut self.held {
            s.stop();
        }
        for s in &self.held {
            remove_cgroup(&s.cgroup);
        }
        if let Some(root) = &self.root {
            remove_cgroup(&root.join("kubepods"));
            remove_cgroup(root);
        }
    }
}

/// Removes an empty cgroup. The kernel can refuse (EBUSY) for a moment
/// after the last process in it is reaped.
fn remove_cgroup(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match std::fs::remove_dir(dir) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::agent::pod_uid_from_cgroup;

    #[test]
    fn a_lab_pod_uid_is_a_uuid_the_agent_reads_back_from_a_cgroup_path() {
        let uid = pod_uid("server");
        assert_eq!(uid, pod_uid("server"), "the same on every call");
        assert_ne!(uid, pod_uid("client"));
        let cgroup = format!("0::/ambit-node-1-0/kubepods/pod{uid}\n");
        assert_eq!(pod_uid_from_cgroup(&cgroup), Some(uid));
    }

    #[test]
    fn the_cgroup_v2_hierarchy_is_preferred_then_v1_name_systemd() {
        let hybrid = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw
";
        assert_eq!(
            cgroup_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let v1: String = hybrid.lines().take(3).map(|l| format!("{l}\n")).collect();
        assert_eq!(
            cgroup_mount(&v1),
            Some(PathBuf::from("/sys/fs/cgroup/systemd"))
        );
        let v2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(cgroup_mount(v2), Some(PathBuf::from("/sys/fs/cgroup")));
        assert_eq!(cgroup_mount("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"), None);
    }
}
