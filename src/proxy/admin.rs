//! What the proxy's side ports answer: readiness (15021 `/healthz/ready`),
//! metrics (15020 `/metrics`, `/stats/prometheus`) and admin (15000
//! `/config_dump`, `/logging`, `/debug/pprof/*`, `/quitquitquit`). The HTTP server is
//! [`crate::sideport`]; values come from the owners' snapshots at request time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use http::{Method, StatusCode};
use prometheus_client::registry::Registry;

use super::config_dump::{config_dump, Configured};
use super::{inpod, pool, profile};
use crate::identity::CertManager;
use crate::sideport::{metrics_reply, not_found, Handler, JSON, TEXT};
use crate::xds::StateHandle;

/// 15021: ready once the pods are served and the first xDS state is in.
pub(super) fn readiness(ready: Arc<AtomicBool>, xds_synced: Arc<AtomicBool>) -> Handler {
    Arc::new(move |_, path| {
        let is_ready = ready.load(Ordering::Acquire) && xds_synced.load(Ordering::Acquire);
        match (path, is_ready) {
            ("/healthz/ready", true) => (StatusCode::OK, TEXT, "ready\n".into()),
            ("/healthz/ready", false) => {
                (StatusCode::SERVICE_UNAVAILABLE, TEXT, "not ready\n".into())
            }
            _ => not_found(),
        }
        .into()
    })
}

/// 15020: the registry, under both paths scrapers use.
pub(super) fn metrics(registry: Arc<Registry>) -> Handler {
    Arc::new(move |_, path| {
        match path {
            "/metrics" | "/stats/prometheus" => metrics_reply(&registry),
            _ => not_found(),
        }
        .into()
    })
}

/// What the admin port reads from.
pub(super) struct AdminView {
    pub quit: Arc<tokio::sync::Notify>,
    pub state: StateHandle,
    pub certs: Arc<CertManager>,
    pub pool: Arc<pool::Pool>,
    pub pods: Arc<inpod::PodTable>,
    /// Of workloads that do not name theirs.
    pub trust_domain: String,
    pub configured: Configured,
}

/// What `GET /` lists.
const INDEX: &str = "\
/config_dump
/logging[?level=<filter>] (POST to change)
/debug/pprof/profile[?seconds=10&frequency=100] (CPU, pprof)
/debug/pprof/heap/profiling[?activate=true|false] (heap sampling on or off)
/debug/pprof/heap (heap, pprof; while sampling is on)
/quitquitquit (POST)
";

/// 15000 (localhost): config dump, log level, profiles, shutdown.
pub(super) fn admin(view: AdminView) -> Handler {
    Arc::new(move |method, path| {
        let route = path.split_once('?').map_or(path, |(p, _)| p);
        match (method, route) {
            (&Method::POST, "/quitquitquit") => {
                view.quit.notify_one();
                (StatusCode::OK, TEXT, "shutting down\n".into())
            }
            (_, "/logging") => logging(method, path),
            (_, "/config_dump") => (
                StatusCode::OK,
                JSON,
                config_dump(
                    &view.state,
                    &view.certs,
                    &view.pool,
                    &view.pods,
                    &view.trust_domain,
                    &view.configured,
                )
                .into(),
            ),
            (&Method::GET, "/debug/pprof/profile") => return profile::cpu(path),
            (&Method::GET, "/debug/pprof/heap") => return profile::heap(),
            (_, "/debug/pprof/heap/profiling") => return profile::heap_profiling(path),
            (_, "/") => (StatusCode::OK, TEXT, INDEX.into()),
            _ => not_found(),
        }
        .into()
    })
}

/// `GET /logging` shows the filter; `POST /logging?level=<filter>` sets it.
fn logging(method: &Method, path: &str) -> crate::sideport::Reply {
    let level = profile::query(path, "level");
    match (method, level) {
        (&Method::POST, Some(level)) => match crate::logging::set(level) {
            Ok(()) => (StatusCode::OK, TEXT, format!("level={level}\n").into()),
            Err(e) => (StatusCode::BAD_REQUEST, TEXT, format!("{e}\n").into()),
        },
        (&Method::POST, None) => (
            StatusCode::BAD_REQUEST,
            TEXT,
            "POST /logging?level=<filter>\n".into(),
        ),
        _ => (
            StatusCode::OK,
            TEXT,
            format!("level={}\n", crate::logging::current()).into(),
        ),
    }
}
