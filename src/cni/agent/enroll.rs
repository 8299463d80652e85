//! Enrolling and removing one pod: the decision on a CNI ADD (the node's
//! rule, the Kubernetes labels), then rules, ZDS Add and the state file in
//! that order, and the reverse on removal. Callers serialise through `ops`.

use std::path::{Path, PathBuf};

use serde_json::json;

use super::store::PodRecord;
use super::Agent;
use crate::cni::install;
use crate::cni::kube;
use crate::cni::plugin::{AddEvent, Enrollment};
use crate::cni::redirect::RedirectRules;
use crate::cni::zds_server::ZdsPod;
use crate::config::agent::{AgentConfig, EnrollRule};
use crate::netns::Netns;

/// Why an enrollment failed; the plugin shows it to the runtime.
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    /// `reason` names the netns path (as [`Netns::open`]'s errors do).
    #[error("pod {pod}: {reason}")]
    Netns {
        pod: String,
        path: String,
        reason: String,
    },
    #[error("pod {pod}: redirection rules: {reason}")]
    Rules { pod: String, reason: String },
    #[error("pod {pod}: proxy did not take the pod: {reason}")]
    Zds { pod: String, reason: String },
    #[error("pod {pod}: Kubernetes API: {reason}")]
    Kube { pod: String, reason: String },
}

/// The agent's own DaemonSet pods are named `<daemonset>-<suffix>`; this is `<daemonset>-`.
pub fn own_pod_prefix(pod_name: &str) -> String {
    match pod_name.rsplit_once('-') {
        Some((base, _)) if !base.is_empty() => format!("{base}-"),
        _ => String::new(),
    }
}

pub fn enrollment(cfg: &AgentConfig) -> Enrollment {
    match &cfg.enroll {
        EnrollRule::All => Enrollment::All,
        EnrollRule::None => Enrollment::None,
        EnrollRule::Namespaces(n) => Enrollment::Namespaces(n.clone()),
        EnrollRule::PodPattern(p) => Enrollment::PodPattern(p.clone()),
        EnrollRule::Kubernetes => Enrollment::Kubernetes {
            agent_namespace: cfg.pod_namespace.clone(),
            agent_pod_prefix: own_pod_prefix(&cfg.pod_name),
        },
    }
}

/// The plugin's entry in the conflist.
pub fn plugin_entry(cfg: &AgentConfig) -> serde_json::Value {
    let enroll = match &cfg.enroll {
        EnrollRule::All => json!({"mode": "all"}),
        EnrollRule::None => json!({"mode": "none"}),
        EnrollRule::Namespaces(n) => json!({"mode": "namespaces", "namespaces": n}),
        EnrollRule::PodPattern(p) => json!({"mode": "pod_pattern", "pod_pattern": p}),
        EnrollRule::Kubernetes => json!({
            "mode": "kubernetes",
            "agent_namespace": cfg.pod_namespace,
            "agent_pod_prefix": own_pod_prefix(&cfg.pod_name),
        }),
    };
    json!({
        "type": install::PLUGIN_TYPE,
        "name": install::PLUGIN_TYPE,
        "cni_agent_run_dir": cfg.run_dir,
        "exclude_namespaces": cfg.exclude_namespaces,
        "enroll": enroll,
    })
}

impl Agent {
    fn uid_of(ev: &AddEvent) -> String {
        [&ev.pod_uid, &ev.container_id]
            .into_iter()
            .find(|s| !s.is_empty())
            .cloned()
            .unwrap_or_else(|| format!("{}/{}", ev.pod_namespace, ev.pod_name))
    }

    /// The service account the local config gives this pod ("default" otherwise).
    fn service_account(&self, ev: &AddEvent) -> String {
        let Some(mesh) = &self.mesh else {
            return "default".into();
        };
        let state = mesh.load();
        let by_name = state
            .workload_by_name(&ev.pod_namespace, &ev.pod_name)
            .map(|w| w.service_account.to_string());
        let by_ip = || {
            ev.ips.iter().find_map(|ip| {
                let addr = ip.address.split('/').next()?.parse().ok()?;
                state
                    .workload_by_addr("", addr)
                    .map(|w| w.service_account.to_string())
            })
        };
        by_name.or_else(by_ip).unwrap_or_else(|| "default".into())
    }

