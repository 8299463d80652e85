//! HBONE's TLS connection: the handshake is rustls' (its unbuffered API),
//! and so are the record ciphers and the key schedule (its kernel API, made
//! for kTLS); what this file owns is the record layer between them and the
//! socket, so that a received record is read straight into one buffer and
//! opened where it lies. rustls' buffered connection instead reads at most
//! one record per system call, moves each partial record to its buffer's
//! front and copies every decrypted record twice more (into a `Vec`, then
//! into the reader's buffer): about 2.5 user-space copies per received byte,
//! here one (into h2's buffer). Sent records are sealed by rustls' own
//! encrypter, as before, and written many to one `writev`.
//!
//! TLS 1.3 only (HBONE's configs allow nothing else). After the handshake a
//! peer may send application data, alerts, `KeyUpdate` (answered when asked,
//! and sent by us before the cipher's confidentiality limit) and, to a
//! client, `NewSessionTicket` (ignored: resumption is off); anything else,
//! a record that does not open, or one longer than TLS allows ends the
//! connection with an error. Knows nothing of HTTP/2.

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

/// The most plaintext one record carries (RFC 8446 §5.1).
const MAX_PLAINTEXT: usize = 1 << 14;
/// The most ciphertext one TLS 1.3 record may carry (RFC 8446 §5.2).
const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;
const HEADER: usize = 5;
/// Room for one whole record: the receive buffer never holds less.
const RECORD_ROOM: usize = HEADER + MAX_CIPHERTEXT;
/// A bulk flow's receive buffer: one read takes this much from the socket.
const RECEIVE_BUFFER: usize = 256 * 1024;
/// The most of one post-handshake handshake message kept while it spans
/// records.
const MAX_HANDSHAKE_MESSAGE: usize = 64 * 1024;
/// Handshake flights are read in pieces of this; a flight may be at most
/// [`MAX_HANDSHAKE_MESSAGE`] plus a record.
const HANDSHAKE_READ: usize = 8 * 1024;
/// Sealed records are written once this much waits, or on flush.
const WRITE_AT: usize = 64 * 1024;
/// Iovecs per `writev`.
const WRITE_VECTORS: usize = 64;
/// Slices of one vectored write sealed together (h2 hands a frame head
/// and its payload).
const SEAL_SLICES: usize = 8;

const HANDSHAKE_KEY_UPDATE: u8 = 24;
const HANDSHAKE_NEW_SESSION_TICKET: u8 = 4;
const ALERT_CLOSE_NOTIFY: u8 = 0;
const ALERT_USER_CANCELED: u8 = 90;

/// Why a TLS connection failed after its handshake.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("TLS record of {0} bytes is longer than TLS 1.3 allows")]
    Oversized(usize),
    #[error("TLS record of outer type {0} after the handshake")]
    UnexpectedOuterType(u8),
    #[error("TLS record did not decrypt: {0}")]
    Decrypt(String),
    #[error("TLS {0} record after the handshake")]
    UnexpectedInnerType(String),
    #[error("TLS alert {0} from the peer")]
    Alert(u8),
    #[error("malformed TLS alert")]
    BadAlert,
    #[error("post-handshake TLS message of type {0} not allowed here")]
    UnexpectedHandshake(u8),
    #[error("malformed post-handshake TLS message")]
    BadHandshake,
    #[error("TLS data after the peer's close_notify")]
    AfterClose,
    #[error("TLS key update: {0}")]
    KeyUpdate(String),
    #[error("TLS record not sealed: {0}")]
    Seal(String),
    #[error("too many TLS {0} from the peer")]
    Flood(&'static str),
}

