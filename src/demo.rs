//! `ambit demo`: a node built on this host the way a real one works — an
//! `ambit node` (agent + shared proxy) in a node network namespace, pods
//! created through the real CNI chain (reference `bridge` + `host-local`, then
//! the `ambit-cni` the agent installed) — then traffic between the pods and a
//! table of what the proxy did: path, bytes, identities, policy decisions.
//! Cleans everything up on Ctrl-C (or at once with `--once`).

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;

use crate::lab::node::Node;
use crate::lab::{connect_from, echo_roundtrip, EchoServer};

const VIP: &str = "10.96.0.10";
const SUBNET: &str = "10.78.0";

fn mesh_config() -> String {
    format!(
        r#"# Demo mesh, in ztunnel's local-config format. host-local hands out .2, .3, .4 in order.
workloads:
- name: client
  namespace: default
  serviceAccount: client-sa
  workloadIps: ["{SUBNET}.2"]
  protocol: HBONE
- name: server
  namespace: default
  serviceAccount: server-sa
  workloadIps: ["{SUBNET}.3"]
  protocol: HBONE
  services:
    "default/echo.default.svc.cluster.local":
      80: 8080
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/{VIP}"]
  ports:
    80: 8080
policies:
- name: deny-admin-port
  namespace: default
  action: Deny
  rules:
  - - - destinationPorts: [9090]
"#
    )
}

/// One row of the result table.
struct Row {
    what: &'static str,
    target: SocketAddr,
    path: String,
    bytes: String,
    src_id: String,
    dst_id: String,
    decision: String,
}

/// JSON log events of the node (agent and proxy share its log), newest first.
fn events(node: &Node) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(node.lab.log_path("node")).unwrap_or_default();
    let mut v: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .map(|v: serde_json::Value| v["fields"].clone())
        .collect();
    v.reverse();
    v
}

