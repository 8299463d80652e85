//! An HTTP/2 CONNECT stream as a byte stream (`AsyncRead` + `AsyncWrite`),
//! so that a second TLS session and HTTP/2 connection can run inside it:
//! the inner tunnel of "double HBONE" through another network's gateway.
//! Reads hand the peer's flow-control credit back as they take the data
//! (at most one DATA frame waits here unread); writes send no more than
//! the stream's send capacity, waiting for more as the peer grants it.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What one write asks for at most: the inner TLS writes records of
/// 16 KiB and a few bytes, so one record goes out whole when the window
/// allows.
const WRITE_AT_MOST: usize = 64 * 1024;

pub struct StreamIo {
    send: h2::SendStream<Bytes>,
    recv: h2::RecvStream,
    /// What the last DATA frame had that a read did not take yet.
    unread: Bytes,
    ended: bool,
}

impl StreamIo {
    pub fn new(send: h2::SendStream<Bytes>, recv: h2::RecvStream) -> StreamIo {
        StreamIo {
            send,
            recv,
            unread: Bytes::new(),
            ended: false,
        }
    }
}

fn broken(e: h2::Error) -> io::Error {
    if e.is_io() {
        return e.into_io().unwrap_or_else(|| io::Error::other("h2"));
    }
    io::Error::new(io::ErrorKind::BrokenPipe, e)
}

impl AsyncRead for StreamIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        while self.unread.is_empty() {
            match ready!(self.recv.poll_data(cx)) {
                None => return Poll::Ready(Ok(())),
                Some(Err(e)) => return Poll::Ready(Err(broken(e))),
                Some(Ok(data)) => {
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    self.unread = data;
                }
            }
        }
        let n = self.unread.len().min(buf.remaining());
        buf.put_slice(&self.unread[..n]);
        self.unread.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for StreamIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if self.ended {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let want = buf.len().min(WRITE_AT_MOST);
        self.send.reserve_capacity(want);
        loop {
            let granted = self.send.capacity();
            if granted > 0 {
                let n = granted.min(want);
                let chunk = Bytes::copy_from_slice(&buf[..n]);
                self.send.send_data(chunk, false).map_err(broken)?;
                return Poll::Ready(Ok(n));
            }
            match ready!(self.send.poll_capacity(cx)) {
                None => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
                Some(Err(e)) => return Poll::Ready(Err(broken(e))),
                Some(Ok(_)) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // What `send_data` took is the connection's to send.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.ended {
            self.ended = true;
            self.send.reserve_capacity(0);
            self.send.send_data(Bytes::new(), true).map_err(broken)?;
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Both ends of one CONNECT stream over an in-memory HTTP/2 connection
    /// with small windows: what goes in one end comes out the other, in
    /// order, past many window updates, and the end of one direction is
    /// an end of file at the other.
    #[tokio::test]
    async fn a_stream_carries_bytes_both_ways_past_its_windows_and_ends_cleanly() {
        let (a, b) = tokio::io::duplex(8 * 1024);
        let server = tokio::spawn(async move {
            let mut conn = h2::server::Builder::new()
                .initial_window_size(16 * 1024)
                .handshake::<_, Bytes>(b)
                .await
                .unwrap();
            let (req, mut respond) = conn.accept().await.unwrap().unwrap();
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            let send = respond
                .send_response(http::Response::new(()), false)
                .unwrap();
            let mut io = StreamIo::new(send, req.into_body());
            let mut got = Vec::new();
            io.read_to_end(&mut got).await.unwrap();
            io.write_all(&got).await.unwrap();
            io.shutdown().await.unwrap();
            got.len()
        });
        let (client, conn) = h2::client::Builder::new()
            .initial_window_size(16 * 1024)
            .handshake::<_, Bytes>(a)
            .await
            .unwrap();
        tokio::spawn(conn);
        let mut client = client.ready().await.unwrap();
        let req = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri("10.0.0.3:80")
            .body(())
            .unwrap();
        let (resp, send) = client.send_request(req, false).unwrap();
        let resp = resp.await.unwrap();
        let mut io = StreamIo::new(send, resp.into_body());
        let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let (mut rd, mut wr) = tokio::io::split(&mut io);
        let writing = async {
            wr.write_all(&sent).await.unwrap();
            wr.shutdown().await.unwrap();
        };
        let mut back = Vec::new();
        let reading = rd.read_to_end(&mut back);
        let ((), read) = tokio::join!(writing, reading);
        read.unwrap();
        assert_eq!(server.await.unwrap(), sent.len());
        assert!(back == sent, "the echo came back whole and in order");
    }
}
