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

/// A certificate for `name` in trust domain `cluster.local`.
fn issue(ca: &LocalCa, name: &str) -> crate::identity::WorkloadCert {
    ca.issue(
        &Identity::new("cluster.local", "ns", name),
        Duration::from_secs(600),
    )
    .unwrap()
}

fn configs() -> Configs {
    let ca = LocalCa::generate("cluster.local").unwrap();
    let issue = |name: &str| issue(&ca, name);
    Configs {
        client: Arc::new(client_config(&issue("client"), None).unwrap()),
        server: Arc::new(server_config(&issue("server"), None).unwrap()),
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
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(s: S, data: Vec<u8>) -> io::Result<Vec<u8>> {
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
    assert!(e.contains("longer than TLS allows"), "{e}");
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

/// A rustls client connected to our server, both past the handshake.
async fn rustls_client_and_our_server() -> (tokio_rustls::client::TlsStream<TcpStream>, TlsStream) {
    let c = configs();
    let (a, b) = tcp_pair().await;
    let connector = tokio_rustls::TlsConnector::from(c.client.clone());
    let (peer, ours) = tokio::join!(
        connector.connect(hbone_server_name(), a),
        accept(c.server.clone(), b)
    );
    (peer.unwrap(), ours.unwrap().0)
}

/// One poll of a read into `buf`: pending when nothing is there to read.
async fn read_once(ours: &mut TlsStream, buf: &mut [u8]) -> Poll<io::Result<()>> {
    std::future::poll_fn(|cx| {
        Poll::Ready(Pin::new(&mut *ours).poll_read(cx, &mut ReadBuf::new(buf)))
    })
    .await
}

fn spare_count() -> usize {
    SPARE_RECEIVE.with(|s| s.borrow().len())
}

#[test]
fn an_emptied_records_buffer_is_kept_for_the_threads_next_reader_and_a_bulk_one_is_not() {
    let mut buf = BytesMut::with_capacity(RECORD_ROOM);
    buf.extend_from_slice(&[7; 100]);
    buf.advance(100);
    let at = buf.as_ptr() as usize - 100;
    give_back_receive(buf);
    let again = spare_receive();
    assert_eq!(
        again.as_ptr() as usize,
        at,
        "the same allocation, from its start"
    );
    assert!(again.is_empty() && again.capacity() >= RECORD_ROOM);
    // A bulk flow's buffer, read to its end or not, and a shared one go
    // back to the allocator.
    give_back_receive(BytesMut::with_capacity(RECEIVE_BUFFER));
    let mut bulk = BytesMut::with_capacity(RECEIVE_BUFFER);
    bulk.extend_from_slice(&vec![1; RECEIVE_BUFFER - 10]);
    bulk.advance(RECEIVE_BUFFER - 10);
    give_back_receive(bulk);
    let mut shared = BytesMut::with_capacity(RECORD_ROOM);
    shared.extend_from_slice(b"x");
    let _held = shared.split_to(1).freeze();
    give_back_receive(shared);
    assert_eq!(spare_count(), 0);
    // At most a few per thread.
    for _ in 0..SPARE_RECEIVE_KEPT + 3 {
        give_back_receive(BytesMut::with_capacity(RECORD_ROOM));
    }
    assert_eq!(spare_count(), SPARE_RECEIVE_KEPT);
    assert_eq!(spare_receive().capacity(), RECORD_ROOM);
}

#[tokio::test]
async fn a_reader_waiting_between_messages_holds_no_buffer_and_reuses_the_threads() {
    let (mut peer, mut ours) = rustls_client_and_our_server().await;
    let mut got = [0u8; 5];
    for round in 0..3u8 {
        peer.write_all(&[round; 5]).await.unwrap();
        peer.flush().await.unwrap();
        ours.read_exact(&mut got).await.unwrap();
        assert_eq!(got, [round; 5]);
        // Nothing more has come: the next read waits, buffer given back.
        assert!(
            read_once(&mut ours, &mut got).await.is_pending(),
            "no message yet"
        );
        assert_eq!(
            ours.received.capacity(),
            0,
            "round {round}: a waiting reader holds none"
        );
        assert_eq!(
            spare_count(),
            1,
            "round {round}: one buffer, kept and reused"
        );
    }
}

#[tokio::test]
async fn a_bulk_readers_buffer_goes_back_to_the_allocator_when_it_waits() {
    let (mut peer, mut ours) = rustls_client_and_our_server().await;
    let data = pattern(BULK, 5);
    let writer = async {
        peer.write_all(&data).await.unwrap();
        peer.flush().await.unwrap();
        peer
    };
    let mut got = vec![0u8; BULK];
    let (_peer, read) = tokio::join!(writer, ours.read_exact(&mut got));
    read.unwrap();
    assert!(got == data);
    assert!(ours.bulk, "a flow this large reads in bulk");
    let mut more = [0u8; 1];
    assert!(read_once(&mut ours, &mut more).await.is_pending());
    assert_eq!(ours.received.capacity(), 0, "a waiting reader holds none");
    assert_eq!(spare_count(), 0, "a bulk buffer is not kept");
}

#[tokio::test]
async fn garbage_instead_of_a_client_hello_is_refused_once_without_a_second_alert() {
    // Bytes that are not TLS, in one write and in several: the handshake
    // fails with an error, and never asks rustls to send a second fatal
    // alert (a debug assertion in rustls: before, a panic in debug builds
    // whenever a pod sent junk to 15008).
    for chunks in [1usize, 5] {
        let (mut a, b) = tcp_pair().await;
        let server = configs().server;
        let accept = tokio::spawn(async move { accept(server, b).await.map(|_| ()) });
        let junk = b"loop?".repeat(100);
        for part in junk.chunks(junk.len() / chunks) {
            // (Once refused, the rest meets a closed socket.)
            let _ = a.write_all(part).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let ended = tokio::time::timeout(Duration::from_secs(5), accept)
            .await
            .expect("the handshake ends");
        let e = ended.expect("no panic").expect_err("refused");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        let mut told = Vec::new();
        let _ = a.read_to_end(&mut told).await;
        assert!(told.len() <= 7 * 2, "at most one alert record: {told:?}");
    }
}

/// A peer with no key-exchange group this side allows (one limited to
/// X25519, against `COMPLIANCE_POLICY=pqc`) is refused at the handshake,
/// and the error says so in words.
#[tokio::test]
async fn a_peer_without_an_allowed_key_exchange_group_is_refused_in_words() {
    use crate::identity::tls::{client_config_on, provider_for, server_config_on, Compliance};
    let ca = LocalCa::generate("cluster.local").unwrap();
    let issue = |name: &str| issue(&ca, name);
    let pqc = Arc::new(provider_for(Compliance::Pqc));
    let mut x25519 = provider_for(Compliance::Default);
    x25519.kx_groups = vec![rustls::crypto::aws_lc_rs::kx_group::X25519];
    let server = Arc::new(server_config_on(&issue("server"), None, pqc).unwrap());
    let client = Arc::new(client_config_on(&issue("client"), None, Arc::new(x25519)).unwrap());
    let (a, b) = tcp_pair().await;
    let connector = tokio_rustls::TlsConnector::from(client);
    let (ours, theirs) = tokio::join!(accept(server, b), connector.connect(hbone_server_name(), a));
    let err = ours.err().expect("refused").to_string();
    assert!(
        err.contains("the peer offers no key exchange group this proxy allows"),
        "{err}"
    );
    assert!(theirs.is_err(), "the peer was told");
}

/// HBONE configurations as `TLS12_ENABLED=true` makes them, on the default
/// key-exchange policy, and a rustls peer's limited to TLS 1.2.
mod tls12 {
    use super::*;
    use crate::identity::tls::{
        client_config_on, provider_for, server_config_on, with_tls12, Compliance,
    };

    fn ours(ca: &LocalCa) -> Configs {
        let p = Arc::new(with_tls12(provider_for(Compliance::Default)));
        Configs {
            client: Arc::new(client_config_on(&issue(ca, "client"), None, p.clone()).unwrap()),
            server: Arc::new(server_config_on(&issue(ca, "server"), None, p).unwrap()),
        }
    }

    /// A peer that speaks TLS 1.2 alone (its provider has no other suite),
    /// and otherwise as HBONE's.
    fn tls12_only(ca: &LocalCa) -> Configs {
        let mut p = with_tls12(provider_for(Compliance::Default));
        p.cipher_suites
            .retain(|s| s.version() == &rustls::version::TLS12);
        let p = Arc::new(p);
        Configs {
            client: Arc::new(client_config_on(&issue(ca, "client"), None, p.clone()).unwrap()),
            server: Arc::new(server_config_on(&issue(ca, "server"), None, p).unwrap()),
        }
    }

    /// The TLS version, suite and group a rustls connection agreed on.
    fn agreed(c: &rustls::CommonState) -> String {
        format!(
            "{:?} {:?} {:?}",
            c.protocol_version().unwrap(),
            c.negotiated_cipher_suite().unwrap().suite(),
            c.negotiated_key_exchange_group().unwrap().name()
        )
    }

    /// X25519 is not FIPS-approved: a FIPS build agrees on P-256.
    const AGREED: &str = if cfg!(feature = "fips") {
        "TLSv1_2 TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384 secp256r1"
    } else {
        "TLSv1_2 TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384 X25519"
    };

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn our_client_carries_every_byte_both_ways_over_tls12_to_a_tls12_only_server() {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let (c, peer) = (ours(&ca), tls12_only(&ca));
        let (a, b) = tcp_pair().await;
        let acceptor = tokio_rustls::TlsAcceptor::from(peer.server);
        let server = tokio::spawn(async move {
            let s = acceptor.accept(b).await?;
            let agreed = agreed(s.get_ref().1);
            Ok::<_, io::Error>((agreed, exchange(s, pattern(BULK, 6)).await?))
        });
        let (ours, _) = connect(c.client, hbone_server_name(), a).await.unwrap();
        let got = exchange(ours, pattern(BULK, 5)).await.unwrap();
        assert!(got == pattern(BULK, 6), "the server's bytes, in order");
        let (agreed, theirs) = server.await.unwrap().unwrap();
        assert!(theirs == pattern(BULK, 5), "our bytes, in order");
        assert_eq!(agreed, AGREED);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn our_server_carries_every_byte_both_ways_over_tls12_from_a_tls12_only_client() {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let (c, peer) = (ours(&ca), tls12_only(&ca));
        let (a, b) = tcp_pair().await;
        let connector = tokio_rustls::TlsConnector::from(peer.client);
        let client = tokio::spawn(async move {
            let s = connector.connect(hbone_server_name(), a).await?;
            let agreed = agreed(s.get_ref().1);
            Ok::<_, io::Error>((agreed, exchange(s, pattern(BULK, 7)).await?))
        });
        let (ours, certs) = accept(c.server, b).await.unwrap();
        let peer = certs.first().and_then(identity_of);
        assert_eq!(peer, Some(Identity::new("cluster.local", "ns", "client")));
        let got = exchange(ours, pattern(BULK, 8)).await.unwrap();
        assert!(got == pattern(BULK, 7));
        let (agreed, theirs) = client.await.unwrap().unwrap();
        assert!(theirs == pattern(BULK, 8));
        assert_eq!(agreed, AGREED);
    }

    /// Off (the default), a TLS 1.2 peer is refused both ways, in words.
    #[tokio::test]
    async fn without_tls12_a_tls12_only_peer_is_refused_in_words() {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let peer = tls12_only(&ca);
        let p = Arc::new(provider_for(Compliance::Default));
        let server = Arc::new(server_config_on(&issue(&ca, "server"), None, p.clone()).unwrap());
        let client = Arc::new(client_config_on(&issue(&ca, "client"), None, p).unwrap());

        let (a, b) = tcp_pair().await;
        let connector = tokio_rustls::TlsConnector::from(peer.client);
        let (ours, theirs) =
            tokio::join!(accept(server, b), connector.connect(hbone_server_name(), a));
        let err = ours.err().expect("refused").to_string();
        assert!(err.contains("no TLS version in common"), "{err}");
        assert!(err.contains("TLS12_ENABLED=true allows 1.2"), "{err}");
        assert!(theirs.is_err(), "the peer was told");

        let (a, b) = tcp_pair().await;
        let acceptor = tokio_rustls::TlsAcceptor::from(peer.server);
        let (ours, theirs) =
            tokio::join!(connect(client, hbone_server_name(), a), acceptor.accept(b));
        let err = ours.err().expect("refused").to_string();
        assert!(err.contains("no TLS version in common"), "{err}");
        assert!(theirs.is_err());
    }

    /// A directory removed when dropped.
    struct PemDir(std::path::PathBuf);

    impl std::ops::Deref for PemDir {
        type Target = std::path::Path;
        fn deref(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for PemDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// `cert`'s chain, key and roots as PEM files in a new directory.
    fn pem_files(cert: &crate::identity::WorkloadCert, name: &str) -> PemDir {
        let dir = std::env::temp_dir().join(format!("ambit-tls12-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        use crate::identity::pem;
        let chain: String = cert.chain.iter().map(|c| pem("CERTIFICATE", c)).collect();
        let roots: String = cert.roots.iter().map(|c| pem("CERTIFICATE", c)).collect();
        std::fs::write(dir.join("cert.pem"), chain).unwrap();
        std::fs::write(
            dir.join("key.pem"),
            pem("PRIVATE KEY", cert.key.secret_pkcs8_der()),
        )
        .unwrap();
        std::fs::write(dir.join("roots.pem"), roots).unwrap();
        PemDir(dir)
    }

    /// OpenSSL's own TLS 1.2 (not rustls') on the other side: `s_server
    /// -rev` answers each line reversed, to our client; `s_client` sends a
    /// line to our server and prints what comes back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn openssl_speaking_tls12_is_carried_by_our_client_and_our_server() {
        use std::process::{Command, Stdio};
        let ca = LocalCa::generate("cluster.local").unwrap();
        let c = ours(&ca);

        // Our client to `openssl s_server -tls1_2`, which asks for our
        // certificate and verifies it against the mesh's roots.
        let dir = pem_files(&issue(&ca, "server"), "server");
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let server = Command::new("openssl")
            .current_dir(&*dir)
            .args([
                "s_server", "-tls1_2", "-rev", "-naccept", "1", "-Verify", "1",
            ])
            .args([
                "-cert",
                "cert.pem",
                "-key",
                "key.pem",
                "-CAfile",
                "roots.pem",
            ])
            .args(["-accept", &format!("127.0.0.1:{port}")])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let tcp = loop {
            match TcpStream::connect(("127.0.0.1", port)).await {
                Ok(t) => break t,
                Err(e) => {
                    assert!(std::time::Instant::now() < deadline, "s_server: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        let (mut ours, certs) = connect(c.client.clone(), hbone_server_name(), tcp)
            .await
            .expect("a TLS 1.2 handshake with openssl");
        let peer = certs.first().and_then(identity_of);
        assert_eq!(peer, Some(Identity::new("cluster.local", "ns", "server")));
        ours.write_all(b"hbone over tls12\n").await.unwrap();
        ours.flush().await.unwrap();
        let mut line = Vec::new();
        while !line.ends_with(b"\n") {
            let mut b = [0u8; 64];
            let n = ours.read(&mut b).await.unwrap();
            assert!(n > 0, "openssl closed before answering: {line:?}");
            line.extend_from_slice(&b[..n]);
        }
        assert_eq!(line, b"21slt revo enobh\n", "openssl reversed our line");
        assert_eq!(
            format!("{:?}", ours.agreed()),
            "(TLSv1_2, TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384)"
        );
        ours.shutdown().await.unwrap();
        drop(ours);
        // `-naccept 1`: it exits once our connection ends.
        let waited = tokio::task::spawn_blocking(move || server.wait_with_output());
        let out = tokio::time::timeout(Duration::from_secs(10), waited)
            .await
            .expect("s_server exits after its one connection")
            .unwrap()
            .unwrap();
        assert!(out.status.success(), "{out:?}");

        // `openssl s_client -tls1_2` to our server, with its certificate.
        let dir = pem_files(&issue(&ca, "client"), "client");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            Command::new("sh")
                .current_dir(&*dir)
                .args([
                    "-c",
                    &format!(
                    "echo hello-from-openssl | openssl s_client -connect {addr} -tls1_2 -ign_eof \
                     -cert cert.pem -key key.pem -CAfile roots.pem 2>&1"
                ),
                ])
                .output()
                .unwrap()
        });
        let (tcp, _) = listener.accept().await.unwrap();
        let (mut ours, certs) = accept(c.server.clone(), tcp).await.unwrap();
        let peer = certs.first().and_then(identity_of);
        assert_eq!(peer, Some(Identity::new("cluster.local", "ns", "client")));
        let mut line = Vec::new();
        while !line.ends_with(b"\n") {
            let mut b = [0u8; 64];
            let n = ours.read(&mut b).await.unwrap();
            assert!(n > 0, "openssl closed before its line: {line:?}");
            line.extend_from_slice(&b[..n]);
        }
        assert_eq!(line, b"hello-from-openssl\n");
        ours.write_all(b"answer-from-ambit\n").await.unwrap();
        ours.shutdown().await.unwrap();
        let out = tokio::task::spawn_blocking(move || client.join().unwrap())
            .await
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.contains("answer-from-ambit"), "{said}");
        assert!(said.contains("Protocol  : TLSv1.2"), "{said}");
        assert!(said.contains("ECDHE-ECDSA-AES256-GCM-SHA384"), "{said}");
    }
}
