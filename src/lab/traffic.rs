//! Traffic drivers: clients and servers that run inside a lab pod's netns
//! (HTTP/1.0 requests, echo servers, short connections, iperf3) and report
//! what a user would see: bytes back, status codes, durations, rates.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::probes::{aborts_here, tcp_ext};
use super::LabPod;
use crate::netns::Netns;

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
        // One write: `write!` on a socket sends each formatted piece apart,
        // and a server that reads one segment and closes (the floor proxy's
        // readiness port) then closes with the rest unread, a reset that
        // loses its answer.
        let request =
            format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n");
        s.write_all(request.as_bytes())?;
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
        Self::start_on(
            pod,
            SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), port),
        )
    }

    /// [`EchoServer::start`] on `bind` (`[::]:port` serves both families).
    pub fn start_on(pod: &LabPod, bind: SocketAddr) -> io::Result<EchoServer> {
        let listener = pod.ns.run(move || TcpListener::bind(bind))??;
        let addr = SocketAddr::new(pod.ip.into(), bind.port());
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

/// Threads that keep the CPUs busy at the lowest priority, as other pods
/// keep a node's: on an idle VM a round trip waits mostly for halted
/// vCPUs to wake (direct's p50 fell from ~83 to 11 µs with two of these,
/// 2026-12-01), which hides the proxies' own costs.
pub struct BusyLoops {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl BusyLoops {
    pub fn start(n: usize) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    // SAFETY: sets this thread's own nice value (Linux keeps
                    // it per thread).
                    unsafe {
                        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
                    }
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        BusyLoops { stop, threads }
    }
}

impl Drop for BusyLoops {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
