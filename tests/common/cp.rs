//! `ambit control-plane` in the lab: started on the node's address with a
//! serving root of its own and a bearer token, and dedicated proxies that
//! take their state and certificates from it alone.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ambit::lab::{write_serving_ca, LabPod, ProxySpec};

use super::{admin_get, Mesh, TD};

pub const CP: &str = "10.77.0.1:15012";

/// The control plane's serving root in the lab's directory, written on first
/// use: apart from the mesh root `m.ca`, as it must be.
pub fn serving_root(m: &Mesh) -> (PathBuf, PathBuf) {
    let (cert, key) = (
        m.lab.dir.join("serving-cert.pem"),
        m.lab.dir.join("serving-key.pem"),
    );
    if !cert.exists() {
        write_serving_ca(&m.lab.dir, "serving").unwrap();
    }
    (cert, key)
}

pub fn start_cp(m: &Mesh, label: &str) {
    let token = m.lab.dir.join("token");
    start_cp_with(m, label, ("AMBIT_CP_TOKEN_FILE", token.as_path()));
}

/// [`start_cp`] with the callers' tokens given by `token` (a key and a path).
pub fn start_cp_with(m: &Mesh, label: &str, token: (&str, &std::path::Path)) {
    let serving = serving_root(m);
    let mut cmd = m.lab.node.command(env!("CARGO_BIN_EXE_ambit"));
    cmd.arg("control-plane")
        .env("LOCAL_XDS_PATH", m.lab.dir.join("cp.yaml"))
        .env("AMBIT_CA_CERT", &m.ca.0)
        .env("AMBIT_CA_KEY", &m.ca.1)
        .env("AMBIT_CP_SERVING_CA_CERT", &serving.0)
        .env("AMBIT_CP_SERVING_CA_KEY", &serving.1)
        .env("AMBIT_CP_LISTEN", CP)
        .env("AMBIT_CP_TLS_SANS", "10.77.0.1")
        .env(token.0, token.1);
    m.lab.spawn(label, cmd).unwrap();
}

/// Starts the control plane ("cp") serving `mesh`, with the token `s3cret`.
pub fn serve_mesh(m: &Mesh, mesh: &str) {
    std::fs::write(m.lab.dir.join("token"), "s3cret\n").unwrap();
    std::fs::write(m.lab.dir.join("cp.yaml"), mesh).unwrap();
    start_cp(m, "cp");
    wait_for(
        &format!("the control plane listening on {CP}"),
        Duration::from_secs(20),
        || cp_listening(m),
    );
}

/// Whether something accepts TCP connections on [`CP`] in the node netns.
pub fn cp_listening(m: &Mesh) -> bool {
    let addr: std::net::SocketAddr = CP.parse().unwrap();
    m.lab
        .node
        .run(move || {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        })
        .unwrap_or(false)
}

pub fn proxy_via_cp(m: &Mesh, pod: &LabPod, sa: &str, token: &str) {
    proxy_via_cp_env(m, pod, sa, token, &[]).unwrap();
}

/// Like [`proxy_via_cp`], with extra environment (set last, so it wins);
/// returns the error of a proxy that never becomes ready.
pub fn proxy_via_cp_env(
    m: &Mesh,
    pod: &LabPod,
    sa: &str,
    token: &str,
    env: &[(&str, &str)],
) -> std::io::Result<()> {
    m.lab.redirect(pod).unwrap();
    let tok = m.lab.dir.join(format!("token-{}", pod.name));
    std::fs::write(&tok, token).unwrap();
    let spec = ProxySpec {
        // The local config and local CA are set too, and must be ignored for the control plane.
        config: m.lab.dir.join("does-not-exist.yaml"),
        ca_cert: m.lab.dir.join("nope.pem"),
        ca_key: m.lab.dir.join("nope.pem"),
        workload_info: format!("default/{}/{sa}", pod.name),
        trust_domain: TD.into(),
        extra_env: vec![
            ("XDS_ADDRESS".into(), format!("https://{CP}")),
            ("CA_ADDRESS".into(), format!("https://{CP}")),
            (
                "XDS_ROOT_CA".into(),
                serving_root(m).0.display().to_string(),
            ),
            ("AMBIT_MESH_ROOT_CA".into(), m.ca.0.display().to_string()),
            ("AUTH_TOKEN".into(), tok.display().to_string()),
            ("SECRET_TTL".into(), "10s".into()),
        ]
        .into_iter()
        .chain(env.iter().map(|(k, v)| (k.to_string(), v.to_string())))
        .collect(),
    };
    m.lab.start_proxy(pod, &spec)
}

/// The proxy's `/config_dump`; panics unless it answers 200, so a failed
/// admin call never passes for a dump that lacks something.
pub fn dump(pod: &LabPod) -> String {
    admin_get(&pod.ns, "127.0.0.1:15000", "/config_dump")
}

pub fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what} not within {limit:?}");
        std::thread::sleep(Duration::from_millis(25));
    }
    t.elapsed()
}
