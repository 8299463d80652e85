//! Faults a node meets besides SIGKILLs (issue #19), one test each, through
//! the real binaries on a lab node: the ZDS socket file, or the plugin
//! event socket file, removed under a running agent and proxy; a full disk
//! under the agent's state file; a pod's sandbox recreated with the same
//! UID in a new netns; a netns deleted while its ADD runs; the CNI conflist rewritten every second by
//! another plugin; and a pod's enrollment flipped back and forth under
//! traffic. Each checks what a user of the node would notice: pods served
//! over HBONE, nothing of a deleted pod left behind, what the logs and
//! metrics say. Numbers they measure are printed (`--nocapture`).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ambit::lab::kubeapi::Kind;
use ambit::lab::node::Node;
use ambit::lab::{
    connect_from, echo_roundtrip, istio_rules, pod_uid, stdout_in, EchoServer, LabPod,
};
use common::counter;
use common::kube::{enrolled_as, kube_node, pod, set_running, wait_for, MODE};
use common::node::{
    fd_kinds, ipset_entries, ipset_members, metric_value, mtls_from, netns_held, proxy_pods_at,
    proxy_uids, round_trip, served, state_records_at, state_uids, state_uids_at, veth_count, ADMIN,
    AGENT_METRICS, METRICS,
};
use common::{wait_until, wait_until_showing};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_ambit");

/// How long a pod whose ADD succeeded may take to be served over HBONE.
const SERVE_LIMIT: Duration = Duration::from_secs(10);

/// How long the agent may take to bind a removed ZDS socket file again (it
/// looks every second).
const REBIND_LIMIT: Duration = Duration::from_secs(3);

/// How long the agent may take to put its plugin back into a conflist
/// another plugin rewrote (it looks every second).
const REPAIR_LIMIT: Duration = Duration::from_secs(2);

/// How long a deleted pod may take to leave the agent, the proxy and the
/// probe ipset (the agent looks at netns paths every second).
const GONE_LIMIT: Duration = Duration::from_secs(5);

/// A second proxy's ports, beside the first's in the node netns.
const NEW_ADMIN: &str = "127.0.0.1:16000";
const NEW_METRICS: &str = "127.0.0.1:16020";
const NEW_READINESS: &str = "127.0.0.1:16021";

/// Fault: the ZDS socket file is removed while agent and proxy run (a
/// cleanup of the run directory, a host directory made anew). The connected
/// proxy keeps its connection and every pod; the agent binds the file again
/// and says so; a pod added meanwhile is served; and a proxy started
/// afterwards (an upgrade) connects through the new file, takes every pod,
/// and serves a new one on its own once the old proxy is gone.
#[test]
fn a_removed_zds_socket_file_is_bound_again_and_a_new_proxy_connects() {
    let mut node = Node::start_with(BIN, "zdsgone", "namespaces:default", false);
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    wait_until("the client served over HBONE", SERVE_LIMIT, || {
        served(&node, &client, echo.addr)
    });
    let traffic = Traffic::start(&client, echo.addr);

    let rebound = remove_and_wait_rebound(&node, &node.dir.join("zds.sock"), "ZDS socket");

    // A pod added now goes to the proxy connected through the old file.
    let late = node.add_pod("late", "default").unwrap();
    wait_until("a pod added after the removal served", SERVE_LIMIT, || {
        served(&node, &late, echo.addr)
    });

    // A new proxy connects through the new file and takes every pod...
    let mut cmd = node.command("proxy");
    cmd.env("AMBIT_ADMIN_ADDR", NEW_ADMIN)
        .env("AMBIT_METRICS_ADDR", NEW_METRICS)
        .env("AMBIT_READINESS_ADDR", NEW_READINESS);
    node.lab.spawn("proxy2", cmd).unwrap();
    node.wait_ready(NEW_READINESS, "/healthz/ready");
    let taken: BTreeSet<String> = proxy_pods_at(&node, NEW_ADMIN)
        .expect("the new proxy's config dump")
        .iter()
        .filter_map(|p| p["uid"].as_str().map(str::to_string))
        .collect();
    let all = uids(&["client", "server", "late"]);
    assert_eq!(taken, all, "the new proxy took every pod");
    // ...and serves on its own once the old one is gone.
    node.lab.stop("proxy");
    let after = node.add_pod("after", "default").unwrap();
    wait_until("a pod added to the new proxy served", SERVE_LIMIT, || {
        round_trip(&after, echo.addr) && mtls_from(&node, NEW_METRICS, "after") > 0
    });

    let attempts = traffic.stop();
    let failed = failures(&attempts);
    println!(
        "ZDS socket file removed: bound again after {rebound:?}; {} round trips from a served pod meanwhile, {} failed",
        attempts.len(),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "a pod already served lost connections: {:?}",
        &failed[..failed.len().min(3)]
    );
}

