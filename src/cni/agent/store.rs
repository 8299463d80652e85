//! The agent's pods: the record of one enrolled pod as the state file keeps
//! it, the in-memory table the ZDS snapshot is read from, and the state file
//! itself (written atomically, read record by record). No rules, no ZDS.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cni::install;
use crate::cni::kube;
use crate::cni::zds_server::{PodSource, ZdsPod};
use crate::netns::Netns;

/// One enrolled pod, as kept in the state file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PodRecord {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub netns_path: PathBuf,
    /// (device, inode) of the netns, to tell a reused path from the same pod.
    pub netns_id: (u64, u64),
    pub ips: Vec<String>,
    /// Per-pod changes to the redirection rules (from its annotations).
    #[serde(default)]
    pub overrides: kube::RuleOverrides,
}

impl PodRecord {
    pub(super) fn ip_addrs(&self) -> Vec<std::net::IpAddr> {
        self.ips
            .iter()
            .filter_map(|a| a.split('/').next()?.parse().ok())
            .collect()
    }
}

struct Enrolled {
    record: PodRecord,
    netns: Netns,
    /// When this agent process took the pod (restored pods: at start).
    since: std::time::Instant,
    /// Whether the Kubernetes watch has shown this pod since.
    seen: bool,
}

impl Enrolled {
    fn new(record: PodRecord, netns: Netns) -> Self {
        Enrolled {
            record,
            netns,
            since: std::time::Instant::now(),
            seen: false,
        }
    }
}

/// The agent's pods; the ZDS snapshot is read from here.
#[derive(Default)]
pub struct PodStore {
    pods: Mutex<BTreeMap<String, Enrolled>>,
}

impl PodSource for PodStore {
    fn pods(&self) -> Vec<ZdsPod> {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.values()
            .map(|p| ZdsPod {
                uid: p.record.uid.clone(),
                name: p.record.name.clone(),
                namespace: p.record.namespace.clone(),
                service_account: p.record.service_account.clone(),
                netns: p.netns.clone(),
            })
            .collect()
    }
}

impl PodStore {
    pub(super) fn records(&self) -> Vec<PodRecord> {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|p| p.record.clone())
            .collect()
    }

    pub(super) fn insert(&self, record: PodRecord, netns: Netns) {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(record.uid.clone(), Enrolled::new(record, netns));
    }

    /// How long the agent has held the pod `uid`.
    pub(super) fn held_for(&self, uid: &str) -> Option<Duration> {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.get(uid).map(|p| p.since.elapsed())
    }

    /// Notes that the watch shows the pod `uid`.
    pub(super) fn mark_seen(&self, uid: &str) {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pods.get_mut(uid) {
            p.seen = true;
        }
    }

    pub(super) fn was_seen(&self, uid: &str) -> bool {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.get(uid).is_some_and(|p| p.seen)
    }

    /// The record and netns of the pod `uid`, if held.
    pub(super) fn get(&self, uid: &str) -> Option<(PodRecord, Netns)> {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.get(uid).map(|p| (p.record.clone(), p.netns.clone()))
    }

    pub(super) fn remove(&self, uid: &str) {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(uid);
    }
}

/// Writes `records` to the state file atomically (0600); an error is logged
/// and the agent keeps serving from memory.
pub(super) fn save_state(path: &Path, records: &[PodRecord]) {
    let text = serde_json::to_string_pretty(records).unwrap_or_else(|_| "[]".into());
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Err(e) = install::write_atomic(path, text.as_bytes(), 0o600) {
        tracing::error!(error = %e, "cannot save agent state");
    }
}

/// Reads the state file and reopens each pod's netns; stale entries are dropped.
///
/// Record by record: one that does not parse (say, written by another
/// version) costs only that pod. A file that is not a list at all is moved
/// aside (`<file>.<unix time>.bad`), as is one that cannot be read, so the
/// next save does not erase what it held.
pub fn load_state(path: &Path) -> Vec<(PodRecord, Netns)> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            set_aside(path, &e.to_string());
            return Vec::new();
        }
    };
    let entries: Vec<serde_json::Value> = match serde_json::from_str(&text) {
        Ok(r) => r,
        Err(e) => {
            set_aside(path, &e.to_string());
            return Vec::new();
        }
    };
    entries
        .into_iter()
        .filter_map(|v| match serde_json::from_value::<PodRecord>(v) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e, "a pod record of the agent state is unreadable; skipped");
                None
            }
        })
        .filter_map(|r| {
            let ns = Netns::open(&r.netns_path).ok()?;
            (ns.id().ok()? == r.netns_id).then_some((r, ns))
        })
        .collect()
}

/// Moves an unreadable state file out of the way of the next save.
fn set_aside(path: &Path, why: &str) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let mut aside = path.as_os_str().to_owned();
    aside.push(format!(".{secs}.bad"));
    let moved = std::fs::rename(path, &aside);
    tracing::error!(file = %path.display(), error = why, moved_to = %Path::new(&aside).display(), moved = moved.is_ok(), "agent state unreadable; starting empty");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreadable_record_costs_only_its_pod_and_a_broken_file_is_kept_aside() {
        let dir = std::env::temp_dir().join(format!("ambit-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("agent-state.json");
        let here = Netns::current().unwrap();
        let good = PodRecord {
            uid: "uid-good".into(),
            name: "good".into(),
            namespace: "default".into(),
            service_account: "default".into(),
            netns_path: here.path().to_path_buf(),
            netns_id: here.id().unwrap(),
            ips: vec!["10.0.0.5/24".into()],
            overrides: Default::default(),
        };
        let bad = serde_json::json!({"uid": "uid-bad", "name": 7});
        let text = serde_json::to_string(&[serde_json::to_value(&good).unwrap(), bad]).unwrap();
        std::fs::write(&path, text).unwrap();
        let loaded: Vec<PodRecord> = load_state(&path).into_iter().map(|(r, _)| r).collect();
        assert_eq!(loaded, vec![good], "the good record survives the bad one");

        let aside = || {
            std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.to_string_lossy().ends_with(".bad"))
                .collect::<Vec<_>>()
        };
        std::fs::write(&path, "[{\"uid\": \"cut short").unwrap();
        assert!(load_state(&path).is_empty());
        assert!(
            !path.exists(),
            "the broken file is moved away from the next save"
        );
        let kept = aside();
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert_eq!(
            std::fs::read_to_string(&kept[0]).unwrap(),
            "[{\"uid\": \"cut short",
            "and kept"
        );
        std::fs::remove_file(&kept[0]).unwrap();
        // Not text at all: kept aside too, not overwritten.
        std::fs::write(&path, [0xff, 0xfe, 0x00]).unwrap();
        assert!(load_state(&path).is_empty());
        assert!(!path.exists() && aside().len() == 1);
        std::fs::remove_dir_all(&dir).ok();
    }
}
