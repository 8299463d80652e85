//! Revoked certificates (issue #44, item 6): a node proxy given a CRL file
//! (`CRL_PATH`) refuses a revoked peer at the handshake, on either side,
//! and closes the open connections of a peer a new list revokes.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ambit::identity::LocalCa;
use ambit::lab::node::Node;
use ambit::lab::{connect_from, echo_roundtrip, EchoServer, LabPod};
use base64::Engine;
use rustls::pki_types::CertificateDer;
use serde_json::Value;

use crate::common::{counter, wait_until, wait_until_showing};

const SETTLE: Duration = Duration::from_secs(10);

/// A subnet no other test uses.
const SUBNET: &str = "10.89.0";

fn roundtrip(pod: &LabPod, dst: SocketAddr, msg: &[u8]) -> Vec<u8> {
    connect_from(pod, dst)
        .and_then(|mut c| echo_roundtrip(&mut c, msg))
        .unwrap_or_default()
}

/// The leaf certificate the node's proxy holds for `sa`, from its dump.
fn held_cert(node: &Node, sa: &str) -> CertificateDer<'static> {
    let dump: Value = serde_json::from_str(&node.dump("127.0.0.1:15000")).unwrap();
    let id = format!("spiffe://cluster.local/ns/default/sa/{sa}");
    let held = dump["certificates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["identity"] == id.as_str())
        .unwrap_or_else(|| panic!("no certificate for {id} in {dump}"));
    let pem = base64::engine::general_purpose::STANDARD
        .decode(held["certChain"][0]["pem"].as_str().unwrap())
        .unwrap();
    let cert = rustls_pemfile::certs(&mut pem.as_slice())
        .next()
        .unwrap()
        .unwrap();
    cert.into_owned()
}

/// Replaces the CRL file as tools and volumes do: written aside, renamed in.
fn publish(path: &Path, text: &str) {
    let aside = path.with_extension("new");
    std::fs::write(&aside, text).unwrap();
    std::fs::rename(&aside, path).unwrap();
}

fn rejections(node: &Node, reporter: &str) -> u64 {
    counter(
        &node.metrics(),
        "istio_crl_policy_rejections_total",
        &[("reporter", reporter)],
    )
}

#[test]
fn a_revoked_peer_is_refused_and_its_open_connections_are_closed_when_the_list_arrives() {
    let mesh = format!(
        "workloads:\n\
        - {{name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"{SUBNET}.2\"], protocol: HBONE}}\n\
        - {{name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"{SUBNET}.3\"], protocol: HBONE}}\n\
        - {{name: bystander, namespace: default, serviceAccount: bystander-sa, workloadIps: [\"{SUBNET}.4\"], protocol: HBONE}}\n"
    );
    // A node with a separate agent and shared proxy, given a CRL file that
    // revokes nothing yet.
    let mut node = Node::prepare(
        env!("CARGO_BIN_EXE_ambit"),
        "crl",
        "all",
        SUBNET,
        &mesh,
        None,
    );
    let crl = node.dir.join("crl").join("crl.pem");
    std::fs::create_dir_all(crl.parent().unwrap()).unwrap();
    std::fs::write(&crl, "").unwrap();
    node.extra_env = vec![("CRL_PATH".into(), crl.display().to_string())];
    node.launch(false);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");
    let ca =
        LocalCa::from_files(&node.dir.join("ca-cert.pem"), &node.dir.join("ca-key.pem")).unwrap();

    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let bystander = node.add_pod("bystander", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    let bystander_echo = EchoServer::start(&bystander, 8080).unwrap();
    wait_until("the client is served", SETTLE, || {
        roundtrip(&client, echo.addr, b"hi") == b"hi"
    });
    assert_eq!(roundtrip(&bystander, echo.addr, b"hi"), b"hi");

    // A long-lived connection of the client's, open before the list, that
    // carries a message each way and stays open.
    let mut open = connect_from(&client, echo.addr).unwrap();
    open.set_read_timeout(Some(SETTLE)).unwrap();
    let mut buf = [0u8; 16];
    open.write_all(b"before").unwrap();
    open.read_exact(&mut buf[..6]).unwrap();
    assert_eq!(&buf[..6], b"before");

    // The client's certificate is revoked: the open connection is closed...
    let revoked = held_cert(&node, "client-sa");
    publish(
        &crl,
        &ca.revocation_list(&[revoked], Duration::from_secs(86_400))
            .unwrap(),
    );
    let _ = open.write_all(b"after");
    let closed_at = std::time::Instant::now();
    let ended = loop {
        match open.read(&mut buf) {
            Ok(0) | Err(_) => break true,
            Ok(_) if closed_at.elapsed() < SETTLE => {
                let _ = open.write_all(b"again");
            }
            Ok(_) => break false,
        }
    };
    assert!(
        ended,
        "the revoked peer's open connection still carries data"
    );
    wait_until_showing(
        "the closing logged",
        SETTLE,
        || {
            node.log()
                .contains("a CRL now revokes the peer's certificate")
        },
        || node.log(),
    );
    // ... a new one is refused at the handshake, counted by the server's side ...
    let before = rejections(&node, "destination");
    assert!(before >= 1, "the closing is counted");
    assert_eq!(roundtrip(&client, echo.addr, b"refused"), b"");
    wait_until("the refusal counted", SETTLE, || {
        rejections(&node, "destination") > before
    });
    // ... and the pods that are not revoked are served as before.
    assert_eq!(roundtrip(&bystander, echo.addr, b"still"), b"still");
    assert_eq!(roundtrip(&server, bystander_echo.addr, b"back"), b"back");

    // A list that revokes the server instead: the client is served again,
    // and callers of the server refuse it (the dialing side, `source`).
    let revoked = held_cert(&node, "server-sa");
    publish(
        &crl,
        &ca.revocation_list(&[revoked], Duration::from_secs(86_400))
            .unwrap(),
    );
    wait_until("callers refuse the revoked server", SETTLE, || {
        roundtrip(&bystander, echo.addr, b"x").is_empty() && rejections(&node, "source") >= 1
    });
    assert_eq!(roundtrip(&client, bystander_echo.addr, b"again"), b"again");

    // A damaged file keeps the lists in force, and says so.
    publish(
        &crl,
        "-----BEGIN X509 CRL-----\ngarbage\n-----END X509 CRL-----\n",
    );
    wait_until_showing(
        "the damaged file refused",
        SETTLE,
        || {
            counter(
                &node.metrics(),
                "ambit_crl_loads_total",
                &[("result", "error")],
            ) == 1
        },
        || node.metrics(),
    );
    assert!(
        roundtrip(&bystander, echo.addr, b"x").is_empty(),
        "still revoked"
    );
    assert_eq!(roundtrip(&client, bystander_echo.addr, b"ok"), b"ok");
}