/// Fault: the plugin event socket file is removed under a running agent.
/// Until it is bound again, an ADD that must be enrolled fails closed (the
/// pod gets no network rather than one outside the mesh), which an ADD sent
/// in the gap shows; the agent binds it again within a couple of checks,
/// says so, and the next ADD is enrolled and served.
#[test]
fn a_removed_plugin_event_socket_is_bound_again_and_the_next_add_is_served() {
    let mut node = Node::start_with(BIN, "evgone", "namespaces:default", false);
    // The local config names the pods by address in the order they come:
    // `client` first, then `server`. Here the first one listens.
    let first = node.add_pod("client", "default").unwrap();
    let echo = EchoServer::start(&first, 8080).unwrap();
    let sock = node.dir.join("run").join("pluginevent.sock");
    let rebound = remove_and_wait_rebound(&node, &sock, "plugin event socket");
    let late = node.add_pod("server", "default").unwrap();
    wait_until("a pod added after the removal served", SERVE_LIMIT, || {
        served(&node, &late, echo.addr)
    });
    println!("plugin event socket removed: bound again after {rebound:?}; the next ADD served");
    // While the file is gone (the agent looks once a second), an ADD that
    // must be enrolled fails closed. Tried until one lands in the gap.
    let mut refused = None;
    for attempt in 0..10 {
        let bound = inode(&sock).expect("the socket is bound");
        std::fs::remove_file(&sock).unwrap();
        // An ADD that came after the agent bound the file again succeeds:
        // then the file is removed again.
        if let Err(e) = node.add_pod(&format!("gap{attempt}"), "default") {
            refused = Some(e);
            break;
        }
        wait_until("the socket bound again", REBIND_LIMIT, || {
            inode(&sock).is_some_and(|i| i != bound)
        });
    }
    let refused = refused.expect("no ADD landed while the socket file was gone in 10 tries");
    assert!(
        refused.contains("\"code\":100") && refused.contains("is the Ambit agent running?"),
        "{refused}"
    );
}

/// Removes the agent's socket file at `sock` (the agent calls it `what`),
/// waits until the agent has bound a new one and checks that its log says
/// so; returns how long that took.
fn remove_and_wait_rebound(node: &Node, sock: &Path, what: &str) -> Duration {
    let bound = inode(sock).unwrap_or_else(|| panic!("the agent bound its {what}"));
    std::fs::remove_file(sock).unwrap();
    let removed = Instant::now();
    wait_until(
        &format!("the {what} file bound again"),
        REBIND_LIMIT,
        || inode(sock).is_some_and(|i| i != bound),
    );
    let rebound = removed.elapsed();
    // The agent logs right after it binds: the line may trail the file.
    let said = format!("the {what} file was removed; bound it again");
    let log = || std::fs::read_to_string(node.lab.log_path("agent")).unwrap_or_default();
    wait_until_showing(
        &format!("the agent's log to say {said:?}"),
        REBIND_LIMIT,
        || log().contains(&said),
        log,
    );
    rebound
}

