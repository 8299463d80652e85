//! The L4 data path: per-pod listeners (outbound 15001, inbound plaintext
//! 15006, inbound HBONE 15008), the HBONE pool, byte copying, metrics and the
//! admin endpoints. It reads mesh state only through `StateHandle` snapshots
//! and never parses config or talks to a control plane itself.

pub mod admin;
pub mod copy;
pub mod hbone;
pub mod inbound;
pub mod metrics;
pub mod outbound;
pub mod pod;
pub mod pool;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use http::{Method, StatusCode};
use prometheus_client::registry::Registry;

use crate::config::{ProxyConfig, WorkloadInfo};
use crate::constants::{HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};
use crate::identity::{CertManager, Identity, LocalCa};
use crate::xds::{self, StateHandle};
use hbone::H2Settings;
use pod::{Pod, PodRef, SocketFactory};

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
fn tune_allocator() {
    // SAFETY: mallopt only changes allocator parameters; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 4 << 20);
    }
}

async fn serve(cfg: ProxyConfig) -> anyhow::Result<()> {
    let state = StateHandle::new(xds::local::load(&cfg.local_xds_path)?);
    tokio::spawn(xds::local::watch(cfg.local_xds_path.clone(), state.clone()));

    let ca = match (&cfg.ca_cert, &cfg.ca_key) {
        (Some(cert), Some(key)) => LocalCa::from_files(cert, key)?,
        _ => LocalCa::load_or_generate(&cfg.state_dir, &cfg.trust_domain)?,
    };
    let certs = CertManager::new(ca, cfg.cert_ttl);
    let wi = cfg
        .workload_info
        .clone()
        .context("dedicated mode needs workload_info")?;
    let pod = dedicated_pod(&cfg, &wi, &state, &certs)?;
    tracing::info!(pod = %format!("{}/{}", pod.namespace, pod.name), identity = %pod.identity, ips = ?pod.ips, "serving pod");

    let metrics = Arc::new(metrics::Metrics::default());
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let h2 = H2Settings {
        stream_window: cfg.stream_window,
        connection_window: cfg.connection_window,
        frame_size: cfg.frame_size,
    };
    let pool = pool::Pool::new(cfg.pool_max_streams, cfg.pool_idle_timeout);
    pool.spawn_evictor();

    let any = |port| -> SocketAddr {
        if cfg.ipv6 {
            (Ipv6Addr::UNSPECIFIED, port).into()
        } else {
            (Ipv4Addr::UNSPECIFIED, port).into()
        }
    };
    let listen = |port| {
        pod.sockets
            .listen(any(port))
            .with_context(|| format!("listening on port {port}"))
    };
    let (out_l, plain_l, hbone_l) = (
        listen(OUTBOUND_PORT)?,
        listen(INBOUND_PLAINTEXT_PORT)?,
        listen(HBONE_PORT)?,
    );

    let outbound = Arc::new(outbound::Outbound {
        pod: pod.clone(),
        state: state.clone(),
        pool: pool.clone(),
        metrics: metrics.clone(),
        h2,
        cluster: cfg.cluster_id.clone(),
        trust_domain: cfg.trust_domain.clone(),
    });
    let inbound = Arc::new(inbound::Inbound {
        pod: pod.clone(),
        state: state.clone(),
        metrics: metrics.clone(),
        h2,
        trust_domain: cfg.trust_domain.clone(),
    });
    tokio::spawn(outbound.serve(out_l));
    tokio::spawn(inbound.clone().serve_hbone(hbone_l));
    tokio::spawn(inbound.serve_plaintext(plain_l));

    let ready = Arc::new(AtomicBool::new(false));
    let quit = Arc::new(tokio::sync::Notify::new());
    let r = ready.clone();
    admin::serve(
        cfg.readiness_addr,
        Arc::new(move |_, path| match (path, r.load(Ordering::Acquire)) {
            ("/healthz/ready", true) => (StatusCode::OK, admin::TEXT, "ready\n".into()),
            ("/healthz/ready", false) => (
                StatusCode::SERVICE_UNAVAILABLE,
                admin::TEXT,
                "not ready\n".into(),
            ),
            _ => (StatusCode::NOT_FOUND, admin::TEXT, "not found\n".into()),
        }),
    )
    .await
    .with_context(|| format!("readiness server on {}", cfg.readiness_addr))?;
    let registry = Arc::new(registry);
    admin::serve(
        cfg.metrics_addr,
        Arc::new(move |_, path| match path {
            "/metrics" | "/stats/prometheus" => {
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
            _ => (StatusCode::NOT_FOUND, admin::TEXT, "not found\n".into()),
        }),
    )
    .await
    .with_context(|| format!("metrics server on {}", cfg.metrics_addr))?;
    let (q, st, c, p) = (quit.clone(), state.clone(), certs.clone(), pool.clone());
    admin::serve(
        cfg.admin_addr,
        Arc::new(move |method, path| match (method, path) {
            (&Method::POST, "/quitquitquit") => {
                q.notify_one();
                (StatusCode::OK, admin::TEXT, "shutting down\n".into())
            }
            (_, "/config_dump") => (StatusCode::OK, admin::JSON, config_dump(&st, &c, &p)),
            (_, "/") => (
                StatusCode::OK,
                admin::TEXT,
                "/config_dump\n/quitquitquit (POST)\n".into(),
            ),
            _ => (StatusCode::NOT_FOUND, admin::TEXT, "not found\n".into()),
        }),
    )
    .await
    .with_context(|| format!("admin server on {}", cfg.admin_addr))?;

    ready.store(true, Ordering::Release);
    tracing::info!("proxy ready");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: exiting"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: exiting"),
        _ = quit.notified() => tracing::info!("/quitquitquit: exiting"),
    }
    Ok(())
}

