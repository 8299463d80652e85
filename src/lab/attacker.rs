//! Hostile mesh peers for the tests (feature `testing`): a client that
//! holds streams it never reads ([`StreamHold`]) and a destination that
//! floods every stream it is sent, or stops reading once it has answered
//! ([`Flood`]). Each has a valid mesh
//! certificate, so it gets past mutual TLS; what it does then is what the
//! proxy must survive.

use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::constants::HBONE_PORT;
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
        let client = Arc::new(tls::client_config(&cert, None).map_err(std::io::Error::other)?);
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
                let mut held = Holding::default();
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

/// What an attacker holds: its streams, and its connections' senders (a
/// connection whose last sender goes closes, so one with no stream needs
/// its sender held to stay open).
#[derive(Default)]
struct Holding {
    streams: Vec<Held>,
    connections: Vec<h2::client::SendRequest<Bytes>>,
}

async fn hold_one(
    client: &Arc<rustls::ClientConfig>,
    hbone: SocketAddr,
    target: SocketAddr,
    streams: usize,
    bytes: usize,
    summary: &mut HoldSummary,
    held: &mut Holding,
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
    held.connections.push(sender.clone());
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
        held.streams.push((send, recv));
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

/// A hostile destination that answers every CONNECT 200. As
/// [`Flood::start`] it sends on every stream as fast as the proxy's windows
/// let it, reading nothing: what a hostile destination makes the client
/// side's proxy hold when the applications there do not read. It sends only
/// into the window the proxy grants, so what it counts as sent is what the
/// proxy took. As [`Flood::deaf`] it grants the largest windows HTTP/2
/// allows and stops reading its socket once it has answered: what the
/// proxy holds for applications whose destination takes nothing.
pub struct Flood {
    answered: Arc<AtomicUsize>,
    sent: Arc<AtomicU64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Flood {
    /// Serves HBONE on `ns`'s 15008 as `identity` (a certificate from the
    /// CA files `ca`); every connection closes when this is dropped.
    pub fn start(ns: &Netns, ca: (&Path, &Path), identity: Identity) -> std::io::Result<Flood> {
        Self::serve(ns, ca, identity, false)
    }

    /// As [`Flood::start`], but sends nothing and reads nothing once a
    /// connection's first CONNECT is answered.
    pub fn deaf(ns: &Netns, ca: (&Path, &Path), identity: Identity) -> std::io::Result<Flood> {
        Self::serve(ns, ca, identity, true)
    }

    fn serve(
        ns: &Netns,
        ca: (&Path, &Path),
        identity: Identity,
        deaf: bool,
    ) -> std::io::Result<Flood> {
        let ca = LocalCa::from_files(ca.0, ca.1).map_err(std::io::Error::other)?;
        let cert = ca
            .issue(&identity, Duration::from_secs(3600))
            .map_err(std::io::Error::other)?;
        let server = Arc::new(tls::server_config(&cert, None).map_err(std::io::Error::other)?);
        let listener = ns.run(|| std::net::TcpListener::bind(("0.0.0.0", HBONE_PORT)))??;
        listener.set_nonblocking(true)?;
        let (answered, sent) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicU64::new(0)));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let counts = (answered.clone(), sent.clone());
        let thread = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let serve = async {
                    loop {
                        let Ok((tcp, _)) = listener.accept().await else {
                            // Out of descriptors, say: not a busy loop.
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        };
                        let (server, counts) = (server.clone(), counts.clone());
                        if deaf {
                            tokio::spawn(answer_then_stop_reading(server, tcp, counts.0));
                        } else {
                            tokio::spawn(flood_one(server, tcp, counts));
                        }
                    }
                };
                tokio::select! {
                    _ = serve => {}
                    _ = stopped => {}
                }
            });
            // The runtime drops here, and with it every connection.
        });
        Ok(Flood {
            answered,
            sent,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// CONNECTs answered 200 so far.
    pub fn answered(&self) -> usize {
        self.answered.load(Ordering::Acquire)
    }

    /// Bytes the proxy's windows took so far, all streams.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Acquire)
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn flood_one(
    server: Arc<rustls::ServerConfig>,
    tcp: TcpStream,
    (answered, sent): (Arc<AtomicUsize>, Arc<AtomicU64>),
) {
    let Ok(tls) = tokio_rustls::TlsAcceptor::from(server).accept(tcp).await else {
        return;
    };
    let Ok(mut conn) = h2::server::handshake(tls).await else {
        return;
    };
    while let Some(Ok((_req, mut respond))) = conn.accept().await {
        let Ok(mut send) = respond.send_response(http::Response::new(()), false) else {
            continue;
        };
        answered.fetch_add(1, Ordering::AcqRel);
        let sent = sent.clone();
        tokio::spawn(async move {
            let chunk = Bytes::from(vec![b'f'; 64 * 1024]);
            loop {
                send.reserve_capacity(chunk.len());
                let n = match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
                    Some(Ok(n)) => n.min(chunk.len()),
                    _ => return,
                };
                if send.send_data(chunk.slice(..n), false).is_err() {
                    return;
                }
                sent.fetch_add(n as u64, Ordering::AcqRel);
            }
        });
    }
}

async fn answer_then_stop_reading(
    server: Arc<rustls::ServerConfig>,
    tcp: TcpStream,
    answered: Arc<AtomicUsize>,
) {
    let Ok(tls) = tokio_rustls::TlsAcceptor::from(server).accept(tcp).await else {
        return;
    };
    let deaf = Arc::new(AtomicBool::new(false));
    let io = Deaf {
        io: tls,
        deaf: deaf.clone(),
    };
    let Ok(mut conn) = h2::server::Builder::new()
        .initial_window_size(i32::MAX as u32)
        .initial_connection_window_size(i32::MAX as u32)
        .handshake::<_, Bytes>(io)
        .await
    else {
        return;
    };
    let mut held = Vec::new();
    // Polled on, so that the answers go out; every read from here pends.
    while let Some(Ok((req, mut respond))) = conn.accept().await {
        if let Ok(send) = respond.send_response(http::Response::new(()), false) {
            answered.fetch_add(1, Ordering::AcqRel);
            held.push((send, req.into_body()));
            deaf.store(true, Ordering::Release);
        }
    }
}
