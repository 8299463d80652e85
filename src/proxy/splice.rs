//! TCP↔TCP in the kernel: `splice(2)` through a pipe, no user-space copy.
//! The pipes (their sizes, their growth for bulk flows, the few kept per
//! worker thread) and the loop that moves one direction, reading and
//! writing overlapped. Knows nothing of HBONE or TLS.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use socket2::SockRef;
use tokio::io::Interest;
use tokio::net::TcpStream;

use super::copy::{both_ways, byte_count, Transferred};

/// The size a pipe grows to once its flow is a bulk one (capped by
/// `fs.pipe-max-size` for a process without `CAP_SYS_RESOURCE`).
const PIPE_SIZE: libc::c_int = 1 << 20;

/// A splice pipe. It starts at the kernel's default size (16 pages, 64 KiB;
/// one page for a user past `fs.pipe-user-pages-soft`) and grows to
/// [`PIPE_SIZE`] only when its flow fills it ([`Pipe::fill_from`]): a full
/// pipe means the source had more waiting than the destination took, which
/// request/response traffic seldom has and a bulk transfer always does.
/// Small pipes matter beyond memory: every pipe's size counts against the
/// user's `fs.pipe-user-pages-soft` (64 MiB by default), past which the
/// kernel makes every new pipe one page, so 1 MiB pipes for every
/// connection would slow all connections down after the first few dozen.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    size: usize,
    /// The size the pipe was made with; it goes back to it before it is kept.
    start: usize,
    /// Growth not tried yet for this connection (one try: a refusal stands).
    may_grow: bool,
}

/// Empty pipes kept per worker thread for the next connection: a short
/// connection otherwise spends ten syscalls making and closing its two.
/// Few, and always at their start size, since kept pipes count against the
/// user's pipe-buffer limit.
const PIPES_KEPT: usize = 4;

thread_local! {
    static SPARE_PIPES: std::cell::RefCell<Vec<Pipe>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Pipe {
    /// A spare empty pipe of this thread, or a new one.
    fn take() -> io::Result<Self> {
        match SPARE_PIPES.try_with(|p| p.borrow_mut().pop()) {
            Ok(Some(pipe)) => Ok(pipe),
            _ => Pipe::new(),
        }
    }

    /// Keeps a drained pipe for reuse, back at its start size (a pipe the
    /// kernel will not shrink is closed instead). Only an empty pipe may
    /// come back: a copy that ends early (an error, a cancelled task) drops
    /// its pipe, and whatever it held goes with it.
    fn give_back(mut self) {
        if self.size > self.start && self.resize(self.start) != self.start {
            return;
        }
        self.may_grow = true;
        // `try_with`: a thread being torn down just closes it.
        let _ = SPARE_PIPES.try_with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < PIPES_KEPT {
                p.push(self);
            }
        });
    }

    fn new() -> io::Result<Self> {
        let (read, write) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)?;
        // SAFETY: F_GETPIPE_SZ on a pipe fd we own.
        let size = unsafe { libc::fcntl(write.as_raw_fd(), libc::F_GETPIPE_SZ) };
        let size = size.max(4096) as usize;
        Ok(Pipe {
            read,
            write,
            size,
            start: size,
            may_grow: true,
        })
    }

    /// Asks the kernel for `bytes` of pipe and returns the size it now has
    /// (unchanged if refused: over `fs.pipe-max-size`, or less than what
    /// the pipe holds).
    fn resize(&mut self, bytes: usize) -> usize {
        let want = libc::c_int::try_from(bytes).unwrap_or(PIPE_SIZE);
        // SAFETY: F_SETPIPE_SZ/F_GETPIPE_SZ on a pipe fd we own; a refusal
        // leaves the pipe as it was.
        let size = unsafe {
            libc::fcntl(self.write.as_raw_fd(), libc::F_SETPIPE_SZ, want);
            libc::fcntl(self.write.as_raw_fd(), libc::F_GETPIPE_SZ)
        };
        if size > 0 {
            self.size = size as usize;
        }
        self.size
    }

    /// Splices what `src` has, up to the pipe's free room, into the pipe,
    /// which already holds `queued` bytes. A flow that fills the pipe is a
    /// bulk one, and the pipe grows to [`PIPE_SIZE`]: filled in bytes (a
    /// splice leaves it holding its size), or in slots (the kernel takes one
    /// slot per socket-buffer fragment, so a flow of MTU-sized segments
    /// fills 16 slots with ~23 KiB: the splice then finds no room while
    /// bytes are queued, and is tried again once the pipe has grown).
    fn fill_from(&mut self, src: RawFd, queued: usize) -> io::Result<usize> {
        let n = match splice(src, self.write.as_raw_fd(), self.size - queued) {
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    && self.may_grow
                    && queued > 0
                    && has_no_room(&self.write) =>
            {
                self.grow();
                splice(src, self.write.as_raw_fd(), self.size - queued)?
            }
            r => r?,
        };
        if self.may_grow && queued + n >= self.size {
            self.grow();
        }
        Ok(n)
    }

    /// The buffers the pipe holds at most (the kernel gives a pipe one per
    /// page of its size). Each takes at least one byte, so a splice into
    /// an empty pipe that moved fewer bytes than this did not run out of
    /// them.
    fn slots(&self) -> usize {
        static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        // SAFETY: sysconf has no preconditions.
        let page =
            *PAGE.get_or_init(|| unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize);
        self.size / page
    }

    /// Grows the pipe to [`PIPE_SIZE`], once per connection (a refusal
    /// keeps it as it is).
    fn grow(&mut self) {
        self.may_grow = false;
        if self.size < PIPE_SIZE as usize {
            self.resize(PIPE_SIZE as usize);
        }
    }
}

fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: both fds are open for the duration of the call; null offsets mean
    // "current position", which is what sockets and pipes require.
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    };
    byte_count(n)
}

/// Whether a splice that moved `n` bytes into a pipe took all its source
/// held: it stopped short of the pipe's byte room, and of its slots. Each
/// slot takes at least a byte, so a splice into an `empty` pipe that moved
/// fewer bytes than the pipe has slots cannot have run out of them; into a
/// pipe already holding data, the slots left are unknown. 0 bytes is the
/// end of the stream, not a drained socket.
fn took_all_there_was(n: usize, empty: bool, room: usize, slots: usize) -> bool {
    n > 0 && empty && n < room && n < slots
}

/// Whether a pipe's write end has no free slot left.
fn has_no_room(write: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: write.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd for an fd we own, zero timeout.
    unsafe { libc::poll(&mut p, 1, 0) == 0 }
}

/// One direction: `src` → pipe → `dst`, then half-close `dst`.
///
/// Reading and writing overlap: while `dst` waits for its peer's ACKs, `src`
/// keeps filling the pipe, and while `src` is dry, the pipe keeps draining.
/// The task sleeps only when neither side can move.
async fn splice_one_way(src: &TcpStream, dst: &TcpStream) -> io::Result<u64> {
    let moved = splice_until_eof(src, dst).await;
    // Also after an error (a reset, a failed write): else the other side
    // would wait for an end that never comes.
    let _ = SockRef::from(dst).shutdown(std::net::Shutdown::Write);
    moved
}

