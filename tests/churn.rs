//! Pods that come and go (issue #55), through the real binaries on a lab
//! node: an agent and the shared proxy, pods created and deleted as a
//! runtime does (sandbox, then the CNI chain: bridge, host-local, then
//! `ambit-cni`), served over ZDS. Round after round of pods added and all
//! removed, the proxy must come back to what it held after the first round:
//! its private memory within a stated bound, and exactly its descriptors,
//! threads, tasks and metric series. Once from a local config, once with
//! each pod's workload added and removed by `ambit control-plane` over xDS,
//! as a real node runs. Numbers are printed (`--nocapture`) and quoted in
//! docs/faults.md.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ambit::lab::anon_kb;
use ambit::lab::node::Node;
use common::node::{fd_kinds, metric_value, proxy_pods_at, proxy_uids, ADMIN, METRICS};
use common::{admin_get, wait_until_showing};

const BIN: &str = env!("CARGO_BIN_EXE_ambit");

/// Pods per round and rounds. Each round's pods have new names and UIDs,
/// as a Job's or a CI runner's do.
const PODS: usize = 100;
const ROUNDS: usize = 5;

/// How much more private memory the proxy may hold after the last round
/// than after the first. Before the fix it grew ~0.45 MiB a round of 200
/// pods, for good (issue #55); see docs/faults.md for what it does now.
const MEMORY_SLACK_KB: u64 = 640;

/// How long a removed pod's state may take to go: the certificate of an
/// identity no pod uses is dropped 10 s after its last pod leaves.
const SETTLE: Duration = Duration::from_secs(25);

/// What the proxy holds, as an operator can read it.
#[derive(Debug, Clone, PartialEq)]
struct Held {
    anon_kb: u64,
    fds: BTreeMap<String, usize>,
    threads: usize,
    tasks: u64,
    series: usize,
}

fn held(node: &Node, pid: u32) -> Held {
    // Descriptors before the scrape: its own connection is one while open.
    let (anon_kb, fds) = (anon_kb(pid), fd_kinds(pid));
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.count())
        .unwrap_or(0);
    let metrics = admin_get(&node.lab.node, METRICS, "/metrics");
    Held {
        anon_kb,
        fds,
        threads,
        tasks: metric_value(&metrics, "tokio_num_alive_tasks")
            .expect("the proxy reports tokio_num_alive_tasks") as u64,
        series: metrics.lines().filter(|l| !l.starts_with('#')).count(),
    }
}

/// Writes the control plane's config with these pods' workloads.
type Publish = dyn Fn(&Node, &[(String, std::net::Ipv4Addr)]);

/// The node's proxy, and how a round's pods reach its mesh state.
struct Churn {
    node: Node,
    pid: u32,
    /// Writes the control plane's config with these pods' workloads
    /// (`None`: the proxy reads its local config, which stays as it is).
    publish: Option<Box<Publish>>,
}

impl Churn {
    /// Adds `PODS` pods, waits until the proxy serves them all (and, over
    /// xDS, holds their workloads), removes them all, and waits until no
    /// trace of them is left that the proxy reports: no pod served, no
    /// workload held, no certificate held.
    fn round(&mut self, round: usize) -> Duration {
        let started = Instant::now();
        let mut pods = Vec::new();
        for i in 0..PODS {
            let name = format!("r{round}-{i}");
            let pod = self
                .node
                .add_pod(&name, "default")
                .unwrap_or_else(|e| panic!("ADD of {name}: {e}\n{}", self.node.log()));
            pods.push((name, pod.ip));
        }
        if let Some(publish) = &self.publish {
            publish(&self.node, &pods);
        }
        let node = &self.node;
        wait_until_showing(
            &format!("round {round}: the proxy serves its {PODS} pods"),
            Duration::from_secs(60),
            || proxy_uids(node).is_some_and(|u| u.len() == PODS),
            || node.log(),
        );
        if self.publish.is_some() {
            wait_until_showing(
                &format!("round {round}: the proxy holds its {PODS} workloads"),
                Duration::from_secs(30),
                || workloads(node) >= PODS,
                || node.log(),
            );
        }
        for (name, _) in &pods {
            self.node
                .delete_pod(name, "default")
                .unwrap_or_else(|e| panic!("DEL of {name}: {e}"));
        }
        if let Some(publish) = &self.publish {
            publish(&self.node, &[]);
        }
        let node = &self.node;
        let over_xds = self.publish.is_some();
        wait_until_showing(
            &format!("round {round}: every pod, workload and certificate gone from the proxy"),
            SETTLE,
            || {
                let metrics = admin_get(&node.lab.node, METRICS, "/metrics");
                proxy_uids(node).is_some_and(|u| u.is_empty())
                    && !metrics.contains("ambit_certificate_expiry_seconds{")
                    && (!over_xds || workloads(node) == 0)
            },
            || node.log(),
        );
        started.elapsed()
    }

