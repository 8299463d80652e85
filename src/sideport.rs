//! The small HTTP/1.1 server behind every side port of the agent and the
//! proxy: readiness, metrics and admin. A handler maps (method, path) to a
//! reply; this file owns the listener, hyper and the Prometheus rendering.
//! What each port answers lives with its role. Never on the data path.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::limits::{caps, ConnectionCap};

/// What a handler answers: status, content type and body.
pub type Reply = (StatusCode, &'static str, Bytes);

/// A reply at once, or one that takes its time (a CPU profile samples for
/// as long as it is asked to). Every other request on the port goes on.
pub enum Answer {
    Now(Reply),
    Later(Pin<Box<dyn Future<Output = Reply> + Send>>),
}

impl From<Reply> for Answer {
    fn from(reply: Reply) -> Self {
        Answer::Now(reply)
    }
}

/// Answers one admin request, given the method and the path with its query.
pub type Handler = Arc<dyn Fn(&Method, &str) -> Answer + Send + Sync>;

/// The answer to a path no endpoint serves.
pub fn not_found() -> Reply {
    (StatusCode::NOT_FOUND, TEXT, "not found\n".into())
}

/// How long a client has to send a request's headers, from the connection's
/// start or the end of its previous request. A side port is never a place
/// to hold a connection open (slowloris).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// The HTTP/1.1 server every side port and local socket uses: hyper with
/// its timer, so [`HEADER_TIMEOUT`] fires.
pub fn http1() -> hyper::server::conn::http1::Builder {
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    b
}

/// Binds `addr` and serves `handler` until the process ends; `name` labels
/// the listener's connection cap.
pub async fn serve(
    addr: SocketAddr,
    name: &'static str,
    handler: Handler,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
    let cap = ConnectionCap::new(name, caps::SIDE_PORT).per_source();
    let local = ConnectionCap::new(name, caps::SIDE_PORT_LOCAL);
    Ok(tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            // This host's own callers (the kubelet) have places of their
            // own: a source no remote peer can take (a TCP handshake cannot
            // come from the address it is sent to).
            let own =
                peer.ip().is_loopback() || stream.local_addr().is_ok_and(|l| l.ip() == peer.ip());
            let admitted = if own {
                local.admit(peer.ip())
            } else {
                cap.admit(peer.ip())
            };
            let Some(slot) = admitted else {
                continue;
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let _slot = slot;
                let svc = service_fn(move |req: Request<Incoming>| {
                    let answer = handler(
                        req.method(),
                        req.uri()
                            .path_and_query()
                            .map(|p| p.as_str())
                            .unwrap_or("/"),
                    );
                    async move {
                        let (status, content_type, body) = match answer {
                            Answer::Now(reply) => reply,
                            Answer::Later(reply) => reply.await,
                        };
                        let resp = Response::builder()
                            .status(status)
                            .header("content-type", content_type)
                            .body(Full::new(body))
                            .unwrap_or_default();
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = http1().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    }))
}

/// Renders `registry` as the Prometheus text a scraper reads.
pub fn metrics_reply(registry: &prometheus_client::registry::Registry) -> Reply {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, registry) {
        Ok(()) => (StatusCode::OK, PROMETHEUS, text.into()),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            TEXT,
            e.to_string().into(),
        ),
    }
}

pub const TEXT: &str = "text/plain; charset=utf-8";
pub const JSON: &str = "application/json";
pub const PROTOBUF: &str = "application/octet-stream";
pub const PROMETHEUS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
