use std::time::Duration;

use super::*;
use crate::identity::tls;
use crate::identity::{Identity, LocalCa, WorkloadCert};

const DAY: Duration = Duration::from_secs(86_400);

fn issue(ca: &LocalCa, sa: &str) -> WorkloadCert {
    ca.issue(&Identity::new("cluster.local", "ns", sa), DAY)
        .unwrap()
}

/// A CRL file in a directory of its own, holding `text`; the directory
/// goes with it.
fn crl_file(tag: &str, text: &str) -> CrlFile {
    let dir = std::env::temp_dir().join(format!("ambit-crl-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("crl.pem");
    std::fs::write(&path, text).unwrap();
    CrlFile(path)
}

struct CrlFile(PathBuf);

impl std::ops::Deref for CrlFile {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for CrlFile {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for CrlFile {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn metric(crls: &Crls, name: &str) -> String {
    let mut registry = Registry::default();
    crls.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    text.lines()
        .filter(|l| l.starts_with(name))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A TLS handshake of `client` to `server`, each with its own lists.
async fn handshake(
    server: &WorkloadCert,
    server_crls: Option<&Arc<Crls>>,
    client: &WorkloadCert,
    client_crls: Option<&Arc<Crls>>,
) -> Result<(), String> {
    tls::test_handshake(server, server_crls, client, client_crls)
        .await
        .map(|_| ())
}

#[test]
fn a_file_is_pem_lists_or_one_der_list_and_anything_else_is_refused() {
    let ca = LocalCa::generate("cluster.local").unwrap();
    let a = issue(&ca, "a");
    let b = issue(&ca, "b");
    let one = ca.revocation_list(&a.chain, DAY).unwrap();
    let two = ca
        .revocation_list(&[a.chain[0].clone(), b.chain[0].clone()], DAY * 2)
        .unwrap();
    assert!(CrlSet::parse(b"").unwrap().is_empty());
    assert!(CrlSet::parse(b" \n\t\n").unwrap().is_empty(), "blank");
    let set = CrlSet::parse(format!("{one}{two}").as_bytes()).unwrap();
    assert_eq!((set.len(), set.revoked), (2, 3));
    let next = set.next_update.unwrap();
    let in_a_day = SystemTime::now() + DAY;
    assert!(
        next <= in_a_day && next > in_a_day - Duration::from_secs(60),
        "the earliest nextUpdate"
    );
    // A root certificate's PEM beside a list is skipped.
    let with_cert = format!("{}{one}", ca.root_pem());
    assert_eq!(CrlSet::parse(with_cert.as_bytes()).unwrap().len(), 1);
    // One DER list.
    let der = rustls_pemfile::crls(&mut one.as_bytes())
        .next()
        .unwrap()
        .unwrap();
    assert_eq!(CrlSet::parse(&der).unwrap().revoked, 1);
    // Refused: garbage, PEM with no list, a damaged list among good ones.
    assert!(CrlSet::parse(b"\x30\x03\x02\x01\x00").is_err());
    assert!(CrlSet::parse(ca.root_pem().as_bytes())
        .unwrap_err()
        .contains("no X509 CRL"));
    let damaged = one.replacen("MI", "Mi", 1);
    assert!(CrlSet::parse(format!("{two}{damaged}").as_bytes()).is_err());
    assert!(
        CrlSet::parse(&der[..der.len() - 3]).is_err(),
        "truncated DER"
    );
}

#[tokio::test]
async fn a_revoked_peer_is_refused_at_the_handshake_on_either_side() {
    let ca = LocalCa::generate("cluster.local").unwrap();
    let other_ca = LocalCa::generate("cluster.local").unwrap();
    let server = issue(&ca, "server");
    let good = issue(&ca, "good");
    let revoked = issue(&ca, "revoked");
    // This CA's list revokes one client and the server; another CA's list
    // (it does not issue here) names the good client's serial too.
    let text = format!(
        "{}{}",
        ca.revocation_list(&[revoked.chain[0].clone(), server.chain[0].clone()], DAY)
            .unwrap(),
        other_ca.revocation_list(&good.chain, DAY).unwrap()
    );
    let crls = Crls::load(&crl_file("handshake", &text)).unwrap();

    // Inbound: the revoked client is refused, the good one accepted.
    let plain = issue(&ca, "server-unrevoked");
    handshake(&plain, Some(&crls), &good, None).await.unwrap();
    let refused = handshake(&plain, Some(&crls), &revoked, None).await;
    assert!(refused.is_err(), "a revoked client was accepted");
    assert!(
        metric(&crls, "istio_crl_policy_rejections_total").contains("reporter=\"destination\"} 1")
    );
    // Outbound: a client with the lists refuses the revoked server.
    let refused = handshake(&server, None, &good, Some(&crls)).await;
    let why = refused.unwrap_err();
    assert!(why.contains("Revoked"), "the client says why: {why}");
    assert!(metric(&crls, "istio_crl_policy_rejections_total").contains("reporter=\"source\"} 1"));
    handshake(&plain, None, &good, Some(&crls)).await.unwrap();
    // No lists: nothing is checked.
    handshake(&server, None, &revoked, None).await.unwrap();
}

#[tokio::test]
async fn a_new_list_closes_what_it_revokes_and_a_bad_file_keeps_the_lists_in_force() {
    let ca = LocalCa::generate("cluster.local").unwrap();
    let peer = issue(&ca, "peer");
    let other = issue(&ca, "other");
    let path = crl_file("reload", "");
    let crls = Crls::load(&path).unwrap();
    let roots = Arc::new(tls::roots(&peer).unwrap());
    let algs = tls::provider().signature_verification_algorithms;
    let generation = crls.generation();
    let mut open = crls.track(&peer.chain, roots.clone(), algs, Side::Inbound, generation);
    let mut kept = crls.track(
        &other.chain,
        roots.clone(),
        algs,
        Side::Outbound,
        generation,
    );
    assert_eq!(crls.tracked(), 2);

    // A bad file: refused, counted, the (empty) lists stay; nothing closes.
    std::fs::write(
        &path,
        "-----BEGIN X509 CRL-----\nnot base64\n-----END X509 CRL-----\n",
    )
    .unwrap();
    crls.reload();
    assert!(metric(&crls, "ambit_crl_loads_total").contains("result=\"error\"} 1"));
    assert!(crls.current().is_empty());

    // The peer revoked: its connection is told, the other's is not.
    std::fs::write(&path, ca.revocation_list(&peer.chain, DAY).unwrap()).unwrap();
    crls.reload();
    tokio::time::timeout(Duration::from_secs(1), open.revoked())
        .await
        .expect("the revoked peer's connection is told to close");
    assert!(
        tokio::time::timeout(Duration::from_millis(50), kept.revoked())
            .await
            .is_err(),
        "an unrevoked peer's connection stays"
    );
    assert_eq!(crls.current().revoked, 1);
    assert!(metric(&crls, "ambit_crl_revoked_certificates").ends_with(" 1"));
    assert!(
        metric(&crls, "istio_crl_policy_rejections_total").contains("reporter=\"destination\"} 1")
    );
    // The same bytes again change nothing.
    crls.reload();
    assert!(metric(&crls, "ambit_crl_loads_total").contains("result=\"ok\"} 2"));

    // A connection whose handshake began before the list arrived is checked
    // when it registers.
    let late = crls.track(&peer.chain, roots, algs, Side::Inbound, generation);
    let mut late = late;
    tokio::time::timeout(Duration::from_secs(1), late.revoked())
        .await
        .expect("a handshake that raced the reload is caught");
    drop((open, kept, late));
    assert_eq!(crls.tracked(), 0, "dropped connections are let go");
}

#[tokio::test]
async fn a_file_that_cannot_be_read_or_parsed_at_start_stops_the_start() {
    let missing = std::env::temp_dir().join("ambit-crl-none/crl.pem");
    assert!(Crls::load(&missing).unwrap_err().contains("cannot read"));
    let bad = crl_file(
        "bad",
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    );
    assert!(Crls::load(&bad).unwrap_err().contains("refused"));
}

#[tokio::test]
async fn the_watch_applies_a_new_file_without_being_asked() {
    let ca = LocalCa::generate("cluster.local").unwrap();
    let peer = issue(&ca, "peer");
    let path = crl_file("watch", "");
    let crls = Crls::load(&path).unwrap();
    crls.spawn_watch().unwrap();
    // Written aside and renamed in, as tools and volumes do.
    let aside = path.with_extension("new");
    std::fs::write(&aside, ca.revocation_list(&peer.chain, DAY).unwrap()).unwrap();
    std::fs::rename(&aside, &path).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while crls.current().revoked != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the watch did not apply the new file"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
