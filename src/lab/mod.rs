//! A node on this host made of network namespaces, for the demo, the
//! end-to-end tests and the benchmarks: a "node" netns holding a bridge, and
//! "pods" as netns on veths into it. Everything is created under unique names
//! and removed when the [`Lab`] is dropped, panics included, so labs can run
//! side by side and leave nothing behind.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cni::redirect::{RedirectOptions, RedirectRules};
use crate::netns::Netns;

pub mod kubeapi;
pub mod node;

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

/// A single-host node of network namespaces.
pub struct Lab {
    pub id: String,
    pub dir: PathBuf,
    pub node: Netns,
    node_name: String,
    pods: Vec<LabPod>,
    children: Mutex<Vec<(String, Child)>>,
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
            id,
            dir,
            node,
            node_name: node_name.clone(),
            pods: Vec::new(),
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

    /// Adds a pod netns on a veth into the bridge, with the next address.
    pub fn add_pod(&mut self, name: &str) -> io::Result<LabPod> {
        let idx = self.pods.len() + 2;
        let netns_name = format!("{}-{name}", self.id);
        ip(&["netns", "add", &netns_name])?;
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

    /// Puts a pod's traffic under redirection (the agent's job on a real node).
    pub fn redirect(&self, pod: &LabPod) -> io::Result<()> {
        let opts = RedirectOptions {
            dns_capture: false,
            bypass_inbound: false,
            ipv6: true,
            virtual_interfaces: Vec::new(),
            loopback_big_tcp: true,
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
        let mut children = self.children.lock().unwrap_or_else(|e| e.into_inner());
        children.retain_mut(|(l, child)| {
            if l != label {
                return true;
            }
            stop_child(child);
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
        let mut cmd = pod.ns.command(&self.binary);
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
        let deadline = Instant::now() + Duration::from_secs(20);
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
                    "proxy in {} not ready within 20s; log:\n{log}",
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

fn stop_child(child: &mut Child) {
    // SAFETY: kill(2) on a pid we spawned and have not reaped yet.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(2);
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
            stop_child(child);
        }
        for pod in &self.pods {
            let _ = ip(&["netns", "del", &pod.netns_name]);
        }
        let _ = ip(&["netns", "del", &self.node_name]);
        if std::env::var_os("AMBIT_KEEP_LAB").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A one-shot HTTP/1.0 GET from inside `pod`; returns (status, body).
pub fn http_get(pod: &LabPod, addr: &str, path: &str) -> io::Result<(u16, String)> {
    http_get_in(&pod.ns, addr, path)
}

/// A one-shot HTTP/1.0 GET from inside `ns`; returns (status, body).
pub fn http_get_in(ns: &Netns, addr: &str, path: &str) -> io::Result<(u16, String)> {
    http_request_in(ns, "GET", addr, path)
}

/// A one-shot HTTP/1.0 request without a body from inside `ns`; returns (status, body).
pub fn http_request_in(
    ns: &Netns,
    method: &str,
    addr: &str,
    path: &str,
) -> io::Result<(u16, String)> {
    let addr: SocketAddr = addr.parse().map_err(io::Error::other)?;
    let (path, method) = (path.to_string(), method.to_string());
    ns.run(move || -> io::Result<(u16, String)> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            s,
            "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n"
        )?;
        let mut resp = String::new();
        s.read_to_string(&mut resp)?;
        let status = resp
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = resp
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Ok((status, body))
    })?
}

/// `iptables-save` inside `ns`: the IPv4 rules in force there.
pub fn iptables_save(ns: &Netns) -> String {
    ns.command("iptables-save")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// How many lines of the pod's IPv4 rules are Istio's (0: not captured).
pub fn istio_rules(pod: &LabPod) -> usize {
    iptables_save(&pod.ns)
        .lines()
        .filter(|l| l.contains("ISTIO"))
        .count()
}

/// Connects from inside `pod` (the socket stays in the pod's netns).
pub fn connect_from(pod: &LabPod, addr: SocketAddr) -> io::Result<TcpStream> {
    pod.ns
        .run(move || TcpStream::connect_timeout(&addr, Duration::from_secs(5)))?
}

/// A server for short connections inside `pod`, as an HTTP/1.0 server
/// behaves: per connection, echoes one byte and closes first. One connection
/// at a time, so its own cost is small and the same on every path.
pub fn close_first_echo(pod: &LabPod, port: u16) -> io::Result<SocketAddr> {
    let listener = pod.ns.run(move || TcpListener::bind(("0.0.0.0", port)))??;
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        for mut conn in listener.incoming().flatten() {
            let _ = conn.set_nodelay(true);
            if conn.read_exact(&mut b).is_ok() {
                let _ = conn.write_all(&b);
            }
        }
    });
    Ok(SocketAddr::new(pod.ip.into(), port))
}

/// How a short connection should end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ends {
    /// A [`close_first_echo`]: one byte echoed, then the server's close.
    Echo,
    /// Nothing listens there: the pod's proxy accepts the connection, takes
    /// the byte sent, and ends it with nothing back (an end of stream).
    Closed,
}

/// What a run of [`short_connections`] met.
#[derive(Debug, Clone, Copy)]
pub struct ShortRun {
    /// SYNs the pod's kernel had to send again (`TcpExt.TCPSynRetrans`).
    pub syn_retries: u64,
    /// Resets the pod's kernel sent to abort a connection ([`aborts`]): its
    /// own proxy's sockets, in dedicated and shared mode alike, live there.
    pub aborts: u64,
    pub slowest_connect: Duration,
}

/// One short connection to `dst` from the calling thread's netns: connect,
/// send a byte, and check it ends as `ends` says. Returns how long the
/// connect took; an error names what went otherwise.
pub fn short_connection(dst: SocketAddr, ends: Ends) -> io::Result<Duration> {
    let t = Instant::now();
    let mut s = TcpStream::connect_timeout(&dst, Duration::from_secs(5))?;
    let took = t.elapsed();
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"x")?;
    let mut b = [0u8; 2];
    let ended = match ends {
        Ends::Echo => (s.read(&mut b)?, s.read(&mut b)?) == (1, 0),
        Ends::Closed => s.read(&mut b)? == 0,
    };
    if ended {
        Ok(took)
    } else {
        Err(io::Error::other(format!("did not end as {ends:?}")))
    }
}

/// Opens `n` [`short_connection`]s from `pod`, one after another, cycling
/// through `targets`. The application's kernel picks each source port
/// knowing only its own destinations, while a proxy's side of every
/// captured connection is 127.0.0.1:15001.
pub fn short_connections(
    pod: &LabPod,
    targets: &[(SocketAddr, Ends)],
    n: usize,
) -> io::Result<ShortRun> {
    let targets = targets.to_vec();
    pod.ns.run(move || {
        let before = tcp_ext("TCPSynRetrans")?;
        let aborted_before = aborts_here()?;
        let mut slowest_connect = Duration::ZERO;
        for (i, &(dst, ends)) in targets.iter().cycle().take(n).enumerate() {
            let took = short_connection(dst, ends).map_err(|e| {
                io::Error::new(e.kind(), format!("connection {i} to {dst} ({ends:?}): {e}"))
            })?;
            slowest_connect = slowest_connect.max(took);
        }
        Ok(ShortRun {
            syn_retries: tcp_ext("TCPSynRetrans")? - before,
            aborts: aborts_here()? - aborted_before,
            slowest_connect,
        })
    })?
}

/// Resets `pod`'s kernel sent to abort connections: closed with data unread
/// (`TCPAbortOnClose`), data arriving after the close (`TCPAbortOnData`),
/// or `SO_LINGER` 0 (`TCPAbortOnLinger`). A reset read after an end of
/// stream goes unseen by the reader; these count it.
pub fn aborts(pod: &LabPod) -> io::Result<u64> {
    pod.ns.run(aborts_here)?
}

fn aborts_here() -> io::Result<u64> {
    Ok(tcp_ext("TCPAbortOnClose")? + tcp_ext("TCPAbortOnData")? + tcp_ext("TCPAbortOnLinger")?)
}

/// A `TcpExt` counter of the calling thread's netns.
fn tcp_ext(name: &str) -> io::Result<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/net/netstat")?;
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (keys, values) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""));
    keys.split_whitespace()
        .position(|k| k == name)
        .and_then(|at| values.split_whitespace().nth(at)?.parse().ok())
        .ok_or_else(|| io::Error::other(format!("no TcpExt {name}")))
}

