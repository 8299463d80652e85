//! The agent's pods: the record of one enrolled pod as the state file keeps
//! it, the in-memory table the ZDS snapshot is read from, and the state file
//! itself (written atomically and again after a failed write, read record
//! by record). No rules, no ZDS.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use serde::{Deserialize, Serialize};

use crate::backoff::Backoff;
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

/// Writes `records` to the state file atomically (0600): the file holds
/// either the old list or the new one, never a part.
fn save_state(path: &Path, records: &[PodRecord]) -> Result<(), install::InstallError> {
    let text = serde_json::to_string_pretty(records).unwrap_or_else(|_| "[]".into());
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    install::write_atomic(path, text.as_bytes(), 0o600)
}

/// First and longest wait before writing the state file again after a failed write.
const SAVE_AGAIN_FIRST: Duration = Duration::from_millis(500);
const SAVE_AGAIN_MAX: Duration = Duration::from_secs(30);

/// The state file, kept in line with the store. Each save writes the pods
/// as held at that moment. A failed write (a full or read-only disk) costs
/// the pods nothing, since the agent serves from memory; it is logged and
/// counted, and the file is written again with backoff until a write
/// succeeds, with no pod change needed to bring it up to date.
pub(super) struct StateFile {
    path: PathBuf,
    store: Arc<PodStore>,
    /// Held from reading the pods until the file is renamed into place, so
    /// that of two saves the later reading is the one left on disk. True
    /// while the file lags the store (the last write failed).
    behind: Mutex<bool>,
    /// Wakes [`StateFile::write_again`] after a failed write.
    failed: tokio::sync::Notify,
    /// `ambit_agent_state_write_failures_total`.
    failures: Counter,
}

impl StateFile {
    pub(super) fn new(path: PathBuf, store: Arc<PodStore>, failures: Counter) -> Self {
        StateFile {
            path,
            store,
            behind: Mutex::new(false),
            failed: tokio::sync::Notify::new(),
            failures,
        }
    }

    /// Writes the store's pods now. On failure the pods stay served and
    /// [`StateFile::write_again`] takes over.
    pub(super) fn save(&self) {
        if let Err(e) = self.write() {
            tracing::error!(file = %self.path.display(), error = %e, "agent state not saved; pods are served from memory, and the file is written again until it succeeds");
            self.failed.notify_one();
        }
    }

    /// One write of the pods as held now, counted if it fails.
    fn write(&self) -> Result<(), install::InstallError> {
        let mut behind = self.behind.lock().unwrap_or_else(|e| e.into_inner());
        let written = save_state(&self.path, &self.store.records());
        match &written {
            Ok(()) if *behind => {
                tracing::info!(file = %self.path.display(), "agent state saved again; the file is up to date")
            }
            Ok(()) => {}
            Err(_) => {
                self.failures.inc();
            }
        }
        *behind = written.is_err();
        written
    }

    fn is_behind(&self) -> bool {
        *self.behind.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After each failed save: writes again, waiting 0.5 s doubling up to
    /// 30 s (jittered) between tries, until the file is up to date (by one
    /// of these writes or by a save of a pod change). Runs for the agent's life.
    pub(super) async fn write_again(self: Arc<Self>) {
        loop {
            self.failed.notified().await;
            let mut backoff = Backoff::new(SAVE_AGAIN_FIRST, SAVE_AGAIN_MAX);
            let mut tries = 0u32;
            while self.is_behind() {
                tokio::time::sleep(backoff.next_delay()).await;
                tries += 1;
                if let Err(e) = self.write() {
                    tracing::warn!(file = %self.path.display(), tries, error = %e, "agent state still not saved; trying again");
                }
            }
        }
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

    fn record(uid: &str, netns: &Netns) -> PodRecord {
        PodRecord {
            uid: uid.into(),
            name: uid.into(),
            namespace: "default".into(),
            service_account: "default".into(),
            netns_path: netns.path().to_path_buf(),
            netns_id: netns.id().unwrap(),
            ips: vec!["10.0.0.5/24".into()],
            overrides: Default::default(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_write_is_counted_and_written_again_with_no_pod_change() {
        let dir = std::env::temp_dir().join(format!("ambit-state-again-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A file where the state file's directory should be: every write fails.
        let blocker = dir.join("state");
        std::fs::write(&blocker, "not a directory").unwrap();
        let path = blocker.join("agent-state.json");
        let store = Arc::new(PodStore::default());
        let failures = Counter::default();
        let state = Arc::new(StateFile::new(
            path.clone(),
            store.clone(),
            failures.clone(),
        ));
        tokio::spawn(state.clone().write_again());
        let here = Netns::current().unwrap();
        store.insert(record("uid-a", &here), here.clone());
        state.save();
        assert_eq!(failures.get(), 1);
        assert!(state.is_behind());
        // Tried again on its own (the first wait is at most 0.75 s).
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(failures.get() >= 2, "{} tries", failures.get());
        std::fs::remove_file(&blocker).unwrap();
        let start = tokio::time::Instant::now();
        while state.is_behind() {
            assert!(
                start.elapsed() < SAVE_AGAIN_MAX * 2,
                "never written once writes work again"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let saved: Vec<String> = load_state(&path).into_iter().map(|(r, _)| r.uid).collect();
        assert_eq!(saved, ["uid-a"]);
        let tries = failures.get();
        tokio::time::sleep(SAVE_AGAIN_MAX * 2).await;
        assert_eq!(failures.get(), tries, "no more writes once up to date");
        std::fs::remove_dir_all(&dir).ok();
    }

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
