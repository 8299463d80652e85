//! End-to-end with a real container runtime: podman (CNI network backend,
//! runtime runc) starts a container on a network whose conflist the agent
//! chained `ambit-cni` into; the container is enrolled and its traffic is
//! carried over HBONE by the node's shared proxy.

use std::process::Command;

use ambit::lab::node::Node;
use ambit::lab::EchoServer;

#[test]
fn podman_container_on_the_chained_network_is_enrolled_and_captured() {
    let mesh = "workloads:\n- {name: server, namespace: default, serviceAccount: server-sa, workloadIps: [\"10.87.0.2\"], protocol: HBONE}\n- {name: client, namespace: default, serviceAccount: client-sa, workloadIps: [\"10.87.0.3\"], protocol: HBONE}\n";
    let mut node = Node::start_full(
        env!("CARGO_BIN_EXE_ambit"),
        "podman",
        "all",
        true,
        // A subnet no other test uses (10.78.0 is the demo's).
        "10.87.0",
        mesh,
        None,
    );
    let server = node.add_pod("server", "default").unwrap();
    let _echo = EchoServer::start(&server, 8080).unwrap();

    // A busybox image from a local rootfs (no registry is reachable).
    let dir = node.dir.clone();
    let rootfs = dir.join("rootfs/bin");
    std::fs::create_dir_all(&rootfs).unwrap();
    std::fs::copy("/usr/bin/busybox", rootfs.join("busybox")).unwrap();
    for c in ["sh", "nc", "echo", "ip"] {
        std::os::unix::fs::symlink("busybox", rootfs.join(c)).unwrap();
    }
    assert!(Command::new("tar")
        .arg("-C")
        .arg(dir.join("rootfs"))
        .arg("-cf")
        .arg(dir.join("rootfs.tar"))
        .arg(".")
        .status()
        .unwrap()
        .success());
    let conf = dir.join("containers.conf");
    std::fs::write(
        &conf,
        format!(
            "[network]\nnetwork_backend = \"cni\"\ncni_plugin_dirs = [\"/usr/lib/cni\", \"{}\"]\nnetwork_config_dir = \"{}\"\n[engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n",
            node.bin_dir.display(),
            node.conf_dir.display()
        ),
    )
    .unwrap();
    let podman = |args: &[&str]| {
        // Only the network namespace changes (setns): podman needs the host's cgroup mounts.
        let out = node
            .lab
            .node
            .command("podman")
            .env("CONTAINERS_CONF", &conf)
            .arg("--root")
            .arg(dir.join("containers/root"))
            .arg("--runroot")
            .arg(dir.join("containers/runroot"))
            .args(["--storage-driver", "vfs", "--runtime", "runc"])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, out) = podman(&[
        "import",
        dir.join("rootfs.tar").to_str().unwrap(),
        "localhost/mesh-bb:1",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = podman(&[
        "run",
        "--rm",
        "--name",
        "client",
        "--ulimit",
        "nofile=20000:20000",
        "--ulimit",
        "nproc=4096:4096",
        "--network",
        "meshnet",
        "localhost/mesh-bb:1",
        "sh",
        "-c",
        "ip -4 addr show eth0 && echo hello-from-podman | nc -w 3 10.87.0.2 8080",
    ]);
    assert!(ok, "podman run failed: {out}\n{}", node.log());
    assert!(
        out.contains("10.87.0.3") && out.contains("hello-from-podman"),
        "{out}"
    );
    let over_hbone = |m: &str| {
        m.lines().any(|l| {
            l.starts_with("istio_tcp_connections_opened_total{reporter=\"destination\"")
                && l.contains("source_principal=\"spiffe://cluster.local/ns/default/sa/client-sa\"")
                && l.contains("connection_security_policy=\"mutual_tls\"")
        })
    };
    // Polled (the wait ends early): the count may trail the container's exit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !over_hbone(&node.metrics()) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let m = node.metrics();
    assert!(
        over_hbone(&m),
        "the container's connection must arrive over HBONE with its identity:\n{m}\n{}",
        node.log()
    );
    let _ = podman(&["rm", "-af"]);
}