impl From<RecordError> for io::Error {
    fn from(e: RecordError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// What one opened record holds.
#[derive(Debug, PartialEq, Eq)]
enum Opened {
    /// Application data, at this range of the buffer handed to `open`.
    Data(Range<usize>),
    /// Nothing for the reader (an empty record, a ticket, a warning).
    Nothing,
    /// The peer moved to new keys; it asks for ours to move too.
    KeyUpdate { requested: bool },
    /// close_notify: the peer sends no more.
    Closed,
}

/// The receiving half of the record layer: pure, over a byte buffer.
struct Receiver {
    decrypter: Box<dyn MessageDecrypter>,
    seq: u64,
    /// A post-handshake handshake message not whole yet.
    handshake: Vec<u8>,
    /// A client may be sent tickets; a server may not.
    client: bool,
    closed: bool,
    /// Key updates the peer may still send before its next data, and
    /// warning alerts for the connection's life: each costs us work and
    /// the peer 27 bytes, so a flood of them ends the connection (the
    /// bounds are rustls' and BoringSSL's).
    key_updates_left: u8,
    warnings_left: u8,
}

const KEY_UPDATES_BETWEEN_DATA: u8 = 32;
const WARNING_ALERTS: u8 = 4;

impl Receiver {
    /// Opens the record at the front of `buf`, in place: `None` if it is not
    /// all there yet, else how many bytes it took and what it held.
    fn open(&mut self, buf: &mut [u8]) -> Result<Option<(usize, Opened)>, RecordError> {
        if buf.len() < HEADER {
            return Ok(None);
        }
        let (typ, len) = (buf[0], u16::from_be_bytes([buf[3], buf[4]]) as usize);
        if typ != u8::from(ContentType::ApplicationData) {
            return Err(RecordError::UnexpectedOuterType(typ));
        }
        if len > MAX_CIPHERTEXT {
            return Err(RecordError::Oversized(len));
        }
        if buf.len() < HEADER + len {
            return Ok(None);
        }
        if self.closed {
            return Err(RecordError::AfterClose);
        }
        let base = buf.as_ptr() as usize;
        let record = &mut buf[..HEADER + len];
        let message = InboundOpaqueMessage::new(
            ContentType::ApplicationData,
            ProtocolVersion::TLSv1_2,
            &mut record[HEADER..],
        );
        let plain = self
            .decrypter
            .decrypt(message, self.seq)
            .map_err(|e| RecordError::Decrypt(e.to_string()))?;
        self.seq += 1;
        let payload: &[u8] = plain.payload;
        let opened = match plain.typ {
            ContentType::ApplicationData if self.handshake.is_empty() => {
                self.key_updates_left = KEY_UPDATES_BETWEEN_DATA;
                let start = payload.as_ptr() as usize - base;
                Opened::Data(start..start + payload.len())
            }
            ContentType::Alert => match payload {
                [_, ALERT_CLOSE_NOTIFY] => {
                    self.closed = true;
                    Opened::Closed
                }
                [_, ALERT_USER_CANCELED] => {
                    self.warnings_left = self
                        .warnings_left
                        .checked_sub(1)
                        .ok_or(RecordError::Flood("warning alerts"))?;
                    Opened::Nothing
                }
                [_, description] => return Err(RecordError::Alert(*description)),
                _ => return Err(RecordError::BadAlert),
            },
            ContentType::Handshake => {
                if self.handshake.len() + payload.len() > MAX_HANDSHAKE_MESSAGE {
                    return Err(RecordError::BadHandshake);
                }
                self.handshake.extend_from_slice(payload);
                self.handshake_messages()?
            }
            other => return Err(RecordError::UnexpectedInnerType(format!("{other:?}"))),
        };
        Ok(Some((HEADER + len, opened)))
    }

    /// Takes the whole handshake messages held: tickets are dropped, a key
    /// update must end its record.
    fn handshake_messages(&mut self) -> Result<Opened, RecordError> {
        let mut taken = 0;
        let mut opened = Opened::Nothing;
        while let [typ, a, b, c, ref rest @ ..] = self.handshake[taken..] {
            let len = u32::from_be_bytes([0, a, b, c]) as usize;
            if rest.len() < len {
                break;
            }
            match typ {
                HANDSHAKE_KEY_UPDATE => {
                    self.key_updates_left = self
                        .key_updates_left
                        .checked_sub(1)
                        .ok_or(RecordError::Flood("key updates"))?;
                    let requested = match rest[..len] {
                        [0] => false,
                        [1] => true,
                        _ => return Err(RecordError::BadHandshake),
                    };
                    if rest.len() != len {
                        // A key change must fall on a record's end (RFC 8446 §5.1).
                        return Err(RecordError::BadHandshake);
                    }
                    opened = Opened::KeyUpdate { requested };
                }
                HANDSHAKE_NEW_SESSION_TICKET if self.client => {}
                other => return Err(RecordError::UnexpectedHandshake(other)),
            }
            taken += 4 + len;
        }
        self.handshake.drain(..taken);
        if self.handshake.is_empty() {
            self.handshake = Vec::new();
        }
        Ok(opened)
    }
}

/// The sending half: seals plaintext into whole records, queued in order.
struct Sender {
    encrypter: Box<dyn MessageEncrypter>,
    seq: u64,
    /// Records sealed under one key before it is replaced.
    rekey_at: u64,
    queue: VecDeque<Vec<u8>>,
    /// Bytes of `queue`'s front already written.
    front_written: usize,
    queued: usize,
    /// Nothing sealed under the current key since our last `KeyUpdate`.
    fresh_key: bool,
}

impl Sender {
    fn seal(&mut self, typ: ContentType, payload: OutboundChunks<'_>) -> Result<(), RecordError> {
        let message = OutboundPlainMessage {
            typ,
            version: ProtocolVersion::TLSv1_2,
            payload,
        };
        let record = self
            .encrypter
            .encrypt(message, self.seq)
            .map_err(|e| RecordError::Seal(e.to_string()))?
            .encode();
        self.seq += 1;
        self.queued += record.len();
        self.queue.push_back(record);
        Ok(())
    }

    /// Application data, in records of at most [`MAX_PLAINTEXT`]; true
    /// when the key has sealed as many records as it may.
    fn seal_data(&mut self, mut data: OutboundChunks<'_>) -> Result<bool, RecordError> {
        self.fresh_key = false;
        while !data.is_empty() {
            let (record, rest) = data.split_at(MAX_PLAINTEXT);
            self.seal(ContentType::ApplicationData, record)?;
            data = rest;
        }
        Ok(self.seq >= self.rekey_at)
    }

    /// Writes records out: `Ready` once the queue is empty.
    fn poll_write_out(&mut self, tcp: &TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.queue.is_empty() {
            let mut slices = [io::IoSlice::new(&[]); WRITE_VECTORS];
            let mut n = 0;
            for (i, record) in self.queue.iter().take(WRITE_VECTORS).enumerate() {
                let from = if i == 0 { self.front_written } else { 0 };
                slices[i] = io::IoSlice::new(&record[from..]);
                n += 1;
            }
            let written = loop {
                ready!(tcp.poll_write_ready(cx))?;
                match tcp.try_write_vectored(&slices[..n]) {
                    Ok(w) => break w,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Poll::Ready(Err(e)),
                }
            };
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.queued -= written;
            let mut left = written;
            while left > 0 {
                let front = self.queue[0].len() - self.front_written;
                if left >= front {
                    left -= front;
                    self.queue.pop_front();
                    self.front_written = 0;
                } else {
                    self.front_written += left;
                    left = 0;
                }
            }
        }
        if self.queue.capacity() > SEAL_SLICES {
            // An idle connection keeps no room for a bulk flow's records.
            self.queue = VecDeque::new();
        }
        Poll::Ready(Ok(()))
    }
}

/// rustls' side of an open connection: new secrets on key updates.
enum Keys {
    Client(KernelConnection<ClientConnectionData>),
    Server(KernelConnection<ServerConnectionData>),
}

impl Keys {
    fn suite(&self) -> SupportedCipherSuite {
        match self {
            Keys::Client(k) => k.negotiated_cipher_suite(),
            Keys::Server(k) => k.negotiated_cipher_suite(),
        }
    }

    fn next_tx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
        match self {
            Keys::Client(k) => k.update_tx_secret(),
            Keys::Server(k) => k.update_tx_secret(),
        }
        .map(|(_, s)| s)
    }

    fn next_rx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
        match self {
            Keys::Client(k) => k.update_rx_secret(),
            Keys::Server(k) => k.update_rx_secret(),
        }
        .map(|(_, s)| s)
    }
}