    /// What the proxy holds once it has given back what it can: the least
    /// private memory over 11 s (jemalloc hands pages back 2 s after their
    /// last use, on its own thread), the rest as last read.
    fn settled(&self) -> Held {
        let mut least = held(&self.node, self.pid);
        let until = Instant::now() + Duration::from_secs(11);
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(500));
            let now = held(&self.node, self.pid);
            least = Held {
                anon_kb: least.anon_kb.min(now.anon_kb),
                ..now
            };
        }
        least
    }

    fn run(mut self, how: &str) {
        let mut after = Vec::new();
        for round in 0..ROUNDS {
            let took = self.round(round);
            let h = self.settled();
            println!(
                "{how}: round {round} ({PODS} pods in and out in {:.0} s): private {} kB, {} fds, {} threads, {} tasks, {} series",
                took.as_secs_f64(),
                h.anon_kb,
                h.fds.values().sum::<usize>(),
                h.threads,
                h.tasks,
                h.series
            );
            after.push(h);
        }
        let (first, last) = (&after[0], &after[ROUNDS - 1]);
        assert!(
            last.anon_kb <= first.anon_kb + MEMORY_SLACK_KB,
            "{how}: the proxy's private memory grew from {} kB after the first round to {} kB after the last ({ROUNDS} rounds of {PODS} pods): {after:#?}",
            first.anon_kb,
            last.anon_kb
        );
        assert_eq!(
            (&first.fds, first.threads, first.tasks, first.series),
            (&last.fds, last.threads, last.tasks, last.series),
            "{how}: descriptors, threads, tasks or metric series left behind by pods that are gone: {after:#?}"
        );
    }
}

/// Workloads in the proxy's mesh state, from its config dump.
fn workloads(node: &Node) -> usize {
    let dump = admin_get(&node.lab.node, ADMIN, "/config_dump");
    let dump: serde_json::Value = serde_json::from_str(&dump).unwrap();
    dump["workloads"].as_array().map_or(0, |w| {
        w.iter()
            .filter(|w| w["name"].as_str().is_some_and(|n| n.starts_with('r')))
            .count()
    })
}

#[test]
fn pods_that_come_and_go_leave_nothing_behind_in_the_shared_proxy() {
    let node = Node::start_with(BIN, "churn", "namespaces:default", false);
    let pid = node.lab.pid("proxy").unwrap();
    assert!(proxy_pods_at(&node, ADMIN).is_some());
    Churn {
        node,
        pid,
        publish: None,
    }
    .run("local config");
}

/// A workload of another node that stays: the control plane signs
/// certificates only for identities its config names, and a pod asks for
/// its certificate before its own workload can be published (its address
/// comes with the ADD).
const ANCHOR: &str = "- {uid: \"Kubernetes//Pod/default/elsewhere\", name: elsewhere, namespace: default, serviceAccount: default, workloadIps: [\"10.232.0.9\"], protocol: HBONE}\n";

/// The control plane's address in the node netns.
const CP_ADDR: &str = "127.0.0.1:15012";

#[test]
fn pods_whose_workloads_come_and_go_over_xds_leave_nothing_behind_in_the_shared_proxy() {
    // A subnet apart from `Node::start_with`'s (10.120–219.x) for a test alongside.
    let mut node = Node::prepare(
        BIN,
        "churnxds",
        "namespaces:default",
        "10.231.0",
        "workloads: []\n",
        None,
    );
    let (cp_config, token) = (node.dir.join("cp.yaml"), node.dir.join("token"));
    std::fs::write(&cp_config, format!("workloads:\n{ANCHOR}")).unwrap();
    std::fs::write(&token, "s3cret\n").unwrap();
    let mut cp = node.lab.node.command(BIN);
    cp.arg("control-plane")
        .env("LOCAL_XDS_PATH", &cp_config)
        .env("AMBIT_CA_CERT", node.dir.join("ca-cert.pem"))
        .env("AMBIT_CA_KEY", node.dir.join("ca-key.pem"))
        .env(
            "AMBIT_CP_SERVING_CA_CERT",
            node.dir.join("serving-ca-cert.pem"),
        )
        .env(
            "AMBIT_CP_SERVING_CA_KEY",
            node.dir.join("serving-ca-key.pem"),
        )
        .env("AMBIT_CP_LISTEN", CP_ADDR)
        .env("AMBIT_CP_TLS_SANS", "127.0.0.1")
        .env("AMBIT_CP_TOKEN_FILE", &token);
    node.lab.spawn("cp", cp).unwrap();
    let path = |p: &str| node.dir.join(p).display().to_string();
    node.extra_env = vec![
        ("XDS_ADDRESS".into(), format!("https://{CP_ADDR}")),
        ("CA_ADDRESS".into(), format!("https://{CP_ADDR}")),
        ("XDS_ROOT_CA".into(), path("serving-ca-cert.pem")),
        ("AMBIT_MESH_ROOT_CA".into(), path("ca-cert.pem")),
        ("AUTH_TOKEN".into(), path("token")),
        // Certificates come from the control plane alone.
        ("AMBIT_CA_KEY".into(), "/nonexistent".into()),
    ];
    node.launch(false);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");
    let pid = node.lab.pid("proxy").unwrap();
    let publish = move |node: &Node, pods: &[(String, std::net::Ipv4Addr)]| {
        let mut yaml = format!("workloads:\n{ANCHOR}");
        for (name, ip) in pods {
            yaml.push_str(&format!(
                "- {{uid: \"Kubernetes//Pod/default/{name}\", name: {name}, namespace: default, serviceAccount: default, workloadIps: [\"{ip}\"], protocol: HBONE}}\n"
            ));
        }
        // Written whole, then renamed over: the control plane never reads half a file.
        let tmp = node.dir.join("cp.yaml.tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(tmp, node.dir.join("cp.yaml")).unwrap();
    };
    Churn {
        node,
        pid,
        publish: Some(Box::new(publish)),
    }
    .run("over xDS");
}

/// Context switches of every thread of process `pid` so far, by thread
/// name: each is a time the thread slept and was woken (or was made to
/// yield).
fn switches(pid: u32) -> BTreeMap<String, u64> {
    let mut by_name = BTreeMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let field = |key: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
                .unwrap_or(0)
        };
        let name = status
            .lines()
            .find_map(|l| l.strip_prefix("Name:"))
            .unwrap_or("?")
            .trim()
            .to_string();
        *by_name.entry(name).or_default() +=
            field("voluntary_ctxt_switches:") + field("nonvoluntary_ctxt_switches:");
    }
    by_name
}

