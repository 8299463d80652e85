//! HBONE's TLS handshake, driven through rustls' unbuffered API on either
//! side, and the hand-over of its keys to the record layer.

use super::*;

/// What a finished handshake leaves beside the keys.
pub(super) struct Handshaken {
    /// Received bytes past the handshake: the start of the first record.
    pub(super) received: BytesMut,
    /// Application data rustls opened during the handshake.
    pub(super) early: BytesMut,
}

/// The two sides' unbuffered connections, driven by one handshake loop.
pub(super) trait Handshaking: Sized {
    type Data;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn done(&self) -> bool;
    fn certificates(&self) -> Vec<CertificateDer<'static>>;
    /// The key-exchange group and suite agreed, once done.
    fn negotiated(&self) -> (Option<rustls::NamedGroup>, Option<rustls::CipherSuite>);
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
            fn negotiated(&self) -> (Option<rustls::NamedGroup>, Option<rustls::CipherSuite>) {
                (
                    self.negotiated_key_exchange_group().map(|g| g.name()),
                    self.negotiated_cipher_suite().map(|s| s.suite()),
                )
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

pub(super) fn tls_io(e: rustls::Error) -> io::Error {
    use crate::identity::tls::{compliance, Compliance};
    use rustls::{AlertDescription, Error, PeerIncompatible};
    let policy = compliance();
    let allows = || {
        format!(
            "this proxy allows {} ({})",
            policy.groups(),
            match policy {
                Compliance::Pqc => "COMPLIANCE_POLICY=pqc",
                Compliance::Default => "the default groups",
            }
        )
    };
    let said = match &e {
        Error::PeerIncompatible(PeerIncompatible::NoKxGroupsInCommon) => format!(
            "the peer offers no key exchange group this proxy allows: {}",
            allows()
        ),
        Error::PeerIncompatible(
            PeerIncompatible::SupportedVersionsExtensionRequired
            | PeerIncompatible::Tls12NotOfferedOrEnabled
            | PeerIncompatible::ServerTlsVersionIsDisabledByOurConfig,
        )
        | Error::AlertReceived(AlertDescription::ProtocolVersion) => format!(
            "the peer and this proxy have no TLS version in common ({e}); this proxy allows {}",
            if crate::identity::tls::tls12() {
                "TLS 1.3 and 1.2"
            } else {
                "TLS 1.3 only (TLS12_ENABLED=true allows 1.2)"
            }
        ),
        Error::AlertReceived(AlertDescription::HandshakeFailure) => format!(
            "the peer refused the handshake (handshake_failure); if it allows none of this proxy's key exchange groups: {}",
            allows()
        ),
        _ => return io::Error::new(io::ErrorKind::InvalidData, e),
    };
    io::Error::new(io::ErrorKind::InvalidData, said)
}

/// Sends the alert a failed handshake left queued, best effort.
/// `received` is the handshake's buffer, its discards made: rustls' next
/// call must see the same bytes.
pub(super) async fn send_alert<C: Handshaking>(
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
pub(super) async fn handshake<C: Handshaking>(
    mut conn: C,
    mut tcp: TcpStream,
) -> io::Result<Connected> {
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
                // The peer is told why (an alert) before the connection
                // ends; one whose bytes are not TLS records at all is not:
                // rustls would read them again for the alert, fail again,
                // and send a second fatal alert (which it asserts against).
                received.advance(discard);
                if !matches!(e, rustls::Error::InvalidMessage(_)) {
                    let _ = send_alert(&mut conn, &mut tcp, &mut received).await;
                }
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
    let (group, _) = conn.negotiated();
    let (secrets, keys) = conn.into_keys().map_err(tls_io)?;
    let rest = Handshaken { received, early };
    let stream = TlsStream::new(tcp, keys, secrets, rest).map_err(io::Error::from)?;
    let (version, suite) = stream.agreed();
    tracing::debug!(group = ?group, suite = ?Some(suite), version = ?version, "HBONE TLS handshake done");
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
