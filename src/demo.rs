//! `ambit demo`: a node of three pods in network namespaces on this host —
//! two meshed pods with their own proxies and a service in front of one, and
//! one pod outside the mesh — then traffic between them and a table of what
//! the proxies did. Cleans everything up on Ctrl-C (or at once with `--once`).

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::lab::{connect_from, echo_roundtrip, write_ca, EchoServer, Lab, LabPod, ProxySpec};

const TD: &str = "cluster.local";
const VIP: &str = "10.96.0.10";

fn config(client: &LabPod, server: &LabPod) -> String {
    format!(
        r#"# Demo mesh, in ztunnel's local-config format.
workloads:
- uid: demo/client
  name: client
  namespace: default
  serviceAccount: client-sa
  workloadIps: ["{c}"]
  protocol: HBONE
- uid: demo/server
  name: server
  namespace: default
  serviceAccount: server-sa
  workloadIps: ["{s}"]
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
"#,
        c = client.ip,
        s = server.ip
    )
}

/// One row of the result table.
struct Row {
    what: &'static str,
    target: SocketAddr,
    result: String,
    path: String,
    bytes: String,
    src_id: String,
    dst_id: String,
}

/// The newest JSON log line of `label` whose message is `msg`, as its fields.
fn last_event(lab: &Lab, label: &str, msg: &str) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(lab.log_path(label)).ok()?;
    text.lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["fields"]["message"] == msg)
        .map(|v| v["fields"].clone())
}

fn field(v: &Option<serde_json::Value>, key: &str) -> String {
    v.as_ref()
        .and_then(|v| {
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
    let bin = std::env::current_exe()?;
    println!(
        "Building a node: bridge {} in its own netns, pods on veths …",
        crate::lab::BRIDGE
    );
    let mut lab = Lab::new("demo", bin).context("creating the demo node")?;
    let client = lab.add_pod("client")?;
    let server = lab.add_pod("server")?;
    let outsider = lab.add_pod("outsider")?;
    let (ca_cert, ca_key) = write_ca(&lab.dir, "ca", TD)?;
    let cfg_path = lab.dir.join("mesh.yaml");
    std::fs::write(&cfg_path, config(&client, &server))?;
    for (pod, sa) in [(&client, "client-sa"), (&server, "server-sa")] {
        lab.redirect(pod)?;
        let spec = ProxySpec {
            config: cfg_path.clone(),
            ca_cert: ca_cert.clone(),
            ca_key: ca_key.clone(),
            workload_info: format!("default/{}/{sa}", pod.name),
            trust_domain: TD.into(),
            extra_env: vec![("LOG_FORMAT".into(), "json".into())],
        };
        lab.start_proxy(pod, &spec)?;
        println!(
            "  pod {:<9} {:<11} meshed: in-pod rules applied, ambit proxy ready",
            pod.name, pod.ip
        );
    }
    println!("  pod {:<9} {:<11} not meshed", outsider.name, outsider.ip);
    let _server_app = EchoServer::start(&server, 8080)?;
    let _outsider_app = EchoServer::start(&outsider, 8080)?;
    println!(
        "  service echo.default.svc.cluster.local {VIP}:80 -> server:8080\n  local config: {}\n",
        cfg_path.display()
    );

    let scenarios: [(&'static str, SocketAddr); 3] = [
        (
            "client -> server (pod IP)",
            SocketAddr::new(server.ip.into(), 8080),
        ),
        ("client -> echo service VIP", format!("{VIP}:80").parse()?),
        (
            "client -> outsider",
            SocketAddr::new(outsider.ip.into(), 8080),
        ),
    ];
    let payload = vec![b'x'; 256 * 1024];
    let mut rows = Vec::new();
    for (what, target) in scenarios {
        let start = Instant::now();
        let outcome =
            connect_from(&client, target).and_then(|mut c| echo_roundtrip(&mut c, &payload));
        std::thread::sleep(Duration::from_millis(150));
        let out_ev = last_event(&lab, "proxy-client", "outbound connection closed");
        let in_ev = last_event(&lab, "proxy-server", "inbound HBONE connection closed");
        let hbone = field(&out_ev, "route") == "hbone";
        rows.push(Row {
            what,
            target,
            result: match outcome {
                Ok(b) if b == payload => format!("ok {:.0?}", start.elapsed()),
                Ok(b) => format!("short ({} B)", b.len()),
                Err(e) => format!("failed: {e}"),
            },
            path: if hbone {
                "HBONE mTLS".into()
            } else {
                field(&out_ev, "route")
            },
            bytes: format!(
                "{} / {}",
                field(&out_ev, "bytes_sent"),
                field(&out_ev, "bytes_received")
            ),
            src_id: if hbone {
                field(&in_ev, "src.principal")
            } else {
                "-".into()
            },
            dst_id: field(&out_ev, "dst.principal").replace("unknown", "-"),
        });
    }
    println!(
        "{:<28} {:<17} {:<12} {:<17} {:<48} {:<48} result",
        "connection",
        "to",
        "path",
        "sent / recv B",
        "client identity (seen by server)",
        "server identity (checked by client)"
    );
    for r in &rows {
        println!(
            "{:<28} {:<17} {:<12} {:<17} {:<48} {:<48} {}",
            r.what,
            r.target.to_string(),
            r.path,
            r.bytes,
            r.src_id,
            r.dst_id,
            r.result
        );
    }
    println!(
        "\nMetrics: ip netns exec {} curl -s 127.0.0.1:15020/metrics",
        client.netns_name
    );
    println!("Logs:    {}", lab.dir.display());
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
