//! Removing the TIME_WAIT an outbound connection leaves on the proxy's side
//! when the destination closes first.
//!
//! Istio's in-pod rules REDIRECT every outbound TCP connection to
//! 127.0.0.1:15001, so the proxy's side of all of them shares one local
//! address and port, whatever the application's destination. When the
//! destination closes first, the proxy closes first towards the application
//! and keeps that connection's TIME_WAIT for 60 s. The application's kernel
//! picks its next source port from its own view (its real destination), so
//! under a stream of short connections it soon reuses a port whose TIME_WAIT
//! the proxy holds from a connection to another destination. That SYN's
//! sequence number and timestamp come from another destination's clock, the
//! TIME_WAIT refuses it (PAWS), and the application's `connect` waits for a
//! retried SYN: about 10 ms, or a whole second when the kernel rate-limits
//! its answer. Measured in the bench's lab: with TIME_WAITs building up,
//! short passthrough connections fell from 3,700/s to 450/s, with 1 s stalls.
//!
//! The connection runs over the pod's loopback, where no segment arrives late
//! or twice, so its TIME_WAIT guards nothing: the proxy removes it with
//! `SOCK_DESTROY` (sock_diag; Linux 6.0+ for TIME_WAIT sockets, with
//! `CONFIG_INET_DIAG_DESTROY` and `CAP_NET_ADMIN` in the pod's netns). Where
//! the kernel refuses, the proxy says so once and leaves TIME_WAIT as it is.
//!
//! `SOCK_DESTROY` finds a socket by its addresses and cookie whatever its
//! state, so the proxy asks only once its own socket is closed (`TCP_CLOSE`):
//! the one socket left with that cookie is then the TIME_WAIT.

use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::Mutex;

use socket2::{SockRef, Socket};

/// `SOCK_DESTROY` from `<linux/sock_diag.h>`.
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const TCP_TIME_WAIT: u32 = 6;
const TCP_CLOSE: u8 = 7;

/// A pod's sock_diag socket; `None` once the kernel has refused, so a
/// kernel or pod without the means costs nothing after the first try.
#[derive(Debug)]
pub struct Reaper {
    /// The pod, `namespace/name`, for the warnings.
    pod: String,
    sock: Mutex<Option<Socket>>,
}

impl Reaper {
    /// Opens the sock_diag socket (inside the pod's netns: `make` runs there).
    pub fn open(pod: String, make: impl FnOnce() -> io::Result<Socket>) -> Self {
        // Non-blocking: the answer is queued within `send`; never wait for it.
        let sock = make()
            .and_then(|s| s.set_nonblocking(true).map(|_| s))
            .inspect_err(|e| tracing::warn!(pod = %pod, error = %e, "no sock_diag socket: outbound connections the destination closes first keep their TIME_WAIT"))
            .ok();
        Reaper {
            pod,
            sock: Mutex::new(sock),
        }
    }

    /// Removes the TIME_WAIT of `conn`, the proxy's side of a connection
    /// from `peer`, if it is in one. `cookie` is `conn`'s `SO_COOKIE`, read
    /// while it was open (its TIME_WAIT keeps it): without it, a lookup that
    /// finds no TIME_WAIT falls back to the listener on the same address,
    /// and the kernel would destroy that instead.
    pub fn remove(&self, conn: &impl AsFd, peer: SocketAddr, cookie: u64) {
        let conn = SockRef::from(conn);
        if tcp_state(conn.as_raw_fd()).ok() != Some(TCP_CLOSE) {
            return; // still open, or closing passively: no TIME_WAIT of ours
        }
        // A closed socket still knows its own address: asked only here,
        // not for every connection.
        let Some(local) = conn.local_addr().ok().and_then(|a| a.as_socket()) else {
            return;
        };
        let mut guard = self.sock.lock().unwrap_or_else(|e| e.into_inner());
        let Some(sock) = guard.as_ref() else { return };
        match destroy(sock, local, peer, cookie) {
            Ok(()) => {}
            // Gone already (the application's RST, or the close was passive),
            // or the tuple now belongs to another socket (ESTALE: not ours).
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESTALE)) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP)) => {
                tracing::warn!(pod = %self.pod, error = %e, "this kernel cannot remove TIME_WAIT sockets (SOCK_DESTROY on TIME_WAIT needs Linux 6.0 and CONFIG_INET_DIAG_DESTROY): short outbound connections may stall on reused ports");
                *guard = None;
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES)) => {
                tracing::warn!(pod = %self.pod, error = %e, "no permission to remove TIME_WAIT sockets (SOCK_DESTROY needs CAP_NET_ADMIN in the pod's netns): short outbound connections may stall on reused ports");
                *guard = None;
            }
            // Anything else (no memory, a lost answer) is this time only.
            Err(e) => tracing::debug!(error = %e, "TIME_WAIT not removed"),
        }
    }
}

