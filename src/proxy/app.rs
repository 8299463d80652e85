//! The proxy's wiring, in one place: from a [`ProxyConfig`] to a running
//! proxy (state source, certificates, pool, pods, side ports), returned as a
//! [`ProxyHandle`] that waits for a stop and drains. Nothing here runs per
//! connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

use super::admin::{self, AdminView};
use super::config_dump::Configured;
use super::hbone::H2Settings;
use super::hostname::HostnameResolver;
use super::pod::{self, Drain, DrainTrigger, SocketFactory};
use super::pods::{PodInfo, ProxyShared};
use super::{dns, inpod, metrics, pool, reauth};
use crate::backoff::Backoff;
use crate::config::{ProxyConfig, ProxyMode};
use crate::identity::caclient::CaClient;
use crate::identity::{CertManager, CertSource, Crls, LocalCa};
use crate::sideport;
use crate::xds::{self, StateHandle};

/// Runs the proxy role until SIGTERM, SIGINT, `/quitquitquit` or a fatal error.
pub fn run(cfg: ProxyConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.worker_threads)
        // Numbered, as ztunnel's: per-thread tools (`top -H`, `perf stat
        // --per-thread`) tell the workers apart (the blocking pool's
        // threads follow them).
        .thread_name_fn(|| {
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            format!("ambit-proxy-{}", NEXT.fetch_add(1, Ordering::Relaxed))
        })
        .enable_all()
        .build()?;
    rt.block_on(async move { start(cfg).await?.wait().await })
}

/// Once the proxy is first ready, unmaps the binary's pages that start-up
/// mapped (see `crate::resident`): what the proxy runs from then on maps
/// back on first use. Measured (`cargo bench --bench dataplane`): a ready,
/// idle dedicated proxy's RSS 10 → 2.5 MB; both proxies' RSS after the
/// whole run 0.81× → 0.64× ztunnel's.
async fn release_startup_pages(ready: Arc<AtomicBool>) {
    while !ready.load(Ordering::Acquire) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    match tokio::task::spawn_blocking(crate::resident::release_file_pages).await {
        Ok(Ok(kb)) => tracing::debug!(released_kb = kb, "start-up pages of the binary unmapped"),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "cannot read /proc/self/smaps; start-up pages stay mapped")
        }
        Err(_) => {}
    }
}

/// A started proxy: what it takes to stop it and drain.
pub struct ProxyHandle {
    quit: Arc<tokio::sync::Notify>,
    /// A task that cannot go on sends why here; the proxy then exits with it.
    fatal: mpsc::UnboundedReceiver<anyhow::Error>,
    stop_trigger: DrainTrigger,
    ready: Arc<AtomicBool>,
    pool: Arc<pool::Pool>,
    active: Arc<pod::ActiveConnections>,
    drain_timeout: Duration,
}

