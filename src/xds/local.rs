//! The local config source: ztunnel's local-config YAML (workloads, services,
//! policies) read from a file, turned into a [`State`], and watched.
//!
//! An edit that parses replaces the state in one swap; an edit that does not
//! parse is logged with the file, line and reason, and the previous state
//! stays in force. Nothing here touches sockets.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use super::store::{State, StateHandle};
use super::types::{Authorization, Service, Workload};

/// The file format (ztunnel's `LocalConfig`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalConfig {
    #[serde(default)]
    pub workloads: Vec<Workload>,
    #[serde(default)]
    pub services: Vec<Service>,
    #[serde(default)]
    pub policies: Vec<Authorization>,
}

/// Why a local config file was rejected.
#[derive(Debug, thiserror::Error)]
pub enum LocalConfigError {
    #[error("local config {path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("local config {path}: {reason}")]
    Parse {
        path: PathBuf,
        line: Option<usize>,
        reason: String,
    },
    #[error("local config {path}: {}", .errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Invalid {
        path: PathBuf,
        errors: Vec<super::store::ResourceError>,
    },
}

/// What a file with a resource the state cannot hold does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnBadResource {
    /// The whole file is rejected (a proxy's own config: all or nothing).
    RejectFile,
    /// That resource is refused and held as refused, the rest applied (a
    /// control plane, which sends istiod's resources as they are, Ambit
    /// can serve them or not: the proxy decides).
    RefuseIt,
}

/// Parses the text of a local config file into a state.
pub fn parse(path: &Path, text: &str) -> Result<State, LocalConfigError> {
    parse_as(path, text, OnBadResource::RejectFile)
}

/// [`parse`], with a bad resource handled as `on_bad` says.
pub fn parse_as(path: &Path, text: &str, on_bad: OnBadResource) -> Result<State, LocalConfigError> {
    let cfg: LocalConfig = if text.trim().is_empty() {
        LocalConfig::default()
    } else {
        serde_yaml::from_str(text).map_err(|e| LocalConfigError::Parse {
            path: path.to_path_buf(),
            line: e.location().map(|l| l.line()),
            reason: e.to_string(),
        })?
    };
    let (st, errors) = State::build_lenient(cfg.workloads, cfg.services, cfg.policies);
    if errors.is_empty() {
        return Ok(st);
    }
    match on_bad {
        OnBadResource::RejectFile => Err(LocalConfigError::Invalid {
            path: path.to_path_buf(),
            errors,
        }),
        OnBadResource::RefuseIt => {
            for e in errors {
                tracing::warn!(file = %path.display(), resource = %e.resource, reason = %e.reason, "local config resource held as refused");
            }
            Ok(st)
        }
    }
}

/// Reads and parses the file.
pub fn load(path: &Path) -> Result<State, LocalConfigError> {
    load_as(path, OnBadResource::RejectFile)
}

/// [`load`], with a bad resource handled as `on_bad` says.
pub fn load_as(path: &Path, on_bad: OnBadResource) -> Result<State, LocalConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| LocalConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_as(path, &text, on_bad)
}

