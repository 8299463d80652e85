//! Moving bytes: what every copy shares (the bytes each way, the order the
//! two directions ended in) and TCP↔HBONE stream, with buffers that grow
//! with the flow. TCP↔TCP is `splice.rs`. Both copy the two directions
//! independently and carry half-close across.

use std::io;

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use socket2::SockRef;
use tokio::io::{AsyncWrite, AsyncWriteExt, Interest};
use tokio::net::tcp::ReadHalf;
use tokio::net::TcpStream;

use super::budget::Reservation;

/// Bytes moved in each direction of one connection.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Transferred {
    /// From the connection's originator towards its destination.
    pub sent: u64,
    /// Back towards the originator.
    pub received: u64,
    /// The destination finished first: the proxy half-closed the
    /// originator's side before the originator closed its own, so the
    /// proxy's side of that connection ends in TIME_WAIT.
    pub proxy_closed_first: bool,
}

/// Runs both directions of a copy (`up` towards the destination, `down`
/// back) and folds their ends into what was moved and the first error.
/// `proxy_closed_first` says whether `down` ended cleanly, with its
/// half-close sent, before `up` read the originator's own close. Only then
/// does the proxy hold the originator's connection in TIME_WAIT.
///
/// A plain combinator, not an async fn: an async fn (or async blocks
/// around `join!`) stores its argument futures again beside the joined
/// ones, which made this three times the size of the two copies it runs,
/// in every connection's task for its whole life. The order the two ended
/// in comes from one process-wide counter each takes a number from.
pub(super) fn both_ways<U, D>(
    up: U,
    down: D,
) -> impl std::future::Future<Output = (Transferred, io::Result<()>)>
where
    U: std::future::Future<Output = io::Result<u64>>,
    D: std::future::Future<Output = io::Result<u64>>,
{
    use futures_util::FutureExt;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static ENDED: AtomicU64 = AtomicU64::new(0);
    let stamp = |r: io::Result<u64>| (r, ENDED.fetch_add(1, Relaxed));
    futures_util::future::join(up.map(stamp), down.map(stamp)).map(|((u, up_at), (d, down_at))| {
        let t = Transferred {
            sent: *u.as_ref().unwrap_or(&0),
            received: *d.as_ref().unwrap_or(&0),
            proxy_closed_first: u.is_ok() && d.is_ok() && down_at < up_at,
        };
        (t, u.and(d).map(|_| ()))
    })
}