/// Builds and starts everything the proxy runs; returns once the side
/// ports are bound (pods come as the agent hands them over).
pub async fn start(cfg: ProxyConfig) -> anyhow::Result<ProxyHandle> {
    let open_files = crate::limits::raise_open_files();
    for (key, addr) in [
        ("xds_address", &cfg.xds_address),
        ("ca_address", &cfg.ca_address),
    ] {
        if let Some(addr) = addr.as_deref().filter(|a| a.starts_with("http://")) {
            tracing::warn!(key, addr, "plaintext control plane (insecure_control_plane): mesh state and certificates cross the network unprotected");
        }
    }
    let sockets = pod::SocketOptions {
        mark: cfg.packet_mark,
        congestion_control: cfg.congestion_control.clone(),
    }
    .usable(cfg.congestion_control_chosen)?;
    sockets.check_privileges(cfg.mode == ProxyMode::Shared)?;
    let mut registry = Registry::default();
    let budget = cfg
        .memory_budget
        .unwrap_or_else(super::budget::default_limit);
    super::budget::BUDGET.set_limit(budget);
    super::budget::BUDGET.register(&mut registry);
    // Mesh state: from the control plane over xDS, or from the local config file.
    let mut xds_synced = Arc::new(AtomicBool::new(true));
    let mut demand = None;
    let state = match (&cfg.xds_address, &cfg.local_xds_path) {
        (Some(addr), _) => {
            let state = StateHandle::default();
            let client = xds::client::XdsClient::new(
                xds::client::XdsConfig {
                    address: addr.clone(),
                    root_ca: cfg.xds_root_ca.clone(),
                    token: cfg.auth_token.clone(),
                    cluster_id: cfg.cluster_id.clone(),
                    node_id: format!(
                        "ztunnel~{}~{}.{}~{}.svc.cluster.local",
                        cfg.instance_ip, cfg.pod_name, cfg.pod_namespace, cfg.pod_namespace
                    ),
                    metadata: vec![
                        ("NAME".into(), cfg.pod_name.clone()),
                        ("NAMESPACE".into(), cfg.pod_namespace.clone()),
                        ("NODE_NAME".into(), cfg.node_name.clone()),
                        ("INSTANCE_IPS".into(), cfg.instance_ip.clone()),
                    ],
                    mark: cfg.packet_mark,
                    on_demand: cfg.xds_on_demand,
                    on_demand_wait: cfg.xds_on_demand_wait,
                    max_message_size: cfg.xds_max_message_size as usize,
                },
                state.clone(),
            );
            xds_synced.clone_from(&client.synced);
            client.metrics.register(&mut registry);
            demand = xds::client::OnDemand::of(&client);
            client.spawn_on_own_thread()?;
            state
        }
        (None, Some(path)) => {
            let state = StateHandle::new(xds::local::load(path)?);
            tokio::spawn(xds::local::watch(path.clone(), state.clone()));
            state
        }
        (None, None) => anyhow::bail!("no mesh state source: set XDS_ADDRESS or LOCAL_XDS_PATH"),
    };

    let source = match (&cfg.ca_address, &cfg.ca_cert, &cfg.ca_key) {
        (Some(addr), _, _) => CertSource::Remote(CaClient {
            address: addr.clone(),
            root_ca: cfg.ca_root_ca.clone().or_else(|| cfg.xds_root_ca.clone()),
            mesh_root: cfg.mesh_root_ca.clone().ok_or_else(|| {
                anyhow::anyhow!("ca_address is set but no mesh root: set mesh_root_ca")
            })?,
            token: cfg.auth_token.clone(),
            cluster_id: cfg.cluster_id.clone(),
            mark: cfg.packet_mark,
        }),
        (None, Some(cert), Some(key)) => {
            CertSource::Local(Box::new(LocalCa::from_files(cert, key)?))
        }
        _ => CertSource::Local(Box::new(LocalCa::load_or_generate(
            &cfg.state_dir,
            &cfg.trust_domain,
        )?)),
    };
    // Revocation lists: refused at start means not started (see `crl`).
    let crls = match &cfg.crl_path {
        Some(path) => {
            let crls = Crls::load(path).map_err(|e| anyhow::anyhow!(e))?;
            crls.spawn_watch().map_err(|e| {
                anyhow::anyhow!("cannot watch the CRL file {}: {e}", path.display())
            })?;
            crls.register_metrics(&mut registry);
            let set = crls.current();
            tracing::info!(path = %path.display(), lists = set.len(), revoked = set.revoked, "CRL file loaded; peers are checked against it");
            Some(crls)
        }
        None => None,
    };
    let certs = CertManager::with_crls(source, cfg.cert_ttl, crls);
    certs.spawn_releaser(Duration::from_secs(10));
    certs.register_metrics(&mut registry);
    let metrics = Arc::new(metrics::Metrics::default());
    metrics.register(&mut registry);
    let spread = cfg.pool_spread.unwrap_or(cfg.worker_threads);
    let pool = pool::Pool::new(cfg.pool_max_streams, spread, cfg.pool_idle_timeout);
    pool.spawn_evictor();
    let (stop_trigger, stop_accepting) = Drain::new();
    // The node's resolvers: for the DNS proxy and for workloads reached by hostname.
    let resolvers = Arc::new(if cfg.dns_upstreams.is_empty() {
        dns::resolv_conf_servers(&std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default())
    } else {
        cfg.dns_upstreams.clone()
    });
    // From the proxy's own netns, never a pod's (see `hostname`).
    let hostnames = Arc::new(HostnameResolver::new(
        resolvers.clone(),
        pod::SocketFactory::local(sockets.clone(), "proxy".into()),
    ));
    let active: Arc<pod::ActiveConnections> = Arc::default();
    let shared = Arc::new(ProxyShared {
        state: state.clone(),
        certs: certs.clone(),
        pool: pool.clone(),
        metrics: metrics.clone(),
        h2: H2Settings {
            stream_window: cfg.stream_window,
            connection_window: cfg.connection_window,
            frame_size: cfg.frame_size,
            unsent_limit: cfg.hbone_unsent_limit,
        },
        cluster: cfg.cluster_id.clone(),
        trust_domain: cfg.trust_domain.clone(),
        cluster_domain: cfg.cluster_domain.as_str().into(),
        network: cfg.network.clone(),
        sockets,
        ipv6: cfg.ipv6,
        stop_accepting,
        active: active.clone(),
        tracker: reauth::Tracker::new(state.clone()),
        pods_gone: Default::default(),
        dns_upstreams: cfg.dns_proxy.then(|| {
            tracing::info!(
                upstreams = ?resolvers,
                "DNS proxy on; other names go to these resolvers"
            );
            resolvers.clone()
        }),
        hostnames,
        demand,
    });
    shared.tracker.spawn_watcher();

    let ready = Arc::new(AtomicBool::new(false));
    tokio::spawn(release_startup_pages(ready.clone()));
    let pods: Arc<inpod::PodTable> = Arc::default();
    pods.register_metrics(&mut registry, cfg.mode == ProxyMode::Dedicated);
    let (fatal_tx, fatal) = mpsc::unbounded_channel();
    match cfg.mode {
        ProxyMode::Dedicated => {
            let wi = cfg
                .workload_info
                .clone()
                .context("dedicated mode needs workload_info")?;
            let info = PodInfo {
                uid: format!("{}/{}", wi.namespace, wi.name),
                namespace: wi.namespace,
                name: wi.name,
                service_account: wi.service_account,
            };
            tokio::spawn(serve_dedicated(
                shared.clone(),
                info,
                ready.clone(),
                fatal_tx,
            ));
        }
        ProxyMode::Shared => {
            let client = inpod::ZdsClient::new(
                cfg.zds_path.clone(),
                shared.clone(),
                pods.clone(),
                ready.clone(),
            )?;
            tokio::spawn(client.run());
        }
    }

    let quit = Arc::new(tokio::sync::Notify::new());
    sideport::serve(
        cfg.readiness_addr,
        "readiness",
        admin::readiness(ready.clone(), xds_synced),
    )
    .await
    .with_context(|| format!("readiness server on {}", cfg.readiness_addr))?;
    crate::limits::register(&mut registry);
    super::metrics::RuntimeGauges(tokio::runtime::Handle::current()).register(&mut registry);
    super::metrics::register_build_info(&mut registry);
    sideport::serve(
        cfg.metrics_addr,
        "metrics",
        admin::metrics(Arc::new(registry)),
    )
    .await
    .with_context(|| format!("metrics server on {}", cfg.metrics_addr))?;
    let view = AdminView {
        quit: quit.clone(),
        state,
        certs,
        pool: pool.clone(),
        pods,
        trust_domain: cfg.trust_domain.clone(),
        configured: Configured::of(&cfg),
    };
    sideport::serve(cfg.admin_addr, "admin", admin::admin(view))
        .await
        .with_context(|| format!("admin server on {}", cfg.admin_addr))?;
    tracing::info!(mode = ?cfg.mode, open_files, memory_budget = budget, "proxy started");
    Ok(ProxyHandle {
        quit,
        fatal,
        stop_trigger,
        ready,
        pool,
        active,
        drain_timeout: cfg.drain_timeout,
    })
}