    /// CNI ADD: decides whether the pod is enrolled, then enrolls it.
    pub async fn add(&self, ev: AddEvent) -> Result<(), EnrollError> {
        let pod = format!("{}/{}", ev.pod_namespace, ev.pod_name);
        if self.cfg.exclude_namespaces.contains(&ev.pod_namespace)
            || !self.enroll.selects(&ev.pod_namespace, &ev.pod_name)
        {
            tracing::info!(pod = %pod, "not enrolled by this node's rule; leaving it alone");
            return Ok(());
        }
        let mut uid = Self::uid_of(&ev);
        let mut service_account = self.service_account(&ev);
        let mut overrides = kube::RuleOverrides::default();
        if let Some(cluster) = &self.cluster {
            let kube_err = |reason: String| EnrollError::Kube {
                pod: pod.clone(),
                reason,
            };
            match cluster
                .lookup(
                    &ev.pod_namespace,
                    &ev.pod_name,
                    &ev.pod_uid,
                    &self.cfg.exclude_namespaces,
                )
                .await
            {
                Err(e) => return Err(kube_err(e.to_string())),
                Ok(None) => return Err(kube_err("no such pod".into())),
                Ok(Some((_, false))) => {
                    tracing::info!(pod = %pod, "not enrolled: its labels do not select it");
                    return Ok(());
                }
                Ok(Some((p, true))) => {
                    let w = kube::wanted(&p);
                    (uid, service_account, overrides) = (w.uid, w.service_account, w.overrides);
                }
            }
        }
        let guard = self.ops.lock().await;
        // Some runtimes name the netns by a host pid; in a container that is
        // the host's /proc mounted elsewhere.
        let netns_path = match ev.netns.strip_prefix("/proc/") {
            Some(rest) if self.cfg.host_proc != Path::new("/proc") => self.cfg.host_proc.join(rest),
            _ => PathBuf::from(&ev.netns),
        };
        let netns = Netns::open(&netns_path).map_err(|e| EnrollError::Netns {
            pod: pod.clone(),
            path: ev.netns.clone(),
            reason: e.to_string(),
        })?;
        let netns_id = netns.id().map_err(|e| EnrollError::Netns {
            pod: pod.clone(),
            path: ev.netns.clone(),
            reason: format!("netns {}: {e}", netns_path.display()),
        })?;
        let record = PodRecord {
            uid,
            name: ev.pod_name.clone(),
            namespace: ev.pod_namespace.clone(),
            service_account,
            netns_path,
            netns_id,
            ips: ev.ips.iter().map(|i| i.address.clone()).collect(),
            overrides,
        };
        self.enroll_pod(record, netns).await?;
        // The API call is made without holding up other pods' ADDs.
        drop(guard);
        if let Some(cluster) = &self.cluster {
            if let Err(e) = cluster
                .annotate(&ev.pod_namespace, &ev.pod_name, Some("enabled"))
                .await
            {
                tracing::warn!(pod = %pod, error = %e, "redirection annotation not set yet; will retry");
            }
        }
        Ok(())
    }

