//! With `enroll: kubernetes`: brings the held pods in line with the API
//! server (label flips, deletions, pods that started without a CNI ADD), the
//! redirection annotations in line with the held pods, and the files the
//! plugin reads while no agent runs. Level-triggered and retried.

use std::path::Path;
use std::time::{Duration, Instant};

use super::discover::find_netns;
use super::Agent;
use crate::backoff::Backoff;
use crate::cni::install;
use crate::cni::kube::{self, Cluster, Wanted};
use crate::cni::plugin::{AMBIENT_NAMESPACES_FILE, PLUGIN_KUBECONFIG_FILE};
use crate::netns::Netns;

/// How long a pod the agent took must be missing from the watch before it
/// counts as deleted (the watch can lag a CNI ADD that looked the pod up).
const WATCH_LAG: Duration = Duration::from_secs(10);
/// Longest wait between looks for the netns of a pod the API wants enrolled.
const MAX_RETRY: Duration = Duration::from_secs(30);

impl Agent {
    /// Puts off the next try for pod `uid`: 1 s, doubling up to [`MAX_RETRY`], jittered.
    fn back_off(&self, uid: &str) -> Duration {
        let mut retry = self.retry.lock().unwrap_or_else(|e| e.into_inner());
        let (at, backoff) = retry.entry(uid.to_string()).or_insert_with(|| {
            (
                Instant::now(),
                Backoff::new(Duration::from_secs(1), MAX_RETRY),
            )
        });
        let delay = backoff.next_delay();
        *at = Instant::now() + delay;
        delay
    }

    /// Whether the agent is exiting: a pass then starts no other pod's work.
    fn stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    /// Brings the held pods in line with the API (label flips, deletions,
    /// pods that started without a CNI ADD) and the redirection annotations
    /// in line with the held pods. Level-triggered: run after every watch
    /// event and every tick, so failures are retried.
    pub(super) async fn reconcile(&self) {
        let Some(cluster) = &self.cluster else { return };
        let excluded = &self.cfg.exclude_namespaces;
        let token = self.plugin_token(cluster).await;
        self.write_plugin_files(token.as_deref());
        let watched = cluster.pods();
        // Held pods the API no longer wants: relabelled, finished or deleted.
        for rec in self.store.records() {
            if self.stopping() {
                return;
            }
            let pod = watched
                .iter()
                .find(|p| p.metadata.uid.as_deref() == Some(rec.uid.as_str()));
            let drop = match pod {
                Some(p) => {
                    self.store.mark_seen(&rec.uid);
                    !cluster.should_enroll(p, excluded)
                }
                // Deleted: gone from the watch that showed it, or never shown
                // (the watch can lag a CNI ADD that looked the pod up).
                None if self.store.was_seen(&rec.uid) => true,
                None if self.store.held_for(&rec.uid).unwrap_or_default() > WATCH_LAG => {
                    // The watch still lags: ask the API server itself.
                    match cluster.get_pod(&rec.namespace, &rec.name).await {
                        Ok(Some(p)) if p.metadata.uid.as_deref() == Some(rec.uid.as_str()) => {
                            !cluster.should_enroll(&p, excluded)
                        }
                        Ok(_) => true,
                        Err(e) => {
                            tracing::warn!(uid = %rec.uid, error = %e, "cannot confirm the pod with the API server; keeping it");
                            false
                        }
                    }
                }
                None => false,
            };
            if !drop {
                continue;
            }
            let alive = Netns::open(&rec.netns_path)
                .and_then(|n| n.id())
                .is_ok_and(|id| id == rec.netns_id);
            {
                let _guard = self.ops.lock().await;
                self.remove(&rec.uid, alive).await;
            }
            // Not under `ops`: an ADD or the reaper need not wait on the API.
            if pod.is_some() {
                if let Err(e) = cluster.annotate(&rec.namespace, &rec.name, None).await {
                    tracing::warn!(uid = %rec.uid, error = %e, "redirection annotation not removed yet; will retry");
                }
            }
        }
        // Pods the API wants that the agent does not hold (no CNI ADD reached
        // it: they predate it, or a label flipped on a running pod).
        let held = self.store.records();
        let now = Instant::now();
        let missing: Vec<Wanted> = {
            let mut retry = self.retry.lock().unwrap_or_else(|e| e.into_inner());
            let missing: Vec<Wanted> = watched
                .iter()
                .filter(|p| cluster.should_enroll(p, excluded))
                .map(|p| kube::wanted(p))
                .filter(|w| !w.ips.is_empty() && !held.iter().any(|h| h.uid == w.uid))
                .collect();
            retry.retain(|uid, _| missing.iter().any(|w| &w.uid == uid));
            missing
                .into_iter()
                .filter(|w| retry.get(&w.uid).is_none_or(|(at, _)| *at <= now))
                .collect()
        };
        if !missing.is_empty() {
            let look = missing.clone();
            let proc_dir = self.cfg.host_proc.clone();
            let found = tokio::task::spawn_blocking(move || find_netns(&proc_dir, &look))
                .await
                .unwrap_or_default();
            for w in &missing {
                if found.iter().any(|(r, _)| r.uid == w.uid) {
                    continue;
                }
                let delay = self.back_off(&w.uid);
                tracing::debug!(pod = %format!("{}/{}", w.namespace, w.name), ?delay, "netns not found on this host yet");
            }
            for (record, netns) in found {
                if self.stopping() {
                    return;
                }
                let _guard = self.ops.lock().await;
                if self.store.held_for(&record.uid).is_some() {
                    continue;
                }
                let pod = format!("{}/{}", record.namespace, record.name);
                let uid = record.uid.clone();
                match self.enroll_pod(record, netns).await {
                    Ok(()) => {
                        tracing::info!(pod = %pod, "running pod enrolled after its labels selected it")
                    }
                    Err(e) => {
                        let delay = self.back_off(&uid);
                        tracing::warn!(pod = %pod, error = %e, ?delay, "running pod not enrolled; will retry")
                    }
                }
            }
        }
        // Annotations follow what the agent holds.
        let held = self.store.records();
        for p in &watched {
            if self.stopping() {
                return;
            }
            let uid = p.metadata.uid.as_deref().unwrap_or_default();
            let is_held = held.iter().any(|h| h.uid == uid);
            let want = is_held.then_some("enabled");
            let has = kube::redirection(p);
            // Only the value this agent writes is ever taken away.
            if has == want || (!is_held && has != Some("enabled")) {
                continue;
            }
            let (ns, name) = (
                p.metadata.namespace.as_deref().unwrap_or("default"),
                p.metadata.name.as_deref().unwrap_or_default(),
            );
            if let Err(e) = cluster.annotate(ns, name, want).await {
                tracing::warn!(pod = %format!("{ns}/{name}"), error = %e, "redirection annotation not updated; will retry");
            }
        }
    }
}

