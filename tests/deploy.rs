//! The Helm chart, its rendered manifests and the container image, checked
//! with real tools: helm renders and lints the chart, kubernetes-validate
//! checks the manifests against the Kubernetes schemas, and podman builds the
//! Dockerfile on local Debian base images (`.ci/install-deps` provides all
//! of them; no registry is reachable from our machines).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde::Deserialize;
use serde_yaml::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ambit");
const CHART: &str = "deploy/chart/ambit";
const MANIFESTS: &str = "deploy/manifests/ambit.yaml";
const BASE: &str = "localhost/ambit-base:bookworm";
const BUILDER: &str = "localhost/ambit-rust:bookworm";
/// The default nofile limit fails container starts on our machines.
const ULIMITS: [&str; 4] = [
    "--ulimit",
    "nofile=20000:20000",
    "--ulimit",
    "nproc=4096:4096",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tool(name: &str) -> Command {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
        .unwrap_or(false);
    assert!(found, "{name} is missing: run .ci/install-deps");
    let mut cmd = Command::new(name);
    cmd.current_dir(repo());
    cmd
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(cmd: &mut Command) -> String {
    String::from_utf8_lossy(&run(cmd).stdout).into_owned()
}

fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).expect("yaml"))
        .filter(|v| !v.is_null())
        .collect()
}

