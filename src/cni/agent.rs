//! The node agent (`ambit agent`): receives CNI ADD events on
//! `<run dir>/pluginevent.sock`, puts enrolled pods under redirection, hands
//! their netns to the proxy over ZDS, keeps its pods in a state file across
//! restarts, notices pods that are gone, and installs (and repairs) the CNI
//! plugin once it is ready to serve events.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::kube::{self, Cluster, Wanted};
use super::plugin::{AddEvent, Enrollment, AMBIENT_NAMESPACES_FILE, PLUGIN_KUBECONFIG_FILE};
use super::redirect::{RedirectOptions, RedirectRules};
use super::zds_server::{PodSource, ZdsPod, ZdsServer};
use super::{hostprobe, install};
use crate::config::agent::{AgentConfig, EnrollRule};
use crate::netns::Netns;
use crate::xds::{State, StateHandle};

/// File name of the plugin event socket inside the run dir.
pub const PLUGIN_SOCKET: &str = "pluginevent.sock";

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
    fn ip_addrs(&self) -> Vec<std::net::IpAddr> {
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
    fn records(&self) -> Vec<PodRecord> {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|p| p.record.clone())
            .collect()
    }

    fn insert(&self, record: PodRecord, netns: Netns) {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(record.uid.clone(), Enrolled::new(record, netns));
    }

    /// How long the agent has held the pod `uid`.
    fn held_for(&self, uid: &str) -> Option<Duration> {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.get(uid).map(|p| p.since.elapsed())
    }

    /// Notes that the watch shows the pod `uid`.
    fn mark_seen(&self, uid: &str) {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pods.get_mut(uid) {
            p.seen = true;
        }
    }

    fn was_seen(&self, uid: &str) -> bool {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.get(uid).is_some_and(|p| p.seen)
    }
}

/// The agent's Prometheus metrics (Istio CNI's names).
#[derive(Default)]
pub struct AgentMetrics {
    /// `istio_cni_plugin_requests_total{response_code}`: plugin events by answer.
    pub plugin_requests: prometheus_client::metrics::family::Family<
        Vec<(String, String)>,
        prometheus_client::metrics::counter::Counter,
    >,
    /// `istio_cni_install_ready`: 1 while the plugin is installed.
    pub install_ready: prometheus_client::metrics::gauge::Gauge,
    /// `ztunnel_connected`: proxies connected over ZDS.
    pub ztunnel_connected: prometheus_client::metrics::gauge::Gauge,
    /// `nodeagent_reconcile_events_total{type}`: pods added and removed.
    pub reconcile_events: prometheus_client::metrics::family::Family<
        Vec<(String, String)>,
        prometheus_client::metrics::counter::Counter,
    >,
}

impl AgentMetrics {
    fn registry(&self) -> prometheus_client::registry::Registry {
        let mut r = prometheus_client::registry::Registry::default();
        r.register(
            "istio_cni_plugin_requests",
            "CNI plugin events by response code",
            self.plugin_requests.clone(),
        );
        r.register(
            "istio_cni_install_ready",
            "1 while the CNI plugin is installed",
            self.install_ready.clone(),
        );
        r.register(
            "ztunnel_connected",
            "Proxies connected over ZDS",
            self.ztunnel_connected.clone(),
        );
        r.register(
            "nodeagent_reconcile_events",
            "Pods enrolled and removed",
            self.reconcile_events.clone(),
        );
        r
    }

    fn event(&self, kind: &str) {
        self.reconcile_events
            .get_or_create(&vec![("type".into(), kind.into())])
            .inc();
    }
}

/// Everything an event handler needs.
pub struct Agent {
    metrics: Arc<AgentMetrics>,
    cfg: AgentConfig,
    store: Arc<PodStore>,
    zds: Arc<ZdsServer>,
    rules: RedirectRules,
    enroll: Enrollment,
    /// The local config (workloads' service accounts), loaded once and watched.
    mesh: Option<StateHandle>,
    /// With `enroll: kubernetes`: the node's pods and all namespaces.
    cluster: Option<Arc<Cluster>>,
    /// Pods the API wants enrolled whose netns was not found yet: next try, delay.
    retry: Mutex<BTreeMap<String, (std::time::Instant, Duration)>>,
    /// Serialises enrollments so rules, ZDS and state change in one order.
    ops: tokio::sync::Mutex<()>,
}