/// Fault: the disk under the agent's state file is full. An ADD still
/// succeeds and its pod is served (the agent serves from memory); the
/// failed write is logged and counted, and written again on its own, with
/// no other pod change, until it succeeds once the disk has room. The file
/// itself is never left half written.
#[test]
fn a_full_disk_under_the_agent_state_loses_no_pod_and_the_file_catches_up() {
    // Mounted before the node starts and unmounted after it stops (locals
    // drop in reverse order), test failures included.
    let disk = Tmpfs::mount(
        &std::env::temp_dir().join(format!("ambit-fulldisk-{}", std::process::id())),
        "64k",
    );
    let state = disk.0.join("agent-state.json");
    let mut node = Node::start_env(
        BIN,
        "fulldisk",
        "namespaces:default",
        false,
        &[("AMBIT_AGENT_STATE", state.to_str().unwrap())],
    );
    let _client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    wait_until("both pods in the state file", GONE_LIMIT, || {
        state_uids_at(&state) == uids(&["client", "server"])
    });

    disk.fill();
    let before = std::fs::read(&state).unwrap();
    let pod = node
        .add_pod("during", "default")
        .expect("an ADD succeeds with the state disk full");
    wait_until("the pod added on a full disk served", SERVE_LIMIT, || {
        served(&node, &pod, echo.addr)
    });
    // Counted, and tried again on its own (the first retry comes within 0.75 s).
    wait_until("failed writes counted and tried again", SERVE_LIMIT, || {
        state_write_failures(&node) >= 2.0
    });
    let log = std::fs::read_to_string(node.lab.log_path("agent")).unwrap();
    assert!(log.contains("agent state not saved"), "logged:\n{log}");
    assert_eq!(
        std::fs::read(&state).unwrap(),
        before,
        "the state file is whole: the pods before the ADD"
    );

    disk.make_room();
    let freed = Instant::now();
    wait_until(
        "the state file holds the pod once the disk has room",
        Duration::from_secs(20),
        || state_uids_at(&state) == uids(&["client", "server", "during"]),
    );
    let caught_up = freed.elapsed();
    let failed_writes = state_write_failures(&node);
    let log = std::fs::read_to_string(node.lab.log_path("agent")).unwrap();
    assert!(log.contains("agent state saved again"), "logged:\n{log}");
    println!("full disk: {failed_writes} failed writes counted; the file caught up {caught_up:?} after the disk had room");
}