/// The kubeconfig for the plugin: the agent's own (`KUBECONFIG`), or one
/// built from the in-cluster service account, with that account's CA to be
/// written beside it at `ca_path` (the run dir has the same path on the host).
fn plugin_kubeconfig(ca_path: &Path, token: Option<&str>) -> Option<(String, Option<Vec<u8>>)> {
    if let Some(path) = std::env::var_os("KUBECONFIG").filter(|p| !p.is_empty()) {
        let first = std::env::split_paths(&path).next()?;
        let text = std::fs::read_to_string(first).ok()?;
        return Some((with_token(&text, token)?, None));
    }
    let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
    let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
    let sa = Path::new("/var/run/secrets/kubernetes.io/serviceaccount");
    let token = match token {
        Some(t) => t.to_string(),
        None => std::fs::read_to_string(sa.join("token")).ok()?,
    };
    let ca = std::fs::read(sa.join("ca.crt")).ok()?;
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: cluster\n  cluster:\n    server: \"https://{host}:{port}\"\n    certificate-authority: \"{}\"\nusers:\n- name: ambit-cni\n  user:\n    token: \"{}\"\ncontexts:\n- name: ambit-cni\n  context:\n    cluster: cluster\n    user: ambit-cni\ncurrent-context: ambit-cni\n",
        ca_path.display(),
        token.trim()
    );
    Some((text, Some(ca)))
}

/// The agent's own kubeconfig `text` with every user's credentials
/// replaced by `token`, if there is one.
fn with_token(text: &str, token: Option<&str>) -> Option<String> {
    let Some(token) = token else {
        return Some(text.to_string());
    };
    let mut config: serde_yaml::Value = serde_yaml::from_str(text).ok()?;
    for user in config["users"].as_sequence_mut()? {
        user["user"] =
            serde_yaml::to_value(std::collections::BTreeMap::from([("token", token)])).ok()?;
    }
    serde_yaml::to_string(&config).ok()
}

/// How long the plugin's own token is asked for (renewed at half).
const PLUGIN_TOKEN_LIFE: Duration = Duration::from_secs(24 * 3600);

/// The CA of the API server, beside the plugin's kubeconfig in the run dir.
const PLUGIN_CA_FILE: &str = "plugin-ca.crt";

