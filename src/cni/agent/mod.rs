//! The node agent (`ambit agent`): receives CNI ADD events on
//! `<run dir>/pluginevent.sock`, puts enrolled pods under redirection, hands
//! their netns to the proxy over ZDS, keeps its pods in a state file across
//! restarts, notices pods that are gone, and installs (and repairs) the CNI
//! plugin once it is ready to serve events.
//!
//! The rooms: `store` (pod records and the state file), `enroll` (one pod
//! in or out), `discover` (finding running pods' netns), `reconcile` (the
//! Kubernetes loop), `events` (the plugin event server), `metrics`; this
//! file wires them and runs the agent's loop.

mod discover;
mod enroll;
mod events;
mod metrics;
mod reconcile;
mod store;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use http::StatusCode;

use super::hostprobe::HostProbes;
use super::install;
use super::kube::{self, Cluster, Wanted};
use super::plugin::Enrollment;
use super::redirect::{Backend, RedirectOptions, RedirectRules};
use super::zds_server::ZdsServer;
use crate::backoff::Backoff;
use crate::config::agent::{AgentConfig, EnrollRule};
use crate::sideport::{self, TEXT};
use crate::xds::StateHandle;
#[cfg(all(test, feature = "lab"))]
pub(crate) use discover::pod_uid_from_cgroup;
use discover::{discover, find_netns};
pub use enroll::{enrollment, own_pod_prefix, plugin_entry, EnrollError};
pub use events::parse_add_event;
use metrics::AgentMetrics;
use store::{load_state, PodStore, StateFile};

/// File name of the plugin event socket inside the run dir.
pub const PLUGIN_SOCKET: &str = "pluginevent.sock";

/// How long the exit waits for a reconcile pass in progress. With the
/// DaemonSet check after it (up to three API requests, each within
/// [`kube::API_BUDGET`]), the exit stays inside the kubelet's default
/// 30 s grace even when the API server stops answering.
const RECONCILE_GRACE: Duration = Duration::from_secs(6);

/// Everything an event handler needs.
pub struct Agent {
    metrics: Arc<AgentMetrics>,
    cfg: AgentConfig,
    store: Arc<PodStore>,
    /// The state file the store is saved to.
    state: Arc<StateFile>,
    zds: Arc<ZdsServer>,
    rules: RedirectRules,
    /// The host's probe SNAT rule and set of enrolled pods' addresses.
    probes: HostProbes,
    enroll: Enrollment,
    /// The local config (workloads' service accounts), loaded once and watched.
    mesh: Option<StateHandle>,
    /// With `enroll: kubernetes`: the node's pods and all namespaces.
    cluster: Option<Arc<Cluster>>,
    /// Pods the API wants enrolled whose netns was not found yet: next try, delays.
    retry: Mutex<BTreeMap<String, (std::time::Instant, Backoff)>>,
    /// Serialises enrollments so rules, ZDS and state change in one order.
    ops: tokio::sync::Mutex<()>,
    /// Set at exit: the reconcile loop ends, and a pass in progress
    /// starts no work on another pod.
    stopping: tokio::sync::watch::Sender<bool>,
    /// The CNI plugin's own token (Kubernetes mode), and when to ask for
    /// the next one.
    plugin_token: Mutex<Option<(String, std::time::Instant)>>,
}

/// Runs the agent until SIGTERM/SIGINT.
pub fn run(cfg: AgentConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(serve(cfg))
}

