//! End-to-end: Kubernetes enrollment. `ambit node` runs with
//! `enroll: kubernetes` against a fake API server (no cluster on these
//! machines) that serves list/watch of pods and namespaces and records the
//! agent's patches; pods are created through the real CNI chain.

mod common;

use std::time::{Duration, Instant};

use ambit::lab::kubeapi::{FakeApi, Kind};
use ambit::lab::node::{Node, RulesMode};
use ambit::lab::{
    connect_from, echo_roundtrip, iptables_save, istio_rules, nft_istio_rules, EchoServer, LabPod,
};
use common::kube::{
    annotated, kube_node, pod, served_objects_pass_the_schemas, set_running, wait_for, MODE,
    REDIRECTION,
};
use common::node::assert_rules_in;
use serde_json::json;

fn has_plugin(node: &Node) -> bool {
    let entry = node.conflist()["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["type"] == "ambit-cni");
    entry && node.bin_dir.join("ambit-cni").exists()
}

#[test]
fn labels_enroll_and_remove_pods_live_and_watches_survive_410() {
    labels_enroll_and_remove(RulesMode::Iptables, "10.119.0");
}

/// The same with the agent's rules in nftables, on a `PATH` without
/// iptables: the annotations' overrides too.
#[test]
fn with_the_rules_in_nftables_labels_enroll_and_remove_pods_live() {
    labels_enroll_and_remove(RulesMode::Nftables, "10.113.0");
}

/// What redirects `pod`'s rules hold, in either back end: lines naming
/// the proxy's ports.
fn redirects(pod: &LabPod) -> String {
    let mut text = iptables_save(&pod.ns);
    text.push_str(&nft_istio_rules(&pod.ns).join("\n"));
    text.replace("--to-ports ", "redirect to :")
}

fn labels_enroll_and_remove(mode: RulesMode, subnet: &str) {
    let mesh = format!(
        "workloads:\n- {{name: a1, namespace: mesh, serviceAccount: client-sa, workloadIps: [\"{subnet}.2\"], protocol: HBONE}}\n- {{name: s1, namespace: shop, serviceAccount: server-sa, workloadIps: [\"{subnet}.3\"], protocol: HBONE}}\n"
    );
    let tag = match mode {
        RulesMode::Iptables => "kube",
        RulesMode::Nftables => "kubenft",
    };
    let (mut node, api) = kube_node(tag, subnet, &mesh);
    let rules_env = Node::rules_env(&node.dir, mode);
    node.extra_env.extend(rules_env);
    api.put(Kind::Pod, pod("mesh", "a1", "node-a", "client-sa"));
    api.put(Kind::Pod, pod("shop", "s1", "node-a", "server-sa"));
    // Another node's pod in an ambient namespace: never this agent's business.
    api.put(Kind::Pod, pod("mesh", "elsewhere", "node-b", "default"));

    node.launch(true);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");
    // The agent asks only for its own node's pods: every pod list and watch
    // it sends is scoped to node-a.
    let pod_requests: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.contains(" /api/v1/pods"))
        .collect();
    assert!(
        pod_requests
            .iter()
            .any(|r| r == "WATCH /api/v1/pods node=node-a"),
        "the agent watches its node's pods: {pod_requests:?}"
    );
    assert!(
        pod_requests.iter().all(|r| r.ends_with(" node=node-a")),
        "a pod request not scoped to this node: {pod_requests:?}"
    );

    // CNI ADD: the agent decides from the labels.
    let a1 = node.add_pod("a1", "mesh").unwrap();
    set_running(&api, "mesh", &a1);
    let s1 = node.add_pod("s1", "shop").unwrap();
    set_running(&api, "shop", &s1);
    assert!(
        istio_rules(&a1) > 0,
        "pod in an ambient namespace is captured"
    );
    // Pod annotations change that pod's rules, as in Istio.
    let mut quiet = pod("mesh", "d1", "node-a", "default");
    quiet["metadata"]["annotations"] = json!({"ambient.istio.io/dns-capture": "false"});
    api.put(Kind::Pod, quiet);
    let d1 = node.add_pod("d1", "mesh").unwrap();
    let (plain, quiet) = (redirects(&a1), redirects(&d1));
    assert!(plain.contains("redirect to :15053"), "{plain}");
    assert!(
        quiet.contains("redirect to :15001") && !quiet.contains("redirect to :15053"),
        "{quiet}"
    );
    assert_rules_in(&node, mode, &[&a1, &d1]);
    assert_eq!(
        istio_rules(&s1),
        0,
        "pod in a plain namespace is left alone"
    );
    wait_for("a1 annotated", &node, || {
        annotated(&api, "mesh", "a1").as_deref() == Some("enabled")
    });
    assert_eq!(annotated(&api, "shop", "s1"), None);
    assert!(
        api.patches().iter().all(|(p, _)| p.starts_with("mesh/")),
        "only captured pods are patched: {:?}",
        api.patches()
    );

    // Namespace label flip: the running pod is found by its IP and captured.
    api.update(Kind::Namespace, "", "shop", |o| {
        o["metadata"]["labels"][MODE] = json!("ambient")
    });
    wait_for("s1 captured after the namespace flip", &node, || {
        istio_rules(&s1) > 0
    });
    wait_for("s1 annotated", &node, || {
        annotated(&api, "shop", "s1").as_deref() == Some("enabled")
    });
    // Both are meshed now: traffic between them works through the proxy.
    let echo = EchoServer::start(&s1, 8080).unwrap();
    let mut conn = connect_from(&a1, echo.addr).unwrap();
    assert_eq!(
        echo_roundtrip(&mut conn, b"over-hbone").unwrap(),
        b"over-hbone"
    );
    drop(conn);
    wait_for("HBONE traffic counted", &node, || {
        node.metrics().lines().any(|l| {
            l.starts_with("istio_tcp_connections_opened_total{reporter=\"destination\"")
                && l.contains(
                    "destination_principal=\"spiffe://cluster.local/ns/shop/sa/server-sa\"",
                )
                && l.contains("source_principal=\"spiffe://cluster.local/ns/mesh/sa/client-sa\"")
        })
    });

    // Pod label opt-out: removed live, annotation dropped.
    api.update(Kind::Pod, "shop", "s1", |o| {
        o["metadata"]["labels"][MODE] = json!("none")
    });
    wait_for("s1 released after its opt-out label", &node, || {
        istio_rules(&s1) == 0
    });
    wait_for("s1 annotation removed", &node, || {
        annotated(&api, "shop", "s1").is_none()
    });
    assert!(
        api.patches()
            .iter()
            .any(|(p, b)| p == "shop/s1" && b["metadata"]["annotations"][REDIRECTION].is_null()),
        "removal is a merge patch with null"
    );

    // The API server's watch cache moves on: watches end with 410 and must relist.
    let lists = |api: &FakeApi| {
        api.requests()
            .iter()
            .filter(|r| r.starts_with("LIST /api/v1/pods"))
            .count()
    };
    let before = lists(&api);
    api.expire_watches();
    wait_for("pods relisted after 410 Gone", &node, || {
        lists(&api) > before
    });
    assert_eq!(
        node.log().matches("too old resource version").count(),
        2,
        "one 410 per watch, and the relist resumes cleanly"
    );
    api.update(Kind::Pod, "shop", "s1", |o| {
        o["metadata"]["labels"]
            .as_object_mut()
            .unwrap()
            .remove(MODE);
    });
    wait_for("s1 captured again through the new watch", &node, || {
        istio_rules(&s1) > 0
    });

    // A deleted pod is released at once (its netns, still here, loses the rules).
    api.delete(Kind::Pod, "mesh", "a1");
    let deleted = Instant::now();
    wait_for("a1 released after deletion", &node, || {
        istio_rules(&a1) == 0
    });
    assert!(
        deleted.elapsed() < Duration::from_secs(3),
        "release took {:?}",
        deleted.elapsed()
    );
    assert!(
        !node.log().contains("elsewhere"),
        "another node's pod was looked at"
    );

    // An agent exit while its DaemonSet remains is an upgrade: the plugin
    // stays, so pods created in the gap fail closed instead of escaping.
    node.lab.stop("node");
    assert!(has_plugin(&node), "CNI plugin kept across an upgrade");
    assert!(node.log().contains("CNI plugin left in place"));
    // The DaemonSet controller deletes the old agent's pod, and with it the
    // API server stops honouring that pod's token. The plugin's kubeconfig
    // carries a token of the agent's ServiceAccount bound to no pod
    // (TokenRequest), so the plugin can still ask.
    assert!(api.issued_tokens() >= 1, "{:?}", api.requests());
    api.delete(Kind::Pod, "istio-system", "ambit-q8x2z");
    // In the gap, a pod of an ambient namespace fails closed (kubelet
    // retries it); a pod of a plain namespace starts, once the API server
    // (which the plugin asks itself) says it is not in the mesh.
    let err = node.add_pod("m2", "mesh").unwrap_err();
    assert!(err.contains("is the Ambit agent running?"), "{err}");
    api.put(Kind::Pod, pod("plain", "p1", "node-a", "default"));
    node.add_pod("p1", "plain")
        .expect("a plain namespace's pod starts without the agent");
    // The plugin asks the API server itself (with the credentials the agent
    // left it): a pod labelled ambient in a plain namespace fails closed too.
    let mut labelled = pod("plain", "p2", "node-a", "default");
    labelled["metadata"]["labels"][MODE] = json!("ambient");
    api.put(Kind::Pod, labelled);
    let err = node.add_pod("p2", "plain").unwrap_err();
    assert!(err.contains("is the Ambit agent running?"), "{err}");
    // Once the API server refuses the plugin's token (the agent's pod is
    // gone, and its pod-bound token with it), nothing can tell that a pod
    // is not in the mesh: a pod labelled ambient in a plain namespace fails
    // closed with both reasons (it started outside the mesh before), and so
    // does an unlabelled one.
    api.revoke();
    let mut labelled = pod("plain", "p3", "node-a", "default");
    labelled["metadata"]["labels"][MODE] = json!("ambient");
    api.put(Kind::Pod, labelled);
    let err = node.add_pod("p3", "plain").unwrap_err();
    assert!(
        err.contains("is the Ambit agent running?")
            && err.contains("the API server could not say whether the pod is in the mesh"),
        "{err}"
    );
    api.put(Kind::Pod, pod("plain", "p4", "node-a", "default"));
    let err = node.add_pod("p4", "plain").unwrap_err();
    assert!(err.contains("could not say"), "{err}");

    // What the stand-in served all along, with what the agent's patches
    // left (s1 was annotated by the agent), is what a real server serves.
    served_objects_pass_the_schemas(
        &api,
        &node.dir,
        &[
            (Kind::Namespace, "", "mesh"),
            (Kind::Namespace, "", "shop"),
            (Kind::Pod, "shop", "s1"),
            (Kind::Pod, "mesh", "d1"),
            (Kind::Pod, "plain", "p3"),
            (Kind::DaemonSet, "istio-system", "ambit"),
            (Kind::Node, "", "node-a"),
        ],
    );
}

