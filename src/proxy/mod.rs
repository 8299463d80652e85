//! The L4 data path: per-pod listeners (outbound 15001, inbound plaintext
//! 15006, inbound HBONE 15008), the HBONE pool, byte copying, metrics and the
//! admin endpoints. It reads mesh state only through `StateHandle` snapshots
//! and never parses config or talks to a control plane itself.

pub mod admin;
pub mod copy;
pub mod dns;
pub mod hbone;
pub mod inbound;
pub mod inpod;
pub mod metrics;
pub mod outbound;
pub mod pod;
pub mod pool;
pub mod rbac;
pub mod reauth;
pub mod timewait;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use http::{Method, StatusCode};
use prometheus_client::registry::Registry;

use crate::config::{ProxyConfig, ProxyMode};
use crate::constants::{DNS_PORT, HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};
use crate::identity::caclient::CaClient;
use crate::identity::{CertManager, CertSource, Identity, LocalCa};
use crate::netns::Netns;
use crate::xds::{self, StateHandle};
use hbone::H2Settings;
use pod::{Drain, Pod, PodRef, SocketFactory};

/// Runs the proxy role until SIGTERM, SIGINT or `/quitquitquit`.
pub fn run(cfg: ProxyConfig) -> anyhow::Result<()> {
    tune_allocator();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.worker_threads)
        .thread_name("ambit-proxy")
        .enable_all()
        .build()?;
    rt.block_on(serve(cfg))
}

/// Keeps glibc malloc from mapping and unmapping (and page-faulting in) the
/// 16–256 KiB buffers the copy loops cycle through: without this, a bulk
/// HBONE flow spends a tenth of its CPU in page faults (perf, measured).
///
/// The price was memory kept after a bulk flow ends: 6–8 MB after one HBONE
/// iperf3 run, the free top of each worker thread's arena, which glibc gives
/// back only past that threshold and which `malloc_trim` never touches in a
/// thread arena. So all threads share the main arena (small allocations
/// stay per thread in glibc's tcache), and every [`TRIM_EVERY`] a small
/// thread hands its free pages back: a bulk flow keeps its buffers between
/// two trims, an idle proxy returns to its size at start (measured: 8.4 MB
/// of anonymous memory left after an HBONE run with the trim alone, 1.3 MB
/// with both; HBONE throughput and connection rate unchanged within noise).
fn tune_allocator() {
    // SAFETY: mallopt only changes allocator parameters; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    let trimmer = std::thread::Builder::new()
        .name("ambit-trim".into())
        .stack_size(64 * 1024)
        .spawn(|| loop {
            std::thread::sleep(TRIM_EVERY);
            // SAFETY: malloc_trim only releases free memory; it takes the
            // arenas' locks like any allocation.
            unsafe { libc::malloc_trim(0) };
        });
    if let Err(e) = trimmer {
        tracing::warn!(error = %e, "no trim thread: memory freed after bulk flows stays with the process");
    }
}

/// How often free allocator memory goes back to the system.
const TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// What every served pod shares: state, certificates, pool, metrics, settings.
pub struct ProxyShared {
    pub state: StateHandle,
    pub certs: Arc<CertManager>,
    pub pool: Arc<pool::Pool>,
    pub metrics: Arc<metrics::Metrics>,
    pub h2: H2Settings,
    pub cluster: String,
    pub trust_domain: String,
    pub network: String,
    /// Mark and congestion control of every pod socket.
    pub sockets: pod::SocketOptions,
    pub ipv6: bool,
    /// Fired when the proxy exits: every pod stops accepting.
    pub stop_accepting: Drain,
    pub active: Arc<pod::ActiveConnections>,
    pub tracker: Arc<reauth::Tracker>,
    /// Resolvers for non-mesh names; `None`: no DNS proxy.
    pub dns_upstreams: Option<Arc<Vec<SocketAddr>>>,
    /// Fetches addresses the state lacks (`XDS_ON_DEMAND` with a control plane).
    pub demand: Option<xds::client::OnDemand>,
}

/// A pod's identity as the agent (or `PROXY_WORKLOAD_INFO`) gives it.
#[derive(Debug, Clone)]
pub struct PodInfo {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub service_account: String,
}