/// The files the agent leaves in `run_dir` for the plugin: the kubeconfig
/// (which holds the agent's token) and the API server's CA; and the list of
/// ambient namespaces older agents left, removed with them. Only the
/// agent's container mounts the run dir; the proxy's pod mounts the ZDS
/// socket's directory alone.
fn plugin_files(run_dir: &Path) -> [std::path::PathBuf; 3] {
    [
        run_dir.join(AMBIENT_NAMESPACES_FILE),
        run_dir.join(PLUGIN_KUBECONFIG_FILE),
        run_dir.join(PLUGIN_CA_FILE),
    ]
}

/// Removes the files [`plugin_files`] names (on uninstall: the token must not
/// outlive the agent on the node). Returns those that could not be removed.
pub(super) fn remove_plugin_files(run_dir: &Path) -> Vec<(std::path::PathBuf, std::io::Error)> {
    plugin_files(run_dir)
        .into_iter()
        .filter_map(|path| match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Some((path, e)),
            _ => None,
        })
        .collect()
}

impl Agent {
    /// Keeps the files the plugin reads while no agent runs current (0600,
    /// rewritten only when they change): a kubeconfig to ask the API server
    /// whether a pod is enrolled.
    /// The token the plugin's kubeconfig carries: one of the agent's own
    /// ServiceAccount bound to no pod ([`Cluster::plugin_token`]), asked
    /// again once half its life has passed; `None` (the plugin then gets the
    /// agent pod's token, with a warning) when the account is not known or
    /// the API refuses.
    async fn plugin_token(&self, cluster: &Cluster) -> Option<String> {
        let account = &self.cfg.service_account;
        if account.is_empty() {
            return None;
        }
        let now = std::time::Instant::now();
        {
            let held = self.plugin_token.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((token, renew_at)) = held.as_ref() {
                if now < *renew_at {
                    return Some(token.clone());
                }
            }
        }
        match cluster
            .plugin_token(&self.cfg.pod_namespace, account, PLUGIN_TOKEN_LIFE)
            .await
        {
            Ok((token, life)) => {
                // Asked again at half its life; a refused renewal keeps the
                // one in hand and is tried again a minute later.
                let renew_at = now + (life / 2).max(Duration::from_secs(60));
                *self.plugin_token.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((token.clone(), renew_at));
                tracing::debug!(account = %account, life = ?life, "CNI plugin token issued");
                Some(token)
            }
            Err(e) => {
                let mut held = self.plugin_token.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((token, renew_at)) = held.as_mut() {
                    *renew_at = now + Duration::from_secs(60);
                    tracing::warn!(error = %e, "CNI plugin token not renewed; the current one stays");
                    return Some(token.clone());
                }
                tracing::warn!(error = %e, "no token of its own for the CNI plugin: it gets the agent pod's, which the API server refuses once this pod is deleted");
                None
            }
        }
    }

    fn write_plugin_files(&self, token: Option<&str>) {
        let [namespaces, kubeconfig_path, ca_path] = plugin_files(&self.cfg.run_dir);
        // Older agents' list, which could start a pod labelled ambient in a
        // plain namespace outside the mesh: gone.
        if let Err(e) = std::fs::remove_file(&namespaces) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(file = %namespaces.display(), error = %e, "old list of ambient namespaces not removed");
            }
        }
        let mut files = Vec::new();
        if let Some((kubeconfig, ca)) = plugin_kubeconfig(&ca_path, token) {
            files.extend(ca.map(|ca| (ca_path, ca)));
            files.push((kubeconfig_path, kubeconfig.into_bytes()));
        }
        for (path, contents) in files {
            if let Err(e) = install::write_if_changed(&path, &contents, 0o600) {
                tracing::warn!(file = %path.display(), error = %e, "file for the plugin not written");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uninstall_leaves_no_token_in_the_run_dir_and_only_removes_the_plugin_files() {
        let dir = std::env::temp_dir().join(format!("ambit-plugin-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for path in plugin_files(&dir) {
            install::write_atomic(&path, b"secret", 0o600).unwrap();
        }
        let other = dir.join("agent-owned-file");
        std::fs::write(&other, "kept").unwrap();
        assert!(remove_plugin_files(&dir).is_empty());
        assert!(
            !dir.join(PLUGIN_KUBECONFIG_FILE).exists(),
            "the kubeconfig holding the agent's token is gone"
        );
        assert!(plugin_files(&dir).iter().all(|p| !p.exists()));
        assert!(other.exists(), "nothing else is touched");
        assert!(
            remove_plugin_files(&dir).is_empty(),
            "files already gone are no error"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