/// One direction's cipher from its secrets.
fn cipher_parts(
    suite: SupportedCipherSuite,
    secrets: ConnectionTrafficSecrets,
) -> Result<
    (
        &'static dyn rustls::crypto::cipher::Tls13AeadAlgorithm,
        u64,
        rustls::crypto::cipher::AeadKey,
        rustls::crypto::cipher::Iv,
    ),
    RecordError,
> {
    let SupportedCipherSuite::Tls13(suite) = suite else {
        return Err(RecordError::KeyUpdate("not a TLS 1.3 connection".into()));
    };
    let (key, iv) = match secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv }
        | ConnectionTrafficSecrets::Aes256Gcm { key, iv }
        | ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (key, iv),
        _ => return Err(RecordError::KeyUpdate("unknown cipher".into())),
    };
    Ok((suite.aead_alg, suite.common.confidentiality_limit, key, iv))
}

fn decrypter(
    suite: SupportedCipherSuite,
    secrets: ConnectionTrafficSecrets,
) -> Result<Box<dyn MessageDecrypter>, RecordError> {
    let (aead, _, key, iv) = cipher_parts(suite, secrets)?;
    Ok(aead.decrypter(key, iv))
}

/// The encrypter and the record count at which it is replaced: a little
/// short of the cipher's confidentiality limit, as rustls does.
fn encrypter(
    suite: SupportedCipherSuite,
    secrets: ConnectionTrafficSecrets,
) -> Result<(Box<dyn MessageEncrypter>, u64), RecordError> {
    let (aead, limit, key, iv) = cipher_parts(suite, secrets)?;
    Ok((aead.encrypter(key, iv), limit.saturating_sub(1 << 10)))
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
}