/// Why an enrollment failed; the plugin shows it to the runtime.
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error("pod {pod}: netns {path}: {reason}")]
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
            .map(|w| w.service_account.clone());
        let by_ip = || {
            ev.ips.iter().find_map(|ip| {
                let addr = ip.address.split('/').next()?.parse().ok()?;
                state
                    .workload_by_addr("", addr)
                    .map(|w| w.service_account.clone())
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
            reason: e.to_string(),
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
    async fn enroll_pod(&self, record: PodRecord, netns: Netns) -> Result<(), EnrollError> {
        let pod = format!("{}/{}", record.namespace, record.name);
        let uid = record.uid.clone();
        let rules = RedirectRules::new(record.overrides.apply(self.rules.opts.clone()));
        let (ns, r) = (netns.clone(), rules.clone());
        tokio::task::spawn_blocking(move || r.apply(&ns))
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
        if let Err(e) = hostprobe::add_pod(&uid, &record.ip_addrs()) {
            tracing::warn!(pod = %pod, error = %e, "probe ipset not updated; kubelet probes to this pod may be captured");
        }
        tracing::info!(pod = %pod, uid = %uid, sa = %record.service_account, "pod enrolled");
        self.metrics.event("add");
        self.store.insert(record, netns);
        self.save();
        Ok(())
    }

    /// Removes a pod: ZDS Del to every proxy, rules removed if its netns still exists.
    /// Removes a pod: probe ipset, then its rules (if its netns is still
    /// there), then ZDS Del to every proxy. If the rules cannot be removed the
    /// pod stays held and served, so its traffic is not blackholed; the
    /// caller retries. Callers hold `ops`.
    async fn remove(&self, uid: &str, netns_alive: bool) {
        let held = {
            let pods = self.store.pods.lock().unwrap_or_else(|e| e.into_inner());
            pods.get(uid).map(|p| (p.record.clone(), p.netns.clone()))
        };
        let Some((record, netns)) = held else { return };
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
        hostprobe::remove_pod(uid, &record.ip_addrs());
        self.store
            .pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(uid);
        self.metrics.event("remove");
        if let Err(e) = self.zds.del(uid).await {
            tracing::warn!(uid, error = %e, "ZDS Del failed");
        }
        tracing::info!(uid, pod = %pod, "pod removed");
        self.save();
    }

    fn save(&self) {
        let records = self.store.records();
        let text = serde_json::to_string_pretty(&records).unwrap_or_else(|_| "[]".into());
        if let Some(dir) = self.cfg.state_file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if let Err(e) = install::write_atomic(&self.cfg.state_file, text.as_bytes(), 0o600) {
            tracing::error!(error = %e, "cannot save agent state");
        }
    }

    /// Pods whose netns path is gone (or now names another netns) are removed.
    async fn reap(&self) {
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

/// How long a pod the agent took must be missing from the watch before it
/// counts as deleted (the watch can lag a CNI ADD that looked the pod up).
const WATCH_LAG: Duration = Duration::from_secs(10);
/// Longest wait between looks for the netns of a pod the API wants enrolled.
const MAX_RETRY: Duration = Duration::from_secs(30);

impl Agent {
    /// Puts off the next try for pod `uid`: 1 s, doubling up to [`MAX_RETRY`].
    fn back_off(&self, uid: &str) -> Duration {
        let mut retry = self.retry.lock().unwrap_or_else(|e| e.into_inner());
        let delay = retry
            .get(uid)
            .map_or(Duration::from_secs(1), |(_, d)| (*d * 2).min(MAX_RETRY));
        retry.insert(uid.to_string(), (std::time::Instant::now() + delay, delay));
        delay
    }

    /// Brings the held pods in line with the API (label flips, deletions,
    /// pods that started without a CNI ADD) and the redirection annotations
    /// in line with the held pods. Level-triggered: run after every watch
    /// event and every tick, so failures are retried.
    async fn reconcile(&self) {
        let Some(cluster) = &self.cluster else { return };
        let excluded = &self.cfg.exclude_namespaces;
        self.write_plugin_files(cluster);
        let watched = cluster.pods();
        // Held pods the API no longer wants: relabelled, finished or deleted.
        for rec in self.store.records() {
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
            let _guard = self.ops.lock().await;
            self.remove(&rec.uid, alive).await;
            if pod.is_some() {
                if let Err(e) = cluster.annotate(&rec.namespace, &rec.name, None).await {
                    tracing::warn!(uid = %rec.uid, error = %e, "redirection annotation not removed yet; will retry");
                }
            }
        }
        // Pods the API wants that the agent does not hold (no CNI ADD reached
        // it: they predate it, or a label flipped on a running pod).
        let held = self.store.records();
        let now = std::time::Instant::now();
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
fn plugin_kubeconfig(ca_path: &Path) -> Option<(String, Option<Vec<u8>>)> {
    if let Some(path) = std::env::var_os("KUBECONFIG").filter(|p| !p.is_empty()) {
        let first = std::env::split_paths(&path).next()?;
        return Some((std::fs::read_to_string(first).ok()?, None));
    }
    let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
    let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
    let sa = Path::new("/var/run/secrets/kubernetes.io/serviceaccount");
    let token = std::fs::read_to_string(sa.join("token")).ok()?;
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

impl Agent {
    /// Keeps the files the plugin reads while no agent runs current (0600,
    /// rewritten only when they change): the namespaces labelled ambient, and
    /// a kubeconfig to ask the API server whether a pod is enrolled.
    fn write_plugin_files(&self, cluster: &Cluster) {
        let dir = &self.cfg.run_dir;
        let ambient = cluster.ambient_namespaces(&self.cfg.exclude_namespaces);
        let mut files = vec![(
            dir.join(AMBIENT_NAMESPACES_FILE),
            serde_json::to_vec(&ambient).unwrap_or_else(|_| b"[]".to_vec()),
        )];
        let ca_path = dir.join("plugin-ca.crt");
        if let Some((kubeconfig, ca)) = plugin_kubeconfig(&ca_path) {
            files.extend(ca.map(|ca| (ca_path, ca)));
            files.push((dir.join(PLUGIN_KUBECONFIG_FILE), kubeconfig.into_bytes()));
        }
        for (path, contents) in files {
            if let Err(e) = install::write_if_changed(&path, &contents, 0o600) {
                tracing::warn!(file = %path.display(), error = %e, "file for the plugin not written");
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
fn discover(
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

fn find_netns(proc_dir: &Path, wanted: &[Wanted]) -> Vec<(PodRecord, Netns)> {
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
        let Some(w) = wanted.iter().find(|w| {
            w.ips.iter().any(|ip| ips.contains(ip))
                && owner.as_deref().is_none_or(|uid| uid == w.uid)
        }) else {
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

async fn plugin_events(agent: Arc<Agent>, listener: tokio::net::UnixListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let agent = agent.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let agent = agent.clone();
                async move { Ok::<_, Infallible>(handle_event(agent, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn handle_event(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: String| {
        Response::builder()
            .status(status)
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_default()
    };
    if req.method() != Method::POST || req.uri().path() != "/cmdadd" {
        return reply(StatusCode::NOT_FOUND, "only POST /cmdadd\n".into());
    }
    let body = match Limited::new(req.into_body(), 64 * 1024).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return reply(StatusCode::BAD_REQUEST, format!("body: {e}\n")),
    };
    let ev: AddEvent = match serde_json::from_slice(&body) {
        Ok(ev) => ev,
        Err(e) => return reply(StatusCode::BAD_REQUEST, format!("bad event: {e}\n")),
    };
    let resp = match agent.add(ev).await {
        Ok(()) => reply(StatusCode::OK, "ok\n".into()),
        Err(e) => {
            tracing::warn!(error = %e, "enrollment failed");
            reply(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n"))
        }
    };
    agent
        .metrics
        .plugin_requests
        .get_or_create(&vec![(
            "response_code".into(),
            resp.status().as_u16().to_string(),
        )])
        .inc();
    resp
}

/// Runs the agent until SIGTERM/SIGINT.
pub fn run(cfg: AgentConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(serve(cfg, None))
}

/// The agent's main loop; `stop` ends it early (used by `ambit node`).
pub async fn serve(cfg: AgentConfig, stop: Option<Arc<tokio::sync::Notify>>) -> anyhow::Result<()> {
    super::redirect::set_host_proc(&cfg.host_proc);
    // Health first: /healthz answers while the agent waits for the API server,
    // so a slow API does not get it killed by its liveness probe.
    let ready = Arc::new(AtomicBool::new(false));
    let r = ready.clone();
    crate::proxy::admin::serve(
        cfg.readiness_addr,
        Arc::new(move |_, path| match path {
            "/healthz" => (StatusCode::OK, crate::proxy::admin::TEXT, "ok\n".into()),
            "/readyz" if r.load(Ordering::Acquire) => {
                (StatusCode::OK, crate::proxy::admin::TEXT, "ready\n".into())
            }
            "/readyz" => (
                StatusCode::SERVICE_UNAVAILABLE,
                crate::proxy::admin::TEXT,
                "not ready\n".into(),
            ),
            _ => crate::proxy::admin::not_found(),
        }),
    )
    .await
    .with_context(|| format!("readiness server on {}", cfg.readiness_addr))?;
    let store = Arc::new(PodStore::default());
    for (record, netns) in load_state(&cfg.state_file) {
        tracing::info!(uid = %record.uid, "pod restored from agent state");
        store.insert(record, netns);
    }
    // Pods that predate the agent: put them under redirection before the proxy gets the snapshot.
    let enroll = enrollment(&cfg);
    let cluster = match cfg.enroll {
        EnrollRule::Kubernetes => Some(Cluster::start(&cfg.node_name).await?),
        _ => None,
    };
    let rules = RedirectRules::new(RedirectOptions {
        dns_capture: cfg.dns_capture,
        bypass_inbound: false,
        ipv6: cfg.ipv6,
        virtual_interfaces: Vec::new(),
        loopback_big_tcp: cfg.pod_loopback_big_tcp,
    });
    let mesh = match &cfg.local_xds_path {
        Some(path) => {
            let handle = StateHandle::new(crate::xds::local::load(path)?);
            tokio::spawn(crate::xds::local::watch(path.clone(), handle.clone()));
            Some(handle)
        }
        None => None,
    };
    let known = mesh.as_ref().map(|m| m.load()).unwrap_or_default();
    let existing = match &cluster {
        Some(c) => {
            let held = store.records();
            let wanted: Vec<Wanted> = c
                .pods()
                .iter()
                .filter(|p| c.should_enroll(p, &cfg.exclude_namespaces))
                .map(|p| kube::wanted(p))
                .filter(|w| !held.iter().any(|h| h.uid == w.uid))
                .collect();
            find_netns(&cfg.host_proc, &wanted)
        }
        None => discover(&cfg, &known, &enroll, &store.records()),
    };
    for (record, netns) in existing {
        match RedirectRules::new(record.overrides.apply(rules.opts.clone())).apply(&netns) {
            Ok(()) => {
                tracing::info!(uid = %record.uid, netns = %record.netns_path.display(), "existing pod found and enrolled");
                store.insert(record, netns);
            }
            Err(e) => {
                tracing::warn!(uid = %record.uid, error = %e, "existing pod found but its rules failed")
            }
        }
    }
    hostprobe::install(cfg.ipv6).context("host probe SNAT rule and ipsets")?;
    for p in store.records() {
        let _ = hostprobe::add_pod(&p.uid, &p.ip_addrs());
    }
    let zds = ZdsServer::start(&cfg.zds_path, store.clone())
        .with_context(|| format!("ZDS socket {}", cfg.zds_path.display()))?;
    let metrics = Arc::new(AgentMetrics::default());
    let agent = Arc::new(Agent {
        metrics: metrics.clone(),
        enroll,
        mesh,
        cluster: cluster.clone(),
        retry: Default::default(),
        cfg: cfg.clone(),
        store,
        zds,
        rules,
        ops: Default::default(),
    });
    agent.save();
    if let Some(cluster) = cluster {
        let agent = agent.clone();
        tokio::spawn(async move {
            loop {
                agent.reconcile().await;
                tokio::select! {
                    _ = cluster.changed.notified() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                // Let a burst of watch events settle into one pass.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
    }

    {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o750)
            .create(&cfg.run_dir)?;
        let sock = cfg.run_dir.join(PLUGIN_SOCKET);
        let _ = std::fs::remove_file(&sock);
        let listener = tokio::net::UnixListener::bind(&sock)
            .with_context(|| format!("plugin socket {}", sock.display()))?;
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600))?;
        tokio::spawn(plugin_events(agent.clone(), listener));
    }

    let registry = Arc::new(metrics.registry());
    crate::proxy::admin::serve(
        cfg.metrics_addr,
        Arc::new(move |_, path| match path {
            "/metrics" => {
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &registry) {
                    Ok(()) => (StatusCode::OK, crate::proxy::admin::PROMETHEUS, text),
                    Err(e) => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        crate::proxy::admin::TEXT,
                        e.to_string(),
                    ),
                }
            }
            _ => crate::proxy::admin::not_found(),
        }),
    )
    .await
    .with_context(|| format!("metrics server on {}", cfg.metrics_addr))?;

    ready.store(!cfg.install_cni, Ordering::Release);
    // Only now, able to serve events, does the agent put the plugin in place.
    let entry = plugin_entry(&cfg);
    let binary = std::env::current_exe()?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let stop = stop.unwrap_or_default();
    tracing::info!(run_dir = %cfg.run_dir.display(), zds = %cfg.zds_path.display(), "agent serving");
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            _ = stop.notified() => break,
        }
        if cfg.install_cni {
            match install::install(&cfg.cni_bin_dir, &cfg.cni_conf_dir, &binary, &entry) {
                Ok(true) => {
                    tracing::info!(conf_dir = %cfg.cni_conf_dir.display(), "CNI plugin installed")
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "CNI plugin not installed yet"),
            }
            ready.store(
                install::primary_config(&cfg.cni_conf_dir)
                    .map(|(_, v, _)| install::has_entry(&v, &entry))
                    .unwrap_or(false),
                Ordering::Release,
            );
        }
        agent.reap().await;
        metrics
            .install_ready
            .set(i64::from(ready.load(Ordering::Acquire)));
        metrics
            .ztunnel_connected
            .set(agent.zds.connected().await as i64);
    }
    let upgrade = match (&agent.cluster, cfg.pod_name.is_empty()) {
        (Some(c), false) => c.daemonset_remains(&cfg.pod_namespace, &cfg.pod_name).await,
        _ => false,
    };
    if cfg.install_cni && upgrade {
        tracing::info!("the DaemonSet remains (upgrade or restart): CNI plugin left in place, so new pods wait for the next agent");
    } else if cfg.install_cni {
        match install::uninstall(&cfg.cni_bin_dir, &cfg.cni_conf_dir) {
            Ok(()) => tracing::info!("CNI plugin uninstalled"),
            Err(e) => tracing::warn!(error = %e, "CNI plugin uninstall incomplete"),
        }
    }
    Ok(())
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

    #[test]
    fn the_agents_own_pod_prefix_is_its_daemonset_name() {
        assert_eq!(own_pod_prefix("ambit-q8x2z"), "ambit-");
        assert_eq!(own_pod_prefix("ambit-agent-7xk2p"), "ambit-agent-");
        assert_eq!(own_pod_prefix(""), "");
        assert_eq!(own_pod_prefix("solo"), "");
    }
}
