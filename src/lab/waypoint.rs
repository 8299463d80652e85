//! A waypoint stand-in for the tests: an HBONE server in a lab pod (mutual
//! TLS with a certificate of its own identity, HTTP/2 CONNECT on 15008) that
//! records every CONNECT it is sent (authority, headers, the peer's
//! identity) and carries the stream on to the destination over HBONE, as a
//! real waypoint does after its L7 work. It does no policy and no L7: it is
//! the observer that shows where a proxy sent its traffic.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use tokio::net::{TcpListener, TcpStream};

use super::LabPod;
use crate::constants::HBONE_PORT;
use crate::identity::{tls, Identity, LocalCa, WorkloadCert};

/// One CONNECT the stand-in received.
#[derive(Debug, Clone)]
pub struct ConnectSeen {
    /// `:authority` as sent.
    pub authority: String,
    /// Every header, lower-case names.
    pub headers: HashMap<String, String>,
    /// The SPIFFE identity of the client certificate.
    pub peer: String,
}

/// A running stand-in; stops with the lab pod's netns.
pub struct WaypointStandIn {
    seen: Arc<Mutex<Vec<ConnectSeen>>>,
    connections: Arc<AtomicUsize>,
}

impl WaypointStandIn {
    /// Serves HBONE on `pod`'s 15008 as `identity`, with a certificate from
    /// the CA in `ca` (cert, key). A CONNECT to an authority in `forward`
    /// is carried to the address it maps to (a service VIP to an endpoint);
    /// any other authority is carried to itself.
    pub fn start(
        pod: &LabPod,
        ca: (&Path, &Path),
        identity: Identity,
        forward: HashMap<SocketAddr, SocketAddr>,
    ) -> std::io::Result<WaypointStandIn> {
        let (listener, cert) = listen_as(pod, ca, identity, HBONE_PORT)?;
        let onward = Onward::Hbone(Arc::new(forward));
        let (seen, connections) = spawn_server(pod, listener, cert, onward);
        Ok(WaypointStandIn { seen, connections })
    }

    /// How many HBONE connections (TLS and HTTP/2 handshakes done) it took.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// The CONNECTs received so far, oldest first.
    pub fn seen(&self) -> Vec<ConnectSeen> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A listener on `pod`'s `port` and a certificate for `identity` from the
/// CA in `ca` (cert, key).
pub(super) fn listen_as(
    pod: &LabPod,
    ca: (&Path, &Path),
    identity: Identity,
    port: u16,
) -> std::io::Result<(std::net::TcpListener, WorkloadCert)> {
    let ca = LocalCa::from_files(ca.0, ca.1).map_err(std::io::Error::other)?;
    let cert = ca
        .issue(&identity, Duration::from_secs(3600))
        .map_err(std::io::Error::other)?;
    let listener = pod
        .ns
        .run(move || std::net::TcpListener::bind(("0.0.0.0", port)))??;
    listener.set_nonblocking(true)?;
    Ok((listener, cert))
}

/// Where a stand-in carries what it is sent.
pub(super) enum Onward {
    /// On over HBONE, as a waypoint: an authority in the map to the
    /// address it maps to, any other to itself.
    Hbone(Arc<HashMap<SocketAddr, SocketAddr>>),
    /// As raw bytes to the address the authority maps to (nothing else is
    /// carried), every byte kept in `relayed` (up to [`RELAYED_KEPT`]): an
    /// east-west gateway, which carries the inner tunnel as it is.
    Raw {
        routes: Arc<HashMap<String, SocketAddr>>,
        relayed: Arc<Mutex<Vec<u8>>>,
    },
}

/// How much of what it relays a gateway stand-in keeps.
pub(super) const RELAYED_KEPT: usize = 16 << 20;

type Seen = Arc<Mutex<Vec<ConnectSeen>>>;

/// Serves HBONE on `listener` as `cert` from a thread in `pod`'s netns (its
/// dials leave from there too), recording every CONNECT.
pub(super) fn spawn_server(
    pod: &LabPod,
    listener: std::net::TcpListener,
    cert: WorkloadCert,
    onward: Onward,
) -> (Seen, Arc<AtomicUsize>) {
    let seen: Seen = Arc::default();
    let connections: Arc<AtomicUsize> = Arc::default();
    let (ns, record, count) = (pod.ns.clone(), seen.clone(), connections.clone());
    std::thread::spawn(move || {
        let _ = ns.run(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(serve(listener, cert, record, count, Arc::new(onward)))
        });
    });
    (seen, connections)
}