impl ProxyShared {
    /// Builds a pod: identity and certificate, addresses from the state (or
    /// from the pod's interfaces when the state does not list it).
    pub async fn pod(
        &self,
        info: &PodInfo,
        sockets: SocketFactory,
        drain: Drain,
        netns: Option<&Netns>,
    ) -> anyhow::Result<PodRef> {
        let identity = Identity::new(&self.trust_domain, &info.namespace, &info.service_account);
        let mut snapshot = self.state.load();
        let interfaces = || -> anyhow::Result<Vec<IpAddr>> {
            Ok(match netns {
                None => interface_ips(),
                Some(ns) => {
                    let home = Netns::current()?;
                    ns.with(&home, || Ok(interface_ips()))?
                }
            })
        };
        if snapshot
            .workload_by_name(&info.namespace, &info.name)
            .is_none()
        {
            if let Some(demand) = &self.demand {
                // On demand, the pod's own workload comes by its addresses.
                // With no stream open, subscribe but do not hold up the pod:
                // its addresses come from its interfaces meanwhile.
                let asks = interfaces()?
                    .into_iter()
                    .map(|ip| demand.fetch_address(&self.network, ip));
                futures_util::future::join_all(asks).await;
                snapshot = self.state.load();
            }
        }
        let workload = snapshot.workload_by_name(&info.namespace, &info.name);
        let ips = match workload {
            Some(w) => w.workload_ips.clone(),
            None => interfaces()?,
        };
        Ok(Arc::new(Pod {
            uid: info.uid.clone(),
            name: info.name.clone(),
            namespace: info.namespace.clone(),
            service_account: info.service_account.clone(),
            network: workload
                .map(|w| w.network.clone())
                .unwrap_or_else(|| self.network.clone()),
            canonical_service: workload
                .map(|w| w.canonical_service().to_string())
                .unwrap_or_else(|| info.name.clone()),
            canonical_revision: workload
                .map(|w| w.canonical_revision.clone())
                .filter(|r| !r.is_empty())
                .unwrap_or_else(|| "latest".into()),
            tls: self.certs.get(&identity).await?,
            identity,
            ips,
            sockets,
            life: pod::Lifecycle {
                drain,
                stop_accepting: self.stop_accepting.clone(),
                active: self.active.clone(),
            },
        }))
    }

    /// Binds the pod's three listeners (inside its netns) and serves them
    /// until its drain fires. Tasks only: no thread per pod.
    pub fn start(self: &Arc<Self>, pod: PodRef) -> anyhow::Result<()> {
        let any = |port| -> SocketAddr {
            if self.ipv6 {
                (Ipv6Addr::UNSPECIFIED, port).into()
            } else {
                (Ipv4Addr::UNSPECIFIED, port).into()
            }
        };
        let listen = |port| {
            pod.sockets
                .listen(any(port))
                .with_context(|| format!("pod {}: listening on port {port}", pod.uid))
        };
        let (out_l, plain_l, hbone_l) = (
            listen(OUTBOUND_PORT)?,
            listen(INBOUND_PLAINTEXT_PORT)?,
            listen(HBONE_PORT)?,
        );
        // Once here, not per connection: accepted sockets inherit the cap.
        if let Err(e) = pod::limit_unsent(&hbone_l, self.h2.unsent_limit) {
            tracing::debug!(pod = %pod.uid, error = %e, "cannot limit HBONE connections' unsent data");
        }
        let outbound = Arc::new(outbound::Outbound {
            pod: pod.clone(),
            state: self.state.clone(),
            demand: self.demand.clone(),
            pool: self.pool.clone(),
            metrics: self.metrics.clone(),
            h2: self.h2,
            cluster: self.cluster.clone(),
            trust_domain: self.trust_domain.clone(),
        });
        let inbound = Arc::new(inbound::Inbound {
            pod: pod.clone(),
            state: self.state.clone(),
            demand: self.demand.clone(),
            metrics: self.metrics.clone(),
            h2: self.h2,
            trust_domain: self.trust_domain.clone(),
            tracker: self.tracker.clone(),
        });
        tokio::spawn(outbound.serve(out_l));
        tokio::spawn(inbound.clone().serve_hbone(hbone_l));
        tokio::spawn(inbound.serve_plaintext(plain_l));
        if let Some(upstreams) = &self.dns_upstreams {
            let dns = Arc::new(dns::DnsProxy::new(
                pod.clone(),
                self.state.clone(),
                upstreams.clone(),
                self.metrics.clone(),
            ));
            let mut addrs: Vec<SocketAddr> = vec![(Ipv4Addr::LOCALHOST, DNS_PORT).into()];
            if self.ipv6 {
                addrs.push((Ipv6Addr::LOCALHOST, DNS_PORT).into());
            }
            for (i, addr) in addrs.into_iter().enumerate() {
                // The IPv4 pair is required; [::1] only where the pod has IPv6 loopback.
                let bound = pod
                    .sockets
                    .udp(addr, false)
                    .and_then(|u| Ok((u, pod.sockets.listen(addr)?)));
                match bound {
                    Ok((udp, tcp)) => {
                        tokio::spawn(dns.clone().serve_udp(udp));
                        tokio::spawn(dns.clone().serve_tcp(tcp));
                    }
                    Err(e) if i == 0 => {
                        return Err(e).with_context(|| format!("pod {}: DNS on {addr}", pod.uid))
                    }
                    Err(e) => tracing::debug!(pod = %pod.uid, error = %e, "no DNS on [::1]"),
                }
            }
        }
        Ok(())
    }
}