impl TlsStream {
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
        let (enc, rekey_at) = encrypter(suite, secrets.tx.1)?;
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
        let message = [HANDSHAKE_KEY_UPDATE, 0, 0, 1, 0];
        self.tx
            .seal(ContentType::Handshake, OutboundChunks::from(&message[..]))?;
        let next = self
            .keys
            .next_tx()
            .map_err(|e| RecordError::KeyUpdate(e.to_string()))?;
        let (enc, rekey_at) = encrypter(self.keys.suite(), next)?;
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
                        self.received = BytesMut::new();
                        self.bulk = false;
                    }
                    ready!(self.tcp.poll_read_ready(cx))?;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
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
            match this.rx.open(&mut this.received) {
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

/// What a finished handshake leaves beside the keys.
struct Handshaken {
    /// Received bytes past the handshake: the start of the first record.
    received: BytesMut,
    /// Application data rustls opened during the handshake.
    early: BytesMut,
}

/// The two sides' unbuffered connections, driven by one handshake loop.
trait Handshaking: Sized {
    type Data;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn done(&self) -> bool;
    fn certificates(&self) -> Vec<CertificateDer<'static>>;
    fn into_keys(self) -> Result<(rustls::ExtractedSecrets, Keys), rustls::Error>;
}

/// The same calls on either side's type (rustls gives them no common trait).
macro_rules! handshaking {
    ($conn:ty, $data:ty, $keys:path) => {
        impl Handshaking for $conn {
            type Data = $data;
            fn process<'c, 'i>(
                &'c mut self,
                incoming: &'i mut [u8],
            ) -> UnbufferedStatus<'c, 'i, Self::Data> {
                self.process_tls_records(incoming)
            }
            fn done(&self) -> bool {
                !self.is_handshaking()
            }
            fn certificates(&self) -> Vec<CertificateDer<'static>> {
                self.peer_certificates()
                    .map(<[_]>::to_vec)
                    .unwrap_or_default()
            }
            fn into_keys(self) -> Result<(rustls::ExtractedSecrets, Keys), rustls::Error> {
                self.dangerous_into_kernel_connection()
                    .map(|(s, k)| (s, $keys(k)))
            }
        }
    };
}

handshaking!(
    UnbufferedClientConnection,
    ClientConnectionData,
    Keys::Client
);
handshaking!(
    UnbufferedServerConnection,
    ServerConnectionData,
    Keys::Server
);

fn tls_io(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Sends the alert a failed handshake left queued, best effort.
/// `received` is the handshake's buffer, its discards made: rustls' next
/// call must see the same bytes.
async fn send_alert<C: Handshaking>(
    conn: &mut C,
    tcp: &mut TcpStream,
    received: &mut BytesMut,
) -> io::Result<()> {
    let mut outgoing = Vec::new();
    let mut encoded = 0;
    loop {
        let UnbufferedStatus { state, discard } = conn.process(received);
        let go_on = match state {
            Ok(ConnectionState::EncodeTlsData(mut data)) => loop {
                match data.encode(&mut outgoing[encoded..]) {
                    Ok(n) => {
                        encoded += n;
                        break true;
                    }
                    Err(EncodeError::InsufficientSize(s)) => {
                        outgoing.resize(encoded + s.required_size, 0)
                    }
                    Err(_) => break false,
                }
            },
            Ok(ConnectionState::TransmitTlsData(data)) => {
                data.done();
                true
            }
            _ => false,
        };
        received.advance(discard);
        if !go_on {
            break;
        }
    }
    tcp.write_all(&outgoing[..encoded]).await
}

/// A connection after its handshake, and the peer's certificate chain
/// (leaf first), which the stream does not keep.
pub type Connected = (TlsStream, Vec<CertificateDer<'static>>);

/// Runs the handshake on `tcp`, then hands the connection to our record layer.
async fn handshake<C: Handshaking>(mut conn: C, mut tcp: TcpStream) -> io::Result<Connected> {
    let mut received = BytesMut::with_capacity(HANDSHAKE_READ);
    let mut outgoing: Vec<u8> = Vec::new();
    let mut encoded = 0;
    let mut early = BytesMut::new();
    loop {
        let UnbufferedStatus { discard, state } = conn.process(&mut received);
        let mut read = false;
        let mut transmit = false;
        let state = match state {
            Ok(state) => state,
            Err(e) => {
                // The peer is told why (an alert) before the connection ends.
                received.advance(discard);
                let _ = send_alert(&mut conn, &mut tcp, &mut received).await;
                return Err(tls_io(e));
            }
        };
        match state {
            ConnectionState::EncodeTlsData(mut data) => loop {
                match data.encode(&mut outgoing[encoded..]) {
                    Ok(n) => {
                        encoded += n;
                        break;
                    }
                    Err(EncodeError::InsufficientSize(s)) => {
                        outgoing.resize(encoded + s.required_size, 0);
                    }
                    Err(e) => {
                        return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
                    }
                }
            },
            ConnectionState::TransmitTlsData(data) => {
                data.done();
                transmit = true;
            }
            ConnectionState::BlockedHandshake => read = true,
            ConnectionState::ReadTraffic(mut data) => {
                while let Some(record) = data.next_record() {
                    let record = record.map_err(tls_io)?;
                    if early.len() + record.payload.len() > RECEIVE_BUFFER {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "too much TLS data during the handshake",
                        ));
                    }
                    early.extend_from_slice(record.payload);
                }
            }
            ConnectionState::WriteTraffic(_) => read = true,
            ConnectionState::PeerClosed | ConnectionState::Closed => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed the connection during the TLS handshake",
                ))
            }
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "unexpected TLS state during the handshake",
                ))
            }
        }
        received.advance(discard);
        if transmit {
            tcp.write_all(&outgoing[..encoded]).await?;
            encoded = 0;
            outgoing = Vec::new();
            continue;
        }
        if read && conn.done() && encoded == 0 {
            break;
        }
        if read {
            if received.len() >= MAX_HANDSHAKE_MESSAGE + RECORD_ROOM {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "TLS handshake flight too large",
                ));
            }
            received.reserve(HANDSHAKE_READ);
            if tcp.read_buf(&mut received).await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed the connection during the TLS handshake",
                ));
            }
        }
    }
    let peer_certificates = conn.certificates();
    let (secrets, keys) = conn.into_keys().map_err(tls_io)?;
    let rest = Handshaken { received, early };
    let stream = TlsStream::new(tcp, keys, secrets, rest).map_err(io::Error::from)?;
    Ok((stream, peer_certificates))
}