/// Fault: kubelet recreates a pod's sandbox. The same pod, with the same
/// UID, comes in a new netns while the old one is on its way out. The new
/// netns replaces the old one in the agent's state and in the proxy, which
/// lets go of the old netns; the pod is served over HBONE in its new
/// netns, stays served when the old sandbox's late DEL and teardown come,
/// and the DEL of the new sandbox leaves nothing of it.
#[test]
fn a_pod_recreated_in_a_new_netns_is_served_there_and_leaves_nothing_once_deleted() {
    let mut node = Node::start_with(BIN, "recreate", "namespaces:default", false);
    let client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    let old = node.add_pod("app", "default").unwrap();
    wait_until("the pod served in its first netns", SERVE_LIMIT, || {
        served(&node, &old, echo.addr)
    });
    let uid = pod_uid("app");

    let new = node.add_sandbox("app", "default", "app-2").unwrap();
    assert_ne!(old.ip, new.ip, "the old sandbox still holds its address");
    let (old_ino, new_ino) = (old.ns.id().unwrap().1, new.ns.id().unwrap().1);
    let state_file = node.dir.join("agent-state.json");
    let records: Vec<serde_json::Value> = state_records_at(&state_file)
        .into_iter()
        .filter(|r| r["uid"] == uid.as_str())
        .collect();
    assert_eq!(records.len(), 1, "one record for the pod: {records:?}");
    assert_eq!(
        records[0]["netns_path"],
        format!("/var/run/netns/{}", new.netns_name),
        "the agent holds the new netns"
    );
    wait_until(
        "the proxy serves the pod in its new netns only",
        GONE_LIMIT,
        || {
            proxy_pods_at(&node, ADMIN).is_some_and(|pods| {
                let mine: Vec<&serde_json::Value> =
                    pods.iter().filter(|p| p["uid"] == uid.as_str()).collect();
                mine.len() == 1 && mine[0]["netns"]["ino"] == new_ino
            })
        },
    );
    let (proxy, agent) = (
        node.lab.pid("proxy").unwrap(),
        node.lab.pid("agent").unwrap(),
    );
    wait_until(
        "the old netns let go: no listener in it, no descriptor of it in the proxy or the agent",
        GONE_LIMIT,
        || {
            listeners(&old).is_empty()
                && !netns_held(proxy).contains(&old_ino)
                && !netns_held(agent).contains(&old_ino)
        },
    );
    assert!(istio_rules(&new) > 0, "the new netns is captured");
    let before = mtls_from(&node, METRICS, "app");
    wait_until(
        "the pod served over HBONE in its new netns",
        SERVE_LIMIT,
        || round_trip(&new, echo.addr) && mtls_from(&node, METRICS, "app") > before,
    );
    wait_until(
        "the probe ipset holds the pod's new address only",
        GONE_LIMIT,
        || {
            let entries = ipset_entries(&node);
            entries.get(&new.ip.to_string()) == Some(&uid)
                && !entries.contains_key(&old.ip.to_string())
        },
    );

    // The old sandbox's DEL and teardown come late. A fixed window on
    // purpose: the agent looks at netns paths every second, and the pod
    // must stay through two looks; there is no event to poll for.
    node.delete_sandbox("app", "default", "app").unwrap();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) {
        assert!(
            state_uids(&node).contains(&uid) && proxy_uids(&node).is_some_and(|p| p.contains(&uid)),
            "the pod was dropped when its old sandbox went"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(round_trip(&new, echo.addr), "still served in its new netns");

    node.delete_sandbox("app", "default", "app-2").unwrap();
    wait_until(
        "nothing of the pod left: agent state, proxy, probe ipset",
        GONE_LIMIT,
        || {
            !state_uids(&node).contains(&uid)
                && proxy_uids(&node).is_some_and(|p| !p.contains(&uid))
                && ipset_members(&node)
                    == BTreeSet::from([client.ip.to_string(), server.ip.to_string()])
        },
    );
}

/// Fault: a pod's netns is deleted while its ADD runs (the runtime gave up
/// on the sandbox). 20 tries, the netns deleted after a random delay within
/// an ADD's usual time. Each ADD either succeeds or fails, and when
/// `ambit-cni` is what fails it names the netns; after the DEL the runtime
/// always sends, nothing of the pod is left (agent state, proxy, probe
/// ipset), and at the end the host's rules, veths and the processes'
/// descriptors are as before. A pod served throughout loses nothing.
#[test]
fn a_netns_deleted_while_its_add_runs_leaves_nothing_after_the_del() {
    let mut node = Node::start_with(BIN, "midadd", "namespaces:default", false);
    let t = Instant::now();
    let client = node.add_pod("client", "default").unwrap();
    let add_time = t.elapsed().min(Duration::from_millis(300));
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    wait_until("the client served over HBONE", SERVE_LIMIT, || {
        served(&node, &client, echo.addr)
    });
    let (agent, proxy) = (
        node.lab.pid("agent").unwrap(),
        node.lab.pid("proxy").unwrap(),
    );
    let held_before = (netns_held(agent), netns_held(proxy));
    let sockets = || fd_kinds(proxy).get("socket").copied().unwrap_or(0);
    // Read once the proxy has closed its side of our last scrape.
    let sockets_before = loop {
        let n = sockets();
        std::thread::sleep(Duration::from_millis(200));
        if sockets() == n {
            break n;
        }
    };
    let (rules_before, veths_before) = (host_rules(&node), veth_count(&node));
    let traffic = Traffic::start(&client, echo.addr);

    let mut rng = fastrand::Rng::with_seed(19);
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..20 {
        let name = format!("gone-{i}");
        let netns = node.create_sandbox(&name, &name);
        let path = format!("/var/run/netns/{netns}");
        let delay = Duration::from_micros(rng.u64(0..=add_time.as_micros() as u64));
        let added = std::thread::scope(|s| {
            let add = s.spawn(|| node.cni("ADD", &name, "default", &name));
            std::thread::sleep(delay);
            node.kill_sandbox(&netns);
            add.join().unwrap()
        });
        let outcome = match added {
            Ok(_) => "ADD ok".to_string(),
            Err(e) => {
                let e = e.to_string();
                let plugin = e.split_whitespace().next().unwrap_or_default().to_string();
                if plugin == "ambit-cni" {
                    assert!(e.contains(&path), "the refusal names the netns: {e}");
                }
                format!("{plugin} failed")
            }
        };
        *outcomes.entry(outcome).or_default() += 1;
        // The runtime always sends a DEL, its netns gone or not.
        let _ = node.delete_sandbox(&name, "default", &name);
        let uid = pod_uid(&name);
        wait_until(&format!("nothing of {name} left"), GONE_LIMIT, || {
            !state_uids(&node).contains(&uid)
                && proxy_uids(&node).is_some_and(|p| !p.contains(&uid))
                && !ipset_entries(&node).values().any(|u| *u == uid)
        });
    }
    let attempts = traffic.stop();
    println!("netns deleted mid-ADD, 20 tries, delays up to {add_time:?}: {outcomes:?}");

    // The kernel ends a netns (and the veth in it) a moment after its last holder.
    wait_until(
        "the agent and the proxy hold the netns and sockets they held before, and the node its veths",
        Duration::from_secs(10),
        || {
            (netns_held(agent), netns_held(proxy)) == held_before
                && sockets() == sockets_before
                && veth_count(&node) == veths_before
        },
    );
    assert_eq!(
        host_rules(&node),
        rules_before,
        "the node's nat rules changed"
    );
    let failed = failures(&attempts);
    assert!(
        failed.is_empty(),
        "the pod served throughout lost connections: {:?}",
        &failed[..failed.len().min(3)]
    );
    assert!(served(&node, &client, echo.addr));
}

/// Fault: another plugin (the cluster's network, say) rewrites the CNI
/// conflist every second without `ambit-cni` in its chain. The agent puts
/// its plugin back each time, within [`REPAIR_LIMIT`], once and last,
/// keeping the other plugin's config; pods added after a repair are
/// enrolled and served, and the other plugin's step runs for them too.
#[test]
fn a_conflist_rewritten_every_second_by_another_plugin_is_repaired_each_time() {
    let mut node = Node::start_with(BIN, "conflist", "namespaces:default", false);
    let _client = node.add_pod("client", "default").unwrap();
    let server = node.add_pod("server", "default").unwrap();
    let echo = EchoServer::start(&server, 8080).unwrap();
    // What the other plugin writes: the network's chain with a step of its
    // own, and no ambit-cni.
    let mut theirs = node.conflist();
    {
        let plugins = theirs["plugins"].as_array_mut().unwrap();
        plugins.retain(|p| p["type"] != "ambit-cni");
        plugins.push(json!({"type": "tuning", "sysctl": {"net.core.somaxconn": "1024"}}));
    }
    let path = node.conf_dir.join("10-meshnet.conflist");
    let mut repairs: Vec<Option<Duration>> = Vec::new();
    let start = Instant::now();
    for i in 0..8u32 {
        // Every second, on the second.
        let at = start + Duration::from_secs(i.into());
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        write_as_another_plugin(&path, &theirs);
        let written = Instant::now();
        let mut repaired = None;
        while repaired.is_none() && written.elapsed() < REPAIR_LIMIT * 2 {
            if plugin_once_and_last(&path) {
                repaired = Some(written.elapsed());
            } else {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        repairs.push(repaired);
        if i % 3 == 2 && repaired.is_some() {
            let pod = node.add_pod(&format!("after-{i}"), "default").unwrap();
            wait_until("a pod added after a repair served", SERVE_LIMIT, || {
                served(&node, &pod, echo.addr)
            });
        }
    }
    let slowest = repairs.iter().flatten().max().copied();
    println!("conflist rewritten 8 times, once a second: repaired after {repairs:?}; slowest {slowest:?}");
    assert!(
        repairs.iter().all(|r| r.is_some_and(|d| d <= REPAIR_LIMIT)),
        "every rewrite repaired within {REPAIR_LIMIT:?}: {repairs:?}"
    );
    let last = node.conflist();
    let types: Vec<&str> = last["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(types, ["bridge", "tuning", "ambit-cni"]);
    let (kept, written) = (
        last["plugins"].as_array().unwrap(),
        theirs["plugins"].as_array().unwrap(),
    );
    assert_eq!(
        kept[..2],
        written[..2],
        "the other plugin's config is kept as it wrote it"
    );
    let end = node.add_pod("at-the-end", "default").unwrap();
    wait_until("a pod added at the end served", SERVE_LIMIT, || {
        served(&node, &end, echo.addr)
    });
    assert_eq!(somaxconn(&end), "1024", "the other plugin's step ran too");
}

/// Enrollment flips: a running pod's label goes from ambient to none and
/// back, six times, while it keeps connecting to a meshed server. After
/// each flip the pod ends in the right state: enrolled, its rules in force,
/// held by the proxy, annotated, its traffic over HBONE; released, no rule
/// left in its netns, not in the proxy, not annotated, its traffic in
/// plaintext. Its connections fail only while a flip is under way.
#[test]
fn enrollment_flipped_back_and_forth_under_traffic_ends_right_each_time() {
    let subnet = "10.116.0";
    let mesh = format!(
        "workloads:\n- {{name: s1, namespace: mesh, serviceAccount: server-sa, workloadIps: [\"{subnet}.2\"], protocol: HBONE}}\n"
    );
    let (mut node, api) = kube_node("flips", subnet, &mesh);
    api.put(Kind::Pod, pod("mesh", "s1", "node-a", "server-sa"));
    api.put(Kind::Pod, pod("mesh", "f1", "node-a", "default"));
    node.launch(true);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");
    let s1 = node.add_pod("s1", "mesh").unwrap();
    set_running(&api, "mesh", &s1);
    let f1 = node.add_pod("f1", "mesh").unwrap();
    set_running(&api, "mesh", &f1);
    let echo = EchoServer::start(&s1, 8080).unwrap();
    wait_for("f1 enrolled by its ADD", &node, || {
        enrolled_as(&node, &api, "mesh", &f1, true)
    });
    let traffic = Traffic::start(&f1, echo.addr);

    let mut flips = Vec::new();
    for flip in 0..6 {
        let enrolled = flip % 2 == 1;
        let from = Instant::now();
        api.update(Kind::Pod, "mesh", "f1", |o| {
            o["metadata"]["labels"][MODE] = json!(if enrolled { "ambient" } else { "none" })
        });
        let what = if enrolled {
            "f1 enrolled again"
        } else {
            "f1 released"
        };
        wait_for(what, &node, || {
            enrolled_as(&node, &api, "mesh", &f1, enrolled)
        });
        flips.push((from, Instant::now()));
        // Its traffic now goes as its state says: over HBONE into s1's
        // proxy, or in plaintext into s1's capture.
        let security = if enrolled { "mutual_tls" } else { "unknown" };
        let before = inbound_to(&node, "s1", security);
        assert!(round_trip(&f1, echo.addr), "{what}: a connection fails");
        wait_for(
            &format!("{what}: s1 counts a {security} connection"),
            &node,
            || inbound_to(&node, "s1", security) > before,
        );
    }
    let attempts = traffic.stop();
    let during_flip = |a: &Attempt| {
        flips
            .iter()
            .any(|(from, to)| a.at >= *from && a.at <= *to + Duration::from_millis(200))
    };
    let failed = failures(&attempts);
    let outside: Vec<&Attempt> = failed.iter().copied().filter(|a| !during_flip(a)).collect();
    let took: Vec<Duration> = flips.iter().map(|(from, to)| *to - *from).collect();
    println!(
        "6 enrollment flips, settled after {took:?}; {} connections, {} failed during a flip",
        attempts.len(),
        failed.len()
    );
    assert!(
        outside.is_empty(),
        "connections failed outside a flip: {:?}",
        &outside[..outside.len().min(3)]
    );
}

/// Connections the proxy opened into pod `name` with the given security.
fn inbound_to(node: &Node, name: &str, security: &str) -> u64 {
    counter(
        &node.metrics(),
        "istio_tcp_connections_opened_total",
        &[
            ("reporter", "destination"),
            ("destination_workload", name),
            ("connection_security_policy", security),
        ],
    )
}

/// One round trip of [`Traffic`].
#[derive(Debug)]
struct Attempt {
    at: Instant,
    error: Option<String>,
}

/// Round trips from one pod to an echo server, back to back, until stopped.
struct Traffic {
    stop: Arc<AtomicBool>,
    made: Arc<std::sync::atomic::AtomicUsize>,
    thread: std::thread::JoinHandle<Vec<Attempt>>,
}

/// Round trips [`Traffic::stop`] waits for at least, however fast the
/// fault went by, so that a test's traffic spans it and some time after.
const MIN_ATTEMPTS: usize = 25;

impl Traffic {
    fn start(pod: &LabPod, echo: SocketAddr) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let made = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (s, m, pod) = (stop.clone(), made.clone(), pod.clone());
        let thread = std::thread::spawn(move || {
            let mut attempts = Vec::new();
            while !s.load(Ordering::Relaxed) {
                let at = Instant::now();
                let sent = b"still served";
                let r = connect_from(&pod, echo).and_then(|mut c| echo_roundtrip(&mut c, sent));
                let error = match r {
                    Ok(b) if b == sent => None,
                    Ok(b) => Some(format!("echoed {} bytes", b.len())),
                    Err(e) => Some(e.to_string()),
                };
                attempts.push(Attempt { at, error });
                m.store(attempts.len(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
            attempts
        });
        Traffic { stop, made, thread }
    }

    /// Stops once at least [`MIN_ATTEMPTS`] round trips were made.
    fn stop(self) -> Vec<Attempt> {
        wait_until("enough round trips", Duration::from_secs(30), || {
            self.made.load(Ordering::Relaxed) >= MIN_ATTEMPTS
        });
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

fn failures(attempts: &[Attempt]) -> Vec<&Attempt> {
    attempts.iter().filter(|a| a.error.is_some()).collect()
}

/// UIDs of the lab pods named `names`.
fn uids(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| pod_uid(n)).collect()
}

fn inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| m.ino())
}

/// The agent's count of failed state-file writes.
fn state_write_failures(node: &Node) -> f64 {
    ambit::lab::http_get_in(&node.lab.node, AGENT_METRICS, "/metrics")
        .ok()
        .and_then(|(_, m)| metric_value(&m, "ambit_agent_state_write_failures_total"))
        .unwrap_or(0.0)
}

/// TCP listeners in the pod's netns.
fn listeners(pod: &LabPod) -> Vec<String> {
    stdout_in(&pod.ns, "ss", &["-ltnH"])
        .lines()
        .map(str::to_string)
        .collect()
}

/// The node's nat rules, IPv4 and IPv6, without counters or timestamps.
fn host_rules(node: &Node) -> Vec<String> {
    ["iptables-save", "ip6tables-save"]
        .iter()
        .flat_map(|save| {
            let out = node
                .lab
                .node
                .command(save)
                .args(["-t", "nat"])
                .output()
                .unwrap();
            assert!(out.status.success(), "{save} on the node");
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| l.split(" [").next().unwrap_or_default().to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Writes the conflist as another plugin's installer does (a new file
/// renamed into place).
fn write_as_another_plugin(path: &Path, conflist: &serde_json::Value) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(conflist).unwrap()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Whether the conflist at `path` holds `ambit-cni` exactly once, last.
fn plugin_once_and_last(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(path) else {
        return false;
    };
    let Ok(list) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    let Some(plugins) = list["plugins"].as_array() else {
        return false;
    };
    let ours = plugins.iter().filter(|p| p["type"] == "ambit-cni").count();
    ours == 1 && plugins.last().is_some_and(|p| p["type"] == "ambit-cni")
}

/// The pod's `net.core.somaxconn` (the other plugin's tuning step sets it).
fn somaxconn(pod: &LabPod) -> String {
    stdout_in(&pod.ns, "sysctl", &["-n", "net.core.somaxconn"])
        .trim()
        .to_string()
}

/// A small tmpfs for the agent's state, unmounted when dropped (test
/// failures included).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .unwrap()
            .success();
        assert!(mounted, "mount a tmpfs on {}", dir.display());
        Tmpfs(dir.to_path_buf())
    }

    /// Fills the disk: after this no new file gets a byte.
    fn fill(&self) {
        use std::io::Write;
        let mut filler = std::fs::File::create(self.0.join("filler")).unwrap();
        while filler.write_all(&[0u8; 4096]).is_ok() {}
        let probe = self.0.join("probe");
        assert!(std::fs::write(&probe, b"x").is_err(), "the disk is full");
        let _ = std::fs::remove_file(&probe);
    }

    fn make_room(&self) {
        std::fs::remove_file(self.0.join("filler")).unwrap();
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}