/// The kernel's TCP state of `fd` (`tcpi_state`, the first byte of `TCP_INFO`).
pub(crate) fn tcp_state(fd: RawFd) -> io::Result<u8> {
    let mut state = 0u8;
    let mut len: libc::socklen_t = 1;
    // SAFETY: getsockopt writes at most `len` (1) bytes into `state`; the
    // kernel copies a prefix of `struct tcp_info`, whose first field is the state.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut state as *mut u8).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(state)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sends one `SOCK_DESTROY` for a TCP TIME_WAIT and reads the kernel's answer.
fn destroy(sock: &Socket, local: SocketAddr, peer: SocketAddr, cookie: u64) -> io::Result<()> {
    let req = request(local, peer, cookie)?;
    sock.send(&req)?;
    // The kernel answers within the send: the reply is already queued.
    let mut reply = [0u8; 256];
    let n = (&*sock).read(&mut reply)?;
    answer(&reply[..n])
}

/// An IPv4-mapped IPv6 address as IPv4 (a dual-stack listener's v4 peers).
fn plain(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The request: `nlmsghdr` then `inet_diag_req_v2` for the socket whose
/// source is `local` (the proxy's side), destination `peer` and cookie `cookie`.
fn request(local: SocketAddr, peer: SocketAddr, cookie: u64) -> io::Result<Vec<u8>> {
    let (src, dst) = (plain(local.ip()), plain(peer.ip()));
    let family = match (src, dst) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
        _ => {
            return Err(io::Error::other(
                "local and peer addresses of different families",
            ))
        }
    };
    let addr = |ip: IpAddr| -> [u8; 16] {
        let mut a = [0u8; 16];
        match ip {
            IpAddr::V4(v4) => a[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => a = v6.octets(),
        }
        a
    };
    let mut m = Vec::with_capacity(72);
    m.extend_from_slice(&72u32.to_ne_bytes()); // nlmsg_len
    m.extend_from_slice(&SOCK_DESTROY.to_ne_bytes());
    m.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16).to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes()); // seq
    m.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel
    m.push(family as u8);
    m.push(libc::IPPROTO_TCP as u8);
    m.push(0); // no extensions
    m.push(0); // pad
               // Ignored by SOCK_DESTROY (it matches any state); the cookie and the
               // TCP_CLOSE check in `remove` are what pick the TIME_WAIT.
    m.extend_from_slice(&(1u32 << TCP_TIME_WAIT).to_ne_bytes());
    m.extend_from_slice(&local.port().to_be_bytes());
    m.extend_from_slice(&peer.port().to_be_bytes());
    m.extend_from_slice(&addr(src));
    m.extend_from_slice(&addr(dst));
    m.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    m.extend_from_slice(&(cookie as u32).to_ne_bytes());
    m.extend_from_slice(&((cookie >> 32) as u32).to_ne_bytes());
    debug_assert_eq!(m.len(), 72);
    Ok(m)
}