fn strs(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| {
            s.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn chart_renders_to_the_checked_in_manifests_which_pass_the_kubernetes_schemas() {
    run(tool("helm").args(["lint", "--strict", CHART]));
    let rendered =
        stdout(tool("helm").args(["template", "ambit", CHART, "--namespace", "istio-system"]));
    let checked_in = std::fs::read_to_string(repo().join(MANIFESTS)).expect("manifests");
    assert!(
        rendered == checked_in,
        "{MANIFESTS} is stale; regenerate it with\n  helm template ambit {CHART} --namespace istio-system > {MANIFESTS}"
    );
    for version in ["1.30.0", "1.33.0"] {
        run(tool("kubernetes-validate").args(["--strict", "-k", version, MANIFESTS]));
    }
    // The validator is not a rubber stamp: a misspelled field fails it.
    let broken = std::env::temp_dir().join(format!("ambit-broken-{}.yaml", std::process::id()));
    std::fs::write(
        &broken,
        checked_in.replace("hostNetwork: true", "hostNetwrk: true"),
    )
    .expect("write");
    let out = tool("kubernetes-validate")
        .args(["--strict", "-k", "1.33.0"])
        .arg(&broken)
        .output()
        .expect("spawn");
    let _ = std::fs::remove_file(&broken);
    assert!(
        !out.status.success(),
        "a misspelled field passed validation"
    );

    let docs = documents(&checked_in);
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "DaemonSet",
            "DaemonSet"
        ]
    );
    // RBAC: exactly the verbs the agent uses.
    let rules = |doc: &Value| -> Vec<(Vec<String>, Vec<String>, Vec<String>)> {
        doc["rules"]
            .as_sequence()
            .expect("rules")
            .iter()
            .map(|r| {
                (
                    strs(&r["apiGroups"]),
                    strs(&r["resources"]),
                    strs(&r["verbs"]),
                )
            })
            .collect()
    };
    let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        rules(&docs[1]),
        [
            (
                v(&[""]),
                v(&["pods", "namespaces"]),
                v(&["get", "list", "watch"])
            ),
            (v(&[""]), v(&["pods/status"]), v(&["patch"])),
            (v(&[""]), v(&["nodes"]), v(&["get"])),
        ]
    );
    assert_eq!(
        rules(&docs[3]),
        [
            (v(&["apps"]), v(&["daemonsets"]), v(&["get"])),
            (v(&[""]), v(&["serviceaccounts/token"]), v(&["create"])),
        ]
    );
    // A token for its own account only.
    assert_eq!(
        strs(&docs[3]["rules"][1]["resourceNames"]),
        [docs[0]["metadata"]["name"].as_str().expect("account name")]
    );
    // The agent on the host network; the proxy on the pod network, upgraded
    // with a surge so a new proxy is up before the old one drains.
    let ds = &docs[5]["spec"]["template"]["spec"];
    assert_eq!(ds["hostNetwork"].as_bool(), Some(true));
    let proxy_ds = &docs[6];
    assert_eq!(proxy_ds["metadata"]["name"].as_str(), Some("ambit-proxy"));
    assert!(proxy_ds["spec"]["template"]["spec"]["hostNetwork"].is_null());
    let rolling = &proxy_ds["spec"]["updateStrategy"]["rollingUpdate"];
    assert_eq!(
        (
            rolling["maxSurge"].as_u64(),
            rolling["maxUnavailable"].as_u64()
        ),
        (Some(1), Some(0))
    );
    assert!(
        proxy_ds["metadata"]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("ambit-")),
        "the plugin passes the proxy's pods through by the agent's prefix"
    );
    assert_eq!(
        ds["priorityClassName"].as_str(),
        Some("system-node-critical")
    );
    let host_paths: Vec<&str> = ds["volumes"]
        .as_sequence()
        .expect("volumes")
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    for p in [
        "/opt/cni/bin",
        "/etc/cni/net.d",
        "/proc",
        "/var/run/netns",
        "/var/run/ambit",
    ] {
        assert!(host_paths.contains(&p), "host path {p} not mounted");
    }
    // Least privilege: the proxy's pod mounts the ZDS socket's directory and
    // nothing of the agent's run dir around it (the plugin event socket, the
    // plugin's kubeconfig with the agent's token).
    let env_of = |spec: &Value, var: &str| -> String {
        spec["containers"][0]["env"]
            .as_sequence()
            .expect("env")
            .iter()
            .find(|e| e["name"].as_str() == Some(var))
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("{var} not set"))
            .to_string()
    };
    let proxy_spec = &proxy_ds["spec"]["template"]["spec"];
    let run_dir = PathBuf::from(env_of(ds, "CNI_AGENT_RUN_DIR"));
    let zds = env_of(ds, "ZTUNNEL_UDS_ADDRESS");
    assert_eq!(env_of(proxy_spec, "INPOD_UDS"), zds, "one ZDS socket");
    let zds_dir = Path::new(&zds).parent().expect("a directory");
    assert_ne!(
        zds_dir, run_dir,
        "the ZDS socket has a directory of its own"
    );
    let proxy_host_paths: Vec<&str> = proxy_spec["volumes"]
        .as_sequence()
        .expect("volumes")
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    assert_eq!(
        proxy_host_paths,
        [zds_dir.to_str().unwrap()],
        "the proxy mounts the ZDS socket's directory and no other host path"
    );
    assert!(
        proxy_host_paths.iter().all(|p| !run_dir.starts_with(p)),
        "the proxy can reach the agent's run dir {}",
        run_dir.display()
    );
    let containers: Vec<&Value> = [ds, &proxy_ds["spec"]["template"]["spec"]]
        .iter()
        .flat_map(|spec| spec["containers"].as_sequence().expect("containers"))
        .collect();
    assert_eq!(containers.len(), 2);
    for c in containers {
        let name = c["name"].as_str().expect("name");
        let sc = &c["securityContext"];
        assert_eq!(sc["privileged"].as_bool(), Some(false), "{name}");
        assert_eq!(strs(&sc["capabilities"]["drop"]), ["ALL"], "{name}");
        let wanted: &[&str] = match name {
            "agent" => &[
                "NET_ADMIN",
                "NET_RAW",
                "SYS_ADMIN",
                "SYS_PTRACE",
                "DAC_OVERRIDE",
            ],
            _ => &["NET_ADMIN", "SYS_ADMIN"],
        };
        assert_eq!(strs(&sc["capabilities"]["add"]), wanted, "{name}");
        // The proxy never runs another program: no escalation for it.
        let escalation = sc["allowPrivilegeEscalation"].as_bool();
        assert_eq!(escalation, Some(name == "agent"), "{name}");
        assert!(
            c["readinessProbe"]["httpGet"]["port"].as_u64().is_some(),
            "{name} has a readiness probe"
        );
        assert!(
            c["resources"]["requests"]["memory"].as_str().is_some(),
            "{name} requests memory"
        );
        // The agent, on the host network, binds its side ports to its pod's
        // IP (the node's), not to every host interface.
        if name == "agent" {
            let env = c["env"].as_sequence().expect("env");
            assert!(
                env.iter().any(|e| e["name"] == "POD_IP"
                    && e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"),
                "the agent is told its pod's IP"
            );
            assert!(
                env.iter()
                    .all(|e| !e["value"].as_str().unwrap_or("").contains("0.0.0.0")),
                "the agent binds nothing to every interface"
            );
        }
        // Every variable the chart sets is one the binary reads for that role.
        let help = stdout(Command::new(BIN).args([name, "--help"]));
        for e in c["env"].as_sequence().expect("env") {
            let var = e["name"].as_str().expect("env name");
            assert!(
                help.contains(&format!("env {var}")) || help.contains(&format!(", {var}")),
                "{name}: {var} is not an `ambit {name}` setting"
            );
        }
    }
}

