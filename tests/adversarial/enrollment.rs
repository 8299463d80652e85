//! Processes on the node that try to get a netns enrolled as a pod.

use std::process::Command;

use ambit::lab::kubeapi::Kind;
use ambit::lab::node::Node;
use ambit::lab::{iptables_save, istio_rules, pod_uid};
use ambit::netns::Netns;
use serde_json::{json, Value};

use crate::common::kube::{annotated, kube_node, pod, set_running, set_running_at, wait_for, MODE};

// Finding pods without a CNI event (they predate the agent, or a label
// flips): the agent takes a pod's netns only from a process whose cgroup
// names that pod's UID. A netns that merely carries the pod's IP is not it.

/// A netns on the node named `<lab id>-<name>` with `ips` on an interface
/// of its own (one end of a veth pair inside it): anyone with CAP_NET_ADMIN
/// on the host can make one.
fn netns_claiming(node: &mut Node, name: &str, ips: &[String]) -> (String, Netns) {
    let netns_name = format!("{}-{name}", node.lab.id);
    assert!(Command::new("ip")
        .args(["netns", "add", &netns_name])
        .status()
        .unwrap()
        .success());
    node.pods.push(netns_name.clone());
    let ns = Netns::named(&netns_name).unwrap();
    let ip = |args: &[&str]| {
        assert!(
            ns.command("ip").args(args).status().unwrap().success(),
            "ip {args:?} in {name}"
        )
    };
    ip(&[
        "link", "add", "decoy0", "type", "veth", "peer", "name", "decoy1",
    ]);
    for addr in ips {
        ip(&["addr", "add", &format!("{addr}/32"), "dev", "decoy0"]);
    }
    ip(&["link", "set", "decoy0", "up"]);
    (netns_name, ns)
}

/// The pods the node's proxy serves, as (uid, netns inode), from its admin dump.
fn served(node: &Node) -> Vec<(String, u64)> {
    let dump: Value = serde_json::from_str(&node.dump("127.0.0.1:15000")).unwrap();
    dump["pods"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|p| {
            let uid = p["uid"].as_str().unwrap_or_default().to_string();
            (uid, p["netns"]["ino"].as_u64().unwrap_or_default())
        })
        .collect()
}

#[test]
fn a_netns_carrying_a_pods_ip_is_not_enrolled_unless_that_pods_process_holds_it() {
    let subnet = "10.116.0";
    let (mut node, api) = kube_node("adversarial", subnet, "");
    api.put(Kind::Pod, pod("shop", "victim", "node-a", "victim-sa"));
    // The API says this pod runs here with an IP, but no sandbox of it is on
    // the node (yet): only the decoys below carry its IP.
    let phantom_ip = format!("{subnet}.200");
    api.put(Kind::Pod, pod("shop", "phantom", "node-a", "default"));
    set_running_at(&api, "shop", "phantom", &phantom_ip);
    node.launch(true);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");

    // The victim starts in a namespace outside the mesh: its CNI ADD leaves it alone.
    let victim = node.add_pod("victim", "shop").unwrap();
    set_running(&api, "shop", &victim);
    assert_eq!(istio_rules(&victim), 0);

    // Three netns carry the victim's and the phantom's IPs: one only named
    // (nothing runs in it), one held by a process outside any pod's cgroup,
    // one held by the sandbox of a pod the API does not know.
    let claimed = [victim.ip.to_string(), phantom_ip.clone()];
    let (_, named) = netns_claiming(&mut node, "decoy-named", &claimed);
    let (stray_name, stray) = netns_claiming(&mut node, "decoy-stray", &claimed);
    let mut sleep = stray.command("sleep");
    sleep.arg("infinity");
    node.lab.spawn("stray", sleep).unwrap();
    let (other_name, other) = netns_claiming(&mut node, "decoy-other-pod", &claimed);
    node.lab.hold(&other_name, &pod_uid("mallory")).unwrap();
    // Only their processes hold these two now.
    for name in [stray_name.as_str(), other_name.as_str()] {
        assert!(Command::new("ip")
            .args(["netns", "del", name])
            .status()
            .unwrap()
            .success());
    }

    // The namespace joins the mesh: the agent looks for both pods' netns.
    api.update(Kind::Namespace, "", "shop", |o| {
        o["metadata"]["labels"][MODE] = json!("ambient")
    });
    // The annotation is written once the whole pass has enrolled what it found.
    wait_for("the victim enrolled after the flip", &node, || {
        annotated(&api, "shop", "victim").as_deref() == Some("enabled")
    });
    assert!(
        istio_rules(&victim) > 0,
        "the victim's own netns is captured"
    );
    for (what, ns) in [
        ("a named netns", &named),
        ("a netns held by a stray process", &stray),
        ("a netns held by another pod's sandbox", &other),
    ] {
        let rules = iptables_save(ns);
        assert!(
            !rules.contains("ISTIO"),
            "{what} carrying a pod's IP was enrolled:\n{rules}\n{}",
            node.log()
        );
    }
    let victim_ino = victim.ns.id().unwrap().1;
    assert_eq!(
        served(&node),
        [(pod_uid("victim"), victim_ino)],
        "the proxy serves the victim in its own netns, and no decoy as the phantom"
    );
    assert_eq!(annotated(&api, "shop", "phantom"), None);
}
