//! The plugin event server: `POST /cmdadd` on `<run dir>/pluginevent.sock`,
//! one CNI ADD per request, answered 200 once the pod is enrolled (or left
//! out by the node's rule) and 500 with the reason otherwise.

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

use super::{Agent, PLUGIN_SOCKET};
use crate::cni::plugin::AddEvent;
use crate::limits::{caps, ConnectionCap};
use crate::unix_bind::{KeptPath, SOCKET_CHECK};

/// Binds the plugin socket in `run_dir` (0750 dir; the socket 0600 from
/// the start, [`crate::unix_bind`]) and serves events on it until the
/// process ends. A socket file removed meanwhile is bound again within
/// [`SOCKET_CHECK`] ([`KeptPath`]): until then, every ADD that must be
/// enrolled fails closed.
pub(super) fn spawn(agent: Arc<Agent>, run_dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o750)
        .create(run_dir)?;
    let sock = run_dir.join(PLUGIN_SOCKET);
    let _ = std::fs::remove_file(&sock);
    let listener = bind(&sock).with_context(|| format!("plugin socket {}", sock.display()))?;
    let kept = KeptPath::new(&sock, "plugin event socket");
    tokio::spawn(plugin_events(agent, listener, kept));
    Ok(())
}

/// The plugin socket at `path`, owner-only from its creation.
fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    crate::unix_bind::owner_only(path, |path| {
        let l = std::os::unix::net::UnixListener::bind(path)?;
        l.set_nonblocking(true)?;
        Ok(l)
    })
    .and_then(tokio::net::UnixListener::from_std)
}

/// Reads the ADD event the plugin POSTs: the Go field names of Istio's
/// `CNIPluginAddEvent` as JSON. Pure, so fuzz/ feeds it arbitrary bodies.
pub fn parse_add_event(body: &[u8]) -> Result<AddEvent, serde_json::Error> {
    serde_json::from_slice(body)
}

async fn plugin_events(
    agent: Arc<Agent>,
    mut listener: tokio::net::UnixListener,
    mut kept: KeptPath,
) {
    let cap = ConnectionCap::new("agent_events", caps::AGENT_EVENTS);
    let mut check = tokio::time::interval(SOCKET_CHECK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = check.tick() => {
                if let Some(fresh) = kept.check(bind) {
                    listener = fresh;
                }
                continue;
            }
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let Some(slot) = cap.admit(std::net::Ipv4Addr::LOCALHOST.into()) else {
            continue;
        };
        let agent = agent.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let svc = service_fn(move |req: Request<Incoming>| {
                let agent = agent.clone();
                async move { Ok::<_, Infallible>(handle_event(agent, req).await) }
            });
            let _ = crate::sideport::http1()
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
    let body = Limited::new(req.into_body(), 64 * 1024).collect();
    let body = match tokio::time::timeout(crate::sideport::HEADER_TIMEOUT, body).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => return reply(StatusCode::BAD_REQUEST, format!("body: {e}\n")),
        Err(_) => return reply(StatusCode::REQUEST_TIMEOUT, "body: too slow\n".into()),
    };
    let ev = match parse_add_event(&body) {
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