/// What identifies one version of the file on disk.
fn stamp(path: &Path) -> Option<(SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

/// How often the file is checked for changes where its directory cannot be
/// watched at all (it is watched with inotify otherwise, see `watch`).
pub const WATCH_INTERVAL: Duration = Duration::from_millis(200);

/// Watches `path` forever, swapping each good version into `state`.
///
/// The file's directory is watched with inotify ([`crate::watch`]): an idle
/// proxy does not wake for it. On each change in the directory the file's
/// (mtime, size, inode) is compared, which tells in-place edits, editor
/// rename-over saves and Kubernetes ConfigMap symlink swaps from changes to
/// other files.
pub async fn watch(path: PathBuf, state: StateHandle) {
    watch_as(path, state, OnBadResource::RejectFile).await
}

/// [`watch`], with a bad resource handled as `on_bad` says.
pub async fn watch_as(path: PathBuf, state: StateHandle, on_bad: OnBadResource) {
    let mut last = stamp(&path);
    let mut watch = match crate::watch::FileWatch::new(&path) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, every = ?WATCH_INTERVAL, "cannot watch the local config's directory; checking the file on a timer");
            None
        }
    };
    let mut ticker = tokio::time::interval(WATCH_INTERVAL);
    loop {
        match &mut watch {
            Some(w) => {
                if !w.changed().await {
                    watch = None;
                }
            }
            None => {
                ticker.tick().await;
            }
        }
        let now = stamp(&path);
        if now == last {
            continue;
        }
        last = now;
        match load_as(&path, on_bad) {
            Ok(new) => {
                let (w, s, p) = (
                    new.workloads().count(),
                    new.services().count(),
                    new.policies().count(),
                );
                state.store(new);
                tracing::info!(file = %path.display(), workloads = w, services = s, policies = p, "local config applied");
            }
            Err(e) => {
                let line = match &e {
                    LocalConfigError::Parse { line, .. } => *line,
                    _ => None,
                };
                tracing::error!(file = %path.display(), line, error = %e, "local config rejected; previous state stays in force");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xds::types::Protocol;

    const GOOD: &str = r#"
workloads:
- uid: cluster1//Pod/default/client
  name: client
  namespace: default
  serviceAccount: client-sa
  workloadIps: ["10.0.0.2"]
  protocol: HBONE
  node: node1
- name: server
  namespace: default
  workloadIps: ["10.0.0.3"]
  protocol: HBONE
  services:
    "default/echo.default.svc.cluster.local":
      80: 8080
- name: legacy
  namespace: other
  workloadIps: ["10.0.0.4"]
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/10.96.0.10"]
  ports:
    80: 8080
policies:
- name: deny-legacy
  namespace: default
  scope: Namespace
  action: Deny
  rules:
  - - - namespaces: [!Exact other, {Prefix: oth}]
"#;

    #[test]
    fn parses_ztunnel_local_config() {
        let st = parse(Path::new("mesh.yaml"), GOOD).unwrap();
        let client = st
            .workload_by_addr("", "10.0.0.2".parse().unwrap())
            .unwrap();
        assert_eq!(client.service_account, "client-sa");
        assert_eq!(client.protocol, Protocol::Hbone);
        assert_eq!(
            client.identity("cluster.local").to_string(),
            "spiffe://cluster.local/ns/default/sa/client-sa"
        );
        let legacy = st
            .workload_by_addr("", "10.0.0.4".parse().unwrap())
            .unwrap();
        assert_eq!(legacy.protocol, Protocol::Tcp);
        assert_eq!(legacy.service_account, "default");
        let svc = st
            .service_by_vip("", "10.96.0.10".parse().unwrap(), None)
            .unwrap();
        assert_eq!(svc.ports[&80], 8080);
        let eps: Vec<_> = st.healthy_endpoints(svc).collect();
        assert_eq!(eps.len(), 1);
        assert_eq!(eps[0].workload.name, "server");
        assert_eq!(st.policies().count(), 1);
    }

    #[test]
    fn syntax_error_names_the_line() {
        let text = "workloads:\n- name: a\n  namespace: b\n  workloadIps: [\"10.0.0.300\"]\n";
        let err = parse(Path::new("m.yaml"), text).unwrap_err();
        match &err {
            LocalConfigError::Parse { line, .. } => assert_eq!(*line, Some(4)),
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().starts_with("local config m.yaml:"), "{err}");
        let err = parse(
            Path::new("m.yaml"),
            "workloads:\n- name: a\n  namespace: b\n  colour: red\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `colour`"), "{err}");
    }

    #[test]
    fn conflicts_are_rejected_with_the_resource_named() {
        let text = "services:\n- {name: a, namespace: n, hostname: h.n, vips: [\"/10.96.0.1\"]}\n- {name: b, namespace: n, hostname: h.n, vips: [\"/10.96.0.2\"]}\n";
        let err = parse(Path::new("m.yaml"), text).unwrap_err().to_string();
        assert!(
            err.contains("services[1] (n/h.n): service n/h.n is defined twice"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn watch_applies_good_edits_and_keeps_state_on_bad_ones() {
        let dir = std::env::temp_dir().join(format!("ambit-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mesh.yaml");
        std::fs::write(&path, "workloads: []\n").unwrap();
        let handle = StateHandle::new(load(&path).unwrap());
        let task = tokio::spawn(watch(path.clone(), handle.clone()));
        tokio::time::sleep(Duration::from_millis(50)).await;
        std::fs::write(&path, GOOD).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while handle.load().workloads().count() != 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "edit not applied within 1s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::fs::write(&path, "workloads: [ {{{").unwrap();
        tokio::time::sleep(WATCH_INTERVAL * 3).await;
        assert_eq!(
            handle.load().workloads().count(),
            3,
            "bad edit must not replace state"
        );
        task.abort();
        std::fs::remove_dir_all(&dir).ok();
    }
}
