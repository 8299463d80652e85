//! The small HTTP/1.1 server behind every side port of the agent and the
//! proxy: readiness, metrics and admin. A handler maps (method, path) to a
//! reply; this file owns the listener, hyper and the Prometheus rendering.
//! What each port answers lives with its role. Never on the data path.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// What a handler answers: status, content type and body.
pub type Reply = (StatusCode, &'static str, String);

/// Answers one admin request, given the method and the path with its query.
pub type Handler = Arc<dyn Fn(&Method, &str) -> Reply + Send + Sync>;

/// The answer to a path no endpoint serves.
pub fn not_found() -> Reply {
    (StatusCode::NOT_FOUND, TEXT, "not found\n".into())
}

/// Binds `addr` and serves `handler` until the process ends.
pub async fn serve(
    addr: SocketAddr,
    handler: Handler,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let (status, content_type, body) = handler(
                        req.method(),
                        req.uri()
                            .path_and_query()
                            .map(|p| p.as_str())
                            .unwrap_or("/"),
                    );
                    let resp = Response::builder()
                        .status(status)
                        .header("content-type", content_type)
                        .body(Full::new(Bytes::from(body)))
                        .unwrap_or_default();
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    }))
}

/// Renders `registry` as the Prometheus text a scraper reads.
pub fn metrics_reply(registry: &prometheus_client::registry::Registry) -> Reply {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, registry) {
        Ok(()) => (StatusCode::OK, PROMETHEUS, text),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, TEXT, e.to_string()),
    }
}

pub const TEXT: &str = "text/plain; charset=utf-8";
pub const JSON: &str = "application/json";
pub const PROMETHEUS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