#[test]
fn the_plugin_is_removed_when_the_daemonset_is_deleted() {
    let (node, api) = kube_node("kubedel", "10.118.0", "");
    node.launch(true);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    assert!(has_plugin(&node));
    // The kubeconfig the agent leaves the plugin carries the agent's token.
    let kubeconfig = node.dir.join("run").join("plugin-kubeconfig");
    wait_for("the plugin's kubeconfig in the run dir", &node, || {
        kubeconfig.exists()
    });
    // The DaemonSet is deleted; the API still answers (the agent's account
    // is there): the DaemonSet's absence alone uninstalls the plugin. (An
    // uninstall that takes the account too, 403 then 401, is
    // `a_403_429_or_5xx_at_exit_…`.)
    api.delete(Kind::DaemonSet, "istio-system", "ambit");
    node.lab.stop("node");
    assert!(
        api.requests()
            .iter()
            .any(|r| r == "GET /apis/apps/v1/namespaces/istio-system/daemonsets/ambit"),
        "the agent looked for its DaemonSet: {:?}",
        api.requests()
    );
    assert!(!has_plugin(&node), "uninstalled with its DaemonSet");
    assert!(
        !kubeconfig.exists(),
        "the token does not outlive the agent on the node"
    );
}

#[test]
fn a_403_429_or_5xx_at_exit_keeps_the_plugin_and_an_uninstall_through_403_to_401_removes_it() {
    // A subnet of its own.
    let (node, api) = kube_node("kube403", "10.114.0", "");
    // A ClusterRole edited by mistake (403: the account is there, its
    // rights are not), a throttling or failing API server: none of them
    // says the DaemonSet is gone, so an exiting agent keeps the plugin.
    for code in [403, 429, 500, 503] {
        node.launch(true);
        node.wait_ready("127.0.0.1:8000", "/readyz");
        assert!(has_plugin(&node));
        api.refuse(http::StatusCode::from_u16(code).unwrap());
        // The agent asks again for 5 s while it gets 403.
        node.lab.stop_within("node", Duration::from_secs(15));
        assert!(
            has_plugin(&node),
            "an API answering {code} at exit uninstalled the plugin"
        );
        let log = node.log();
        assert!(log.contains("keeping the CNI plugin"), "{code}: {log}");
        api.serve_again();
    }
    // An uninstall deletes the DaemonSet, then the bindings (403), then
    // the account (401) a moment later: the agent waits the 403 out, and
    // the 401 removes the plugin.
    node.launch(true);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    api.delete(Kind::DaemonSet, "istio-system", "ambit");
    api.refuse(http::StatusCode::FORBIDDEN);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(1500));
            api.revoke();
        });
        node.lab.stop_within("node", Duration::from_secs(15));
    });
    assert!(!has_plugin(&node), "uninstalled once the account was gone");
    let refused = api.requests();
    assert!(
        refused.iter().any(|r| r.starts_with("REFUSED 403"))
            && refused.iter().any(|r| r.starts_with("REFUSED 401")),
        "{refused:?}"
    );
}

