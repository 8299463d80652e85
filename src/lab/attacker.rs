//! Hostile mesh peers for the tests (feature `testing`). Each has a valid
//! mesh certificate, so it gets past mutual TLS; what it does then is what
//! the proxy must survive.

use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::identity::{tls, Identity, LocalCa};
use crate::netns::Netns;

/// What a [`StreamHold`] got from the proxy.
#[derive(Debug, Clone, Copy, Default)]
pub struct HoldSummary {
    /// HBONE connections the proxy took.
    pub connections: usize,
    /// CONNECTs answered 200.
    pub opened: usize,
    /// CONNECTs refused with `REFUSED_STREAM`, or connections closed before
    /// their streams were answered.
    pub refused: usize,
}

/// A peer that opens many HBONE streams, sends on each, and never reads
/// what comes back: it stops reading its sockets once its streams are
/// answered, and advertises the largest windows HTTP/2 allows, so the
/// proxy's flow control never holds anything back for it.
pub struct StreamHold {
    pub summary: HoldSummary,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StreamHold {
    /// From `ns`, as `identity` (a certificate from the CA files `ca`):
    /// `connections` connections to `hbone` (a proxy's 15008), `streams`
    /// CONNECTs to `target` on each, `bytes` sent on every stream answered.
    /// Returns once every stream is answered or refused; holds them until
    /// dropped.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        ns: &Netns,
        ca: (&Path, &Path),
        identity: Identity,
        hbone: SocketAddr,
        target: SocketAddr,
        connections: usize,
        streams: usize,
        bytes: usize,
    ) -> std::io::Result<StreamHold> {
        let ca = LocalCa::from_files(ca.0, ca.1).map_err(std::io::Error::other)?;
        let cert = ca
            .issue(&identity, Duration::from_secs(3600))
            .map_err(std::io::Error::other)?;
        let client = Arc::new(tls::client_config(&cert).map_err(std::io::Error::other)?);
        let (summary_tx, summary_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let ns = ns.clone();
        let thread = std::thread::spawn(move || {
            if ns.enter().is_err() {
                return;
            }
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let mut summary = HoldSummary::default();
                let mut held = Vec::new();
                for _ in 0..connections {
                    hold_one(
                        &client,
                        hbone,
                        target,
                        streams,
                        bytes,
                        &mut summary,
                        &mut held,
                    )
                    .await;
                }
                let _ = summary_tx.send(summary);
                let _ = stopped.await;
                drop(held);
            });
        });
        let summary = summary_rx
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| std::io::Error::other("the attacker did not get its streams answered"))?;
        Ok(StreamHold {
            summary,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for StreamHold {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

type Held = (h2::SendStream<Bytes>, h2::RecvStream);

async fn hold_one(
    client: &Arc<rustls::ClientConfig>,
    hbone: SocketAddr,
    target: SocketAddr,
    streams: usize,
    bytes: usize,
    summary: &mut HoldSummary,
    held: &mut Vec<Held>,
) {
    let connect = async {
        let tcp = TcpStream::connect(hbone).await.ok()?;
        let tls = tokio_rustls::TlsConnector::from(client.clone())
            .connect(tls::hbone_server_name(), tcp)
            .await
            .ok()?;
        let deaf = Arc::new(AtomicBool::new(false));
        let io = Deaf {
            io: tls,
            deaf: deaf.clone(),
        };
        let (sender, conn) = h2::client::Builder::new()
            .initial_window_size(i32::MAX as u32)
            .initial_connection_window_size(i32::MAX as u32)
            .handshake::<_, Bytes>(io)
            .await
            .ok()?;
        tokio::spawn(conn);
        Some((sender, deaf))
    };
    let Some((mut sender, deaf)) = connect.await else {
        summary.refused += streams;
        return;
    };
    summary.connections += 1;
    let mut asked = Vec::new();
    for _ in 0..streams {
        let Ok(ready) = sender.clone().ready().await else {
            break;
        };
        sender = ready;
        let req = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri(target.to_string())
            .body(())
            .unwrap_or_default();
        match sender.send_request(req, false) {
            Ok(pair) => asked.push(pair),
            Err(_) => break,
        }
    }
    summary.refused += streams - asked.len();
    let mut answered = Vec::new();
    for (resp, send) in asked {
        match tokio::time::timeout(Duration::from_secs(20), resp).await {
            Ok(Ok(r)) if r.status() == http::StatusCode::OK => {
                summary.opened += 1;
                answered.push((send, r.into_body()));
            }
            _ => summary.refused += 1,
        }
    }
    // From here on nothing is read: the proxy's answers pile up on its side.
    deaf.store(true, Ordering::Release);
    let payload = Bytes::from(vec![b'x'; bytes]);
    for (mut send, recv) in answered {
        let _ = send.send_data(payload.clone(), false);
        held.push((send, recv));
    }
}

/// An I/O stream whose reads stop (pending forever) once `deaf` is set;
/// writes go on.
struct Deaf<T> {
    io: T,
    deaf: Arc<AtomicBool>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Deaf<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.deaf.load(Ordering::Acquire) {
            return Poll::Pending;
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Deaf<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