/// Dedicated mode: the one pod this proxy runs beside. Its certificate may
/// not be there yet (CA away): retry with backoff, not ready meanwhile.
async fn serve_dedicated(
    shared: Arc<ProxyShared>,
    info: PodInfo,
    ready: Arc<AtomicBool>,
    fatal: mpsc::UnboundedSender<anyhow::Error>,
) {
    if let Some(demand) = &shared.demand {
        // On demand, the pod's workload is fetched by its addresses:
        // give the first stream a moment to open.
        demand.until_connected().await;
    }
    let (trigger, drain) = Drain::new();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(15));
    let sockets = || {
        SocketFactory::local(
            shared.sockets.clone(),
            format!("{}/{}", info.namespace, info.name),
        )
    };
    loop {
        match shared.pod(&info, sockets(), drain.clone(), None).await {
            Ok(pod) => {
                tracing::info!(pod = %pod.uid, identity = %pod.identity, ips = ?pod.ips, "serving pod (dedicated mode)");
                if let Err(e) = shared.start(pod) {
                    let _ = fatal.send(e.context("cannot open the pod's listeners"));
                    return;
                }
                ready.store(true, Ordering::Release);
                break;
            }
            Err(e) => tracing::warn!(error = %e, "pod not served yet; retrying"),
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
    // Held for the life of the process: dropping it would drain the pod.
    let _keep = trigger;
    std::future::pending::<()>().await;
}

impl ProxyHandle {
    /// Serves until a signal, `/quitquitquit` or a fatal error, then drains:
    /// stop accepting (a successor listening beside us takes new
    /// connections), give connections in flight until the deadline; a second
    /// signal exits at once.
    pub async fn wait(mut self) -> anyhow::Result<()> {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let fatal = tokio::select! {
            _ = term.recv() => { tracing::info!("SIGTERM: draining"); None }
            _ = tokio::signal::ctrl_c() => { tracing::info!("SIGINT: draining"); None }
            _ = self.quit.notified() => { tracing::info!("/quitquitquit: draining"); None }
            Some(e) = self.fatal.recv() => Some(e),
        };
        self.stop_trigger.fire();
        self.ready.store(false, Ordering::Release);
        if let Some(e) = fatal {
            return Err(e);
        }
        // Outbound HBONE connections close with GOAWAY once their streams end.
        self.pool.drain();
        let deadline = tokio::time::Instant::now() + self.drain_timeout;
        while self.active.count() > 0 && tokio::time::Instant::now() < deadline {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = term.recv() => break,
                _ = tokio::signal::ctrl_c() => break,
            }
        }
        tracing::info!(open = self.active.count(), "proxy exiting");
        Ok(())
    }
}