async fn serve(cfg: ProxyConfig) -> anyhow::Result<()> {
    let sockets = pod::SocketOptions {
        mark: cfg.packet_mark,
        congestion_control: cfg.congestion_control.clone(),
    }
    .usable(cfg.congestion_control_chosen)?;
    let mut registry = Registry::default();
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
                },
                state.clone(),
            );
            xds_synced.clone_from(&client.synced);
            client.metrics.register(&mut registry);
            demand = xds::client::OnDemand::of(&client);
            tokio::spawn(client.run());
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
    let certs = CertManager::new(source, cfg.cert_ttl);
    certs.spawn_releaser(std::time::Duration::from_secs(10));
    let metrics = Arc::new(metrics::Metrics::default());
    metrics.register(&mut registry);
    let active_pods = prometheus_client::metrics::gauge::Gauge::<i64>::default();
    registry.register(
        "workload_manager_active_proxy_count",
        "Pods this proxy serves",
        active_pods.clone(),
    );
    let pending_pods = prometheus_client::metrics::gauge::Gauge::<i64>::default();
    registry.register(
        "workload_manager_pending_proxy_count",
        "Pods handed to this proxy that are not serving yet",
        pending_pods.clone(),
    );
    // Seconds until each held workload certificate expires: alert before it happens.
    let expiry = prometheus_client::metrics::family::Family::<
        Vec<(String, String)>,
        prometheus_client::metrics::gauge::Gauge,
    >::default();
    registry.register(
        "ambit_certificate_expiry_seconds",
        "Seconds until the workload certificate expires",
        expiry.clone(),
    );
    let pool = pool::Pool::new(cfg.pool_max_streams, cfg.pool_idle_timeout);
    pool.spawn_evictor();
    let (stop_trigger, stop_accepting) = Drain::new();
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
        network: cfg.network.clone(),
        sockets,
        ipv6: cfg.ipv6,
        stop_accepting,
        active: active.clone(),
        tracker: Arc::default(),
        dns_upstreams: cfg.dns_proxy.then(|| {
            let upstreams = if cfg.dns_upstreams.is_empty() {
                dns::resolv_conf_servers(
                    &std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default(),
                )
            } else {
                cfg.dns_upstreams.clone()
            };
            tracing::info!(
                ?upstreams,
                "DNS proxy on; other names go to these resolvers"
            );
            Arc::new(upstreams)
        }),
        demand,
    });
    shared.tracker.spawn_watcher(state.clone());

    let ready = Arc::new(AtomicBool::new(false));
    let pods: Arc<inpod::PodTable> = Arc::default();
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
            // The pod needs its certificate: retry (not ready meanwhile) while the CA is away.
            let (shared, ready) = (shared.clone(), ready.clone());
            tokio::spawn(async move {
                if let Some(demand) = &shared.demand {
                    // On demand, the pod's workload is fetched by its addresses:
                    // give the first stream a moment to open.
                    demand.until_connected().await;
                }
                let (trigger, drain) = Drain::new();
                let mut backoff = std::time::Duration::from_millis(100);
                loop {
                    match shared
                        .pod(
                            &info,
                            SocketFactory::local(
                                shared.sockets.clone(),
                                format!("{}/{}", info.namespace, info.name),
                            ),
                            drain.clone(),
                            None,
                        )
                        .await
                    {
                        Ok(pod) => {
                            tracing::info!(pod = %pod.uid, identity = %pod.identity, ips = ?pod.ips, "serving pod (dedicated mode)");
                            if let Err(e) = shared.start(pod) {
                                tracing::error!(error = %e, "cannot open the pod's listeners");
                                std::process::exit(1);
                            }
                            ready.store(true, Ordering::Release);
                            break;
                        }
                        Err(e) => tracing::warn!(error = %e, "pod not served yet; retrying"),
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(std::time::Duration::from_secs(15));
                }
                // Held for the life of the process: dropping it would drain the pod.
                let _keep = trigger;
                std::future::pending::<()>().await;
            });
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
    let (r, x) = (ready.clone(), xds_synced.clone());
    admin::serve(
        cfg.readiness_addr,
        Arc::new(move |_, path| {
            match (path, r.load(Ordering::Acquire) && x.load(Ordering::Acquire)) {
                ("/healthz/ready", true) => (StatusCode::OK, admin::TEXT, "ready\n".into()),
                ("/healthz/ready", false) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    admin::TEXT,
                    "not ready\n".into(),
                ),
                _ => admin::not_found(),
            }
        }),
    )
    .await
    .with_context(|| format!("readiness server on {}", cfg.readiness_addr))?;
    let registry = Arc::new(registry);
    let scrape_certs = certs.clone();
    let scrape_pods = pods.clone();
    let dedicated_pods = i64::from(cfg.mode == ProxyMode::Dedicated);
    admin::serve(
        cfg.metrics_addr,
        Arc::new(move |_, path| match path {
            "/metrics" | "/stats/prometheus" => {
                pending_pods.set(scrape_pods.pending());
                active_pods.set(if scrape_pods.uids().is_empty() {
                    dedicated_pods
                } else {
                    scrape_pods.uids().len() as i64
                });
                // Certificate expiry is computed at scrape time, so it is never stale.
                expiry.clear();
                for (id, not_after) in scrape_certs.summary() {
                    let left = not_after
                        .duration_since(std::time::SystemTime::now())
                        .map(|d| d.as_secs() as i64)
                        .unwrap_or(0);
                    expiry
                        .get_or_create(&vec![("identity".to_string(), id)])
                        .set(left);
                }
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &registry) {
                    Ok(()) => (StatusCode::OK, admin::PROMETHEUS, text),
                    Err(e) => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        admin::TEXT,
                        e.to_string(),
                    ),
                }
            }
            _ => admin::not_found(),
        }),
    )
    .await
    .with_context(|| format!("metrics server on {}", cfg.metrics_addr))?;
    let (q, st, c, p, t) = (
        quit.clone(),
        state.clone(),
        certs.clone(),
        pool.clone(),
        pods.clone(),
    );
    admin::serve(
        cfg.admin_addr,
        Arc::new(move |method, path| match (method, path) {
            (&Method::POST, "/quitquitquit") => {
                q.notify_one();
                (StatusCode::OK, admin::TEXT, "shutting down\n".into())
            }
            (_, p) if p == "/logging" || p.starts_with("/logging?") => {
                let level = p
                    .split_once('?')
                    .and_then(|(_, q)| q.split('&').find_map(|kv| kv.strip_prefix("level=")));
                match (method, level) {
                    (&Method::POST, Some(level)) => match crate::logging::set(level) {
                        Ok(()) => (StatusCode::OK, admin::TEXT, format!("level={level}\n")),
                        Err(e) => (StatusCode::BAD_REQUEST, admin::TEXT, format!("{e}\n")),
                    },
                    (&Method::POST, None) => (
                        StatusCode::BAD_REQUEST,
                        admin::TEXT,
                        "POST /logging?level=<filter>\n".into(),
                    ),
                    _ => (
                        StatusCode::OK,
                        admin::TEXT,
                        format!("level={}\n", crate::logging::current()),
                    ),
                }
            }
            (_, "/config_dump") => (StatusCode::OK, admin::JSON, config_dump(&st, &c, &p, &t)),
            (_, "/") => (
                StatusCode::OK,
                admin::TEXT,
                "/config_dump\n/logging[?level=<filter>] (POST to change)\n/quitquitquit (POST)\n"
                    .into(),
            ),
            _ => admin::not_found(),
        }),
    )
    .await
    .with_context(|| format!("admin server on {}", cfg.admin_addr))?;

    tracing::info!(mode = ?cfg.mode, "proxy started");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: draining"),
        _ = quit.notified() => tracing::info!("/quitquitquit: draining"),
    }
    // Stop accepting (a successor listening beside us takes new connections),
    // then give connections in flight until the deadline; a second signal exits at once.
    stop_trigger.fire();
    ready.store(false, Ordering::Release);
    // Outbound HBONE connections close with GOAWAY once their streams end.
    pool.drain();
    let deadline = tokio::time::Instant::now() + cfg.drain_timeout;
    while active.count() > 0 && tokio::time::Instant::now() < deadline {
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_millis(50)) => {}
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    tracing::info!(open = active.count(), "proxy exiting");
    Ok(())
}

