//! Shared addresses, as a real cluster has them: hostNetwork pods that all
//! carry their node's IP, and services of different namespaces that share
//! a VIP (ServiceEntries). All are held; a client reaches the service of
//! its own namespace.

mod common;

use std::net::SocketAddr;

use ambit::lab::{connect_from, echo_roundtrip, EchoServer};
use common::{admin_get, workload, Mesh};

#[test]
fn shared_node_ips_and_shared_vips_are_held_and_routed_by_namespace() {
    let mut m = Mesh::new("shared");
    let (client, mine, theirs) = (m.pod("client"), m.pod("mine"), m.pod("theirs"));
    let node_ip = "10.77.0.1";
    m.write_config(&format!(
        "workloads:\n{}\
         - {{uid: mine, name: mine, namespace: default, workloadIps: [\"{}\"], protocol: TCP, services: {{\"default/db.example.com\": {{5432: 7000}}}}}}\n\
         - {{uid: theirs, name: theirs, namespace: other, workloadIps: [\"{}\"], protocol: TCP, services: {{\"other/db.example.com\": {{5432: 7000}}}}}}\n\
         - {{uid: kube-proxy, name: kube-proxy, namespace: kube-system, workloadIps: [\"{node_ip}\"], networkMode: HOST_NETWORK}}\n\
         - {{uid: exporter, name: exporter, namespace: monitoring, workloadIps: [\"{node_ip}\"], networkMode: HOST_NETWORK}}\n\
         services:\n\
         - {{name: db, namespace: other, hostname: db.example.com, vips: [\"/10.96.0.60\"], ports: {{5432: 7000}}}}\n\
         - {{name: db, namespace: default, hostname: db.example.com, vips: [\"/10.96.0.60\"], ports: {{5432: 7000}}}}\n",
        workload(&client, "client-sa", "HBONE"),
        mine.ip,
        theirs.ip,
    ));
    m.mesh(&client, "client-sa");
    let (at_mine, at_theirs) = (
        EchoServer::start(&mine, 7000).unwrap(),
        EchoServer::start(&theirs, 7000).unwrap(),
    );

    // Everything is held: nothing was refused as a conflict.
    let dump: serde_json::Value =
        serde_json::from_str(&admin_get(&client.ns, "127.0.0.1:15000", "/config_dump")).unwrap();
    let uids: Vec<&str> = dump["workloads"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|w| w["uid"].as_str())
        .collect();
    for uid in ["kube-proxy", "exporter", "mine", "theirs"] {
        assert!(uids.contains(&uid), "{uid} not held: {uids:?}");
    }
    let services = dump["services"].as_array().unwrap();
    assert_eq!(services.len(), 2, "both services on the VIP are held");
    assert!(
        !m.proxy_log(&client).contains("rejected"),
        "{}",
        m.proxy_log(&client)
    );

    // The client (namespace default) reaches default's service, every time.
    let vip: SocketAddr = "10.96.0.60:5432".parse().unwrap();
    for i in 0..10 {
        let msg = format!("q{i}");
        let mut c = connect_from(&client, vip).unwrap();
        assert_eq!(
            echo_roundtrip(&mut c, msg.as_bytes()).unwrap(),
            msg.as_bytes()
        );
    }
    assert_eq!(at_mine.peers().len(), 10);
    assert!(
        at_theirs.peers().is_empty(),
        "another namespace's service was used"
    );
}