/// Pods on a /22 (the lab's usual /24 holds 253).
const IDLE_PODS: usize = 500;

/// How long the idle proxy is watched, and how often it may be woken then
/// in all: each pod's listeners are tasks that wait in the kernel, and
/// nothing of the proxy's own runs on a timer while nothing changes.
const IDLE_WINDOW: Duration = Duration::from_secs(30);
const IDLE_WAKEUPS: u64 = 5;

/// An idle shared proxy serving 500 pods, with nothing flowing and
/// nothing changing, is not woken by timers of its own (issue #55 item 3):
/// no polling of its config, no trimming of the allocator, no evictor of an
/// empty pool, no looking for certificates to drop while no pod leaves.
#[test]
fn an_idle_proxy_serving_500_pods_is_not_woken_by_timers_of_its_own() {
    let node = Node::prepare(
        BIN,
        "idle",
        "namespaces:default",
        "10.232.0",
        "workloads: []\n",
        None,
    );
    // The config in a directory of its own, as a ConfigMap volume is: the
    // watch of the lab's directory would wake for every line of its logs.
    let config_dir = node.dir.join("config");
    std::fs::create_dir_all(&config_dir).unwrap();
    std::fs::write(config_dir.join("mesh.yaml"), "workloads: []\n").unwrap();
    let mut node = node;
    node.extra_env = vec![(
        "LOCAL_XDS_PATH".into(),
        config_dir.join("mesh.yaml").display().to_string(),
    )];
    let conflist = node.conf_dir.join("10-meshnet.conflist");
    let wide = std::fs::read_to_string(&conflist)
        .unwrap()
        .replace("10.232.0.0/24", "10.232.0.0/22");
    std::fs::write(&conflist, wide).unwrap();
    node.launch(false);
    node.wait_ready("127.0.0.1:8000", "/readyz");
    node.wait_ready("127.0.0.1:15021", "/healthz/ready");
    let pid = node.lab.pid("proxy").unwrap();
    for i in 0..IDLE_PODS {
        let name = format!("idle-{i}");
        node.add_pod(&name, "default")
            .unwrap_or_else(|e| panic!("ADD of {name}: {e}"));
    }
    let node_ref = &node;
    wait_until_showing(
        &format!("the proxy serves its {IDLE_PODS} pods"),
        Duration::from_secs(60),
        || proxy_uids(node_ref).is_some_and(|u| u.len() == IDLE_PODS),
        || node_ref.log(),
    );
    // Let start-up's one-off work end (the binary's start-up pages are
    // released once ready; the ADDs' log lines are written).
    std::thread::sleep(Duration::from_secs(3));
    let before = switches(pid);
    std::thread::sleep(IDLE_WINDOW);
    let after = switches(pid);
    let woken: BTreeMap<&String, u64> = after
        .iter()
        .map(|(name, n)| (name, n - before.get(name).copied().unwrap_or(0)))
        .collect();
    let total: u64 = woken.values().sum();
    println!(
        "idle proxy serving {IDLE_PODS} pods: {total} context switches in {} s, by thread {woken:?}",
        IDLE_WINDOW.as_secs()
    );
    assert!(
        total <= IDLE_WAKEUPS,
        "an idle proxy serving {IDLE_PODS} pods was woken {total} times in {IDLE_WINDOW:?}: {woken:?}"
    );
}