/// The agent's main loop, until SIGTERM or SIGINT.
async fn serve(cfg: AgentConfig) -> anyhow::Result<()> {
    let open_files = crate::limits::raise_open_files();
    tracing::debug!(open_files, "open-file limit");
    super::redirect::set_host_proc(&cfg.host_proc);
    // Health first: /healthz answers while the agent waits for the API server,
    // so a slow API does not get it killed by its liveness probe.
    let ready = Arc::new(AtomicBool::new(false));
    let r = ready.clone();
    sideport::serve(
        cfg.readiness_addr,
        "agent_readiness",
        Arc::new(move |_, path| {
            match path {
                "/healthz" => (StatusCode::OK, TEXT, "ok\n".into()),
                "/readyz" if r.load(Ordering::Acquire) => (StatusCode::OK, TEXT, "ready\n".into()),
                "/readyz" => (StatusCode::SERVICE_UNAVAILABLE, TEXT, "not ready\n".into()),
                _ => sideport::not_found(),
            }
            .into()
        }),
    )
    .await
    .with_context(|| format!("readiness server on {}", cfg.readiness_addr))?;
    let backend = match cfg.native_nftables {
        true => Backend::Nftables,
        false => Backend::Iptables,
    };
    let rules = RedirectRules::new(RedirectOptions {
        dns_capture: cfg.dns_capture,
        bypass_inbound: false,
        ipv6: cfg.ipv6,
        virtual_interfaces: Vec::new(),
        loopback_big_tcp: cfg.pod_loopback_big_tcp,
        backend,
    });
    // A host that cannot take the rules fails here, once, with the reason,
    // rather than at each pod's ADD.
    rules.check_host().context(
        "the nftables rules back end (native_nftables / NATIVE_NFTABLES) cannot be used on this host",
    )?;
    let probes = HostProbes {
        backend,
        ipv6: cfg.ipv6,
    };
    let store = Arc::new(PodStore::default());
    let mut restored = Vec::new();
    for (record, netns) in load_state(&cfg.state_file) {
        tracing::info!(uid = %record.uid, "pod restored from agent state");
        restored.push(record.uid.clone());
        store.insert(record, netns);
    }
    // Pods that predate the agent: put them under redirection before the proxy gets the snapshot.
    let enroll = enrollment(&cfg);
    let cluster = match cfg.enroll {
        EnrollRule::Kubernetes => Some(Cluster::start(&cfg.node_name).await?),
        _ => None,
    };
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
        let pod_rules = RedirectRules::new(record.overrides.apply(rules.opts.clone()));
        match pod_rules.apply(&netns) {
            Ok(()) => {
                // Found running: it may hold the other back end's rules
                // (a state file lost across a switch of back ends).
                pod_rules.take_over(&netns);
                tracing::info!(uid = %record.uid, netns = %record.netns_path.display(), "existing pod found and enrolled");
                store.insert(record, netns);
            }
            Err(e) => {
                tracing::warn!(uid = %record.uid, error = %e, "existing pod found but its rules failed")
            }
        }
    }
    probes
        .install()
        .context("host probe SNAT rule and probe sets")?;
    // The held pods' entries, and none of pods that went while the agent
    // was away (or as it was killed).
    let held: Vec<(String, Vec<std::net::IpAddr>)> = store
        .records()
        .iter()
        .map(|p| (p.uid.clone(), p.ip_addrs()))
        .collect();
    let (added, stale) = probes.sync(&held);
    tracing::info!(
        added,
        removed = stale,
        "probe set entries synced with the pods held"
    );
    let zds = ZdsServer::start(&cfg.zds_path, store.clone())
        .with_context(|| format!("ZDS socket {}", cfg.zds_path.display()))?;
    let metrics = Arc::new(AgentMetrics::default());
    let state = Arc::new(StateFile::new(
        cfg.state_file.clone(),
        store.clone(),
        metrics.state_write_failures.clone(),
    ));
    tokio::spawn(state.clone().write_again());
    let agent = Arc::new(Agent {
        metrics: metrics.clone(),
        enroll,
        mesh,
        cluster: cluster.clone(),
        retry: Default::default(),
        cfg: cfg.clone(),
        store,
        state,
        zds,
        rules,
        probes,
        ops: Default::default(),
        stopping: tokio::sync::watch::Sender::new(false),
        plugin_token: Default::default(),
    });
    agent.save();
    // Stopped before the plugin's files are removed at exit: a pass still
    // running (a DaemonSet's deletion wakes it) would write them again. A
    // pass in progress ends after the pod it is working on (see the exit).
    let mut stopped = agent.stopping.subscribe();
    let mut reconciler = None;
    if let Some(cluster) = cluster {
        let agent = agent.clone();
        reconciler = Some(tokio::spawn(async move {
            loop {
                agent.reconcile().await;
                tokio::select! {
                    _ = cluster.changed.notified() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stopped.changed() => return,
                }
                // Let a burst of watch events settle into one pass.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }

    // The pods held before this start get their rules again, as this
    // agent writes them: one enrolled under the other back end (or other
    // switches) moves over, one already right is rewritten the same.
    // Alongside serving: each pod's rules stay in force throughout.
    {
        let agent = agent.clone();
        let restored: Vec<String> = restored.into_iter().collect();
        tokio::spawn(async move { agent.reapply(restored).await });
    }
    events::spawn(agent.clone(), &cfg.run_dir)?;

    let mut registry = metrics.registry();
    crate::limits::register(&mut registry);
    let registry = Arc::new(registry);
    sideport::serve(
        cfg.metrics_addr,
        "agent_metrics",
        Arc::new(move |_, path| {
            match path {
                "/metrics" => sideport::metrics_reply(&registry),
                _ => sideport::not_found(),
            }
            .into()
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
    tracing::info!(run_dir = %cfg.run_dir.display(), zds = %cfg.zds_path.display(), "agent serving");
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
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
    agent.stopping.send_replace(true);
    if let Some(mut reconciler) = reconciler {
        // The pass in progress finishes the pod it is working on (its API
        // requests each within their budget, then the proxy's answer) and
        // starts no other; the next agent's first pass, level-triggered,
        // does the rest. Only a pod's work that outlives this grace is cut
        // at what it awaits.
        if tokio::time::timeout(RECONCILE_GRACE, &mut reconciler)
            .await
            .is_err()
        {
            tracing::warn!(grace = ?RECONCILE_GRACE, "the reconcile pass in progress outlived its grace at exit; cut short");
            reconciler.abort();
            let _ = reconciler.await;
        }
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
    if !upgrade {
        // Uninstalled: the host's probe rule and sets go too (the pods'
        // own rules stay with their netns: traffic is never let out
        // uncaptured).
        match agent.probes.uninstall() {
            Ok(()) => tracing::info!("host probe rule and sets removed"),
            Err(e) => tracing::warn!(error = %e, "host probe rule and sets not removed"),
        }
        // The plugin's kubeconfig holds the agent's token: it goes with the
        // agent (kept only across an upgrade, for the plugin to use meanwhile).
        for (path, e) in reconcile::remove_plugin_files(&cfg.run_dir) {
            tracing::warn!(file = %path.display(), error = %e, "file for the plugin not removed");
        }
    }
    Ok(())
}