/// A syscall's result as a byte count, or its `errno`.
pub(super) fn byte_count(n: isize) -> io::Result<usize> {
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// How long a stream's source must be quiet before its send-buffer
/// reservation may go back.
const QUIET: std::time::Duration = std::time::Duration::from_millis(50);

/// Whether a quiet stream's send buffer counts as drained, from the
/// capacity h2 offers it now (`free`, asked for [`STREAM_SEND_BUFFER`])
/// and what it offered as the burst began (`window`, with nothing queued).
/// h2 offers the peer's stream window less what it has not acknowledged
/// and less what h2 still holds; a peer acknowledges once half its window
/// is unacknowledged, so with nothing held `free` is at least half of
/// `window`. Waiting for the whole send buffer, as before, never ended
/// when the peer's window was below it (an Ambit peer past 256 HBONE
/// connections per GiB of budget grants smaller ones): every stream that
/// had sent kept its reservation for life, and a node of 1,000 pods
/// refused new streams after 1,200 held connections (`cargo bench
/// --bench node`). The cost: a stream whose connection stops draining may
/// hold up to half its send buffer past its reservation.
///
/// [`STREAM_SEND_BUFFER`]: super::budget::STREAM_SEND_BUFFER
fn drained(free: usize, window: usize) -> bool {
    free >= super::budget::STREAM_SEND_BUFFER
        .min(window.div_ceil(2))
        .max(1)
}

/// Read buffers start small (idle connections cost little) and grow to this for bulk flows.
const MIN_BUF: usize = super::budget::STREAM_READ_START;
const MAX_BUF: usize = super::budget::STREAM_READ_BUFFER;

/// The most a stream whose messages are small reads at once ([`read_small`]).
/// Small enough that a bulk flow's reads (a segment is ~1.4 kB) stay in its
/// buffer: their chunks, copied out at their sizes, spread over a size
/// class each, and each worker's allocator cache then kept ~20 freed
/// objects of every one of them (with 4 KiB, half a megabyte more private
/// memory per proxy after a bulk transfer).
const SMALL_READ: usize = 1024;

/// Reads from a TCP half into an HBONE stream, honouring HTTP/2 flow control.
/// The read buffer exists only while the source has data, so an idle stream
/// holds none; while its reads are small (under [`SMALL_READ`]: short requests
/// and answers, not a bulk flow) it has none at all, each read copied from the
/// stack into a chunk of its size: a message through the proxy then costs
/// one small allocation, not a buffer and the handle the chunk shares it
/// by. While the stream may have data queued in h2, its send buffer is
/// reserved in `reserved` (when given): from its first data until it is
/// quiet with nothing queued. Past the budget the stream is reset.
async fn tcp_to_h2(
    src: ReadHalf<'_>,
    mut dst: SendStream<Bytes>,
    mut reserved: Option<&mut Reservation>,
) -> io::Result<u64> {
    use super::budget::STREAM_SEND_BUFFER;
    let mut buf_size = MIN_BUF;
    let mut buf = BytesMut::new();
    // Whether the next read goes through the stack: until a read fills
    // [`SMALL_READ`], and again from a read shorter than it.
    let mut small = true;
    let mut grown = None;
    let mut total = 0u64;
    let mut queued = false;
    // The capacity h2 offered as the current burst began ([`drained`]).
    let mut window = STREAM_SEND_BUFFER;
    // While queued: the timer that finds the source quiet, and whether data
    // came since it was set. One timer a burst, set again for each
    // [`QUIET`] that saw data (so the source is found quiet 50-100 ms after
    // its last data), rather than one made and dropped at every wait (a
    // clock read and two trips to the timer wheel a message).
    let mut quiet: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    let mut came = false;
    loop {
        let mut chunk = loop {
            let read = if small {
                read_small(src.as_ref())
            } else {
                // A new buffer only when the last one is mostly used: a
                // read that would block then costs no allocation.
                if buf.capacity() - buf.len() < buf_size / 2 {
                    buf.reserve(buf_size);
                }
                read_some(src.as_ref(), &mut buf).map(|_| buf.split().freeze())
            };
            match read {
                Ok(chunk) => break chunk,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    dst.send_reset(h2::Reason::CANCEL);
                    return Err(e);
                }
            }
            // Quiet: an idle stream holds no read buffer, and once h2 holds
            // nothing of it (its whole send buffer is free again) its
            // send-buffer reservation goes back.
            buf = BytesMut::new();
            let ready = match (queued, reserved.as_deref_mut()) {
                (true, Some(r)) => loop {
                    let timer = quiet.get_or_insert_with(|| {
                        came = false;
                        Box::pin(tokio::time::sleep(QUIET))
                    });
                    tokio::select! {
                        biased;
                        ready = src.readable() => break ready,
                        _ = timer.as_mut() => {}
                    }
                    if std::mem::take(&mut came) {
                        timer.as_mut().reset(tokio::time::Instant::now() + QUIET);
                        continue;
                    }
                    quiet = None;
                    dst.reserve_capacity(STREAM_SEND_BUFFER);
                    if drained(dst.capacity(), window) {
                        r.shrink(STREAM_SEND_BUFFER);
                        queued = false;
                    }
                    dst.reserve_capacity(0);
                    break src.readable().await;
                },
                _ => src.readable().await,
            };
            if let Err(e) = ready {
                dst.send_reset(h2::Reason::CANCEL);
                return Err(e);
            }
        };
        let n = chunk.len();
        // A source that never runs dry still lets the worker's other tasks
        // run: its reads do not go through tokio's (budgeted) `poll_read`.
        tokio::task::consume_budget().await;
        if n == 0 {
            return dst
                .send_data(Bytes::new(), true)
                .map(|_| total)
                .map_err(h2_io);
        }
        small = n < SMALL_READ;
        came = true;
        if let (false, Some(r)) = (queued, reserved.as_deref_mut()) {
            if let Err(refusal) = r.grow(STREAM_SEND_BUFFER) {
                dst.send_reset(h2::Reason::CANCEL);
                return Err(io::Error::other(refusal.reason()));
            }
            queued = true;
            // What h2 could take with none of this burst queued yet.
            dst.reserve_capacity(STREAM_SEND_BUFFER);
            window = dst.capacity();
        }
        if n >= buf_size && buf_size < MAX_BUF {
            // Room to grow comes from the memory budget, once per stream.
            if grown.is_none() {
                grown = super::budget::BUDGET.grow_read_buffer(MIN_BUF);
            }
            if grown.is_some() {
                buf_size *= 2;
            }
        }
        total += n as u64;
        while !chunk.is_empty() {
            dst.reserve_capacity(chunk.len());
            let cap = loop {
                let capacity = tokio::select! {
                    biased;
                    capacity = std::future::poll_fn(|cx| dst.poll_capacity(cx)) => capacity,
                    // The source reset while the destination takes nothing:
                    // what it sent can never be delivered, and the stream
                    // is not held for a connection that is gone.
                    _ = src.as_ref().ready(Interest::ERROR) => {
                        dst.send_reset(h2::Reason::CANCEL);
                        let e = src.as_ref().take_error().ok().flatten();
                        return Err(e.unwrap_or_else(|| io::ErrorKind::ConnectionReset.into()));
                    }
                };
                match capacity {
                    None => {
                        return Err(io::Error::new(
                            io::ErrorKind::BrokenPipe,
                            "HBONE stream closed",
                        ))
                    }
                    Some(Err(e)) => return Err(h2_io(e)),
                    Some(Ok(0)) => {
                        tokio::task::yield_now().await;
                        dst.reserve_capacity(chunk.len());
                    }
                    Some(Ok(n)) => break n,
                }
            };
            let part = chunk.split_to(cap.min(chunk.len()));
            dst.send_data(part, false).map_err(h2_io)?;
        }
    }
}