/// The kernel's answer: an `NLMSG_ERROR` whose code is 0 (done) or `-errno`.
fn answer(reply: &[u8]) -> io::Result<()> {
    let field = |at: usize| reply.get(at..at + 4).map(|b| [b[0], b[1], b[2], b[3]]);
    let kind = reply.get(4..6).map(|b| u16::from_ne_bytes([b[0], b[1]]));
    match (kind, field(16).map(i32::from_ne_bytes)) {
        (Some(NLMSG_ERROR), Some(0)) => Ok(()),
        (Some(NLMSG_ERROR), Some(code)) => Err(io::Error::from_raw_os_error(-code)),
        _ => Err(io::Error::other("unexpected sock_diag answer")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_names_the_proxys_side_as_source_in_network_order() {
        let local: SocketAddr = "[::ffff:127.0.0.1]:15001".parse().unwrap();
        let peer: SocketAddr = "[::ffff:10.1.2.3]:40000".parse().unwrap();
        let m = request(local, peer, 0x1122_3344_5566_7788).unwrap();
        assert_eq!(m.len(), 72);
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), SOCK_DESTROY);
        assert_eq!(
            m[16],
            libc::AF_INET as u8,
            "v4-mapped peers are asked as IPv4"
        );
        assert_eq!(m[17], libc::IPPROTO_TCP as u8);
        assert_eq!(u32::from_ne_bytes([m[20], m[21], m[22], m[23]]), 1 << 6);
        assert_eq!(&m[24..26], &15001u16.to_be_bytes());
        assert_eq!(&m[26..28], &40000u16.to_be_bytes());
        assert_eq!(&m[28..32], &[127, 0, 0, 1]);
        assert_eq!(&m[44..48], &[10, 1, 2, 3]);
        let half = |at: usize| u32::from_ne_bytes([m[at], m[at + 1], m[at + 2], m[at + 3]]);
        assert_eq!(
            (half(64), half(68)),
            (0x5566_7788, 0x1122_3344),
            "cookie, low half first"
        );

        let v6 = request(
            "[fd00::1]:15001".parse().unwrap(),
            "[fd00::2]:5".parse().unwrap(),
            1,
        );
        assert_eq!(v6.unwrap()[16], libc::AF_INET6 as u8);
        assert!(request(
            "1.2.3.4:1".parse().unwrap(),
            "[fd00::2]:5".parse().unwrap(),
            1
        )
        .is_err());
    }

    #[test]
    fn answers_read_as_done_or_the_kernels_errno() {
        let reply = |code: i32| {
            let mut r = vec![0u8; 36];
            r[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
            r[16..20].copy_from_slice(&code.to_ne_bytes());
            r
        };
        assert!(answer(&reply(0)).is_ok());
        let e = answer(&reply(-libc::ENOENT)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        assert!(
            answer(&[1, 2, 3]).is_err(),
            "short garbage is an error, not a panic"
        );
    }

    /// Through the kernel: a real TIME_WAIT on loopback is removed; asking
    /// again finds nothing, and never the listener on the same port. IPv4,
    /// IPv6, and IPv4 through a dual-stack listener (v4-mapped addresses).
    #[test]
    fn a_time_wait_the_proxy_holds_is_removed_and_the_listener_stays() {
        remove_a_time_wait("127.0.0.1:0".parse().unwrap(), None);
        remove_a_time_wait("[::1]:0".parse().unwrap(), None);
        remove_a_time_wait(
            "[::]:0".parse().unwrap(),
            Some("127.0.0.1".parse().unwrap()),
        );
    }

    /// `bind` for the listener; the client dials `dial`, or the listener's own address.
    fn remove_a_time_wait(bind: SocketAddr, dial: Option<IpAddr>) {
        let sock = Socket::new(
            socket2::Domain::from(libc::AF_NETLINK),
            socket2::Type::DGRAM,
            Some(socket2::Protocol::from(libc::NETLINK_SOCK_DIAG)),
        )
        .unwrap();
        let listener = std::net::TcpListener::bind(bind).unwrap();
        let at = listener.local_addr().unwrap();
        let at = SocketAddr::new(dial.unwrap_or(at.ip()), at.port());
        let mut client = std::net::TcpStream::connect(at).unwrap();
        let (server, peer) = listener.accept().unwrap();
        let cookie = socket2::SockRef::from(&server).cookie().unwrap();
        let reaper = Reaper {
            pod: "default/test".into(),
            sock: Mutex::new(Some(sock)),
        };
        reaper.remove(&server, peer, cookie);
        assert_eq!(
            tcp_state(server.as_raw_fd()).unwrap(),
            1,
            "an open connection is left alone"
        );
        // The "proxy" (server) closes first; the client's close then puts it
        // in TIME_WAIT while the proxy still holds its descriptor.
        server.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(client.read(&mut [0u8; 1]).unwrap(), 0);
        drop(client);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while tcp_state(server.as_raw_fd()).unwrap() != TCP_CLOSE {
            assert!(std::time::Instant::now() < deadline, "no TIME_WAIT formed");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let guard = reaper.sock.lock().unwrap();
        let sock = guard.as_ref().unwrap();
        if let Err(e) = destroy(sock, at, peer, cookie) {
            panic!("{e} (EOPNOTSUPP: the kernel lacks TIME_WAIT destroy, Linux 6.0+)");
        }
        let again = destroy(sock, at, peer, cookie).unwrap_err();
        assert!(
            matches!(again.raw_os_error(), Some(libc::ENOENT | libc::ESTALE)),
            "{again}"
        );
        drop(guard);
        reaper.remove(&server, peer, cookie);
        // Private state, asserted on purpose: "not found" must not switch the reaper off.
        assert!(
            reaper.sock.lock().unwrap().is_some(),
            "not found is no refusal"
        );
        std::net::TcpStream::connect(at).expect("the listener still accepts");
    }
}
