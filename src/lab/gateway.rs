//! An east-west gateway stand-in for the tests: in a lab pod attached to two
//! networks, an HBONE server (mutual TLS with a certificate of the
//! gateway's identity, HTTP/2 CONNECT) that takes the outer tunnel of a
//! connection to another network, records the CONNECT (authority, headers,
//! the client's identity), and carries the stream's bytes as they are to
//! the destination's proxy on the other network, as Istio's east-west
//! gateway does. It keeps every byte it relays, so a test can show it
//! never saw the application's: the inner mutual TLS runs end to end
//! through it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::waypoint::{listen_as, refuse, spawn_server, ConnectSeen, Onward, RELAYED_KEPT};
use super::LabPod;
use crate::identity::Identity;
use crate::proxy::tunnel::StreamIo;

/// A running stand-in; stops with the lab pod's netns.
pub struct GatewayStandIn {
    seen: Arc<Mutex<Vec<ConnectSeen>>>,
    connections: Arc<AtomicUsize>,
    relayed: Arc<Mutex<Vec<u8>>>,
}

impl GatewayStandIn {
    /// Serves HBONE on `pod`'s `port` as `identity`, with a certificate
    /// from the CA in `ca` (cert, key). A CONNECT whose authority is in
    /// `routes` (`hostname:port`) is carried to the address it maps to
    /// (the destination's HBONE port); any other is answered 503.
    pub fn start(
        pod: &LabPod,
        ca: (&Path, &Path),
        identity: Identity,
        port: u16,
        routes: HashMap<String, SocketAddr>,
    ) -> std::io::Result<GatewayStandIn> {
        let (listener, cert) = listen_as(pod, ca, identity, port)?;
        let relayed: Arc<Mutex<Vec<u8>>> = Arc::default();
        let onward = Onward::Raw {
            routes: Arc::new(routes),
            relayed: relayed.clone(),
        };
        let (seen, connections) = spawn_server(pod, listener, cert, onward);
        Ok(GatewayStandIn {
            seen,
            connections,
            relayed,
        })
    }

    /// How many HBONE connections (TLS and HTTP/2 handshakes done) it took.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// The CONNECTs received so far, oldest first.
    pub fn seen(&self) -> Vec<ConnectSeen> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Every byte it carried, both ways, in the order it carried them (the
    /// first 16 MiB).
    pub fn relayed(&self) -> Vec<u8> {
        self.relayed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Carries one CONNECT's bytes to the address its authority maps to.
pub(super) async fn relay(
    req: Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    routes: Arc<HashMap<String, SocketAddr>>,
    relayed: Arc<Mutex<Vec<u8>>>,
) {
    let authority = req.uri().to_string();
    let Some(&to) = routes.get(&authority) else {
        return refuse(&mut respond);
    };
    let Ok(tcp) = TcpStream::connect(to).await else {
        return refuse(&mut respond);
    };
    let Ok(down) = respond.send_response(Response::new(()), false) else {
        return;
    };
    let keep = |bytes: &[u8]| {
        let mut kept = relayed.lock().unwrap_or_else(|e| e.into_inner());
        let room = RELAYED_KEPT.saturating_sub(kept.len());
        kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
    };
    let (mut from_dst, mut to_dst) = tcp.into_split();
    let (mut from_client, mut to_client) = tokio::io::split(StreamIo::new(down, req.into_body()));
    tokio::join!(
        copy_kept(&mut from_client, &mut to_dst, &keep),
        copy_kept(&mut from_dst, &mut to_client, &keep)
    );
}

/// Copies `from` into `to` until the end, keeping what passes, then ends `to`.
async fn copy_kept(
    from: &mut (impl AsyncRead + Unpin),
    to: &mut (impl AsyncWrite + Unpin),
    keep: &impl Fn(&[u8]),
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        keep(&buf[..n]);
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
