//! Scenario pieces for tests against the fake Kubernetes API server: a node
//! whose agent enrolls by labels (`enroll: kubernetes`), namespaces and pods
//! as the API shows them (a lab pod's UID is [`pod_uid`] of its name, as its
//! sandbox's cgroup says), and the waits and reads those tests share.

use std::time::{Duration, Instant};

use ambit::lab::kubeapi::{FakeApi, Kind};
use ambit::lab::node::Node;
use ambit::lab::{istio_rules, pod_uid, stdout_in, LabPod};

use super::node::proxy_uids;
use serde_json::{json, Value};

pub const BIN: &str = env!("CARGO_BIN_EXE_ambit");
pub const MODE: &str = "istio.io/dataplane-mode";
pub const REDIRECTION: &str = "ambient.istio.io/redirection";

/// A namespace, labelled ambient or not.
pub fn namespace(name: &str, ambient: bool) -> Value {
    let labels = if ambient {
        json!({MODE: "ambient"})
    } else {
        json!({})
    };
    json!({"metadata": {"name": name, "uid": format!("ns-{name}"), "labels": labels}})
}

/// A pod bound to `node`, not running yet, with the UID the lab gives it.
pub fn pod(ns: &str, name: &str, node: &str, sa: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": ns, "uid": pod_uid(name), "labels": {}},
        "spec": {"nodeName": node, "serviceAccountName": sa, "containers": [{"name": "app", "image": "app"}]},
        "status": {"phase": "Pending"},
    })
}

/// What kubelet does once the sandbox is up: the pod gets its IP and runs.
pub fn set_running(api: &FakeApi, ns: &str, p: &LabPod) {
    set_running_at(api, ns, &p.name, &p.ip.to_string());
}

/// Pod `name` runs with IP `ip`, as the API server tells it.
pub fn set_running_at(api: &FakeApi, ns: &str, name: &str, ip: &str) {
    api.update(Kind::Pod, ns, name, |o| {
        o["status"] = json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]});
    });
}

/// Polls `f` until it holds; after 20 s fails naming `what`, with the node's log.
pub fn wait_for(what: &str, node: &Node, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(
            Instant::now() < deadline,
            "timed out: {what}\nlog:\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The pod's redirection annotation, as the agent set it.
pub fn annotated(api: &FakeApi, ns: &str, name: &str) -> Option<String> {
    api.get(Kind::Pod, ns, name)?["metadata"]["annotations"][REDIRECTION]
        .as_str()
        .map(String::from)
}

/// The agent's own pod, owned by its DaemonSet.
fn agent_objects(api: &FakeApi) {
    api.put(
        Kind::Pod,
        json!({
            "metadata": {"name": "ambit-q8x2z", "namespace": "istio-system", "uid": "uid-agent",
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ambit",
                                              "uid": "uid-ds", "controller": true}]},
            "spec": {"nodeName": "node-a", "hostNetwork": true, "containers": [{"name": "agent", "image": "ambit"}]},
            "status": {"phase": "Running"},
        }),
    );
    api.put(
        Kind::DaemonSet,
        json!({"metadata": {"name": "ambit", "namespace": "istio-system", "uid": "uid-ds"},
               "spec": {"selector": {"matchLabels": {"app": "ambit"}},
                        "template": {"spec": {"containers": [{"name": "agent", "image": "ambit"}],
                                              "nodeSelector": {"kubernetes.io/os": "linux"}}}}}),
    );
    api.put(
        Kind::Node,
        json!({"metadata": {"name": "node-a", "labels": {"kubernetes.io/os": "linux"}}}),
    );
}

/// A node `node-a` whose agent enrolls from the fake API server (not
/// started yet), with namespaces `mesh` and `kube-system` labelled ambient
/// and `shop`, `istio-system` and `plain` not.
pub fn kube_node(tag: &str, subnet: &str, mesh: &str) -> (Node, FakeApi) {
    let mut node = Node::prepare(BIN, tag, "kubernetes", subnet, mesh, None);
    // Over TLS with a CA bundle, as a real API server: the agent's and the
    // plugin's clients (both kube-rs) get the CA from their kubeconfigs.
    let api = FakeApi::start_tls(&node.lab.node).unwrap();
    let kubeconfig = node.dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    node.extra_env.extend(
        [
            ("KUBECONFIG", kubeconfig.display().to_string()),
            ("NODE_NAME", "node-a".into()),
            ("POD_NAMESPACE", "istio-system".into()),
            ("POD_NAME", "ambit-q8x2z".into()),
            ("SERVICE_ACCOUNT", "ambit".into()),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    );
    for (name, ambient) in [
        ("mesh", true),
        ("shop", false),
        ("kube-system", true),
        ("istio-system", false),
        ("plain", false),
    ] {
        api.put(Kind::Namespace, namespace(name, ambient));
    }
    agent_objects(&api);
    // The agent's token is its pod's, as a projected one is: once the pod
    // is deleted, the API server refuses it.
    api.bind_kubeconfig_token("istio-system", "ambit-q8x2z");
    (node, api)
}

/// Whether `pod` is in the state a flip asked for: enrolled (captured,
/// served by the proxy, annotated) or not (none of these).
pub fn enrolled_as(node: &Node, api: &FakeApi, ns: &str, pod: &LabPod, enrolled: bool) -> bool {
    let uid = pod_uid(&pod.name);
    let Some(in_proxy) = proxy_uids(node).map(|p| p.contains(&uid)) else {
        return false;
    };
    let captured = istio_rules(pod) > 0;
    let route = ip_rule_in(pod);
    let annotation = annotated(api, ns, &pod.name);
    if enrolled {
        captured && route && in_proxy && annotation.as_deref() == Some("enabled")
    } else {
        !captured && !route && !in_proxy && annotation.is_none()
    }
}

/// Whether the pod's netns has the in-pod policy route rule (fwmark 0x111 → table 100).
pub fn ip_rule_in(pod: &LabPod) -> bool {
    stdout_in(&pod.ns, "ip", &["rule", "list"]).contains("lookup 100")
}

/// Checks what the stand-in serves against the Kubernetes OpenAPI schemas
/// of the chart's oldest version (`kubernetes-validate --strict`, unknown
/// fields refused): the objects the agent reads, and what its patches
/// left, are shaped as a real API server's would be.
pub fn served_objects_pass_the_schemas(
    api: &FakeApi,
    dir: &std::path::Path,
    objects: &[(Kind, &str, &str)],
) {
    let docs: Vec<String> = objects
        .iter()
        .map(|(kind, ns, name)| {
            let obj = api
                .get(*kind, ns, name)
                .unwrap_or_else(|| panic!("the stand-in has no {kind:?} {ns}/{name}"));
            obj.to_string()
        })
        .collect();
    let file = dir.join("served.yaml");
    std::fs::write(&file, docs.join("\n---\n")).unwrap();
    let out = std::process::Command::new("kubernetes-validate")
        .args(["--strict", "-k", "1.30.0"])
        .arg(&file)
        .output()
        .expect("kubernetes-validate runs (.ci/install-deps installs it)");
    assert!(
        out.status.success(),
        "served objects fail the Kubernetes 1.30 schemas:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
