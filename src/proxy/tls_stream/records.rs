//! The record rules of HBONE's TLS after the handshake, over plain byte
//! buffers: what a received record may hold and what it means, how data is
//! sealed into records and queued, and the ciphers from rustls' secrets.
//! No handshake here, and no reading from a socket.

use super::*;

/// The most plaintext one record carries (RFC 8446 §5.1).
pub(super) const MAX_PLAINTEXT: usize = 1 << 14;
/// The most ciphertext one TLS 1.3 record may carry (RFC 8446 §5.2). A
/// TLS 1.2 record may carry 2,048 bytes of overhead, but its AES-GCM adds
/// 24: one longer than this would not open either.
pub(super) const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;
pub(super) const HEADER: usize = 5;
/// Room for one whole record: the receive buffer never holds less.
pub(super) const RECORD_ROOM: usize = HEADER + MAX_CIPHERTEXT;
/// A bulk flow's receive buffer: one read takes this much from the socket.
pub(super) const RECEIVE_BUFFER: usize = 256 * 1024;
/// The most of one post-handshake handshake message kept while it spans
/// records.
pub(super) const MAX_HANDSHAKE_MESSAGE: usize = 64 * 1024;
/// Handshake flights are read in pieces of this; a flight may be at most
/// [`MAX_HANDSHAKE_MESSAGE`] plus a record.
pub(super) const HANDSHAKE_READ: usize = 8 * 1024;
/// Sealed records are written once this much waits, or on flush.
pub(super) const WRITE_AT: usize = 64 * 1024;
/// Iovecs per `writev`.
pub(super) const WRITE_VECTORS: usize = 64;
/// Slices of one vectored write sealed together (h2 hands a frame head
/// and its payload).
pub(super) const SEAL_SLICES: usize = 8;

pub(super) const HANDSHAKE_KEY_UPDATE: u8 = 24;
pub(super) const HANDSHAKE_NEW_SESSION_TICKET: u8 = 4;
pub(super) const ALERT_CLOSE_NOTIFY: u8 = 0;
pub(super) const ALERT_USER_CANCELED: u8 = 90;