/// Reads what `src` holds into `buf`'s spare room ([`recv_some`]).
pub(super) fn read_some(src: &TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    let n = recv_some(src, buf.spare_capacity_mut())?;
    // SAFETY: recv(2) initialized the first `n` bytes of the spare room.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

/// Reads what `src` holds, up to [`SMALL_READ`] bytes, through a buffer on
/// the stack, into a chunk of its own size ([`recv_some`]): no buffer of
/// the stream's is allocated for it, nor shared with the chunk.
fn read_small(src: &TcpStream) -> io::Result<Bytes> {
    let mut room = [std::mem::MaybeUninit::<u8>::uninit(); SMALL_READ];
    let n = recv_some(src, &mut room)?;
    // SAFETY: recv(2) initialized the first `n` bytes.
    let read = unsafe { std::slice::from_raw_parts(room.as_ptr().cast::<u8>(), n) };
    Ok(Bytes::copy_from_slice(read))
}

/// Reads what `src` holds into `room`. A read that leaves room means the
/// socket had no more: its readiness is cleared then, as tokio's own
/// `poll_read` does, so the next wait goes straight to the poller instead
/// of making a read that finds nothing (one system call less per message
/// through the proxy). Cleared only if no new event came since the read
/// began (`try_io` compares readiness ticks), so data arriving meanwhile is
/// never missed.
fn recv_some(src: &TcpStream, room: &mut [std::mem::MaybeUninit<u8>]) -> io::Result<usize> {
    let mut got = 0;
    let size = room.len();
    let read = src.try_io(Interest::READABLE, || {
        let n = SockRef::from(src).recv(room)?;
        got = n;
        if n > 0 && n < size {
            Err(io::ErrorKind::WouldBlock.into())
        } else {
            Ok(n)
        }
    });
    match read {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock && got > 0 => Ok(got),
        r => r,
    }
}

/// Writes an HBONE stream's data to a TCP half; END_STREAM (or RST NO_ERROR/CANCEL) half-closes it.
async fn h2_to_tcp<W: AsyncWrite + Unpin>(src: RecvStream, mut dst: W) -> io::Result<u64> {
    let moved = h2_until_end(src, &mut dst).await;
    // Also after a reset: the TCP side must not wait for an end that never comes.
    let closed = dst.shutdown().await;
    let total = moved?;
    closed.map(|_| total)
}

async fn h2_until_end<W: AsyncWrite + Unpin>(mut src: RecvStream, dst: &mut W) -> io::Result<u64> {
    let mut total = 0u64;
    while let Some(chunk) = src.data().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e)
                if matches!(
                    e.reason(),
                    Some(h2::Reason::NO_ERROR) | Some(h2::Reason::CANCEL)
                ) =>
            {
                break
            }
            Err(e) => return Err(h2_io(e)),
        };
        dst.write_all(&chunk).await?;
        total += chunk.len() as u64;
        let _ = src.flow_control().release_capacity(chunk.len());
    }
    Ok(total)
}