fn podman_image_exists(name: &str) -> bool {
    Command::new("podman")
        .args(["image", "exists", name])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn home_dir(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(&std::env::var("HOME").expect("HOME")).join(default))
}

/// An image built from the Dockerfile with `features`, removed when dropped.
struct Image(String);

impl Drop for Image {
    fn drop(&mut self) {
        let _ = Command::new("podman").args(["rmi", "-f", &self.0]).output();
    }
}

/// Builds the Dockerfile (with `--build-arg FEATURES=<features>` when
/// given) on the local base images; `cache` under target/ keeps the build
/// stage's target dir between runs.
fn build_image(features: &str, cache: &str) -> Image {
    for image in [BASE, BUILDER] {
        assert!(
            podman_image_exists(image),
            "{image} is missing: run .ci/install-deps"
        );
    }
    let mut tag = format!("localhost/ambit:test-{}", std::process::id());
    if !features.is_empty() {
        tag = format!("{tag}-{features}");
    }
    let cache = repo().join("target").join(cache);
    std::fs::create_dir_all(&cache).expect("cache dir");
    let (rustup, cargo) = (
        home_dir("RUSTUP_HOME", ".rustup"),
        home_dir("CARGO_HOME", ".cargo"),
    );
    let started = std::time::Instant::now();
    run(tool("podman")
        .args(["build", "--network", "host", "-t", &tag])
        .args(["--build-arg", &format!("BUILD_IMAGE={BUILDER}")])
        .args(["--build-arg", &format!("BASE_IMAGE={BASE}")])
        .args(["--build-arg", &format!("FEATURES={features}")])
        // The host's Rust toolchain and crate cache stand in for the rust image.
        .arg("-v")
        .arg(format!("{}:/usr/local/rustup:ro", rustup.display()))
        .arg("-v")
        .arg(format!("{}:/usr/local/cargo", cargo.display()))
        .arg("-v")
        .arg(format!("{}:/src/target", cache.display()))
        .arg("."));
    eprintln!("image {tag} built in {:?}", started.elapsed());
    Image(tag)
}

/// `podman run` of `entrypoint` in `image` with `env`, without a network,
/// under the limits podman needs here; the caller adds the arguments.
fn podman_in(image: &Image, entrypoint: &str, env: &[&str]) -> Command {
    let mut cmd = tool("podman");
    cmd.args(["run", "--rm", "--network", "none"]).args(ULIMITS);
    for e in env {
        cmd.args(["-e", e]);
    }
    cmd.args(["--entrypoint", entrypoint, &image.0]);
    cmd
}

/// Runs `entrypoint args` in `image` with `env`: its stdout, or the test
/// fails with its output.
fn podman_run(image: &Image, entrypoint: &str, args: &[&str], env: &[&str]) -> String {
    stdout(podman_in(image, entrypoint, env).args(args))
}