async fn splice_until_eof(src: &TcpStream, dst: &TcpStream) -> io::Result<u64> {
    let mut pipe = Pipe::take()?;
    let mut total = 0u64;
    let mut queued = 0usize;
    let mut eof = false;
    // The pipe fills by slots (one per socket-buffer fragment) as well as by
    // bytes, and a full pipe answers EAGAIN like an empty socket. Only the
    // latter may clear `src`'s readiness: else data left in the socket would
    // never be read (no new edge), or a closed `src` would spin.
    let mut pipe_full = false;
    loop {
        let mut moved = false;
        if !eof && !pipe_full && queued < pipe.size {
            // A splice that provably took all the socket had (see
            // `took_all_there_was`: in practice a message shorter than the
            // pipe has slots, 16 bytes at its start size) clears the
            // socket's readiness, as `read_some` does for reads, saving the
            // splice that would find nothing. Larger messages still make
            // that splice: a short splice of them may have run out of
            // slots. `try_io` clears only if no new event came meanwhile.
            let (empty, room, slots) = (queued == 0, pipe.size - queued, pipe.slots());
            let mut took = 0;
            let filled = src.try_io(Interest::READABLE, || {
                match pipe.fill_from(src.as_raw_fd(), queued) {
                    Err(e)
                        if e.kind() == io::ErrorKind::WouldBlock
                            && queued > 0
                            && has_no_room(&pipe.write) =>
                    {
                        Ok(None)
                    }
                    Ok(n) if took_all_there_was(n, empty, room, slots) => {
                        took = n;
                        Err(io::ErrorKind::WouldBlock.into())
                    }
                    r => r.map(Some),
                }
            });
            let filled = match filled {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && took > 0 => Ok(Some(took)),
                r => r,
            };
            match filled {
                Ok(None) => pipe_full = true,
                Ok(Some(0)) => eof = true,
                Ok(Some(n)) => {
                    queued += n;
                    total += n as u64;
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        if queued > 0 {
            match dst.try_io(Interest::WRITABLE, || {
                splice(pipe.read.as_raw_fd(), dst.as_raw_fd(), queued)
            }) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(m) => {
                    queued -= m;
                    moved = true;
                    pipe_full = false;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        if eof && queued == 0 {
            break;
        }
        if moved {
            // A flow that never blocks must still let the worker's other tasks run.
            tokio::task::consume_budget().await;
            continue;
        }
        let fill = !eof && !pipe_full && queued < pipe.size;
        match (fill, queued > 0) {
            (true, true) => tokio::select! {
                r = src.readable() => r?,
                w = dst.writable() => w?,
            },
            // Nothing queued: a destination that reset meanwhile will take
            // nothing more, and the copy ends (else, once its other
            // direction has ended, it would wait on a source that may never
            // send again).
            (true, false) => tokio::select! {
                r = src.readable() => r?,
                _ = dst.ready(Interest::ERROR) => {
                    let e = dst.take_error().ok().flatten();
                    return Err(e.unwrap_or_else(|| io::ErrorKind::ConnectionReset.into()));
                }
            },
            // The pipe full and the destination taking nothing: a source
            // that resets meanwhile ends the copy, which is not held for a
            // connection that is gone.
            (false, true) if !eof => tokio::select! {
                w = dst.writable() => w?,
                _ = src.ready(Interest::ERROR) => {
                    let e = src.take_error().ok().flatten();
                    return Err(e.unwrap_or_else(|| io::ErrorKind::ConnectionReset.into()));
                }
            },
            _ => dst.writable().await?,
        }
    }
    pipe.give_back(); // eof and nothing queued: empty
    Ok(total)
}

/// Copies between two TCP connections in the kernel until both directions end.
pub async fn splice_bidirectional(
    client: &TcpStream,
    upstream: &TcpStream,
) -> (Transferred, io::Result<()>) {
    both_ways(
        splice_one_way(client, upstream),
        splice_one_way(upstream, client),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::copy::tests::pair;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn a_full_pipe_is_told_from_an_empty_one() {
        let pipe = Pipe::new().unwrap();
        assert!(!has_no_room(&pipe.write));
        let chunk = [7u8; 4096];
        while nix::unistd::write(&pipe.write, &chunk).is_ok() {}
        assert!(has_no_room(&pipe.write), "EAGAIN on write means full");
        let mut buf = [0u8; 4096];
        nix::unistd::read(pipe.read.as_raw_fd(), &mut buf).unwrap();
        assert!(!has_no_room(&pipe.write), "a freed slot is room again");
    }

    /// The pipe's size as the kernel has it.
    fn kernel_size(pipe: &Pipe) -> usize {
        // SAFETY: F_GETPIPE_SZ on a pipe fd the test owns.
        let n = unsafe { libc::fcntl(pipe.write.as_raw_fd(), libc::F_GETPIPE_SZ) };
        assert!(n > 0, "{}", io::Error::last_os_error());
        n as usize
    }

    #[test]
    fn a_pipe_starts_small_and_grows_once_a_flow_fills_it() {
        let mut pipe = Pipe::new().unwrap();
        let start = pipe.size;
        assert!(
            start < PIPE_SIZE as usize && kernel_size(&pipe) == start,
            "a new pipe has the kernel's default size (64 KiB), not {start} bytes"
        );
        // The source: another pipe, filled page by page, so a pipe's worth
        // of bytes takes exactly a pipe's worth of slots.
        let source = Pipe::new().unwrap();
        let put = |bytes: usize| {
            let data = vec![3u8; bytes];
            assert_eq!(nix::unistd::write(&source.write, &data).unwrap(), bytes);
        };
        let take = |pipe: &Pipe, bytes: usize| {
            let mut buf = vec![0u8; bytes];
            assert_eq!(
                nix::unistd::read(pipe.read.as_raw_fd(), &mut buf).unwrap(),
                bytes
            );
        };
        // A request's worth: carried, and the pipe stays small.
        put(300);
        assert_eq!(pipe.fill_from(source.read.as_raw_fd(), 0).unwrap(), 300);
        assert_eq!((pipe.size, kernel_size(&pipe)), (start, start));
        take(&pipe, 300);
        // A pipe's worth waiting at once: a bulk flow, and the pipe grows.
        put(start);
        assert_eq!(pipe.fill_from(source.read.as_raw_fd(), 0).unwrap(), start);
        assert_eq!(pipe.size, PIPE_SIZE as usize, "grown to the bulk size");
        assert_eq!(kernel_size(&pipe), pipe.size, "and the kernel agrees");
        take(&pipe, start);
        // Kept for the next connection at its start size.
        pipe.give_back();
        let kept = SPARE_PIPES
            .with(|p| p.borrow_mut().pop())
            .expect("the drained pipe is kept");
        assert_eq!((kept.size, kernel_size(&kept)), (start, start));
        assert!(kept.may_grow, "the next connection may grow it again");
    }

    #[test]
    fn a_pipe_full_of_small_fragments_grows_too() {
        // The kernel's default number of slots in a pipe.
        const SLOTS: usize = 16;
        let mut pipe = Pipe::new().unwrap();
        let start = pipe.size;
        // A packet pipe: each write stays a buffer of its own, so each one
        // takes a slot of `pipe`, as a socket's small fragments do.
        let (packets_read, packets_write) = nix::unistd::pipe2(
            nix::fcntl::OFlag::O_DIRECT
                | nix::fcntl::OFlag::O_NONBLOCK
                | nix::fcntl::OFlag::O_CLOEXEC,
        )
        .unwrap();
        let segment = [5u8; 100];
        for _ in 0..SLOTS {
            assert_eq!(nix::unistd::write(&packets_write, &segment).unwrap(), 100);
        }
        let queued = pipe.fill_from(packets_read.as_raw_fd(), 0).unwrap();
        assert_eq!(queued, SLOTS * 100, "one segment per slot");
        assert!(has_no_room(&pipe.write), "full by slots, not by bytes");
        assert_eq!(pipe.size, start, "not grown yet");
        // The next segment finds no room: the pipe grows and takes it.
        assert_eq!(nix::unistd::write(&packets_write, &segment).unwrap(), 100);
        assert_eq!(
            pipe.fill_from(packets_read.as_raw_fd(), queued).unwrap(),
            100
        );
        assert_eq!(pipe.size, PIPE_SIZE as usize);
        assert_eq!(kernel_size(&pipe), pipe.size);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn small_segments_then_close_reach_a_slow_reader_whole() {
        let (mut app_client, proxy_in) = pair().await;
        let (proxy_out, mut app_server) = pair().await;
        app_client.set_nodelay(true).unwrap();
        let relay = tokio::spawn(async move { splice_bidirectional(&proxy_in, &proxy_out).await });
        // Many small segments fill the pipe by slots long before by bytes;
        // the FIN arrives while the reader is not reading yet.
        let writer = tokio::spawn(async move {
            for _ in 0..20_000 {
                app_client.write_all(&[1u8; 100]).await.unwrap();
            }
            app_client.shutdown().await.unwrap();
            app_client
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), app_server.read_to_end(&mut got))
            .await
            .expect("every byte and the FIN within 20 s")
            .unwrap();
        assert_eq!(got.len(), 2_000_000);
        drop(app_server);
        drop(writer.await.unwrap());
        let (t, res) = tokio::time::timeout(Duration::from_secs(5), relay)
            .await
            .expect("the relay ends once both sides closed")
            .unwrap();
        res.unwrap();
        assert_eq!(t.sent, 2_000_000);
    }

    #[test]
    fn only_a_splice_short_of_both_bytes_and_slots_took_all_there_was() {
        const START: usize = 64 * 1024; // 16 slots of a page
        assert!(took_all_there_was(1, true, START, 16), "a 1-byte message");
        assert!(took_all_there_was(15, true, START, 16));
        assert!(
            !took_all_there_was(16, true, START, 16),
            "16 bytes may be 16 one-byte segments filling every slot"
        );
        assert!(
            !took_all_there_was(23_168, true, START, 16),
            "16 MTU-sized segments fill the slots with a third of the bytes"
        );
        assert!(
            !took_all_there_was(3, false, START - 100, 16),
            "into a pipe holding data: its free slots are unknown"
        );
        assert!(
            !took_all_there_was(0, true, START, 16),
            "the end of the stream"
        );
        assert!(
            took_all_there_was(200, true, 1 << 20, 256),
            "a grown pipe has more slots"
        );
        assert!(
            !took_all_there_was(1, true, 4096, 1),
            "a one-page pipe never tells"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_byte_messages_and_bursts_of_them_all_cross_the_relay() {
        let (mut app_client, proxy_in) = pair().await;
        let (proxy_out, mut app_server) = pair().await;
        app_client.set_nodelay(true).unwrap();
        app_server.set_nodelay(true).unwrap();
        let relay = tokio::spawn(async move { splice_bidirectional(&proxy_in, &proxy_out).await });
        let deadline = Duration::from_secs(20);
        // Ping-pong: each message is all the socket holds, so each splice
        // clears the readiness; a message left behind would stall here.
        for i in 0..2_000u32 {
            let b = [(i % 251) as u8];
            app_client.write_all(&b).await.unwrap();
            let mut got = [0u8; 1];
            tokio::time::timeout(deadline, app_server.read_exact(&mut got))
                .await
                .unwrap_or_else(|_| panic!("request {i} stalled"))
                .unwrap();
            app_server.write_all(&got).await.unwrap();
            tokio::time::timeout(deadline, app_client.read_exact(&mut got))
                .await
                .unwrap_or_else(|_| panic!("reply {i} stalled"))
                .unwrap();
            assert_eq!(got, b);
        }
        // Bursts of 1-byte segments: more of them than a pipe has slots,
        // so some splices stop at the slots with bytes still waiting.
        // Each burst must arrive whole before the next is sent: no later
        // data or FIN comes to wake a copy that stopped too early.
        for burst in 0..200 {
            for _ in 0..40 {
                app_client.write_all(&[9u8]).await.unwrap();
            }
            let mut got = [0u8; 40];
            tokio::time::timeout(Duration::from_secs(5), app_server.read_exact(&mut got))
                .await
                .unwrap_or_else(|_| panic!("burst {burst} stalled in the relay"))
                .unwrap();
        }
        app_client.shutdown().await.unwrap();
        let mut rest = Vec::new();
        tokio::time::timeout(deadline, app_server.read_to_end(&mut rest))
            .await
            .expect("the FIN within 20 s")
            .unwrap();
        assert!(rest.is_empty());
        drop(app_server);
        drop(app_client);
        let (t, res) = tokio::time::timeout(Duration::from_secs(5), relay)
            .await
            .expect("the relay ends once both sides closed")
            .unwrap();
        res.unwrap();
        assert_eq!(t.sent, 2_000 + 8_000);
    }

    #[tokio::test]
    async fn splice_moves_bytes_both_ways_with_half_close() {
        let (mut app_client, proxy_in) = pair().await;
        let (proxy_out, mut app_server) = pair().await;
        let relay = tokio::spawn(async move { splice_bidirectional(&proxy_in, &proxy_out).await });
        let payload = vec![7u8; 3 << 20];
        let p2 = payload.clone();
        let writer = tokio::spawn(async move {
            app_client.write_all(&p2).await.unwrap();
            app_client.shutdown().await.unwrap();
            let mut back = Vec::new();
            app_client.read_to_end(&mut back).await.unwrap();
            back
        });
        let mut got = Vec::new();
        app_server.read_to_end(&mut got).await.unwrap();
        assert_eq!(
            got.len(),
            payload.len(),
            "server must see EOF after all bytes"
        );
        app_server.write_all(b"reply").await.unwrap();
        app_server.shutdown().await.unwrap();
        assert_eq!(writer.await.unwrap(), b"reply");
        let (t, res) = relay.await.unwrap();
        res.unwrap();
        assert_eq!(
            t,
            Transferred {
                sent: 3 << 20,
                received: 5,
                proxy_closed_first: false,
            },
            "the client closed first"
        );
    }

    /// One connection through a splice relay on this thread: the client
    /// sends `request` and half-closes, the server reads it all, answers
    /// `reply` and closes. Returns the relay's count and what each end read.
    async fn one_exchange(request: &[u8], reply: &[u8]) -> (Transferred, Vec<u8>, Vec<u8>) {
        let (mut app_client, proxy_in) = pair().await;
        let (proxy_out, mut app_server) = pair().await;
        let relay = async { splice_bidirectional(&proxy_in, &proxy_out).await };
        let apps = async {
            app_client.write_all(request).await.unwrap();
            app_client.shutdown().await.unwrap();
            let mut got = Vec::new();
            app_server.read_to_end(&mut got).await.unwrap();
            app_server.write_all(reply).await.unwrap();
            drop(app_server);
            let mut back = Vec::new();
            app_client.read_to_end(&mut back).await.unwrap();
            (got, back)
        };
        let ((t, res), (got, back)) = tokio::join!(relay, apps);
        res.unwrap();
        (t, got, back)
    }

    #[tokio::test]
    async fn a_drained_pipe_serves_the_next_connection() {
        // Current-thread runtime: the copies run on this thread, whose
        // spare pipes are counted here.
        let spare = || SPARE_PIPES.with(|p| p.borrow().len());
        let before = spare();
        let (t, got, back) = one_exchange(b"ping", b"pong").await;
        assert_eq!(
            (got.as_slice(), back.as_slice()),
            (&b"ping"[..], &b"pong"[..])
        );
        assert_eq!((t.sent, t.received), (4, 4));
        assert_eq!(spare(), before + 2, "both pipes kept");
        // The next connection takes them and moves bytes through them as well.
        let (t, got, _) = one_exchange(b"again", b"").await;
        assert_eq!(got, b"again");
        assert_eq!(t.sent, 5);
        assert_eq!(spare(), before + 2, "taken and given back, not made anew");
    }

    /// A destination that reads nothing, a pipe full of what the source
    /// sent, then the source resets: the copy ends, not held for it.
    #[tokio::test]
    async fn a_source_reset_while_the_destination_takes_nothing_ends_the_copy() {
        let (mut app_client, proxy_in) = pair().await;
        let (proxy_out, _deaf_server) = pair().await;
        let relay = tokio::spawn(async move { splice_bidirectional(&proxy_in, &proxy_out).await });
        let chunk = vec![3u8; 256 * 1024];
        let mut written = 0;
        while let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(500), app_client.write(&chunk)).await
        {
            written += n;
        }
        assert!(
            written > PIPE_SIZE as usize,
            "the path is full: {written} bytes"
        );
        assert!(!relay.is_finished(), "the copy waits on the destination");
        let std_client = app_client.into_std().unwrap();
        socket2::SockRef::from(&std_client)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(std_client);
        let (_, res) = tokio::time::timeout(Duration::from_secs(2), relay)
            .await
            .expect("the copy ends once its source resets")
            .unwrap();
        assert_eq!(res.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
    }

    #[tokio::test]
    async fn a_destination_reset_ends_the_clients_side_and_is_no_clean_close() {
        let (mut app_client, proxy_in) = pair().await;
        let (proxy_out, app_server) = pair().await;
        let relay = tokio::spawn(async move { splice_bidirectional(&proxy_in, &proxy_out).await });
        app_client.write_all(b"request").await.unwrap();
        // The destination resets (SO_LINGER 0) instead of closing.
        let std_server = app_server.into_std().unwrap();
        socket2::SockRef::from(&std_server)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(std_server);
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), app_client.read_to_end(&mut got))
            .await
            .expect("the client is told the end, not left waiting")
            .ok();
        drop(app_client);
        let (t, res) = tokio::time::timeout(Duration::from_secs(5), relay)
            .await
            .expect("the relay ends")
            .unwrap();
        assert!(res.is_err(), "the reset is reported");
        assert!(
            !t.proxy_closed_first,
            "a reset is not the proxy's clean close"
        );
    }

    #[tokio::test]
    async fn a_destination_that_closes_first_is_reported() {
        let (mut app_client, proxy_in) = pair().await;
        let (proxy_out, mut app_server) = pair().await;
        let relay = tokio::spawn(async move { splice_bidirectional(&proxy_in, &proxy_out).await });
        app_server.write_all(b"bye").await.unwrap();
        drop(app_server);
        let mut got = Vec::new();
        app_client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"bye");
        drop(app_client);
        let (t, _) = relay.await.unwrap();
        assert!(t.proxy_closed_first, "{t:?}");
        assert_eq!(t.received, 3);
    }
}