fn h2_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        e.into_io()
            .unwrap_or_else(|| io::Error::other("h2 I/O error"))
    } else {
        io::Error::other(e)
    }
}

/// Copies between a TCP connection and an HBONE stream until both directions end.
/// `sent` counts TCP → stream. `reserved` is the stream's budget
/// reservation, grown by its send buffer when it first sends.
pub async fn tcp_h2_bidirectional(
    tcp: &mut TcpStream,
    send: SendStream<Bytes>,
    recv: RecvStream,
    reserved: Option<&mut Reservation>,
) -> (Transferred, io::Result<()>) {
    let (r, w) = tcp.split();
    both_ways(tcp_to_h2(r, send, reserved), h2_to_tcp(recv, w)).await
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A connected pair on loopback: (the connecting side, the accepted side).
    pub(in crate::proxy) async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (b, _) = l.accept().await.unwrap();
        (a, b)
    }

    /// A destination that grants no window, then the application resets:
    /// the copy ends at once and resets the stream, instead of waiting on
    /// the window for ever.
    #[tokio::test]
    async fn a_source_reset_while_the_destination_takes_nothing_ends_the_copy() {
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        let server = tokio::spawn(async move {
            let mut conn = h2::server::Builder::new()
                .initial_window_size(0)
                .handshake::<_, Bytes>(server_io)
                .await
                .unwrap();
            let (req, mut respond) = conn.accept().await.unwrap().unwrap();
            let _answer = respond.send_response(http::Response::new(()), false);
            let mut body = req.into_body();
            let ended = tokio::spawn(async move { body.data().await.map(|d| d.map(|_| ())) });
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            ended.await.unwrap()
        });
        let (mut sender, conn) = h2::client::handshake(client_io).await.unwrap();
        tokio::spawn(conn);
        let (resp, send) = sender.send_request(http::Request::new(()), false).unwrap();
        let body = resp.await.unwrap().into_body();

        let (app, mut proxied) = pair().await;
        let copy =
            tokio::spawn(async move { tcp_h2_bidirectional(&mut proxied, send, body, None).await });
        let mut app = app.into_std().unwrap();
        app.set_nonblocking(false).unwrap();
        std::io::Write::write_all(&mut app, &[7u8; 64 * 1024]).unwrap();
        // Let the copy read it and wait on the window the server never grants.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(!copy.is_finished(), "the copy waits on the window");
        SockRef::from(&app)
            .set_linger(Some(std::time::Duration::ZERO))
            .unwrap();
        drop(app);

        let (_, ended) = tokio::time::timeout(std::time::Duration::from_secs(2), copy)
            .await
            .expect("the copy ends once its source resets")
            .unwrap();
        assert_eq!(ended.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        let at_server = server.await.unwrap();
        assert_eq!(
            at_server.and_then(|r| r.err()).and_then(|e| e.reason()),
            Some(h2::Reason::CANCEL),
            "the destination sees the stream reset"
        );
    }

    /// An HBONE stream's sending end, its answer's body (held to keep the
    /// stream open), and the task of the peer that reads it (granting
    /// `window` per stream) and releases what it reads, as an application
    /// that keeps up: it ends with all it read.
    async fn h2_stream_to_a_reader(
        window: u32,
    ) -> (
        SendStream<Bytes>,
        RecvStream,
        tokio::task::JoinHandle<Vec<u8>>,
    ) {
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        let server = tokio::spawn(async move {
            let mut conn = h2::server::Builder::new()
                .initial_window_size(window)
                .handshake::<_, Bytes>(server_io)
                .await
                .unwrap();
            let (req, mut respond) = conn.accept().await.unwrap().unwrap();
            let _answer = respond.send_response(http::Response::new(()), false);
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            let mut body = req.into_body();
            let mut got = Vec::new();
            while let Some(Ok(d)) = body.data().await {
                got.extend_from_slice(&d);
                let _ = body.flow_control().release_capacity(d.len());
            }
            got
        });
        let (mut sender, conn) = h2::client::handshake(client_io).await.unwrap();
        tokio::spawn(conn);
        let (resp, send) = sender.send_request(http::Request::new(()), false).unwrap();
        (send, resp.await.unwrap().into_body(), server)
    }

    /// A peer whose stream window is below the send buffer (an Ambit peer
    /// with many connections grants 16–256 KiB): once the application has
    /// sent a little and gone quiet, the stream's send-buffer reservation
    /// goes back. Before, h2 never offered the whole send buffer again, so
    /// it was kept for the stream's life.
    #[tokio::test]
    async fn a_quiet_stream_gives_its_send_buffer_back_under_a_small_peer_window() {
        use super::super::budget::{Budget, STREAM_OPEN_COST};
        let budget: &'static Budget = Box::leak(Box::default());
        budget.set_limit(1 << 30);
        let (send, _body, server) = h2_stream_to_a_reader(64 << 10).await;

        let (app, mut proxied) = pair().await;
        let mut reservation = budget.reserve(STREAM_OPEN_COST, None, None).unwrap();
        let copy = async {
            let (r, _w) = proxied.split();
            tcp_to_h2(r, send, Some(&mut reservation)).await
        };
        let app_side = async {
            let mut app = app;
            tokio::io::AsyncWriteExt::write_all(&mut app, b"ping")
                .await
                .unwrap();
            let sending = async {
                while budget.used() == STREAM_OPEN_COST {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
            };
            tokio::time::timeout(std::time::Duration::from_secs(2), sending)
                .await
                .expect("the stream reserves its send buffer as it sends");
            // Quiet now: the send buffer's reservation goes back.
            let given_back = async {
                while budget.used() != STREAM_OPEN_COST {
                    tokio::time::sleep(QUIET).await;
                }
            };
            let back = tokio::time::timeout(std::time::Duration::from_secs(2), given_back).await;
            tokio::io::AsyncWriteExt::shutdown(&mut app).await.unwrap();
            back
        };
        let (copied, back) = tokio::join!(copy, app_side);
        assert!(
            back.is_ok(),
            "the quiet stream kept {} bytes reserved",
            budget.used()
        );
        assert_eq!(copied.unwrap(), 4);
        assert_eq!(server.await.unwrap().len(), 4);
    }

    /// Messages of every size, each after a pause (so that each read
    /// finds one message, the way an application's requests come), then a
    /// bulk flow, then small ones again: what arrives is what was sent, in
    /// order, whether a read went through the stack (under
    /// [`SMALL_READ`]) or through the stream's buffer.
    #[tokio::test]
    async fn messages_of_every_size_arrive_whole_through_small_reads_and_the_buffer() {
        let (send, _body, server) = h2_stream_to_a_reader(64 << 10).await;

        let (mut app, mut proxied) = pair().await;
        let sizes = [
            1,
            SMALL_READ - 1,
            SMALL_READ,
            SMALL_READ + 1,
            3,
            MIN_BUF,
            2 * MAX_BUF + 7,
            5,
            1,
        ];
        let mut sent = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            sent.extend((0..size).map(|b| (b * 31 + i * 7) as u8));
        }
        let copy = async {
            let (r, _w) = proxied.split();
            tcp_to_h2(r, send, None).await
        };
        let app_side = async {
            let mut at = 0;
            for &size in &sizes {
                app.write_all(&sent[at..at + size]).await.unwrap();
                at += size;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            app.shutdown().await.unwrap();
        };
        let (copied, ()) = tokio::join!(copy, app_side);
        assert_eq!(copied.unwrap(), sent.len() as u64);
        let got = server.await.unwrap();
        assert_eq!(got.len(), sent.len());
        assert!(got == sent, "the bytes arrived changed or out of order");
    }

    #[test]
    fn a_send_buffer_counts_as_drained_at_half_the_window_it_began_with() {
        use super::super::budget::STREAM_SEND_BUFFER;
        // A window as large as the send buffer: half of it free is drained.
        assert!(drained(STREAM_SEND_BUFFER, STREAM_SEND_BUFFER));
        assert!(drained(STREAM_SEND_BUFFER / 2, STREAM_SEND_BUFFER));
        assert!(!drained(STREAM_SEND_BUFFER / 2 - 1, STREAM_SEND_BUFFER));
        // A 16 KiB window with 8 KiB unacknowledged: drained.
        assert!(drained(8 << 10, 16 << 10));
        assert!(!drained(4 << 10, 16 << 10));
        // No window at all when the burst began: any room at all.
        assert!(!drained(0, 0));
        assert!(drained(1, 0));
    }
}