/// The pod a dedicated proxy serves: identity from `workload_info`, addresses
/// from the state (or, if the state does not list it, from the interfaces).
fn dedicated_pod(
    cfg: &ProxyConfig,
    wi: &WorkloadInfo,
    state: &StateHandle,
    certs: &Arc<CertManager>,
) -> anyhow::Result<PodRef> {
    let identity = Identity::new(&cfg.trust_domain, &wi.namespace, &wi.service_account);
    let snapshot = state.load();
    let workload = snapshot.workload_by_name(&wi.namespace, &wi.name);
    let ips = match workload {
        Some(w) => w.workload_ips.clone(),
        None => {
            tracing::warn!(pod = %format!("{}/{}", wi.namespace, wi.name), "served pod is not in the local config; using interface addresses");
            interface_ips()
        }
    };
    Ok(Arc::new(Pod {
        uid: workload
            .map(|w| w.uid.clone())
            .unwrap_or_else(|| format!("{}/{}", wi.namespace, wi.name)),
        name: wi.name.clone(),
        namespace: wi.namespace.clone(),
        service_account: wi.service_account.clone(),
        network: workload
            .map(|w| w.network.clone())
            .unwrap_or_else(|| cfg.network.clone()),
        canonical_service: workload
            .map(|w| w.canonical_service().to_string())
            .unwrap_or_else(|| wi.name.clone()),
        canonical_revision: workload
            .map(|w| w.canonical_revision.clone())
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| "latest".into()),
        tls: certs.get(&identity)?,
        identity,
        ips,
        sockets: SocketFactory::new(cfg.packet_mark, None),
    }))
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

fn config_dump(state: &StateHandle, certs: &CertManager, pool: &pool::Pool) -> String {
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
    serde_json::json!({
        "workloads": workloads, "services": services, "policies": policies, "certificates": certificates,
        "pool": {"open": pool.open(), "dials": pool.dials()},
    })
    .to_string()
}
