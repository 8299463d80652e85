//! A DNS query as a pod sends it to its proxy on 15053, through the
//! proxy's `reply` against a small fixed mesh (a service with v4 and v6
//! VIPs, a headless one with an unhealthy endpoint, a ServiceEntry host two
//! namespaces define, one of them visible to its own namespace only), asked
//! from two namespaces.
//!
//! Checked beyond "no panic": a packet shorter than a header is dropped, and
//! every answer parses as DNS and carries the query's id.

#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use ambit::proxy::{dns_reply, DnsAsker, DnsReply};
use ambit::xds::{local, State};
use hickory_proto::op::Message;
use libfuzzer_sys::fuzz_target;

const MESH: &str = r#"
workloads:
- {name: db-0, namespace: data, workloadIps: [10.0.0.7, "fd00::7"], protocol: HBONE, services: {"data/db.data.svc.cluster.local": {5432: 5432}}}
- {name: db-1, namespace: data, workloadIps: [10.0.0.8], status: Unhealthy, services: {"data/db.data.svc.cluster.local": {5432: 5432}}}
services:
- {name: echo, namespace: shop, hostname: echo.shop.svc.cluster.local, vips: ["/10.96.0.10", "/fd00::10"], ports: {80: 8080}}
- {name: db, namespace: data, hostname: db.data.svc.cluster.local, ports: {5432: 5432}}
- {name: pay, namespace: shop, hostname: pay.example.com, vips: ["/10.96.0.70"], ports: {443: 443}}
- {name: pay, namespace: data, hostname: pay.example.com, vips: ["/10.96.0.71"], ports: {443: 443}, visibility: NAMESPACE}
"#;

fn mesh() -> &'static State {
    static MESH_STATE: OnceLock<State> = OnceLock::new();
    MESH_STATE.get_or_init(|| {
        local::parse(Path::new("dns-fuzz.yaml"), MESH).expect("the fuzz mesh is valid")
    })
}

fuzz_target!(|packet: &[u8]| {
    for namespace in ["shop", "data"] {
        let asker = DnsAsker {
            namespace,
            cluster_domain: "cluster.local",
        };
        let reply = dns_reply(packet, mesh(), asker);
        if packet.len() < 12 {
            assert_eq!(reply, DnsReply::Drop);
        }
        if let DnsReply::Answer(bytes) = reply {
            let answer = Message::from_vec(&bytes).expect("an answer parses as DNS");
            assert_eq!(answer.id(), u16::from_be_bytes([packet[0], packet[1]]));
        }
    }
});