/// Why a TLS connection failed after its handshake.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("TLS record of {0} bytes is longer than TLS allows")]
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
pub(super) enum Opened {
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
pub(super) struct Receiver {
    pub(super) decrypter: Box<dyn MessageDecrypter>,
    pub(super) seq: u64,
    /// A post-handshake handshake message not whole yet.
    pub(super) handshake: Vec<u8>,
    /// A client may be sent tickets; a server may not.
    pub(super) client: bool,
    pub(super) closed: bool,
    /// Key updates the peer may still send before its next data, and
    /// warning alerts for the connection's life: each costs us work and
    /// the peer 27 bytes, so a flood of them ends the connection (the
    /// bounds are rustls' and BoringSSL's).
    pub(super) key_updates_left: u8,
    pub(super) warnings_left: u8,
    /// A TLS 1.2 connection: records carry their real type outside, and
    /// nothing of the handshake may follow it (no key updates, tickets or
    /// renegotiation).
    pub(super) tls12: bool,
}

pub(super) const KEY_UPDATES_BETWEEN_DATA: u8 = 32;
pub(super) const WARNING_ALERTS: u8 = 4;

impl Receiver {
    /// Opens the record at the front of `buf`, in place: `None` if it is not
    /// all there yet, else how many bytes it took and what it held.
    pub(super) fn open(&mut self, buf: &mut [u8]) -> Result<Option<(usize, Opened)>, RecordError> {
        if buf.len() < HEADER {
            return Ok(None);
        }
        let (typ, len) = (buf[0], u16::from_be_bytes([buf[3], buf[4]]) as usize);
        let outer = ContentType::from(typ);
        let allowed = match outer {
            ContentType::ApplicationData => true,
            ContentType::Alert | ContentType::Handshake => self.tls12,
            _ => false,
        };
        if !allowed {
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
        // TLS 1.2 authenticates the header's type and version with the
        // record; TLS 1.3's are fixed (and checked above).
        let version = ProtocolVersion::from(u16::from_be_bytes([record[1], record[2]]));
        let message = InboundOpaqueMessage::new(outer, version, &mut record[HEADER..]);
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
            ContentType::Handshake if self.tls12 => {
                // A HelloRequest (renegotiation), or anything else.
                return Err(RecordError::UnexpectedHandshake(
                    payload.first().copied().unwrap_or_default(),
                ));
            }
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
    pub(super) fn handshake_messages(&mut self) -> Result<Opened, RecordError> {
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
pub(super) struct Sender {
    pub(super) encrypter: Box<dyn MessageEncrypter>,
    pub(super) seq: u64,
    /// Records sealed under one key before it is replaced.
    pub(super) rekey_at: u64,
    pub(super) queue: VecDeque<Vec<u8>>,
    /// Bytes of `queue`'s front already written.
    pub(super) front_written: usize,
    pub(super) queued: usize,
    /// Nothing sealed under the current key since our last `KeyUpdate`.
    pub(super) fresh_key: bool,
}

impl Sender {
    pub(super) fn seal(
        &mut self,
        typ: ContentType,
        payload: OutboundChunks<'_>,
    ) -> Result<(), RecordError> {
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
    pub(super) fn seal_data(&mut self, mut data: OutboundChunks<'_>) -> Result<bool, RecordError> {
        self.fresh_key = false;
        while !data.is_empty() {
            let (record, rest) = data.split_at(MAX_PLAINTEXT);
            self.seal(ContentType::ApplicationData, record)?;
            data = rest;
        }
        Ok(self.seq >= self.rekey_at)
    }

    /// Writes records out: `Ready` once the queue is empty.
    pub(super) fn poll_write_out(
        &mut self,
        tcp: &TcpStream,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
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
pub(super) enum Keys {
    Client(KernelConnection<ClientConnectionData>),
    Server(KernelConnection<ServerConnectionData>),
}

impl Keys {
    pub(super) fn suite(&self) -> SupportedCipherSuite {
        match self {
            Keys::Client(k) => k.negotiated_cipher_suite(),
            Keys::Server(k) => k.negotiated_cipher_suite(),
        }
    }

    pub(super) fn next_tx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
        match self {
            Keys::Client(k) => k.update_tx_secret(),
            Keys::Server(k) => k.update_tx_secret(),
        }
        .map(|(_, s)| s)
    }

    pub(super) fn next_rx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
        match self {
            Keys::Client(k) => k.update_rx_secret(),
            Keys::Server(k) => k.update_rx_secret(),
        }
        .map(|(_, s)| s)
    }
}

/// One direction's key and IV from rustls' secrets.
fn key_iv(
    secrets: ConnectionTrafficSecrets,
) -> Result<(rustls::crypto::cipher::AeadKey, rustls::crypto::cipher::Iv), RecordError> {
    match secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv }
        | ConnectionTrafficSecrets::Aes256Gcm { key, iv }
        | ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => Ok((key, iv)),
        _ => Err(RecordError::KeyUpdate("unknown cipher".into())),
    }
}

/// A TLS 1.2 cipher's IV as rustls' secrets hold it (its fixed part, then
/// the explicit nonce's start), split back into the two its cipher takes.
fn tls12_iv<'a>(
    suite: &rustls::Tls12CipherSuite,
    iv: &'a rustls::crypto::cipher::Iv,
) -> Result<(&'a [u8], &'a [u8]), RecordError> {
    let shape = suite.aead_alg.key_block_shape();
    let (fixed, explicit) = (shape.fixed_iv_len, shape.explicit_nonce_len);
    let iv = iv.as_ref();
    if fixed + explicit > iv.len() {
        return Err(RecordError::KeyUpdate("unknown TLS 1.2 cipher".into()));
    }
    Ok((&iv[..fixed], &iv[fixed..fixed + explicit]))
}

pub(super) fn decrypter(
    suite: SupportedCipherSuite,
    secrets: ConnectionTrafficSecrets,
) -> Result<Box<dyn MessageDecrypter>, RecordError> {
    let (key, iv) = key_iv(secrets)?;
    Ok(match suite {
        SupportedCipherSuite::Tls13(s) => s.aead_alg.decrypter(key, iv),
        SupportedCipherSuite::Tls12(s) => s.aead_alg.decrypter(key, tls12_iv(s, &iv)?.0),
    })
}

/// The encrypter for records from `first_seq` on, and the record count at
/// which it is replaced (TLS 1.3) or the connection ends (TLS 1.2, which
/// cannot change keys): a little short of the cipher's confidentiality
/// limit, as rustls does.
pub(super) fn encrypter(
    suite: SupportedCipherSuite,
    secrets: ConnectionTrafficSecrets,
    first_seq: u64,
) -> Result<(Box<dyn MessageEncrypter>, u64), RecordError> {
    let (key, iv) = key_iv(secrets)?;
    let (mut encrypter, limit) = match suite {
        SupportedCipherSuite::Tls13(s) => (
            s.aead_alg.encrypter(key, iv),
            s.common.confidentiality_limit,
        ),
        SupportedCipherSuite::Tls12(s) => {
            let (fixed, explicit) = tls12_iv(s, &iv)?;
            (
                s.aead_alg.encrypter(key, fixed, explicit),
                s.common.confidentiality_limit,
            )
        }
    };
    // aws-lc's GCM sealing key (TLS 1.3 nonces, which rustls uses for
    // TLS 1.2 too) takes its first nonce as sequence number 0 and refuses
    // any nonce that does not grow from it. A TLS 1.2 key sealed the
    // handshake's Finished (record 0) before the keys came here, so its
    // first record here is 1: the records before it are sealed once more
    // into nothing (their output is dropped, never sent) so that the key
    // counts from 0. A TLS 1.3 traffic key starts at 0.
    if first_seq > PRIMED_RECORDS {
        return Err(RecordError::KeyUpdate(format!(
            "a key handed over at record {first_seq}"
        )));
    }
    for seq in 0..first_seq {
        let message = OutboundPlainMessage {
            typ: ContentType::ApplicationData,
            version: ProtocolVersion::TLSv1_2,
            payload: OutboundChunks::from(&[][..]),
        };
        encrypter
            .encrypt(message, seq)
            .map_err(|e| RecordError::Seal(e.to_string()))?;
    }
    Ok((encrypter, limit.saturating_sub(1 << 10)))
}

/// The most records a key may have sealed before the record layer takes
/// it: a TLS 1.2 handshake seals one (its Finished).
const PRIMED_RECORDS: u64 = 4;

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

    /// TLS 1.2's records: the type is outside, nothing inside to strip.
    struct Clear12;
    impl MessageDecrypter for Clear12 {
        fn decrypt<'a>(
            &mut self,
            msg: InboundOpaqueMessage<'a>,
            _seq: u64,
        ) -> Result<InboundPlainMessage<'a>, rustls::Error> {
            Ok(msg.into_plain_message())
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
            tls12: false,
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

    /// After a TLS 1.2 handshake: data and alerts, under their own outer
    /// type, are taken; a HelloRequest (renegotiation), a KeyUpdate and a
    /// type TLS 1.2 never encrypts are refused.
    #[test]
    fn after_a_tls12_handshake_no_handshake_message_is_taken() {
        let mut rx = Receiver {
            decrypter: Box::new(Clear12),
            tls12: true,
            ..receiver(true)
        };
        let mut open = |typ: u8, payload: &[u8]| {
            let mut r = vec![typ, 3, 3];
            r.extend_from_slice(&(payload.len() as u16).to_be_bytes());
            r.extend_from_slice(payload);
            rx.open(&mut r).map(|o| o.map(|(_, opened)| opened))
        };
        assert_eq!(open(23, b"data").unwrap(), Some(Opened::Data(5..9)));
        assert_eq!(open(21, &[1, 90]).unwrap(), Some(Opened::Nothing));
        assert_eq!(
            open(22, &[0, 0, 0, 0]),
            Err(RecordError::UnexpectedHandshake(0)),
            "a HelloRequest"
        );
        assert_eq!(
            open(22, &[24, 0, 0, 1, 1]),
            Err(RecordError::UnexpectedHandshake(24)),
            "a KeyUpdate"
        );
        assert_eq!(open(20, &[1]), Err(RecordError::UnexpectedOuterType(20)));
        assert_eq!(open(21, &[1, 0]).unwrap(), Some(Opened::Closed));
        // Over TLS 1.3 an alert or handshake type outside is refused.
        let mut rx = receiver(true);
        let mut r = vec![21, 3, 3, 0, 2, 1, 0];
        assert_eq!(rx.open(&mut r), Err(RecordError::UnexpectedOuterType(21)));
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