fn field(e: Option<&serde_json::Value>, key: &str) -> String {
    e.and_then(|v| {
        v[key]
            .as_str()
            .map(str::to_string)
            .or_else(|| v[key].as_u64().map(|n| n.to_string()))
    })
    .unwrap_or_else(|| "-".into())
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let once = args.iter().any(|a| a == "--once");
    if nix::unistd::geteuid().as_raw() != 0 {
        anyhow::bail!("the demo creates network namespaces and iptables rules: run it as root");
    }
    for (tool, hint) in [
        (
            "/usr/lib/cni/bridge",
            "the reference CNI plugins (Debian: containernetworking-plugins)",
        ),
        (
            "/usr/lib/cni/host-local",
            "the reference CNI plugins (Debian: containernetworking-plugins)",
        ),
    ] {
        if !std::path::Path::new(tool).exists() {
            anyhow::bail!("{tool} is missing: install {hint}, or run `bash .ci/install-deps`");
        }
    }
    for tool in ["ip", "iptables-restore", "ip6tables-restore", "ipset"] {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).exists()))
            .unwrap_or(false);
        if !found {
            anyhow::bail!("`{tool}` is not on PATH: run `bash .ci/install-deps` first");
        }
    }
    let bin = std::env::current_exe()?;
    let bin = bin.to_str().context("binary path is not UTF-8")?;
    // The node's processes inherit this: JSON logs, so the table can be read back from them.
    std::env::set_var("LOG_FORMAT", "json");
    println!("Starting a node: `ambit node` (agent + shared proxy) in its own network namespace …");
    let mut node = Node::start_full(
        bin,
        "demo",
        "namespaces:default",
        true,
        SUBNET,
        &mesh_config(),
        None,
    );
    println!(
        "  agent ready; it installed ambit-cni into {} and chained it into {}",
        node.bin_dir.display(),
        node.conf_dir.display()
    );
    let client = node
        .add_pod("client", "default")
        .map_err(anyhow::Error::msg)?;
    let server = node
        .add_pod("server", "default")
        .map_err(anyhow::Error::msg)?;
    let outsider = node
        .add_pod("outsider", "outside")
        .map_err(anyhow::Error::msg)?;
    for (p, how) in [
        (&client, "enrolled"),
        (&server, "enrolled"),
        (&outsider, "not enrolled (namespace 'outside')"),
    ] {
        println!(
            "  pod {:<9} {:<10} created through bridge + host-local + ambit-cni: {how}",
            p.name, p.ip
        );
    }
    let _apps = [
        EchoServer::start(&server, 8080)?,
        EchoServer::start(&server, 9090)?,
        EchoServer::start(&outsider, 8080)?,
    ];
    println!("  service echo.default.svc.cluster.local {VIP}:80 -> server:8080; policy default/deny-admin-port denies port 9090");
    println!("  local config: {}\n", node.dir.join("mesh.yaml").display());

    let scenarios: [(&'static str, SocketAddr); 4] = [
        (
            "client -> server (pod IP)",
            SocketAddr::new(server.ip.into(), 8080),
        ),
        ("client -> echo service VIP", format!("{VIP}:80").parse()?),
        (
            "client -> outsider",
            SocketAddr::new(outsider.ip.into(), 8080),
        ),
        (
            "client -> server admin port",
            SocketAddr::new(server.ip.into(), 9090),
        ),
    ];
    let payload = vec![b'x'; 64 * 1024];
    let mut rows = Vec::new();
    for (what, target) in scenarios {
        let before = events(&node).len();
        let outcome =
            connect_from(&client, target).and_then(|mut c| echo_roundtrip(&mut c, &payload));
        std::thread::sleep(Duration::from_millis(200));
        // This scenario's access lines (`connection complete`, newest
        // first), by direction.
        let mut evs = events(&node);
        evs.truncate(evs.len().saturating_sub(before));
        let line = |direction: &str, e: &&serde_json::Value| {
            e["message"] == "connection complete" && e["direction"] == direction
        };
        let out = evs.iter().find(|e| line("outbound", e));
        let route = field(out, "route");
        let inbound = evs
            .iter()
            .find(|e| e["message"] == "connection complete" && e["decision"] == "allow");
        let denied = evs
            .iter()
            .find(|e| line("inbound", e) && e["decision"] == "deny");
        let hbone = route == "hbone";
        rows.push(Row {
            what,
            target,
            path: if hbone { "HBONE mTLS".into() } else { route },
            bytes: format!(
                "{} / {}",
                field(out, "bytes_sent"),
                field(out, "bytes_recv")
            ),
            src_id: if hbone {
                field(denied.or(inbound), "src.identity")
            } else {
                "-".into()
            },
            dst_id: if hbone {
                field(out, "dst.identity")
            } else {
                "-".into()
            },
            decision: match (&outcome, denied) {
                (_, Some(d)) => format!("DENIED by {} (401)", field(Some(d), "policy")),
                (Ok(b), None) if *b == payload => "allowed, echoed".into(),
                (Ok(b), None) => format!("short reply ({} B)", b.len()),
                (Err(e), None) => format!("failed: {e}"),
            },
        });
    }
    println!(
        "{:<28} {:<16} {:<12} {:<15} {:<44} {:<44} decision",
        "connection",
        "to",
        "path",
        "sent / recv B",
        "client identity (seen by server)",
        "server identity (checked by client)"
    );
    for r in &rows {
        println!(
            "{:<28} {:<16} {:<12} {:<15} {:<44} {:<44} {}",
            r.what,
            r.target.to_string(),
            r.path,
            r.bytes,
            r.src_id.trim_start_matches("spiffe://"),
            r.dst_id.trim_start_matches("spiffe://"),
            r.decision
        );
    }
    println!(
        "\nMetrics: ip netns exec {} curl -s 127.0.0.1:15020/metrics",
        node.lab.node_name()
    );
    println!("Logs:    {}", node.lab.log_path("node").display());
    if once {
        return Ok(());
    }
    println!("\nPress Ctrl-C to stop and clean up.");
    wait_for_ctrl_c()?;
    println!("Cleaning up …");
    Ok(())
}

fn wait_for_ctrl_c() -> io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    })
}