fn interface_ips() -> Vec<IpAddr> {
    nix::ifaddrs::getifaddrs()
        .map(|addrs| {
            addrs
                .filter_map(|a| a.address)
                .filter_map(|s| {
                    s.as_sockaddr_in()
                        .map(|v4| IpAddr::V4(v4.ip()))
                        .or_else(|| s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
                })
                .filter(|ip| !ip.is_loopback())
                .collect()
        })
        .unwrap_or_default()
}

fn config_dump(
    state: &StateHandle,
    certs: &CertManager,
    pool: &pool::Pool,
    pods: &inpod::PodTable,
) -> String {
    let st = state.load();
    let workloads: Vec<_> = st
        .workloads()
        .map(|w| serde_json::json!({"uid": w.uid, "name": w.name, "namespace": w.namespace, "serviceAccount": w.service_account,
            "workloadIps": w.workload_ips, "protocol": format!("{:?}", w.protocol).to_uppercase()}))
        .collect();
    let services: Vec<_> = st
        .services()
        .map(|s| {
            serde_json::json!({"name": s.name, "namespace": s.namespace, "hostname": s.hostname,
            "vips": s.vips.iter().map(|v| v.to_string()).collect::<Vec<_>>(), "ports": s.ports})
        })
        .collect();
    let policies: Vec<_> = st.policies().map(|p| p.key()).collect();
    let certificates: Vec<_> = certs
        .summary()
        .into_iter()
        .map(|(id, exp)| {
            let secs = exp
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            serde_json::json!({"identity": id, "expiresUnix": secs})
        })
        .collect();
    let served: Vec<_> = pods
        .views()
        .into_iter()
        .map(|p| {
            let cert = certificates
                .iter()
                .find(|c| c["identity"] == p.identity)
                .cloned();
            serde_json::json!({
                "uid": p.uid, "name": p.name, "namespace": p.namespace, "identity": p.identity,
                "ips": p.ips, "netns": {"dev": p.netns.0, "ino": p.netns.1}, "addedUnix": p.added_unix,
                // Serving with its certificate, or still waiting for it from the CA.
                "state": if cert.is_some() { "serving" } else { "certificate pending" },
                "certificateExpiresUnix": cert.map(|c| c["expiresUnix"].clone()),
            })
        })
        .collect();
    serde_json::json!({
        "workloads": workloads, "services": services, "policies": policies, "certificates": certificates,
        "pool": {"open": pool.open(), "dials": pool.dials()},
        "pods": served,
    })
    .to_string()
}
