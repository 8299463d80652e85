//! The lab's topology: a "node" netns holding a bridge, "pods" as netns on
//! veths into it, each held by its sandbox process as kubelet leaves a pod
//! (`sandbox`), processes started inside them (proxies, iperf3 servers),
//! and CA roots on disk (a mesh root, and the control plane's serving root).
//! Everything is created under unique names and removed when the [`Lab`] is
//! dropped, panics included.

use std::io::{self, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::http_get;
use super::sandbox::{pod_uid, Sandboxes};
use crate::cni::redirect::{Backend, RedirectOptions, RedirectRules};
use crate::netns::Netns;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// The bridge subnet inside every lab (labs are isolated, so they can share it).
pub const SUBNET: &str = "10.77.0";
pub const BRIDGE: &str = "br0";

/// One pod of a lab.
#[derive(Debug, Clone)]
pub struct LabPod {
    pub name: String,
    pub netns_name: String,
    pub ip: Ipv4Addr,
    pub ns: Netns,
}

/// Another network of a lab: a netns of its own holding its own bridge,
/// with no route to or from the lab's first bridge. A pod on it reaches
/// the first network only through a pod attached to both ([`Lab::attach`]),
/// as another network's pods reach a mesh only through its gateway.
#[derive(Debug)]
pub struct LabNetwork {
    pub name: String,
    netns_name: String,
    /// The first three bytes of its /24, the bridge at `.1`.
    pub subnet: [u8; 3],
    /// The next host address to give.
    next: u8,
}

/// A single-host node of network namespaces.
pub struct Lab {
    pub id: String,
    pub dir: PathBuf,
    pub node: Netns,
    node_name: String,
    pods: Vec<LabPod>,
    /// Netns of the other networks and of their pods, removed at the end.
    others: Vec<String>,
    children: Mutex<Vec<(String, Child)>>,
    /// The processes holding pods' netns, in cgroups named by pod UID.
    sandboxes: Mutex<Sandboxes>,
    binary: PathBuf,
}

fn sh(cmd: &mut Command) -> io::Result<String> {
    let out = cmd.stdin(Stdio::null()).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str]) -> io::Result<String> {
    sh(Command::new("ip").args(args))
}

/// How to run a dedicated proxy in a pod.
#[derive(Debug, Clone)]
pub struct ProxySpec {
    pub config: PathBuf,
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    /// `ns/name/sa`
    pub workload_info: String,
    pub trust_domain: String,
    pub extra_env: Vec<(String, String)>,
}

impl Lab {
    /// A node netns with a bridge at `10.77.0.1/24`. `binary` is the `ambit` to run.
    pub fn new(tag: &str, binary: impl Into<PathBuf>) -> io::Result<Lab> {
        let id = format!(
            "ambit-{tag}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let dir = std::env::temp_dir().join(&id);
        std::fs::create_dir_all(&dir)?;
        let node_name = format!("{id}-node");
        ip(&["netns", "add", &node_name])?;
        let node = Netns::named(&node_name)?;
        let mut lab = Lab {
            sandboxes: Mutex::new(Sandboxes::new(&id)),
            id,
            dir,
            node,
            node_name: node_name.clone(),
            pods: Vec::new(),
            others: Vec::new(),
            children: Mutex::default(),
            binary: binary.into(),
        };
        let n = node_name.as_str();
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&["-n", n, "link", "add", BRIDGE, "type", "bridge"])?;
        ip(&[
            "-n",
            n,
            "addr",
            "add",
            &format!("{SUBNET}.1/24"),
            "dev",
            BRIDGE,
        ])?;
        ip(&["-n", n, "link", "set", BRIDGE, "up"])?;
        lab.pods.clear();
        Ok(lab)
    }

