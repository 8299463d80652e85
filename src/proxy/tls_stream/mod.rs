//! HBONE's TLS connection: the handshake is rustls' (its unbuffered API),
//! and so are the record ciphers and the key schedule (its kernel API, made
//! for kTLS); what this module owns is the record layer between them and
//! the socket (`records`: the rules over bytes; `handshake`: driving
//! rustls to its keys; here: the stream over the socket), so that a received record is read straight into one buffer and
//! opened where it lies. rustls' buffered connection instead reads at most
//! one record per system call, moves each partial record to its buffer's
//! front and copies every decrypted record twice more (into a `Vec`, then
//! into the reader's buffer): about 2.5 user-space copies per received byte,
//! here one (into h2's buffer). Sent records are sealed by rustls' own
//! encrypter, as before, and written many to one `writev`.
//!
//! TLS 1.3, and TLS 1.2 when `TLS12_ENABLED` lets HBONE's configs agree on
//! it. After a TLS 1.3 handshake a peer may send application data, alerts,
//! `KeyUpdate` (answered when asked, and sent by us before the cipher's
//! confidentiality limit) and, to a client, `NewSessionTicket` (ignored:
//! resumption is off); after a TLS 1.2 one, data and alerts only (no
//! renegotiation), and the connection ends before its key's limit, as
//! TLS 1.2 cannot change keys. Anything else, a record that does not open,
//! or one longer than TLS allows ends the connection with an error. Knows
//! nothing of HTTP/2.