/// The client side of an HBONE connection on `tcp`. `config` must allow
/// secret extraction (HBONE's client configs do).
pub async fn connect(
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
    tcp: TcpStream,
) -> io::Result<Connected> {
    let conn = UnbufferedClientConnection::new(config, name).map_err(tls_io)?;
    handshake(conn, tcp).await
}

/// The server side of an HBONE connection accepted on `tcp`. `config` must
/// allow secret extraction (HBONE's server configs do).
pub async fn accept(config: Arc<ServerConfig>, tcp: TcpStream) -> io::Result<Connected> {
    let conn = UnbufferedServerConnection::new(config).map_err(tls_io)?;
    handshake(conn, tcp).await
}

#[cfg(test)]
mod tests {
    //! Each side of our record layer against rustls' own buffered
    //! connection (tokio-rustls) on the other: the peer every HBONE
    //! connection to or from ztunnel has.
    use super::*;
    use crate::identity::tls::{client_config, hbone_server_name, identity_of, server_config};
    use crate::identity::{Identity, LocalCa};
    use std::time::Duration;
    use tokio::net::TcpListener;

    struct Configs {
        client: Arc<ClientConfig>,
        server: Arc<ServerConfig>,
    }

    fn configs() -> Configs {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let issue = |name: &str| {
            ca.issue(
                &Identity::new("cluster.local", "ns", name),
                Duration::from_secs(600),
            )
            .unwrap()
        };
        Configs {
            client: Arc::new(client_config(&issue("client")).unwrap()),
            server: Arc::new(server_config(&issue("server")).unwrap()),
        }
    }