#[test]
fn the_plugin_is_removed_when_the_daemonset_no_longer_selects_the_node() {
    // A subnet of its own: 10.119.0 is the labels test's.
    let (node, api) = kube_node("kubesel", "10.117.0", "");
    // The DaemonSet now asks for nodes of another pool: the controller
    // deletes this node's agent and will not bring it back.
    api.update(Kind::DaemonSet, "istio-system", "ambit", |ds| {
        ds["spec"]["template"]["spec"]["affinity"] = json!({"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["mesh"]}]}]}}});
    });
    api.update(Kind::Node, "", "node-a", |n| {
        n["metadata"]["labels"]["pool"] = json!("mesh");
    });
    node.launch(true);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    assert!(has_plugin(&node));
    api.update(Kind::Node, "", "node-a", |n| {
        n["metadata"]["labels"]["pool"] = json!("batch");
    });
    node.lab.stop("node");
    assert!(
        !has_plugin(&node),
        "a node the DaemonSet no longer selects must not keep a plugin no agent serves"
    );
    assert!(
        api.requests()
            .iter()
            .any(|r| r.contains("/api/v1/nodes/node-a")),
        "{:?}",
        api.requests()
    );
}

#[test]
fn the_agent_exits_within_its_grace_when_the_api_server_stops_answering() {
    let (mut node, api) = kube_node("kubestall", "10.115.0", "");
    for name in ["w1", "w2"] {
        api.put(Kind::Pod, pod("mesh", name, "node-a", "default"));
    }
    node.launch(true);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    for name in ["w1", "w2"] {
        let p = node.add_pod(name, "mesh").unwrap();
        set_running(&api, "mesh", &p);
        wait_for("the pod annotated", &node, || {
            annotated(&api, "mesh", name).as_deref() == Some("enabled")
        });
    }
    // The API server wedges: watches still stream, requests for one object
    // hang. The namespace leaves the mesh (one watch event), so one
    // reconcile pass drops both pods, sending a PATCH for each in turn.
    let patches = || {
        let sent = |r: &&String| r.starts_with("PATCH /api/v1/namespaces/mesh/pods/");
        api.requests().iter().filter(sent).count()
    };
    let before = patches();
    api.stall();
    api.update(Kind::Namespace, "", "mesh", |o| {
        o["metadata"]["labels"][MODE] = json!("none")
    });
    wait_for("the first opt-out PATCH in flight", &node, || {
        patches() > before
    });

    let pid = node.lab.pid("node").unwrap();
    let asked = Instant::now();
    // SAFETY: kill(2) on the node process the lab spawned and still holds.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let exited = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(true)
    };
    // The kubelet's default grace is 30 s; after it the agent is killed
    // mid-exit, its files and rules left as they were.
    while !exited() && asked.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = asked.elapsed();
    eprintln!("the agent exited {took:?} after SIGTERM");
    let log = node.log();
    assert!(exited(), "the agent still runs 30 s after SIGTERM:\n{log}");
    assert!(took < Duration::from_secs(20), "exit took {took:?}:\n{log}");
    assert!(
        log.contains("no answer from the API server within"),
        "the PATCH in flight gave up on its own:\n{log}"
    );
    // The pass ended after that pod, starting no other's work (the next
    // agent's first pass does it), and so was not cut short.
    assert_eq!(patches(), before + 1, "{:?}", api.requests());
    assert!(!log.contains("outlived its grace at exit"), "{log}");
    // Whether the DaemonSet remains cannot be told: the plugin stays, as
    // across an upgrade.
    assert!(
        log.contains("cannot tell whether the agent's DaemonSet remains"),
        "{log}"
    );
    assert!(has_plugin(&node));
    node.lab.stop("node");
}

/// A real API server ends every watch after a while (its
/// `--min-request-timeout`, or the watch's `timeoutSeconds`), first with
/// a BOOKMARK; the agent's client watches again from there and keeps
/// seeing changes. Here watches end every second.
#[test]
fn the_agent_watches_again_each_time_the_api_server_ends_a_watch() {
    let subnet = "10.123.0";
    let mesh = format!(
        "workloads:\n- {{name: s1, namespace: shop, serviceAccount: server-sa, workloadIps: [\"{subnet}.2\"], protocol: HBONE}}\n"
    );
    let (mut node, api) = kube_node("rewatch", subnet, &mesh);
    api.cap_watches(Duration::from_secs(1));
    api.put(Kind::Pod, pod("shop", "s1", "node-a", "server-sa"));
    node.launch(true);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    let s1 = node.add_pod("s1", "shop").unwrap();
    set_running(&api, "shop", &s1);
    assert_eq!(istio_rules(&s1), 0, "a plain namespace's pod is left alone");
    let watches = || {
        api.requests()
            .iter()
            .filter(|r| r.starts_with("WATCH /api/v1/namespaces"))
            .count()
    };
    wait_for(
        "three namespace watches, each ended by the server",
        &node,
        || watches() >= 3,
    );
    // Relisting is what a client does after a 410, not after a watch that
    // simply ended: it resumes from its last resourceVersion.
    let lists = api
        .requests()
        .iter()
        .filter(|r| r.starts_with("LIST /api/v1/namespaces"))
        .count();
    assert_eq!(lists, 1, "{:?}", api.requests());
    api.update(Kind::Namespace, "", "shop", |o| {
        o["metadata"]["labels"][MODE] = json!("ambient")
    });
    wait_for("s1 captured after the namespace flip", &node, || {
        istio_rules(&s1) > 0
    });
}

/// In a cluster there is no kubeconfig: the agent finds the API server from
/// `KUBERNETES_SERVICE_HOST`/`_PORT` and its service account's files at the
/// fixed path `/var/run/secrets/kubernetes.io/serviceaccount`, and builds
/// the plugin's kubeconfig from them. Here the agent runs in a mount
/// namespace of its own where that path holds the stand-in's token and CA;
/// the plugin, run by the CNI chain outside it, reads only what the agent
/// left in its run dir.
#[test]
fn in_cluster_the_agent_and_the_plugin_reach_the_api_server_from_the_service_account() {
    let (mut node, api) = kube_node("kubeinc", "10.117.0", "");
    node.extra_env.retain(|(k, _)| k != "KUBECONFIG");
    let home = node.dir.join("home");
    std::fs::create_dir_all(&home).unwrap();
    node.extra_env.extend(
        [
            ("KUBERNETES_SERVICE_HOST", api.addr.ip().to_string()),
            ("KUBERNETES_SERVICE_PORT", api.addr.port().to_string()),
            // No ~/.kube/config of the machine's is read instead.
            ("HOME", home.display().to_string()),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    );
    let sa = node.dir.join("serviceaccount");
    api.write_service_account(&sa, "istio-system").unwrap();
    // The mount point exists on the host (an empty directory in /run, a
    // tmpfs); what is mounted on it is seen by the agent alone.
    std::fs::create_dir_all("/run/secrets").unwrap();
    let script = format!(
        "set -e; mount -t tmpfs ambit-test /run/secrets; \
         mkdir -p /run/secrets/kubernetes.io/serviceaccount; \
         cp {}/* /run/secrets/kubernetes.io/serviceaccount/; exec \"$0\" \"$@\"",
        sa.display()
    );
    let wrapper = [
        "unshare",
        "--mount",
        // As a container whose host paths are mounted HostToContainer:
        // the pods' netns mounts, made later on the host, reach it.
        "--propagation",
        "slave",
        "sh",
        "-c",
        &script,
    ];
    node.lab
        .spawn("node", node.command_through("node", &wrapper))
        .unwrap();
    node.wait_ready("127.0.0.1:8000", "/readyz");
    assert!(
        !std::path::Path::new("/run/secrets/kubernetes.io").exists(),
        "the service account's files stayed in the agent's mount namespace"
    );
    assert!(has_plugin(&node));

    // The agent listed and watched with the account's token.
    wait_for("the agent watches its node's pods", &node, || {
        api.requests()
            .iter()
            .any(|r| r == "WATCH /api/v1/pods node=node-a")
    });
    // The plugin's kubeconfig: the in-cluster server, the CA copied beside
    // it, and a token of its own (TokenRequest), not the agent's.
    let run = node.dir.join("run");
    let kubeconfig = run.join("plugin-kubeconfig");
    wait_for("the plugin's kubeconfig in the run dir", &node, || {
        kubeconfig.exists()
    });
    let text = std::fs::read_to_string(&kubeconfig).unwrap();
    assert!(
        text.contains(&format!("https://{}", api.addr)),
        "the in-cluster server: {text}"
    );
    assert!(
        text.contains(&run.join("plugin-ca.crt").display().to_string()),
        "{text}"
    );
    assert!(
        !text.contains("fake-token"),
        "the plugin got its own token: {text}"
    );
    assert_eq!(
        std::fs::read(run.join("plugin-ca.crt")).unwrap(),
        std::fs::read(sa.join("ca.crt")).unwrap()
    );

    // A pod of an ambient namespace, decided by the agent: captured.
    api.put(Kind::Pod, pod("mesh", "ic1", "node-a", "default"));
    let ic1 = node.add_pod("ic1", "mesh").unwrap();
    assert!(istio_rules(&ic1) > 0, "captured:\n{}", node.log());

    // With the agent gone, the plugin asks the API server itself, with the
    // kubeconfig built from the service account: it reads the pod's label,
    // so a labelled pod of a plain namespace fails closed and an unlabelled
    // one starts.
    node.lab.stop("node");
    assert!(has_plugin(&node), "kept across an upgrade");
    let asked_before = api.requests().len();
    let mut labelled = pod("plain", "ic2", "node-a", "default");
    labelled["metadata"]["labels"][MODE] = json!("ambient");
    api.put(Kind::Pod, labelled);
    let err = node.add_pod("ic2", "plain").unwrap_err();
    assert!(
        err.contains("is the Ambit agent running?") && !err.contains("could not say"),
        "{err}"
    );
    api.put(Kind::Pod, pod("plain", "ic3", "node-a", "default"));
    node.add_pod("ic3", "plain")
        .expect("the API server says the plain pod is not in the mesh");
    assert!(
        api.requests()[asked_before..]
            .iter()
            .any(|r| r.contains("/namespaces/plain/pods/ic3")),
        "the plugin asked the API server: {:?}",
        &api.requests()[asked_before..]
    );
}