    /// Adds a pod netns on a veth into the bridge, with the next address,
    /// held by its sandbox as pod [`pod_uid`]`(name)`.
    pub fn add_pod(&mut self, name: &str) -> io::Result<LabPod> {
        let idx = self.pods.len() + 2;
        let netns_name = format!("{}-{name}", self.id);
        ip(&["netns", "add", &netns_name])?;
        self.hold(&netns_name, &pod_uid(name))?;
        let (n, p) = (self.node_name.as_str(), netns_name.as_str());
        let veth = format!("veth{idx}");
        let addr = Ipv4Addr::new(10, 77, 0, idx as u8);
        ip(&[
            "-n", n, "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", p,
        ])?;
        ip(&["-n", n, "link", "set", &veth, "master", BRIDGE, "up"])?;
        ip(&["-n", p, "addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
        ip(&["-n", p, "link", "set", "eth0", "up"])?;
        ip(&["-n", p, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            p,
            "route",
            "add",
            "default",
            "via",
            &format!("{SUBNET}.1"),
        ])?;
        let pod = LabPod {
            name: name.to_string(),
            netns_name: netns_name.clone(),
            ip: addr,
            ns: Netns::named(&netns_name)?,
        };
        self.pods.push(pod.clone());
        Ok(pod)
    }

    /// Another network, `subnet.0/24` on a bridge of its own (see
    /// [`LabNetwork`]).
    pub fn add_network(&mut self, name: &str, subnet: [u8; 3]) -> io::Result<LabNetwork> {
        let netns_name = format!("{}-net-{name}", self.id);
        ip(&["netns", "add", &netns_name])?;
        self.others.push(netns_name.clone());
        let n = netns_name.as_str();
        let [a, b, c] = subnet;
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&["-n", n, "link", "add", BRIDGE, "type", "bridge"])?;
        ip(&[
            "-n",
            n,
            "addr",
            "add",
            &format!("{a}.{b}.{c}.1/24"),
            "dev",
            BRIDGE,
        ])?;
        ip(&["-n", n, "link", "set", BRIDGE, "up"])?;
        Ok(LabNetwork {
            name: name.to_string(),
            netns_name,
            subnet,
            next: 2,
        })
    }

    /// A pod on `net`, as [`Lab::add_pod`] adds one on the first network.
    pub fn add_pod_on(&mut self, net: &mut LabNetwork, name: &str) -> io::Result<LabPod> {
        let netns_name = format!("{}-{}-{name}", self.id, net.name);
        ip(&["netns", "add", &netns_name])?;
        self.others.push(netns_name.clone());
        self.hold(&netns_name, &pod_uid(name))?;
        let addr = plug(net, &netns_name, "eth0")?;
        let gw = Ipv4Addr::from([net.subnet[0], net.subnet[1], net.subnet[2], 1]);
        ip(&["-n", &netns_name, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            &netns_name,
            "route",
            "add",
            "default",
            "via",
            &gw.to_string(),
        ])?;
        Ok(LabPod {
            name: name.to_string(),
            netns_name: netns_name.clone(),
            ip: addr,
            ns: Netns::named(&netns_name)?,
        })
    }

    /// A second interface (`eth1`) for `pod` on `net`, with the next
    /// address there (returned): the pod stands on both networks.
    pub fn attach(&self, pod: &LabPod, net: &mut LabNetwork) -> io::Result<Ipv4Addr> {
        plug(net, &pod.netns_name, "eth1")
    }

    /// Gives `pod` an IPv6 address too (`fd77::<n>/64`, `<n>` its IPv4
    /// address's last byte), the bridge `fd77::1` on first use: a dual-stack
    /// pod. Before its proxy starts, which learns the pod's addresses then.
    pub fn add_ipv6(&self, pod: &LabPod) -> io::Result<std::net::Ipv6Addr> {
        let n = self.node_name.as_str();
        let bridge = ip(&["-n", n, "-6", "addr", "show", "dev", BRIDGE])?;
        if !bridge.contains("fd77::1/64") {
            ip(&["-n", n, "addr", "add", "fd77::1/64", "dev", BRIDGE, "nodad"])?;
        }
        let addr: std::net::Ipv6Addr = format!("fd77::{}", pod.ip.octets()[3])
            .parse()
            .map_err(io::Error::other)?;
        let p = pod.netns_name.as_str();
        ip(&[
            "-n",
            p,
            "addr",
            "add",
            &format!("{addr}/64"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        ip(&["-n", p, "-6", "route", "add", "default", "via", "fd77::1"])?;
        Ok(addr)
    }

    /// Holds the netns named `netns_name` as kubelet leaves a pod's: by a
    /// process in a cgroup `.../kubepods/pod<uid>`, until [`Lab::release`]
    /// or the lab's end. The agent finds a pod without a CNI event only so.
    pub fn hold(&self, netns_name: &str, uid: &str) -> io::Result<()> {
        let ns = Netns::named(netns_name)?;
        self.sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .hold(netns_name, &ns, uid)
    }

    /// Ends the sandbox holding the netns named `netns_name`: its process
    /// is killed and its cgroup removed (the netns lives on while named).
    pub fn release(&self, netns_name: &str) {
        self.sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(netns_name);
    }

    /// Puts a pod's traffic under redirection (the agent's job on a real node).
    pub fn redirect(&self, pod: &LabPod) -> io::Result<()> {
        self.redirect_with(pod, Backend::Iptables)
    }

    /// [`Lab::redirect`], the rules written by `backend`.
    pub fn redirect_with(&self, pod: &LabPod, backend: Backend) -> io::Result<()> {
        let opts = RedirectOptions {
            dns_capture: false,
            bypass_inbound: false,
            ipv6: true,
            virtual_interfaces: Vec::new(),
            loopback_big_tcp: true,
            backend,
        };
        RedirectRules::new(opts)
            .apply(&pod.ns)
            .map_err(io::Error::other)
    }

    /// Spawns `cmd` (already set to run in some netns) and kills it when the lab ends.
    pub fn spawn(&self, label: &str, mut cmd: Command) -> io::Result<()> {
        let log = std::fs::File::create(self.log_path(label))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.children
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((label.to_string(), child));
        Ok(())
    }

    /// Starts `iperf3 -s` in `pod` (label `iperf3-<pod>`) and returns once it listens on 5201.
    pub fn start_iperf3_server(&self, pod: &LabPod) -> io::Result<()> {
        let mut cmd = pod.ns.command("iperf3");
        cmd.args(["-s", "-p", "5201"]);
        self.spawn(&format!("iperf3-{}", pod.name), cmd)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let ss = pod
                .ns
                .command("ss")
                .args(["-ltnH", "sport", "=", ":5201"])
                .output()?;
            if !ss.stdout.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("iperf3 -s in {} never listened", pod.name),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Where a spawned process's output goes.
    pub fn log_path(&self, label: &str) -> PathBuf {
        self.dir.join(format!("{label}.log"))
    }

    /// Stops a spawned process (SIGTERM, then SIGKILL).
    pub fn stop(&self, label: &str) {
        self.stop_within(label, Duration::from_secs(2));
    }

    /// [`Lab::stop`], waiting up to `grace` for the exit before SIGKILL.
    pub fn stop_within(&self, label: &str, grace: Duration) {
        let mut children = self.children.lock().unwrap_or_else(|e| e.into_inner());
        children.retain_mut(|(l, child)| {
            if l != label {
                return true;
            }
            stop_child(child, grace);
            false
        });
    }

    /// The pid of a spawned process.
    pub fn pid(&self, label: &str) -> Option<u32> {
        let children = self.children.lock().unwrap_or_else(|e| e.into_inner());
        children
            .iter()
            .find(|(l, _)| l == label)
            .map(|(_, c)| c.id())
    }

    /// Runs a dedicated `ambit proxy` inside `pod` and waits until it is ready.
    pub fn start_proxy(&self, pod: &LabPod, spec: &ProxySpec) -> io::Result<()> {
        self.start_proxy_from(&self.binary.clone(), pod, spec)
    }

    /// Runs `binary proxy` in dedicated mode inside `pod`, as
    /// [`Lab::start_proxy`] does: `binary` is `ambit` or another proxy that
    /// reads ztunnel's settings (`PROXY_MODE`, `LOCAL_XDS_PATH`,
    /// `PROXY_WORKLOAD_INFO`) and answers `/healthz/ready` on 15021, such as
    /// ztunnel itself, so that a bench can measure both in one run.
    pub fn start_proxy_from(
        &self,
        binary: &Path,
        pod: &LabPod,
        spec: &ProxySpec,
    ) -> io::Result<()> {
        self.start_proxy_waiting(binary, pod, spec, Duration::from_secs(20))
    }

    /// [`Lab::start_proxy_from`], waiting up to `wait` for it to be ready
    /// (a proxy taking a large mesh first takes longer than 20 s).
    pub fn start_proxy_waiting(
        &self,
        binary: &Path,
        pod: &LabPod,
        spec: &ProxySpec,
        wait: Duration,
    ) -> io::Result<()> {
        let mut cmd = pod.ns.command(binary);
        cmd.arg("proxy")
            .env("PROXY_MODE", "dedicated")
            .env("LOCAL_XDS_PATH", &spec.config)
            .env("PROXY_WORKLOAD_INFO", &spec.workload_info)
            .env("TRUST_DOMAIN", &spec.trust_domain)
            .env("AMBIT_CA_CERT", &spec.ca_cert)
            .env("AMBIT_CA_KEY", &spec.ca_key)
            .env(
                "AMBIT_STATE_DIR",
                self.dir.join(format!("state-{}", pod.name)),
            )
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            );
        for (k, v) in &spec.extra_env {
            cmd.env(k, v);
        }
        let label = format!("proxy-{}", pod.name);
        self.spawn(&label, cmd)?;
        let deadline = Instant::now() + wait;
        loop {
            if http_get(pod, "127.0.0.1:15021", "/healthz/ready")
                .map(|(s, _)| s == 200)
                .unwrap_or(false)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(self.log_path(&label)).unwrap_or_default();
                return Err(io::Error::other(format!(
                    "proxy in {} not ready within {wait:?}; log:\n{log}",
                    pod.name
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The `ambit` binary this lab runs.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    pub fn pods(&self) -> &[LabPod] {
        &self.pods
    }

    pub fn node_name(&self) -> &str {
        &self.node_name
    }
}

/// A veth from `net`'s bridge to `dev` in the netns `netns_name`, with
/// `net`'s next address (returned).
fn plug(net: &mut LabNetwork, netns_name: &str, dev: &str) -> io::Result<Ipv4Addr> {
    let [a, b, c] = net.subnet;
    let addr = Ipv4Addr::new(a, b, c, net.next);
    let veth = format!("veth{}", net.next);
    net.next = net
        .next
        .checked_add(1)
        .filter(|n| *n < 255)
        .ok_or_else(|| io::Error::other(format!("network {} is full", net.name)))?;
    let (n, p) = (net.netns_name.as_str(), netns_name);
    ip(&[
        "-n", n, "link", "add", &veth, "type", "veth", "peer", "name", dev, "netns", p,
    ])?;
    ip(&["-n", n, "link", "set", &veth, "master", BRIDGE, "up"])?;
    ip(&["-n", p, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
    ip(&["-n", p, "link", "set", dev, "up"])?;
    Ok(addr)
}

fn stop_child(child: &mut Child, grace: Duration) {
    // SAFETY: kill(2) on a pid we spawned and have not reaped yet.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Lab {
    fn drop(&mut self) {
        for (_, child) in self
            .children
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
        {
            stop_child(child, Duration::from_secs(2));
        }
        for pod in &self.pods {
            let _ = ip(&["netns", "del", &pod.netns_name]);
        }
        for netns in &self.others {
            let _ = ip(&["netns", "del", netns]);
        }
        let _ = ip(&["netns", "del", &self.node_name]);
        if std::env::var_os("AMBIT_KEEP_LAB").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Writes a PEM mesh CA (PKCS#8 key, mode 0600) into `dir`, returning (cert, key) paths.
pub fn write_ca(dir: &Path, name: &str, trust_domain: &str) -> io::Result<(PathBuf, PathBuf)> {
    let ca = crate::identity::LocalCa::generate(trust_domain).map_err(io::Error::other)?;
    write_root(dir, name, &ca)
}

/// Writes a PEM serving root for `ambit control-plane` (its TLS certificate's
/// issuer, what the proxies take as `xds_root_ca`) into `dir`, returning
/// (cert, key) paths. It is never a mesh root.
pub fn write_serving_ca(dir: &Path, name: &str) -> io::Result<(PathBuf, PathBuf)> {
    let ca = crate::identity::LocalCa::generate_serving().map_err(io::Error::other)?;
    write_root(dir, name, &ca)
}

fn write_root(
    dir: &Path,
    name: &str,
    ca: &crate::identity::LocalCa,
) -> io::Result<(PathBuf, PathBuf)> {
    use std::os::unix::fs::OpenOptionsExt;
    let (cert, key) = (
        dir.join(format!("{name}-cert.pem")),
        dir.join(format!("{name}-key.pem")),
    );
    std::fs::write(&cert, ca.root_pem())?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&key)?;
    f.write_all(ca.key_pem().as_bytes())?;
    Ok((cert, key))
}