/// An established TCP connection as `ss` shows it.
#[derive(Debug, Clone)]
pub struct Established {
    /// Owned by an `ambit` process (the proxy), not the application.
    pub proxy: bool,
    pub local: String,
    pub peer: String,
    /// Its congestion control algorithm, e.g. `cubic`.
    pub congestion_control: String,
}

/// Sets `pod`'s default TCP congestion control: what its applications'
/// sockets get.
pub fn set_default_congestion_control(pod: &LabPod, algorithm: &str) -> io::Result<()> {
    let set = pod
        .ns
        .command("sysctl")
        .args([
            "-qw",
            &format!("net.ipv4.tcp_congestion_control={algorithm}"),
        ])
        .status()?;
    if !set.success() {
        return Err(io::Error::other(format!("sysctl: {set}")));
    }
    Ok(())
}

/// The established TCP connections in `pod` (`ss -HOtnpi`, one line each).
pub fn established(pod: &LabPod) -> io::Result<Vec<Established>> {
    let out = pod
        .ns
        .command("ss")
        .args(["-HOtnpi", "state", "established"])
        .output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!("ss: {out:?}")));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .map(|line| {
            // Recv-Q Send-Q Local Peer [users:((..))] <algorithm> <details>...
            let f: Vec<&str> = line.split_whitespace().collect();
            let field = |i: usize| {
                f.get(i)
                    .map(|s| s.to_string())
                    .ok_or_else(|| io::Error::other(format!("ss line too short: {line}")))
            };
            let algorithm = f.iter().skip(4).find(|t| !t.starts_with("users:"));
            Ok(Established {
                proxy: line.contains("((\"ambit\""),
                local: field(2)?,
                peer: field(3)?,
                congestion_control: algorithm.map(|s| s.to_string()).unwrap_or_default(),
            })
        })
        .collect()
}