    /// Enrolls a pod whose netns is open: rules, then ZDS Add (waiting for
    /// the Ack), then the probe ipset and the state file. Callers hold `ops`.
    pub(super) async fn enroll_pod(
        &self,
        record: PodRecord,
        netns: Netns,
    ) -> Result<(), EnrollError> {
        let pod = format!("{}/{}", record.namespace, record.name);
        let uid = record.uid.clone();
        let rules = RedirectRules::new(record.overrides.apply(self.rules.opts.clone()));
        let (ns, r) = (netns.clone(), rules.clone());
        // A pod held already (enrolled again) may carry the other back
        // end's rules, from before a restart that switched back ends.
        let held = self.store.get(&uid).is_some();
        tokio::task::spawn_blocking(move || {
            r.apply(&ns)?;
            if held {
                r.take_over(&ns);
            }
            Ok::<(), crate::cni::redirect::RedirectError>(())
        })
        .await
        .map_err(|e| EnrollError::Rules {
            pod: pod.clone(),
            reason: e.to_string(),
        })?
        .map_err(|e| EnrollError::Rules {
            pod: pod.clone(),
            reason: e.to_string(),
        })?;
        let zpod = ZdsPod {
            uid: uid.clone(),
            name: record.name.clone(),
            namespace: record.namespace.clone(),
            service_account: record.service_account.clone(),
            netns: netns.clone(),
        };
        if let Err(e) = self.zds.add(&zpod).await {
            let ns = netns.clone();
            let _ = tokio::task::spawn_blocking(move || rules.remove(&ns)).await;
            return Err(EnrollError::Zds {
                pod,
                reason: e.to_string(),
            });
        }
        // The tools run on the blocking pool, not on a worker thread.
        let (probes, u, ips) = (self.probes, uid.clone(), record.ip_addrs());
        match tokio::task::spawn_blocking(move || probes.add_pod(&u, &ips)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(pod = %pod, error = %e, "probe set not updated; kubelet probes to this pod may be captured")
            }
            Err(e) => {
                tracing::warn!(pod = %pod, error = %e, "probe set not updated; kubelet probes to this pod may be captured")
            }
        }
        if let Some((old, _)) = self.store.get(&uid) {
            self.let_go_of_old_sandbox(&pod, &old, &record);
        }
        tracing::info!(pod = %pod, uid = %uid, sa = %record.service_account, "pod enrolled");
        self.metrics.event("add");
        self.store.insert(record, netns);
        self.save();
        Ok(())
    }

    /// The pod `old` held is enrolled again as `new` (same uid), usually in
    /// a new sandbox with a new netns after kubelet recreated it: the proxy
    /// has already replaced the old netns's listeners, and the record (with
    /// the old netns fd) is about to be replaced. Here the old addresses
    /// leave the probe set, or they would stay there, the pod's uid on
    /// them, after the pod is gone. The old netns keeps its rules until it
    /// goes: whatever still runs there stays captured, and with no proxy
    /// listening there it is cut off rather than let out in plaintext.
    fn let_go_of_old_sandbox(&self, pod: &str, old: &PodRecord, new: &PodRecord) {
        let kept = new.ip_addrs();
        let stale: Vec<std::net::IpAddr> = old
            .ip_addrs()
            .into_iter()
            .filter(|ip| !kept.contains(ip))
            .collect();
        self.probes.remove_pod(&new.uid, &stale);
        if old.netns_id != new.netns_id {
            tracing::info!(pod, uid = %new.uid, old_netns = %old.netns_path.display(), netns = %new.netns_path.display(), "pod enrolled again in a new netns (sandbox recreated); the old one is let go");
        }
    }

    /// Removes a pod: probe ipset, then its rules (if its netns is still
    /// there), then ZDS Del to every proxy. If the rules cannot be removed the
    /// pod stays held and served, so its traffic is not blackholed; the
    /// caller retries. Callers hold `ops`.
    pub(super) async fn remove(&self, uid: &str, netns_alive: bool) {
        let Some((record, netns)) = self.store.get(uid) else {
            return;
        };
        let pod = format!("{}/{}", record.namespace, record.name);
        if netns_alive {
            let rules = self.rules.clone();
            let removed = tokio::task::spawn_blocking(move || rules.remove(&netns))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()));
            if let Err(e) = removed {
                tracing::warn!(uid, pod = %pod, error = %e, "redirection rules not removed; pod kept in the mesh, will retry");
                return;
            }
        }
        let (probes, u, ips) = (self.probes, uid.to_string(), record.ip_addrs());
        let _ = tokio::task::spawn_blocking(move || probes.remove_pod(&u, &ips)).await;
        self.store.remove(uid);
        self.metrics.event("remove");
        if let Err(e) = self.zds.del(uid).await {
            tracing::warn!(uid, error = %e, "ZDS Del failed");
        }
        tracing::info!(uid, pod = %pod, "pod removed");
        self.save();
    }

    /// Writes the rules of the pods `uids` again (those restored from the
    /// state file at start) under this agent's back end and switches. A
    /// pod whose write fails keeps the rules it had; one gone meanwhile is
    /// left to [`Agent::reap`].
    pub(super) async fn reapply(&self, uids: Vec<String>) {
        let (mut done, mut failed) = (0usize, 0usize);
        for uid in uids {
            let _ops = self.ops.lock().await;
            let Some((record, netns)) = self.store.get(&uid) else {
                continue;
            };
            let rules = RedirectRules::new(record.overrides.apply(self.rules.opts.clone()));
            match tokio::task::spawn_blocking(move || rules.reapply(&netns)).await {
                Ok(Ok(())) => done += 1,
                Ok(Err(e)) => {
                    failed += 1;
                    tracing::warn!(uid, error = %e, "rules of a pod held before this start not written again; it keeps the ones it had");
                }
                Err(e) => {
                    failed += 1;
                    tracing::warn!(uid, error = %e, "rules of a pod held before this start not written again");
                }
            }
        }
        if done + failed > 0 {
            tracing::info!(pods = done, failed, backend = ?self.rules.opts.backend, "rules of the pods held before this start written again");
        }
    }

    /// Saves the held pods to the state file (a failed write is retried on its own).
    pub(super) fn save(&self) {
        self.state.save();
    }

    /// Pods whose netns path is gone (or now names another netns) are removed.
    pub(super) async fn reap(&self) {
        let gone = |rec: &PodRecord| {
            Netns::open(&rec.netns_path)
                .and_then(|n| n.id())
                .map(|id| id != rec.netns_id)
                .unwrap_or(true)
        };
        if !self.store.records().iter().any(gone) {
            return;
        }
        // Under `ops`, and on the records as they are now: an ADD may have
        // just replaced a pod's record with its new sandbox.
        let _guard = self.ops.lock().await;
        for rec in self.store.records() {
            if gone(&rec) {
                self.remove(&rec.uid, false).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_own_pod_prefix_is_its_daemonset_name() {
        assert_eq!(own_pod_prefix("ambit-q8x2z"), "ambit-");
        assert_eq!(own_pod_prefix("ambit-agent-7xk2p"), "ambit-agent-");
        assert_eq!(own_pod_prefix(""), "");
        assert_eq!(own_pod_prefix("solo"), "");
    }
}