async fn serve(
    listener: std::net::TcpListener,
    cert: WorkloadCert,
    seen: Seen,
    connections: Arc<AtomicUsize>,
    onward: Arc<Onward>,
) -> std::io::Result<()> {
    let listener = TcpListener::from_std(listener)?;
    let server = Arc::new(tls::server_config(&cert, None).map_err(std::io::Error::other)?);
    let client = Arc::new(tls::client_config(&cert, None).map_err(std::io::Error::other)?);
    loop {
        let (tcp, _) = listener.accept().await?;
        let (server, client, seen, connections, onward) = (
            server.clone(),
            client.clone(),
            seen.clone(),
            connections.clone(),
            onward.clone(),
        );
        tokio::spawn(async move {
            let Ok(tls) = tokio_rustls::TlsAcceptor::from(server).accept(tcp).await else {
                return;
            };
            let peer = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(tls::identity_of)
                .map(|i| i.to_string())
                .unwrap_or_default();
            let Ok(mut conn) = h2::server::handshake(tls).await else {
                return;
            };
            connections.fetch_add(1, Ordering::Relaxed);
            while let Some(Ok((req, respond))) = conn.accept().await {
                let seen_now = ConnectSeen {
                    authority: req.uri().to_string(),
                    headers: req
                        .headers()
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
                        .collect(),
                    peer: peer.clone(),
                };
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(seen_now);
                match &*onward {
                    Onward::Hbone(forward) => {
                        let (client, forward) = (client.clone(), forward.clone());
                        tokio::spawn(carry(req, respond, client, forward));
                    }
                    Onward::Raw { routes, relayed } => {
                        let (routes, relayed) = (routes.clone(), relayed.clone());
                        tokio::spawn(super::gateway::relay(req, respond, routes, relayed));
                    }
                }
            }
        });
    }
}

/// Carries one CONNECT on over HBONE to its destination's proxy.
async fn carry(
    req: Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    client: Arc<rustls::ClientConfig>,
    forward: Arc<HashMap<SocketAddr, SocketAddr>>,
) {
    let Ok(authority) = req.uri().to_string().parse::<SocketAddr>() else {
        return refuse(&mut respond);
    };
    let target = forward.get(&authority).copied().unwrap_or(authority);
    let upstream = async {
        let tcp = TcpStream::connect((target.ip(), HBONE_PORT)).await.ok()?;
        let connector = tokio_rustls::TlsConnector::from(client);
        let tls = connector
            .connect(tls::hbone_server_name(), tcp)
            .await
            .ok()?;
        let (sender, conn) = h2::client::handshake(tls).await.ok()?;
        tokio::spawn(conn);
        let mut sender = sender.ready().await.ok()?;
        let mut up = Request::builder()
            .method(http::Method::CONNECT)
            .uri(target.to_string());
        if let Some(f) = req.headers().get("forwarded") {
            up = up.header("forwarded", f);
        }
        let (resp, send) = sender.send_request(up.body(()).ok()?, false).ok()?;
        let resp = resp.await.ok()?;
        (resp.status() == StatusCode::OK).then(|| (send, resp.into_body()))
    };
    let Some((up_send, up_recv)) = upstream.await else {
        return refuse(&mut respond);
    };
    let Ok(down_send) = respond.send_response(Response::new(()), false) else {
        return;
    };
    let down_recv = req.into_body();
    tokio::join!(pipe(down_recv, up_send), pipe(up_recv, down_send));
}

/// Answers a CONNECT 503, ending the stream.
pub(super) fn refuse(respond: &mut h2::server::SendResponse<Bytes>) {
    let resp = Response::builder()
        .status(StatusCode::SERVICE_UNAVAILABLE)
        .body(())
        .unwrap_or_default();
    let _ = respond.send_response(resp, true);
}

/// Copies one HTTP/2 stream's data into another, ending it at the end.
async fn pipe(mut from: h2::RecvStream, mut to: h2::SendStream<Bytes>) {
    while let Some(Ok(data)) = from.data().await {
        let _ = from.flow_control().release_capacity(data.len());
        // The end of the stream arrives as an empty chunk: it goes on as the
        // end below, never as an empty DATA frame of its own, which an HTTP/2
        // peer counts against the connection (h2 ends one past 100).
        if data.is_empty() {
            continue;
        }
        if to.send_data(data, false).is_err() {
            return;
        }
    }
    let _ = to.send_data(Bytes::new(), true);
}
