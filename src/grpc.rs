//! gRPC over TLS for the control-plane links (xDS and the CA), with rustls and
//! a root CA from a file: a client channel that verifies the server's name,
//! and a server that serves handshaken TLS streams. Plain `http://` works for
//! labs that want it. No TLS code of tonic's is used, so there is one rustls
//! and one crypto provider in the process.

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::{Channel, Endpoint, Uri};

#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    #[error("{what} {path}: {reason}")]
    File {
        what: &'static str,
        path: String,
        reason: String,
    },
    #[error("address {0:?}: expected http(s)://host:port")]
    Address(String),
    #[error("connecting to {addr}: {reason}")]
    Connect { addr: String, reason: String },
}

/// Root certificates from a PEM file, or the system's store for `SYSTEM`
/// (Istio's convention for `XDS_ROOT_CA`/`CA_ROOT_CA`).
pub fn roots_from(path: &Path) -> Result<rustls::RootCertStore, GrpcError> {
    if path.as_os_str() == "SYSTEM" {
        let found = rustls_native_certs::load_native_certs();
        let mut store = rustls::RootCertStore::empty();
        let (added, _) = store.add_parsable_certificates(found.certs);
        if added == 0 {
            return Err(GrpcError::File {
                what: "root CA",
                path: "SYSTEM".into(),
                reason: "the system store holds no usable certificate".into(),
            });
        }
        return Ok(store);
    }
    let err = |reason: String| GrpcError::File {
        what: "root CA",
        path: path.display().to_string(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let mut store = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
        store
            .add(cert.map_err(|e| err(e.to_string()))?)
            .map_err(|e| err(e.to_string()))?;
    }
    if store.is_empty() {
        return Err(err("no certificate found".into()));
    }
    Ok(store)
}

/// Connects a TCP socket carrying `mark` (so a proxy inside a pod's netns is
/// not captured by that pod's own redirection rules).
async fn marked_connect(authority: &str, mark: u32) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::other(format!("{authority}: no address"));
    for addr in tokio::net::lookup_host(authority).await? {
        let sock = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket2::SockRef::from(&sock).set_mark(mark)?;
        match sock.connect(addr).await {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// A channel to `addr` (`https://host:port` verified against `roots`, or
/// `http://`), its sockets marked with `mark`.
pub async fn channel(
    addr: &str,
    roots: Option<rustls::RootCertStore>,
    mark: u32,
) -> Result<Channel, GrpcError> {
    let uri: Uri = addr.parse().map_err(|_| GrpcError::Address(addr.into()))?;
    let host = uri
        .host()
        .ok_or_else(|| GrpcError::Address(addr.into()))?
        .trim_matches(['[', ']'])
        .to_string();
    let endpoint =
        Endpoint::from_shared(addr.to_string()).map_err(|_| GrpcError::Address(addr.into()))?;
    let connect_err = |e: tonic::transport::Error| GrpcError::Connect {
        addr: addr.into(),
        reason: causes(&e),
    };
    if uri.scheme_str() != Some("https") {
        return endpoint
            .connect_with_connector(tower::service_fn(move |uri: Uri| async move {
                let authority = uri
                    .authority()
                    .map(|a| a.as_str().to_string())
                    .unwrap_or_default();
                Ok::<_, std::io::Error>(TokioIo::new(marked_connect(&authority, mark).await?))
            }))
            .await
            .map_err(connect_err);
    }
    let roots = roots.unwrap_or_else(rustls::RootCertStore::empty);
    let provider = crate::identity::tls::provider();
    let versions = crate::identity::tls::versions(&provider);
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|e| GrpcError::Connect {
            addr: addr.into(),
            reason: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let server_name = rustls::pki_types::ServerName::try_from(host.clone())
        .map_err(|_| GrpcError::Address(addr.into()))?;
    endpoint
        .connect_with_connector(tower::service_fn(move |uri: Uri| {
            let (connector, name) = (connector.clone(), server_name.clone());
            async move {
                let authority = uri
                    .authority()
                    .map(|a| a.as_str().to_string())
                    .unwrap_or_default();
                let tcp = marked_connect(&authority, mark).await?;
                let tls = connector.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(TokioIo::new(tls))
            }
        }))
        .await
        .map_err(connect_err)
}

/// An error and its causes, outermost first ("transport error: ... : invalid
/// peer certificate: BadSignature"), so a log line says what really failed.
fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = cause.source();
    }
    out
}

/// A server-side TLS stream that tonic can serve.
pub struct ServerTls {
    tls: tokio_rustls::server::TlsStream<TcpStream>,
    /// The connection's place under the listener's cap, given back on drop.
    _slot: crate::limits::CapSlot,
}

impl tonic::transport::server::Connected for ServerTls {
    type ConnectInfo = Option<std::net::SocketAddr>;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.tls.get_ref().0.peer_addr().ok()
    }
}

impl AsyncRead for ServerTls {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_read(cx, buf)
    }
}

impl AsyncWrite for ServerTls {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_shutdown(cx)
    }
}

/// Accepts TCP on `listener`, completes TLS with `cfg`, and yields the streams.
pub fn tls_incoming(
    listener: TcpListener,
    cfg: Arc<rustls::ServerConfig>,
) -> impl futures_util::Stream<Item = Result<ServerTls, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<ServerTls>(64);
    let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
    let cap =
        crate::limits::ConnectionCap::new("control_plane", crate::limits::caps::CONTROL_PLANE)
            .per_source();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, peer)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let Some(slot) = cap.admit(peer.ip()) else {
                continue;
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(tcp))
                    .await
                {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(ServerTls { tls, _slot: slot }).await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(src.addr = %peer, error = %e, "control-plane TLS handshake failed")
                    }
                    Err(_) => {
                        tracing::warn!(src.addr = %peer, "control-plane TLS handshake timed out")
                    }
                }
            });
        }
    });
    futures_util::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|s| (Ok(s), rx)) },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that says `text` and has `cause` as its source.
    #[derive(Debug)]
    struct Layer {
        text: String,
        cause: Option<Box<dyn std::error::Error + Send + Sync>>,
    }

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.text)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.cause.as_deref().map(|c| c as _)
        }
    }

    #[test]
    fn a_connect_error_names_its_innermost_cause() {
        let tls = rustls::Error::InvalidCertificate(rustls::CertificateError::BadSignature);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, tls);
        let err = Layer {
            text: "transport error".into(),
            cause: Some(Box::new(Layer {
                // A wrapper that repeats its cause's text, as some do.
                text: io.to_string(),
                cause: Some(Box::new(io)),
            })),
        };
        assert_eq!(
            causes(&err),
            "transport error: invalid peer certificate: BadSignature",
            "each cause once, outermost first"
        );
    }

    #[test]
    fn roots_from_a_file_or_the_system() {
        assert!(!roots_from(Path::new("SYSTEM"))
            .expect("system roots (ca-certificates)")
            .is_empty());
        assert!(roots_from(Path::new("/nonexistent.pem"))
            .unwrap_err()
            .to_string()
            .contains("/nonexistent.pem"));
        let ca = crate::identity::LocalCa::generate("td").unwrap();
        let path = std::env::temp_dir().join(format!("ambit-roots-{}.pem", std::process::id()));
        std::fs::write(&path, ca.root_pem()).unwrap();
        assert_eq!(roots_from(&path).unwrap().len(), 1);
        std::fs::remove_file(&path).ok();
    }
}