/// `ambit version` in `image` under `env`: whether it ran, and what it said.
fn version_in(image: &Image, env: &[&str]) -> (bool, String) {
    let out = podman_in(image, "/usr/local/bin/ambit", env)
        .arg("version")
        .output()
        .expect("podman run");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}

/// The binary in `image` is static: the agent installs it on hosts of any
/// glibc as the CNI plugin.
fn assert_static(image: &Image) {
    let out = podman_in(image, "ldd", &[])
        .arg("/usr/local/bin/ambit")
        .output()
        .expect("ldd");
    let ldd =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        ldd.contains("not a dynamic executable") || ldd.contains("statically linked"),
        "ldd: {ldd}"
    );
}

/// What the Dockerfile adds on top of the base, in MB.
fn added_mb(image: &Image) -> u64 {
    let size = |image: &str| {
        stdout(tool("podman").args(["image", "inspect", "--format", "{{.Size}}", image]))
            .trim()
            .parse::<u64>()
            .expect("size")
    };
    (size(&image.0) - size(BASE)) / 1_000_000
}

#[test]
fn image_builds_from_the_dockerfile_and_every_role_answers_through_its_symlink() {
    let image = build_image("", "image");
    let podman_run =
        |entrypoint: &str, args: &[&str], env: &[&str]| podman_run(&image, entrypoint, args, env);
    let ours = stdout(Command::new(BIN).arg("version"));
    let theirs = podman_run("/usr/local/bin/ambit", &["version"], &[]);
    assert_eq!(
        theirs.split_whitespace().nth(1),
        ours.split_whitespace().nth(1),
        "image version: {theirs}"
    );
    for role in ["agent", "proxy", "control-plane"] {
        let help = podman_run(&format!("/usr/local/bin/ambit-{role}"), &["--help"], &[]);
        assert!(
            help.starts_with(&format!("ambit {role}: configuration keys")),
            "ambit-{role}: {help}"
        );
    }
    let node = podman_run("/usr/local/bin/ambit-node", &["--help"], &[]);
    assert!(node.starts_with("ambit node:"), "{node}");
    let cni = podman_run("/usr/local/bin/ambit-cni", &[], &["CNI_COMMAND=VERSION"]);
    let cni: serde_json::Value = serde_json::from_str(&cni).expect("CNI VERSION answer");
    assert!(cni["supportedVersions"]
        .as_array()
        .expect("versions")
        .iter()
        .any(|v| v == "1.1.0"));
    // The tools the agent runs are in the image.
    let tools = "iptables-restore ip6tables-restore iptables-legacy-restore ip6tables-legacy-restore nft ipset ip";
    podman_run(
        "sh",
        &[
            "-c",
            &format!("for t in {tools}; do command -v $t >/dev/null || {{ echo missing $t; exit 1; }}; done; iptables-restore --version"),
        ],
        &[],
    );
    assert_static(&image);
    // A default image has no FIPS module, and says so rather than run as
    // if it had one.
    let (ran, said) = version_in(&image, &["COMPLIANCE_POLICY=fips-140-3"]);
    assert!(!ran && said.contains("has no FIPS module"), "{said}");
    let added = added_mb(&image);
    eprintln!("image adds {added} MB to its base");
    assert!(added < 60, "the image adds {added} MB to its base");
}

/// The second flavour: `--build-arg FEATURES=fips`, every TLS and key
/// operation on aws-lc's FIPS 140-3 module. It takes Istio's FIPS
/// policies (a build without the module refuses them, as the test above
/// shows), and still links statically.
#[test]
fn the_fips_image_builds_and_takes_istio_s_fips_policy() {
    let image = build_image("fips", "image-fips");
    for policy in ["fips-140-3", "fips-140-2", "pqc", ""] {
        let (ran, said) = version_in(&image, &[&format!("COMPLIANCE_POLICY={policy}")]);
        assert!(ran, "COMPLIANCE_POLICY={policy}: {said}");
        assert!(said.starts_with("ambit "), "{said}");
    }
    assert_static(&image);
    let added = added_mb(&image);
    eprintln!("the FIPS image adds {added} MB to its base");
    assert!(added < 60, "the FIPS image adds {added} MB to its base");
}