use std::collections::VecDeque;
use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::crypto::cipher::{
    InboundOpaqueMessage, MessageDecrypter, MessageEncrypter, OutboundChunks, OutboundPlainMessage,
};
use rustls::kernel::KernelConnection;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{ConnectionState, EncodeError, UnbufferedStatus};
use rustls::{
    ClientConfig, ConnectionTrafficSecrets, ContentType, ProtocolVersion, ServerConfig,
    SupportedCipherSuite,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

mod handshake;
mod meter;
mod records;
#[cfg(test)]
mod tests;

use handshake::Handshaken;
pub use handshake::{accept, connect};
use meter::FrameMeter;
use records::*;

/// Empty receive buffers of one record's room kept per worker thread. A
/// connection gives its buffer back whenever it has read all there was
/// (so an idle connection holds none) and takes one for the next message:
/// a request/response flow otherwise pays a 16 KiB malloc and free per
/// message. Few, and a bulk flow's larger buffer is never kept.
const SPARE_RECEIVE_KEPT: usize = 4;

thread_local! {
    static SPARE_RECEIVE: std::cell::RefCell<Vec<BytesMut>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A spare receive buffer of this thread (empty, a record's room), or an
/// empty one with no room yet.
fn spare_receive() -> BytesMut {
    SPARE_RECEIVE
        .try_with(|s| s.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Keeps an emptied receive buffer for this thread's next reader, if it
/// is a record's room (not a bulk flow's), whole and not shared.
fn give_back_receive(mut buf: BytesMut) {
    buf.clear();
    // `try_reclaim` first: until it moves the start back, `capacity` counts
    // only what lies past the bytes read. It moves nothing when that is
    // already a record's room, so a larger buffer can still pass here: the
    // reader gives back none of a bulk flow's.
    if !buf.try_reclaim(RECORD_ROOM) || buf.capacity() > 2 * RECORD_ROOM {
        return;
    }
    // `try_with`: a thread being torn down just frees it.
    let _ = SPARE_RECEIVE.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < SPARE_RECEIVE_KEPT {
            s.push(buf);
        }
    });
}

/// An HBONE TLS connection after its handshake.
pub struct TlsStream {
    tcp: TcpStream,
    keys: Keys,
    rx: Receiver,
    tx: Sender,
    /// Received bytes not yet opened, after the plaintext not yet read.
    received: BytesMut,
    /// Opened application data not yet read, a range of `received`.
    plain: Range<usize>,
    /// Where the record holding `plain` ends in `received`.
    plain_record_end: usize,
    /// The peer's handshake left application data before the record layer
    /// took over (a client's first bytes beside its Finished).
    early: BytesMut,
    /// The grown buffer size, once a read filled the buffer.
    bulk: bool,
    close_sent: bool,
    write_limit: usize,
    /// HTTP/2 frames in what is opened, for the cooperative budget.
    frames: FrameMeter,
}

impl TlsStream {
    /// The TLS version and cipher suite the handshake agreed on.
    pub fn agreed(&self) -> (ProtocolVersion, rustls::CipherSuite) {
        match &self.keys {
            Keys::Client(k) => (k.protocol_version(), k.negotiated_cipher_suite().suite()),
            Keys::Server(k) => (k.protocol_version(), k.negotiated_cipher_suite().suite()),
        }
    }

    /// Caps the sealed records waiting to be written; a write past it waits.
    pub fn set_buffer_limit(&mut self, limit: usize) {
        self.write_limit = limit.max(WRITE_AT);
    }

    fn new(
        tcp: TcpStream,
        keys: Keys,
        secrets: rustls::ExtractedSecrets,
        rest: Handshaken,
    ) -> Result<Self, RecordError> {
        let suite = keys.suite();
        let (enc, rekey_at) = encrypter(suite, secrets.tx.1, secrets.tx.0)?;
        let client = matches!(keys, Keys::Client(_));
        Ok(Self {
            tcp,
            rx: Receiver {
                decrypter: decrypter(suite, secrets.rx.1)?,
                seq: secrets.rx.0,
                handshake: Vec::new(),
                client,
                closed: false,
                key_updates_left: KEY_UPDATES_BETWEEN_DATA,
                warnings_left: WARNING_ALERTS,
                tls12: matches!(suite, SupportedCipherSuite::Tls12(_)),
            },
            tx: Sender {
                encrypter: enc,
                seq: secrets.tx.0,
                rekey_at,
                queue: VecDeque::new(),
                front_written: 0,
                queued: 0,
                fresh_key: false,
            },
            keys,
            received: rest.received,
            plain: 0..0,
            plain_record_end: 0,
            frames: {
                let mut frames = FrameMeter::new(!client);
                frames.count(&rest.early);
                frames
            },
            early: rest.early,
            bulk: false,
            close_sent: false,
            write_limit: crate::proxy::pod::TLS_SEND_BUFFER,
        })
    }

    /// The peer moved its keys; ours follow when it asks.
    fn peer_key_update(&mut self, requested: bool) -> Result<(), RecordError> {
        let next = self
            .keys
            .next_rx()
            .map_err(|e| RecordError::KeyUpdate(e.to_string()))?;
        self.rx.decrypter = decrypter(self.keys.suite(), next)?;
        self.rx.seq = 0;
        // Requests that come while we have sent nothing since our last
        // update are answered by that one (RFC 8446 §4.6.3), so a peer
        // asking again and again without reading cannot grow our queue.
        if requested && !self.tx.fresh_key {
            self.key_update()?;
        }
        Ok(())
    }

    /// Sends a `KeyUpdate` (not asking the peer's) and seals what follows
    /// under the next key.
    fn key_update(&mut self) -> Result<(), RecordError> {
        if self.rx.tls12 {
            return Err(RecordError::KeyUpdate(
                "TLS 1.2 cannot change keys: the connection ends at its key's record limit".into(),
            ));
        }
        let message = [HANDSHAKE_KEY_UPDATE, 0, 0, 1, 0];
        self.tx
            .seal(ContentType::Handshake, OutboundChunks::from(&message[..]))?;
        let next = self
            .keys
            .next_tx()
            .map_err(|e| RecordError::KeyUpdate(e.to_string()))?;
        let (enc, rekey_at) = encrypter(self.keys.suite(), next, 0)?;
        self.tx.encrypter = enc;
        self.tx.rekey_at = rekey_at;
        self.tx.seq = 0;
        self.tx.fresh_key = true;
        Ok(())
    }

    /// Makes room for the next read: at least a whole record's, and for a
    /// bulk flow (one whose read filled the buffer) a [`RECEIVE_BUFFER`]'s.
    /// `BytesMut` moves the unopened bytes (at most a partial record) to
    /// the front when that makes the room, instead of growing.
    fn make_room(&mut self) {
        let (least, size) = if self.bulk {
            (RECEIVE_BUFFER / 4, RECEIVE_BUFFER)
        } else {
            (RECORD_ROOM, RECORD_ROOM)
        };
        if self.received.capacity() == 0 && !self.bulk {
            self.received = spare_receive();
        }
        let len = self.received.len();
        if self.received.capacity() - len < least {
            self.received
                .reserve(size.saturating_sub(len).max(RECORD_ROOM));
        }
    }

    /// Reads from the socket into `received`: the bytes read, 0 at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        loop {
            self.make_room();
            let room = self.received.capacity() - self.received.len();
            match super::copy::read_some(&self.tcp, &mut self.received) {
                Ok(n) => {
                    if n == room && !self.bulk {
                        self.bulk = true;
                    }
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if self.received.is_empty() && self.received.capacity() > 0 {
                        // Idle: no buffer held while nothing arrives.
                        // A record's room goes to the thread's next
                        // reader; a bulk flow's buffer to the allocator.
                        let buf = std::mem::take(&mut self.received);
                        if !self.bulk {
                            give_back_receive(buf);
                        }
                        self.bulk = false;
                    }
                    ready!(self.tcp.poll_read_ready(cx))?;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

/// Takes up to `units` more of the task's cooperative budget; what the
/// budget cannot give is forgiven: the task yields before its next record.
fn charge(cx: &mut Context<'_>, units: usize) {
    for _ in 0..units {
        match tokio::task::coop::poll_proceed(cx) {
            Poll::Ready(unit) => unit.made_progress(),
            Poll::Pending => return,
        }
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.early.is_empty() {
            let n = this.early.len().min(out.remaining());
            out.put_slice(&this.early[..n]);
            this.early.advance(n);
            if this.early.is_empty() {
                this.early = BytesMut::new();
            }
            return Poll::Ready(Ok(()));
        }
        // As many whole records as are here and fit, each opened in place
        // and copied out once; the socket is read only when none is left.
        let mut delivered = false;
        loop {
            if !this.plain.is_empty() {
                let n = this.plain.len().min(out.remaining());
                out.put_slice(&this.received[this.plain.start..this.plain.start + n]);
                this.plain.start += n;
                delivered = true;
                if !this.plain.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                // Everything before the next record is read: let it go.
                this.received.advance(this.plain_record_end);
                this.plain = 0..0;
                if out.remaining() == 0 {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            if this.rx.closed {
                return Poll::Ready(Ok(()));
            }
            // Each record opened is a unit of the task's cooperative budget
            // (tokio's: 128 a turn), as each read of tokio's own sockets is,
            // and so is each HTTP/2 frame in it: a peer whose records arrive
            // faster than they are parsed (empty ones, PRIORITY or PING
            // frames) would otherwise keep this loop, and the worker under
            // it, for as long as it sends.
            let coop = match tokio::task::coop::poll_proceed(cx) {
                Poll::Ready(coop) => coop,
                Poll::Pending if delivered => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            };
            let opened = this.rx.open(&mut this.received);
            if let Ok(Some((_, opened))) = &opened {
                coop.made_progress();
                if let Opened::Data(range) = opened {
                    let frames = this.frames.count(&this.received[range.clone()]);
                    charge(cx, frames);
                }
            }
            match opened {
                Ok(Some((used, opened))) => match opened {
                    Opened::Data(range) if !range.is_empty() => {
                        this.plain = range;
                        this.plain_record_end = used;
                    }
                    Opened::KeyUpdate { requested } => {
                        this.received.advance(used);
                        this.peer_key_update(requested)?;
                    }
                    _ => this.received.advance(used),
                },
                Ok(None) if delivered => return Poll::Ready(Ok(())),
                Ok(None) => {
                    let n = ready!(this.poll_fill(cx))?;
                    if n == 0 {
                        let why = if this.received.is_empty() {
                            "peer closed the connection without sending TLS close_notify"
                        } else {
                            "peer closed the connection inside a TLS record"
                        };
                        return Poll::Ready(Err(io::Error::new(io::ErrorKind::UnexpectedEof, why)));
                    }
                }
                // What was read goes up first; the error comes with the next read.
                Err(_) if delivered => return Poll::Ready(Ok(())),
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
    }
}

impl TlsStream {
    fn poll_write_chunks(
        &mut self,
        cx: &mut Context<'_>,
        data: OutboundChunks<'_>,
    ) -> Poll<io::Result<usize>> {
        if self.close_sent {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if self.tx.queued >= self.write_limit {
            // Past the cap: nothing more is taken until all is written.
            ready!(self.tx.poll_write_out(&self.tcp, cx))?;
        }
        let (now, _) = data.split_at(data.len().min(self.write_limit));
        let n = now.len();
        self.seal_chunks(now)?;
        if self.tx.queued >= WRITE_AT {
            if let Poll::Ready(Err(e)) = self.tx.poll_write_out(&self.tcp, cx) {
                return Poll::Ready(Err(e));
            }
        }
        Poll::Ready(Ok(n))
    }

    /// Seals `data`, replacing the key on the way when its limit comes.
    fn seal_chunks(&mut self, mut data: OutboundChunks<'_>) -> io::Result<()> {
        while !data.is_empty() {
            let records_left = (self.tx.rekey_at.saturating_sub(self.tx.seq)).max(1);
            let fits = usize::try_from(records_left)
                .unwrap_or(usize::MAX)
                .saturating_mul(MAX_PLAINTEXT);
            let (now, rest) = data.split_at(fits.min(data.len()));
            if self.tx.seal_data(now)? {
                self.key_update()?;
            }
            data = rest;
        }
        Ok(())
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.get_mut()
            .poll_write_chunks(cx, OutboundChunks::from(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut slices: [&[u8]; SEAL_SLICES] = [&[]; SEAL_SLICES];
        let mut n = 0;
        for b in bufs.iter().filter(|b| !b.is_empty()).take(SEAL_SLICES) {
            slices[n] = b;
            n += 1;
        }
        if n == 0 {
            return Poll::Ready(Ok(0));
        }
        let data = if n == 1 {
            OutboundChunks::from(slices[0])
        } else {
            OutboundChunks::new(&slices[..n])
        };
        self.get_mut().poll_write_chunks(cx, data)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.tx.poll_write_out(&this.tcp, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.close_sent {
            let alert = [1u8, ALERT_CLOSE_NOTIFY]; // warning, close_notify
            this.tx
                .seal(ContentType::Alert, OutboundChunks::from(&alert[..]))?;
            this.close_sent = true;
        }
        ready!(this.tx.poll_write_out(&this.tcp, cx))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}