/// The TIME_WAITs on local port `port` in `pod` once they stop going away
/// (a proxy removes the last one just after the application's close), or
/// after 3 s: `ss` lines, empty when there are none.
pub fn time_waits(pod: &LabPod, port: u16) -> io::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let out = pod
            .ns
            .command("ss")
            .args([
                "-Htan",
                "state",
                "time-wait",
                &format!("( sport = :{port} )"),
            ])
            .output()?;
        let held = String::from_utf8_lossy(&out.stdout).into_owned();
        if held.trim().is_empty() || Instant::now() > deadline {
            return Ok(held);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What one `iperf3 -c` run moved.
#[derive(Debug, Clone, Copy)]
pub struct Iperf {
    /// Gbit/s received, over the test time.
    pub gbps: f64,
    /// Gbit received in all.
    pub gbit: f64,
}

/// Runs `iperf3 -c server -t secs -J` (plus `extra`) from `client`; an error
/// carries iperf3's own reason.
pub fn iperf3(client: &LabPod, server: Ipv4Addr, secs: u64, extra: &[&str]) -> io::Result<Iperf> {
    let out = client
        .ns
        .command("iperf3")
        .args(["-c", &server.to_string(), "-t", &secs.to_string(), "-J"])
        .args(extra)
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        io::Error::other(format!(
            "iperf3 output is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        ))
    })?;
    let received = &v["end"]["sum_received"];
    match (
        received["bits_per_second"].as_f64(),
        received["bytes"].as_f64(),
    ) {
        (Some(bps), Some(bytes)) => Ok(Iperf {
            gbps: bps / 1e9,
            gbit: bytes * 8.0 / 1e9,
        }),
        _ => Err(io::Error::other(format!("iperf3: {}", v["error"]))),
    }
}

/// An echo application inside a pod: sends back every byte, records who connected.
pub struct EchoServer {
    pub addr: SocketAddr,
    peers: Arc<Mutex<Vec<SocketAddr>>>,
}

impl EchoServer {
    pub fn start(pod: &LabPod, port: u16) -> io::Result<EchoServer> {
        let listener = pod.ns.run(move || TcpListener::bind(("0.0.0.0", port)))??;
        let addr = SocketAddr::new(pod.ip.into(), port);
        let peers: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
        let seen = peers.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                if let Ok(p) = conn.peer_addr() {
                    seen.lock().unwrap_or_else(|e| e.into_inner()).push(p);
                }
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        match conn.read(&mut buf) {
                            Ok(0) | Err(_) => {
                                let _ = conn.shutdown(std::net::Shutdown::Write);
                                return;
                            }
                            Ok(n) => {
                                if conn.write_all(&buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        Ok(EchoServer { addr, peers })
    }

    /// Peers that connected so far.
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Sends `payload`, half-closes, and reads everything back.
pub fn echo_roundtrip(stream: &mut TcpStream, payload: &[u8]) -> io::Result<Vec<u8>> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut writer = stream.try_clone()?;
    let data = payload.to_vec();
    let w = std::thread::spawn(move || -> io::Result<()> {
        writer.write_all(&data)?;
        writer.shutdown(std::net::Shutdown::Write)
    });
    let mut back = Vec::new();
    stream.read_to_end(&mut back)?;
    w.join()
        .map_err(|_| io::Error::other("writer panicked"))??;
    Ok(back)
}

/// Writes a PEM CA (PKCS#8 key, mode 0600) into `dir`, returning (cert, key) paths.
pub fn write_ca(dir: &Path, name: &str, trust_domain: &str) -> io::Result<(PathBuf, PathBuf)> {
    use std::os::unix::fs::OpenOptionsExt;
    let ca = crate::identity::LocalCa::generate(trust_domain).map_err(io::Error::other)?;
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

/// Runs a CNI conflist for one container exactly as a runtime does: ADD runs
/// the plugins in order, each getting the previous result as `prevResult`
/// (plus the list's `name` and `cniVersion`); DEL runs them in reverse. The
/// plugins run inside `node` (where the bridge lives). Returns the last result.
pub struct CniCall<'a> {
    pub node: &'a Netns,
    pub conflist: &'a serde_json::Value,
    pub cni_path: &'a str,
    pub container_id: &'a str,
    pub netns_path: &'a Path,
    pub cni_args: &'a str,
}

impl CniCall<'_> {
    pub fn run(&self, command: &str) -> io::Result<serde_json::Value> {
        let plugins = self.conflist["plugins"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let ordered: Vec<_> = if command == "DEL" {
            plugins.into_iter().rev().collect()
        } else {
            plugins
        };
        let mut prev: Option<serde_json::Value> = None;
        for plugin in ordered {
            let ty = plugin["type"].as_str().unwrap_or_default().to_string();
            let mut conf = plugin.clone();
            conf["name"] = self.conflist["name"].clone();
            conf["cniVersion"] = self.conflist["cniVersion"].clone();
            if let Some(p) = &prev {
                conf["prevResult"] = p.clone();
            }
            let exe = self
                .cni_path
                .split(':')
                .map(|d| Path::new(d).join(&ty))
                .find(|p| p.exists())
                .ok_or_else(|| {
                    io::Error::other(format!("plugin {ty} not found in {}", self.cni_path))
                })?;
            let mut child = self
                .node
                .command(&exe)
                .env("CNI_COMMAND", command)
                .env("CNI_CONTAINERID", self.container_id)
                .env("CNI_NETNS", self.netns_path)
                .env("CNI_IFNAME", "eth0")
                .env("CNI_PATH", self.cni_path)
                .env("CNI_ARGS", self.cni_args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?;
            child
                .stdin
                .take()
                .map(|mut i| i.write_all(conf.to_string().as_bytes()))
                .transpose()?;
            let out = child.wait_with_output()?;
            if !out.status.success() {
                return Err(io::Error::other(format!(
                    "{ty} {command} failed ({}): {} {}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            if command == "ADD" {
                prev = Some(
                    serde_json::from_slice(&out.stdout)
                        .map_err(|e| io::Error::other(format!("{ty} result: {e}")))?,
                );
            }
        }
        Ok(prev.unwrap_or(serde_json::Value::Null))
    }
}

/// Resident memory of a process in kB (`/proc/<pid>/status` VmRSS; 0 if unknown).
pub fn rss_kb(pid: u32) -> u64 {
    status_kb(pid, "VmRSS")
}

/// The private (anonymous) part of [`rss_kb`], `RssAnon`: what one more such
/// process costs, where the rest is the binary's pages, shared with others.
pub fn anon_kb(pid: u32) -> u64 {
    status_kb(pid, "RssAnon")
}

fn status_kb(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.split(':').next() == Some(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}