    async fn tcp_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (a.unwrap(), b.unwrap().0)
    }

    /// Bytes no two positions of which repeat within a record, so a record
    /// out of place or a byte lost shows.
    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_be_bytes()[0] ^ seed)
            .collect()
    }

    const BULK: usize = 3 * 1024 * 1024 + 17;

    /// Writes `data` in writes of varied sizes, reads everything the peer
    /// sends until its close_notify, then closes.
    async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
        s: S,
        data: Vec<u8>,
    ) -> io::Result<Vec<u8>> {
        let (mut r, mut w) = tokio::io::split(s);
        let writer = async move {
            let mut sizes = [1usize, 9, 16_384, 16_385, 70_000, 300_000].iter().cycle();
            let mut at = 0;
            while at < data.len() {
                let n = (*sizes.next().unwrap()).min(data.len() - at);
                w.write_all(&data[at..at + n]).await?;
                at += n;
            }
            w.shutdown().await?;
            Ok::<_, io::Error>(w)
        };
        let reader = async move {
            let mut got = Vec::new();
            r.read_to_end(&mut got).await?;
            Ok::<_, io::Error>((r, got))
        };
        let (w, r) = tokio::join!(writer, reader);
        let (_w, (_r, got)) = (w?, r?);
        Ok(got)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn our_client_and_a_rustls_server_carry_every_byte_both_ways_and_close_cleanly() {
        let c = configs();
        let (a, b) = tcp_pair().await;
        // As a server that keeps rustls' defaults does, it sends tickets
        // after the handshake, which our client drops.
        let mut server = (*c.server).clone();
        server.send_tls13_tickets = 2;
        server.session_storage = rustls::server::ServerSessionMemoryCache::new(16);
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let server = tokio::spawn(async move {
            let s = acceptor.accept(b).await?;
            exchange(s, pattern(BULK, 2)).await
        });
        let (ours, certs) = connect(c.client.clone(), hbone_server_name(), a)
            .await
            .unwrap();
        let peer = certs.first().and_then(identity_of);
        assert_eq!(peer, Some(Identity::new("cluster.local", "ns", "server")));
        let got = exchange(ours, pattern(BULK, 1)).await.unwrap();
        assert!(got == pattern(BULK, 2), "the server's bytes, in order");
        let theirs = server.await.unwrap().unwrap();
        assert!(theirs == pattern(BULK, 1), "our bytes, in order");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn our_server_takes_a_rustls_clients_first_bytes_sent_beside_its_finished() {
        let c = configs();
        let (a, b) = tcp_pair().await;
        let connector = tokio_rustls::TlsConnector::from(c.client.clone());
        let client = tokio::spawn(async move {
            let s = connector.connect(hbone_server_name(), a).await?;
            exchange(s, pattern(BULK, 3)).await
        });
        let (ours, certs) = accept(c.server.clone(), b).await.unwrap();
        let peer = certs.first().and_then(identity_of);
        assert_eq!(peer, Some(Identity::new("cluster.local", "ns", "client")));
        let got = exchange(ours, pattern(BULK, 4)).await.unwrap();
        assert!(got == pattern(BULK, 3));
        assert!(client.await.unwrap().unwrap() == pattern(BULK, 4));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peers_key_update_is_followed_and_answered() {
        let c = configs();
        let (a, b) = tcp_pair().await;
        let acceptor = tokio_rustls::TlsAcceptor::from(c.server.clone());
        let server = tokio::spawn(async move {
            let mut s = acceptor.accept(b).await.unwrap();
            let mut got = vec![0u8; 100_000];
            for round in 0..3u8 {
                s.write_all(&pattern(50_000, round)).await.unwrap();
                // New keys for what follows, and ours asked to follow too.
                s.get_mut().1.refresh_traffic_keys().unwrap();
                s.write_all(&pattern(50_000, round + 10)).await.unwrap();
                s.flush().await.unwrap();
                // Our answer came under the old keys, our data under the new.
                s.read_exact(&mut got).await.unwrap();
                assert!(got == pattern(100_000, round + 20), "round {round}");
            }
            s.shutdown().await.unwrap();
        });
        let (mut ours, _) = connect(c.client.clone(), hbone_server_name(), a)
            .await
            .unwrap();
        for round in 0..3u8 {
            let mut got = vec![0u8; 100_000];
            ours.read_exact(&mut got).await.unwrap();
            assert!(got[..50_000] == pattern(50_000, round));
            assert!(got[50_000..] == pattern(50_000, round + 10));
            ours.write_all(&pattern(100_000, round + 20)).await.unwrap();
            ours.flush().await.unwrap();
        }
        let mut rest = Vec::new();
        ours.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        server.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_asking_for_new_keys_again_and_again_gets_one_answer_then_is_cut_off() {
        let c = configs();
        let (a, b) = tcp_pair().await;
        let acceptor = tokio_rustls::TlsAcceptor::from(c.server.clone());
        let server = tokio::spawn(async move {
            let mut s = acceptor.accept(b).await.unwrap();
            let flood = |s: &mut tokio_rustls::server::TlsStream<TcpStream>, n| {
                for _ in 0..n {
                    s.get_mut().1.refresh_traffic_keys().unwrap();
                }
            };
            flood(&mut s, 20);
            s.write_all(b"after").await.unwrap();
            s.flush().await.unwrap();
            let mut got = [0u8; 4];
            s.read_exact(&mut got).await.unwrap();
            // Past the bound between data records: the connection ends.
            flood(&mut s, 40);
            let _ = s.flush().await;
            got
        });
        let (mut ours, _) = connect(c.client.clone(), hbone_server_name(), a)
            .await
            .unwrap();
        let mut got = [0u8; 5];
        ours.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"after", "every key followed");
        assert_eq!(ours.tx.queue.len(), 1, "one answer queued for 20 requests");
        ours.write_all(b"back").await.unwrap();
        ours.flush().await.unwrap();
        assert_eq!(
            &server.await.unwrap(),
            b"back",
            "our data under our one new key"
        );
        let e = read_error(&mut ours).await;
        assert!(e.contains("too many TLS key updates"), "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn our_keys_move_before_their_limit_and_the_peer_follows() {
        let c = configs();
        let (a, b) = tcp_pair().await;
        let acceptor = tokio_rustls::TlsAcceptor::from(c.server.clone());
        let server = tokio::spawn(async move {
            let mut s = acceptor.accept(b).await.unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.unwrap();
            got
        });
        let (mut ours, _) = connect(c.client.clone(), hbone_server_name(), a)
            .await
            .unwrap();
        // As if the key had sealed all but 2 of its records before each
        // 40 kB write (3 records): each write crosses a key change.
        let mut changes = 0;
        let data = pattern(1_000_000, 7);
        for part in data.chunks(40_000) {
            let seq = ours.tx.seq;
            ours.tx.rekey_at = seq + 2;
            ours.write_all(part).await.unwrap();
            if ours.tx.seq < seq + 3 {
                changes += 1;
            }
        }
        ours.shutdown().await.unwrap();
        assert!(changes >= 20, "keys moved {changes} times");
        assert!(
            server.await.unwrap() == data,
            "the peer opened every record"
        );
    }

    #[tokio::test]
    async fn a_server_of_another_ca_is_refused_by_our_client_and_told_why() {
        let (ours, foreign) = (configs(), configs());
        let (a, b) = tcp_pair().await;
        let acceptor = tokio_rustls::TlsAcceptor::from(foreign.server.clone());
        let server = tokio::spawn(async move { acceptor.accept(b).await.map(|_| ()) });
        let e = connect(ours.client.clone(), hbone_server_name(), a)
            .await
            .err()
            .expect("refused");
        assert!(e.to_string().contains("certificate"), "{e}");
        let told = server.await.unwrap().expect_err("the peer hears an alert");
        assert!(told.to_string().contains("alert"), "{told}");
    }

    /// Our client's stream, and the rustls server's raw socket after the
    /// handshake (to send what a hostile peer would).
    async fn hostile_peer() -> (TlsStream, TcpStream) {
        let c = configs();
        let (a, b) = tcp_pair().await;
        let acceptor = tokio_rustls::TlsAcceptor::from(c.server.clone());
        let server = tokio::spawn(async move { acceptor.accept(b).await.unwrap() });
        let (ours, _) = connect(c.client.clone(), hbone_server_name(), a)
            .await
            .unwrap();
        let (raw, _) = server.await.unwrap().into_inner();
        (ours, raw)
    }

    async fn read_error(ours: &mut TlsStream) -> String {
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(5), ours.read(&mut buf))
            .await
            .expect("an answer, not a hang");
        read.expect_err("the record is refused").to_string()
    }

    #[tokio::test]
    async fn a_record_that_does_not_open_ends_the_connection_with_an_error() {
        let (mut ours, mut raw) = hostile_peer().await;
        let mut record = vec![23, 3, 3, 0, 40];
        record.extend_from_slice(&[0x5a; 40]);
        raw.write_all(&record).await.unwrap();
        let e = read_error(&mut ours).await;
        assert!(e.contains("did not decrypt"), "{e}");
    }

    #[tokio::test]
    async fn a_record_longer_than_tls_allows_is_refused_before_it_is_read() {
        let (mut ours, mut raw) = hostile_peer().await;
        // 65,535 bytes announced, 5 sent: refused on the header alone.
        raw.write_all(&[23, 3, 3, 0xff, 0xff, 1, 2, 3, 4, 5])
            .await
            .unwrap();
        let e = read_error(&mut ours).await;
        assert!(e.contains("longer than TLS 1.3 allows"), "{e}");
        let (mut ours, mut raw) = hostile_peer().await;
        raw.write_all(&[22, 3, 3, 0, 4, 1, 2, 3, 4]).await.unwrap();
        let e = read_error(&mut ours).await;
        assert!(e.contains("outer type 22"), "{e}");
    }

    #[tokio::test]
    async fn a_peer_gone_without_close_notify_or_inside_a_record_is_an_error() {
        let (mut ours, raw) = hostile_peer().await;
        drop(raw);
        let e = read_error(&mut ours).await;
        assert!(e.contains("without sending TLS close_notify"), "{e}");
        let (mut ours, mut raw) = hostile_peer().await;
        raw.write_all(&[23, 3, 3, 0, 40, 1, 2]).await.unwrap();
        drop(raw);
        let e = read_error(&mut ours).await;
        assert!(e.contains("inside a TLS record"), "{e}");
    }
}

#[cfg(test)]
mod receiver_tests {
    //! The receiving rules over plain records: a stand-in cipher that only
    //! strips TLS 1.3's inner content type.
    use super::*;
    use rustls::crypto::cipher::InboundPlainMessage;

    struct Clear;
    impl MessageDecrypter for Clear {
        fn decrypt<'a>(
            &mut self,
            msg: InboundOpaqueMessage<'a>,
            _seq: u64,
        ) -> Result<InboundPlainMessage<'a>, rustls::Error> {
            msg.into_tls13_unpadded_message()
        }
    }

    fn receiver(client: bool) -> Receiver {
        Receiver {
            decrypter: Box::new(Clear),
            seq: 0,
            handshake: Vec::new(),
            client,
            closed: false,
            key_updates_left: KEY_UPDATES_BETWEEN_DATA,
            warnings_left: WARNING_ALERTS,
        }
    }

    /// One record of `typ` holding `payload`, as the wire has it.
    fn record(typ: ContentType, payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() + 1) as u16;
        let mut r = vec![23, 3, 3];
        r.extend_from_slice(&len.to_be_bytes());
        r.extend_from_slice(payload);
        r.push(u8::from(typ));
        r
    }

    fn open(rx: &mut Receiver, typ: ContentType, payload: &[u8]) -> Result<Opened, RecordError> {
        let mut r = record(typ, payload);
        let len = r.len();
        let (used, opened) = rx.open(&mut r)?.expect("a whole record");
        assert_eq!(used, len);
        Ok(opened)
    }

    #[test]
    fn data_is_opened_in_place_and_a_partial_record_waits() {
        let mut rx = receiver(true);
        let mut r = record(ContentType::ApplicationData, b"hello");
        assert_eq!(rx.open(&mut r[..3]).unwrap(), None, "no whole header");
        assert_eq!(rx.open(&mut r[..8]).unwrap(), None, "no whole record");
        let (used, opened) = rx.open(&mut r).unwrap().unwrap();
        assert_eq!((used, opened), (r.len(), Opened::Data(5..10)));
        assert_eq!(&r[5..10], b"hello");
        assert_eq!(rx.seq, 1, "each record opened counts");
    }

    #[test]
    fn a_key_update_split_over_records_is_taken_whole_and_must_end_its_record() {
        let mut rx = receiver(false);
        let hs = ContentType::Handshake;
        assert_eq!(open(&mut rx, hs, &[24, 0, 0]).unwrap(), Opened::Nothing);
        assert_eq!(
            open(&mut rx, hs, &[1, 1]).unwrap(),
            Opened::KeyUpdate { requested: true }
        );
        assert_eq!(
            open(&mut rx, hs, &[24, 0, 0, 1, 0]).unwrap(),
            Opened::KeyUpdate { requested: false }
        );
        assert_eq!(
            open(&mut rx, hs, &[24, 0, 0, 1, 0, 24]),
            Err(RecordError::BadHandshake),
            "bytes after a key update in its record"
        );
        let mut rx = receiver(false);
        assert_eq!(
            open(&mut rx, hs, &[24, 0, 0, 1, 7]),
            Err(RecordError::BadHandshake)
        );
    }

    #[test]
    fn key_updates_are_bounded_between_data_records() {
        let mut rx = receiver(false);
        let (hs, update) = (ContentType::Handshake, [24, 0, 0, 1, 1]);
        for _ in 0..2 {
            for _ in 0..KEY_UPDATES_BETWEEN_DATA {
                assert!(matches!(
                    open(&mut rx, hs, &update),
                    Ok(Opened::KeyUpdate { .. })
                ));
            }
            // Data between them starts the count again.
            assert!(matches!(
                open(&mut rx, ContentType::ApplicationData, b"x"),
                Ok(Opened::Data(_))
            ));
        }
        for _ in 0..KEY_UPDATES_BETWEEN_DATA {
            open(&mut rx, hs, &update).unwrap();
        }
        assert_eq!(
            open(&mut rx, hs, &update),
            Err(RecordError::Flood("key updates"))
        );
    }

    #[test]
    fn tickets_are_dropped_by_a_client_and_refused_by_a_server() {
        let ticket = [4, 0, 0, 3, 1, 2, 3];
        let hs = ContentType::Handshake;
        assert_eq!(
            open(&mut receiver(true), hs, &ticket).unwrap(),
            Opened::Nothing
        );
        assert_eq!(
            open(&mut receiver(false), hs, &ticket),
            Err(RecordError::UnexpectedHandshake(4))
        );
        // A certificate request (post-handshake auth was never offered).
        assert_eq!(
            open(&mut receiver(true), hs, &[13, 0, 0, 0]),
            Err(RecordError::UnexpectedHandshake(13))
        );
    }

    #[test]
    fn a_handshake_message_cannot_grow_past_its_bound_nor_interleave_with_data() {
        let mut rx = receiver(true);
        let hs = ContentType::Handshake;
        // A ticket announcing 16 MB, fed a record at a time.
        let mut first = vec![4, 0xff, 0xff, 0xff];
        first.extend_from_slice(&[0; 16_000]);
        assert_eq!(open(&mut rx, hs, &first).unwrap(), Opened::Nothing);
        assert_eq!(
            open(&mut rx, ContentType::ApplicationData, b"x"),
            Err(RecordError::UnexpectedInnerType("ApplicationData".into())),
            "data inside a handshake message"
        );
        let mut rx = receiver(true);
        open(&mut rx, hs, &first).unwrap();
        for _ in 0..3 {
            open(&mut rx, hs, &[0; 16_000]).unwrap();
        }
        assert_eq!(
            open(&mut rx, hs, &[0; 16_000]),
            Err(RecordError::BadHandshake)
        );
    }

    #[test]
    fn close_notify_ends_the_data_and_a_fatal_alert_is_an_error() {
        let mut rx = receiver(true);
        let alert = ContentType::Alert;
        assert_eq!(open(&mut rx, alert, &[1, 90]).unwrap(), Opened::Nothing);
        assert_eq!(open(&mut rx, alert, &[1, 0]).unwrap(), Opened::Closed);
        assert_eq!(
            open(&mut rx, ContentType::ApplicationData, b"late"),
            Err(RecordError::AfterClose)
        );
        let mut rx = receiver(true);
        for _ in 0..WARNING_ALERTS {
            assert_eq!(open(&mut rx, alert, &[1, 90]).unwrap(), Opened::Nothing);
        }
        assert_eq!(
            open(&mut rx, alert, &[1, 90]),
            Err(RecordError::Flood("warning alerts"))
        );
        assert_eq!(
            open(&mut receiver(true), alert, &[2, 20]),
            Err(RecordError::Alert(20))
        );
        assert_eq!(
            open(&mut receiver(true), alert, &[2]),
            Err(RecordError::BadAlert)
        );
        assert_eq!(
            open(&mut receiver(true), ContentType::Heartbeat, &[1]),
            Err(RecordError::UnexpectedInnerType("Heartbeat".into()))
        );
    }
}
