//! A mesh peer that streams HTTP/2 control frames at a proxy's 15008 as
//! fast as it can write them (feature `testing`): PRIORITY frames, which ask
//! for nothing back, or PINGs, each of which the proxy answers. It has a
//! valid mesh certificate, so every byte is decrypted and parsed: work a
//! proxy must not let one peer turn into a worker thread of its own.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::identity::{tls, Identity, LocalCa};
use crate::netns::Netns;

/// Which frames a [`FrameFlood`] sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frames {
    /// PRIORITY for stream 1 (5 bytes each): parsed and ignored.
    Priority,
    /// PING (8 bytes each): each one answered with a PING ACK.
    Ping,
}

impl Frames {
    fn one(self) -> Vec<u8> {
        match self {
            // Length 5, type PRIORITY, no flags, stream 1; depends on 0, weight 16.
            Frames::Priority => vec![0, 0, 5, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 15],
            // Length 8, type PING, no flags, stream 0; opaque data.
            Frames::Ping => vec![0, 0, 8, 6, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
        }
    }
}

/// Connections streaming frames until dropped.
pub struct FrameFlood {
    sent: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Bytes of frames per write (rustls seals them into 16 KiB records).
const CHUNK: usize = 64 * 1024;

impl FrameFlood {
    /// From `ns`, as `identity` (a certificate from the CA files `ca`):
    /// `connections` HBONE connections to `hbone`, each sending `frames`
    /// after the HTTP/2 preface, and reading (and dropping) what comes back.
    /// Returns once every connection is through its TLS handshake.
    pub fn start(
        ns: &Netns,
        ca: (&Path, &Path),
        identity: Identity,
        hbone: SocketAddr,
        frames: Frames,
        connections: usize,
    ) -> std::io::Result<FrameFlood> {
        let ca = LocalCa::from_files(ca.0, ca.1).map_err(std::io::Error::other)?;
        let cert = ca
            .issue(&identity, Duration::from_secs(3600))
            .map_err(std::io::Error::other)?;
        let client = Arc::new(tls::client_config(&cert, None).map_err(std::io::Error::other)?);
        let sent = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (up_tx, up_rx) = std::sync::mpsc::channel();
        let ns = ns.clone();
        let (sent2, stop2) = (sent.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            if ns.enter().is_err() {
                return;
            }
            // One thread per connection: the flood is as fast as it can be.
            let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(connections.max(1))
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let mut tasks = Vec::new();
                for _ in 0..connections {
                    let connect = async {
                        let tcp = TcpStream::connect(hbone).await?;
                        tokio_rustls::TlsConnector::from(client.clone())
                            .connect(tls::hbone_server_name(), tcp)
                            .await
                    };
                    let Ok(tls) = connect.await else {
                        let _ = up_tx.send(false);
                        continue;
                    };
                    let _ = up_tx.send(true);
                    let (sent, stop) = (sent2.clone(), stop2.clone());
                    tasks.push(tokio::spawn(flood(tls, frames, sent, stop)));
                }
                for t in tasks {
                    let _ = t.await;
                }
            });
        });
        for _ in 0..connections {
            match up_rx.recv_timeout(Duration::from_secs(20)) {
                Ok(true) => {}
                _ => {
                    stop.store(true, Ordering::Release);
                    return Err(std::io::Error::other(
                        "a flood connection did not get through its handshake",
                    ));
                }
            }
        }
        Ok(FrameFlood {
            sent,
            stop,
            thread: Some(thread),
        })
    }

    /// Frames sent so far, over all connections.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Acquire)
    }
}

async fn flood(
    tls: tokio_rustls::client::TlsStream<TcpStream>,
    frames: Frames,
    sent: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    let (mut rx, mut tx) = tokio::io::split(tls);
    // What comes back (SETTINGS, PING ACKs) is read and dropped.
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        while matches!(rx.read(&mut buf).await, Ok(n) if n > 0) {}
    });
    let one = frames.one();
    let per_chunk = CHUNK / one.len();
    let chunk: Vec<u8> = one.repeat(per_chunk);
    // The preface and an empty SETTINGS, then frames.
    let mut start = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    start.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    if tx.write_all(&start).await.is_err() {
        return;
    }
    while !stop.load(Ordering::Acquire) {
        // A proxy that stops reading ends the flood rather than hold it.
        let wrote = tokio::time::timeout(Duration::from_secs(5), tx.write_all(&chunk)).await;
        if !matches!(wrote, Ok(Ok(()))) {
            break;
        }
        sent.fetch_add(per_chunk as u64, Ordering::Release);
    }
    reader.abort();
}

impl Drop for FrameFlood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
