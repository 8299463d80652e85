//! A served pod: its identity and addresses, and the socket factory every one
//! of its listeners and outbound connections comes from.
//!
//! Nothing about a pod is process-wide: a proxy serving many pods holds one
//! [`Pod`] each, and every socket it opens for a pod carries that pod's mark
//! (and, in shared mode, is created inside that pod's netns).

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, SockRef, Socket, TcpKeepalive, Type};
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpSocket, TcpStream};

pub use super::own::Own;
use crate::identity::{Identity, PodLease, TlsHandle};
use crate::netns::Netns;

/// How long an outbound connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What every socket the proxy opens for a pod carries.
#[derive(Debug, Clone)]
pub struct SocketOptions {
    /// `SO_MARK`, so the pod's redirection rules let the proxy's own traffic out.
    pub mark: u32,
    /// `TCP_CONGESTION` of TCP sockets (`congestion_control`); `None`: the
    /// kernel's default. Accepted connections inherit their listener's.
    pub congestion_control: Option<Arc<str>>,
}

impl SocketOptions {
    /// Just the mark; the kernel's congestion control.
    pub fn marked(mark: u32) -> Self {
        SocketOptions {
            mark,
            congestion_control: None,
        }
    }

    /// Sets the congestion control on a new TCP socket, if one is configured.
    fn apply_congestion_control(&self, s: &Socket) -> io::Result<()> {
        match &self.congestion_control {
            Some(cc) => s.set_tcp_congestion(cc.as_bytes()),
            None => Ok(()),
        }
    }

    /// These options, checked against this kernel at start. A congestion
    /// control it cannot take is an error when the user `chosen` it; the
    /// default is dropped instead (the kernel's own stays), with a warning,
    /// so an unusual kernel does not keep the proxy from starting.
    pub fn usable(mut self, chosen: bool) -> anyhow::Result<Self> {
        if let Err(e) = self.check() {
            if chosen {
                return Err(e);
            }
            tracing::warn!(error = %e, "keeping the kernel's congestion control");
            self.congestion_control = None;
        }
        Ok(self)
    }

    /// Whether this kernel lets the proxy set its congestion control: a
    /// clear error at start rather than a warning at the first connection.
    /// Whether this process may do what every pod socket needs: the mark
    /// (`SO_MARK`, like `IP_TRANSPARENT` and `SOCK_DESTROY`: CAP_NET_ADMIN)
    /// and, for a proxy that `enters_pods` (shared), `setns` into a pod's
    /// network namespace (CAP_SYS_ADMIN). Checked at start, as ztunnel does,
    /// so a container given too few capabilities fails saying which, not
    /// each connection later.
    pub fn check_privileges(&self, enters_pods: bool) -> anyhow::Result<()> {
        let probe = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| anyhow::anyhow!("cannot open a socket: {e}"))?;
        probe.set_mark(self.mark).map_err(|e| {
            anyhow::anyhow!(
                "cannot mark sockets (SO_MARK {:#x}): {e}; the proxy needs CAP_NET_ADMIN",
                self.mark
            )
        })?;
        if enters_pods {
            let here = crate::netns::Netns::current()
                .map_err(|e| anyhow::anyhow!("cannot open this thread's netns: {e}"))?;
            here.enter().map_err(|e| {
                anyhow::anyhow!(
                    "cannot enter network namespaces (setns): {e}; a shared proxy needs CAP_SYS_ADMIN"
                )
            })?;
        }
        Ok(())
    }

    fn check(&self) -> anyhow::Result<()> {
        let Some(cc) = &self.congestion_control else {
            return Ok(());
        };
        let probe = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| anyhow::anyhow!("cannot check `congestion_control`: {e}"))?;
        self.apply_congestion_control(&probe).map_err(|e| {
            let why = match e.raw_os_error() {
                Some(libc::ENOENT) => "no such algorithm in this kernel".to_string(),
                Some(libc::EPERM) => "not allowed: not in net.ipv4.tcp_allowed_congestion_control, and no CAP_NET_ADMIN".to_string(),
                _ => e.to_string(),
            };
            let available =
                std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control")
                    .map(|a| a.trim().to_string())
                    .unwrap_or_else(|_| "(list unavailable)".into());
            anyhow::anyhow!(
                "config key `congestion_control` = {cc:?} cannot be set: {why}; this kernel has: {available}; empty keeps the kernel's default"
            )
        })
    }
}

/// Creates a pod's sockets: marked, keepalive, no Nagle, in the pod's netns.
#[derive(Debug, Clone)]
pub struct SocketFactory {
    options: SocketOptions,
    /// `None`: the proxy already runs inside the pod's netns (dedicated mode).
    /// `Some((pod, home))`: sockets are made inside `pod`, then the thread returns to `home`.
    netns: Option<(Netns, Netns)>,
    /// The pod, `namespace/name`, for warnings.
    pod: String,
    /// Removes outbound TIME_WAITs (see [`super::timewait`]); opened on first use.
    reaper: Arc<std::sync::OnceLock<super::timewait::Reaper>>,
}

impl SocketFactory {
    /// Sockets in the caller's own netns (dedicated mode) for `pod`
    /// (`namespace/name`).
    pub fn local(options: SocketOptions, pod: String) -> Self {
        SocketFactory {
            options,
            netns: None,
            pod,
            reaper: Arc::default(),
        }
    }

    /// Sockets inside `pod`'s netns; the creating thread goes back to `home`.
    pub fn in_pod(options: SocketOptions, name: String, pod: Netns, home: Netns) -> Self {
        SocketFactory {
            options,
            netns: Some((pod, home)),
            pod: name,
            reaper: Arc::default(),
        }
    }

    fn socket(&self, addr: &SocketAddr) -> io::Result<Socket> {
        self.socket_of(addr, Type::STREAM, Protocol::TCP)
    }

    fn socket_of(&self, addr: &SocketAddr, ty: Type, proto: Protocol) -> io::Result<Socket> {
        let domain = Domain::for_address(*addr);
        self.inside(|| {
            let s = Socket::new(domain, ty.nonblocking(), Some(proto))?;
            s.set_mark(self.options.mark)?;
            if proto == Protocol::TCP {
                if let Err(e) = self.options.apply_congestion_control(&s) {
                    // Checked at start, so not expected; once is enough to say it.
                    static WARNED: std::sync::Once = std::sync::Once::new();
                    WARNED.call_once(|| {
                        tracing::warn!(pod = %self.pod, congestion_control = ?self.options.congestion_control, error = %e, "cannot set the congestion control; this socket and later failing ones keep the kernel's default");
                    });
                }
            }
            Ok(s)
        })
    }

    fn inside<T>(&self, make: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        match &self.netns {
            None => make(),
            Some((pod, home)) => pod.with(home, make),
        }
    }

    /// Removes the TIME_WAIT the proxy holds for `conn`, its connection from
    /// `peer` (an outbound connection whose destination closed first);
    /// `cookie` is `conn`'s `SO_COOKIE`.
    pub fn forget_time_wait(&self, conn: &TcpStream, peer: SocketAddr, cookie: u64) {
        self.reaper
            .get_or_init(|| {
                super::timewait::Reaper::open(self.pod.clone(), || {
                    self.inside(|| {
                        Socket::new(
                            Domain::from(libc::AF_NETLINK),
                            Type::DGRAM,
                            Some(Protocol::from(libc::NETLINK_SOCK_DIAG)),
                        )
                    })
                })
            })
            .remove(conn, peer, cookie);
    }

    /// A listener with `SO_REUSEPORT`, so a new proxy can bind beside a draining one.
    pub fn listen(&self, addr: SocketAddr) -> io::Result<TcpListener> {
        let s = self.socket(&addr)?;
        s.set_reuse_address(true)?;
        s.set_reuse_port(true)?;
        if addr.is_ipv6() {
            s.set_only_v6(false)?;
        }
        // Accepted connections inherit these: no per-connection syscalls.
        tune(&s)?;
        s.bind(&addr.into())?;
        s.listen(1024)?;
        TcpListener::from_std(s.into())
    }

    /// A UDP socket in the pod: bound to `addr` (a listener) or, with `connect`, aimed at it.
    pub fn udp(&self, addr: SocketAddr, connect: bool) -> io::Result<tokio::net::UdpSocket> {
        let s = self.socket_of(&addr, Type::DGRAM, Protocol::UDP)?;
        if connect {
            s.connect(&addr.into())?;
        } else {
            s.set_reuse_address(true)?;
            s.set_reuse_port(true)?;
            // Room for a burst of queries (the default holds ~100 packets).
            let _ = s.set_recv_buffer_size(1 << 20);
            s.bind(&addr.into())?;
        }
        tokio::net::UdpSocket::from_std(s.into())
    }

    /// Connects to `addr` from the pod, within [`CONNECT_TIMEOUT`].
    pub async fn connect(&self, addr: SocketAddr) -> io::Result<TcpStream> {
        self.connect_with(addr, None).await
    }

    /// Connects to the pod's application at `addr` with the original client's
    /// address `src` as source (`IP_TRANSPARENT` + `IP_FREEBIND`, or for IPv6
    /// `IPV6_TRANSPARENT` + `IPV6_FREEBIND`, Linux 4.15+), so the
    /// application sees who really called. The in-pod connmark rules and
    /// table 100 bring the replies back to this socket. Falls back to the
    /// pod's own address where spoofing is not possible.
    pub async fn connect_as(
        &self,
        addr: SocketAddr,
        src: std::net::IpAddr,
    ) -> io::Result<TcpStream> {
        let src = super::hbone::canonical(src);
        if src.is_ipv4() != addr.is_ipv4() || src.is_loopback() {
            return self.connect(addr).await;
        }
        match self.connect_with(addr, Some(src)).await {
            Ok(s) => Ok(s),
            Err(e)
                if e.kind() == io::ErrorKind::PermissionDenied
                    || e.raw_os_error() == Some(libc::EPERM) =>
            {
                tracing::debug!(src = %src, dst.addr = %addr, error = %e, "cannot spoof the source; delivering from the pod's address");
                self.connect(addr).await
            }
            Err(e) => Err(e),
        }
    }

    async fn connect_with(
        &self,
        addr: SocketAddr,
        src: Option<std::net::IpAddr>,
    ) -> io::Result<TcpStream> {
        let s = self.socket(&addr)?;
        if let Some(src) = src {
            if src.is_ipv4() {
                s.set_ip_transparent_v4(true)?;
                s.set_freebind_v4(true)?;
            } else {
                s.set_ip_transparent_v6(true)?;
                s.set_freebind_v6(true)?;
            }
            // The port is chosen at connect, unique per 4-tuple, not at
            // bind, unique per address: a bind(0) port cannot be shared
            // with any socket of the client's address, TIME_WAIT ones
            // included, so one busy client used up the range in a minute
            // and every later connect searched it for milliseconds.
            nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::IpBindAddressNoPort, &true)
                .map_err(io::Error::from)?;
            s.bind(&SocketAddr::new(src, 0).into())?;
        }
        tune(&s)?;
        let sock = TcpSocket::from_std_stream(s.into());
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, sock.connect(addr))
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("connect to {addr} timed out"),
                )
            })??;
        Ok(stream)
    }
}

/// Whether `ip` is one of a pod's addresses `pod_ips` (an IPv4-mapped IPv6
/// address counts as its IPv4 one).
pub fn is_own_address(pod_ips: &[IpAddr], ip: IpAddr) -> bool {
    let ip = super::hbone::canonical(ip);
    pod_ips
        .iter()
        .any(|own| super::hbone::canonical(*own) == ip)
}

/// How much encrypted data rustls may queue before writing: large enough that
/// one `writev` carries a whole HTTP/2 DATA frame's records (rustls' default,
/// 64 KiB, splits a 256 KiB frame into four writes).
pub const TLS_SEND_BUFFER: usize = 1 << 20;

/// Caps the bytes the kernel queues unsent for `socket` (`TCP_NOTSENT_LOWAT`);
/// 0 leaves the kernel's default (no cap). Set on a listener, it holds for
/// every connection the listener accepts.
///
/// Used on HBONE connections (`hbone_unsent_limit`). Without a cap the kernel
/// takes encrypted records up to the whole send buffer (`tcp_wmem`'s maximum,
/// 4 MiB on these machines) when the network is the bottleneck, and every
/// other stream on the connection waits behind them. With it, the rest waits
/// in rustls' buffer ([`TLS_SEND_BUFFER`]), which is then the whole backlog
/// ahead of a new frame. The kernel checks the cap before each buffer it fills,
/// so one write can go over it by up to a buffer, and it wakes the writer
/// when half the cap is left.
pub fn limit_unsent(socket: &impl std::os::fd::AsFd, bytes: u32) -> io::Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    SockRef::from(socket).set_tcp_notsent_lowat(bytes)
}

/// Ends a connection the proxy accepted but could not carry (no route, a
/// refused dial, a denial, a copy cut short by the other side's failure) as
/// a plain close would: the peer reads an end of stream. But first it reads
/// and drops whatever the peer sends, until the peer closes too: a close with
/// unread data is a reset, and a connection that ends in a reset leaves a
/// conntrack entry that does not restart on the next SYN with the same
/// addresses but carries it to wherever the old one was redirected. That
/// next SYN may be the proxy's own dial (it picks its ports from the same
/// pool as the application, in the same netns), which then loops back into
/// the proxy's own listener (seen in tests/dataplane.rs before this drain,
/// as dials to a closed port that "succeeded").
///
/// Bounded: [`UNSERVED_DRAIN_TIME`] and [`UNSERVED_DRAIN_BYTES`] per
/// connection, and at most [`UNSERVED_DRAINING`] connections at once across
/// the proxy, so peers that never close cannot pile up sockets; past a
/// bound the close may be a reset.
///
/// Returns whether the peer closed cleanly: the proxy's side may then be in
/// TIME_WAIT (`timewait` checks that its socket is closed before removing).
pub async fn end_unserved(stream: &TcpStream) -> bool {
    let _ = SockRef::from(stream).shutdown(std::net::Shutdown::Write);
    let Ok(_permit) = DRAINING.try_acquire() else {
        return false;
    };
    let drain = async {
        let mut left = UNSERVED_DRAIN_BYTES;
        loop {
            stream.readable().await?;
            // MSG_TRUNC: TCP drops the bytes without copying them anywhere.
            match stream.try_io(Interest::READABLE, || discard(stream, left)) {
                Ok(0) => return Ok::<bool, io::Error>(true),
                Ok(n) if n >= left => return Ok(false),
                Ok(n) => left -= n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    };
    matches!(
        tokio::time::timeout(UNSERVED_DRAIN_TIME, drain).await,
        Ok(Ok(true))
    )
}

/// Drops up to `len` received bytes of `stream` unread.
fn discard(stream: &TcpStream, len: usize) -> io::Result<usize> {
    // SAFETY: with MSG_TRUNC, TCP discards the data and writes nothing to
    // the (null) buffer.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            std::ptr::null_mut(),
            len,
            libc::MSG_TRUNC | libc::MSG_DONTWAIT,
        )
    };
    super::copy::byte_count(n)
}

/// How long [`end_unserved`] waits for the peer's close.
const UNSERVED_DRAIN_TIME: Duration = Duration::from_secs(5);
/// How much [`end_unserved`] drops before giving up.
const UNSERVED_DRAIN_BYTES: usize = 1 << 20;
/// How many connections [`end_unserved`] drains at once, proxy-wide.
const UNSERVED_DRAINING: usize = 1024;
static DRAINING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(UNSERVED_DRAINING);

mod life;
pub use life::{ActiveConnections, ConnectionGuard, Drain, DrainTrigger, Lifecycle};

/// NODELAY and keepalive, for every connection the proxy holds (set on
/// listeners, whose accepted connections inherit them, and before connect).
fn tune(s: &Socket) -> io::Result<()> {
    s.set_tcp_nodelay(true)?;
    let ka = TcpKeepalive::new()
        .with_time(Duration::from_secs(180))
        .with_interval(Duration::from_secs(180));
    s.set_tcp_keepalive(&ka)
}

/// One pod the proxy serves.
#[derive(Debug)]
pub struct Pod {
    pub uid: String,
    /// The UID again, as the memory budget's key for this pod's streams.
    pub key: std::sync::Arc<str>,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub identity: Identity,
    pub network: String,
    pub ips: Vec<IpAddr>,
    pub sockets: SocketFactory,
    pub tls: TlsHandle,
    /// Dropped after `tls` (fields drop in order): the certificate manager
    /// is told once this pod no longer holds its identity's certificate.
    pub lease: PodLease,
    pub life: Lifecycle,
    /// What the pod says of itself while the state holds no workload for it.
    pub unlisted: Arc<Own>,
    /// What it last said of itself (see [`Pod::own`]).
    pub said: arc_swap::ArcSwap<Own>,
    /// Its connections open now (the config dump's `connections`).
    pub open: Arc<super::open::OpenConnections>,
}

pub type PodRef = Arc<Pod>;

#[cfg(test)]
mod tests {
    use super::super::copy::tests::pair;
    use super::*;

    #[test]
    fn only_the_pods_own_addresses_are_its_own() {
        let ips: Vec<IpAddr> = vec!["10.0.0.3".parse().unwrap(), "fd00::3".parse().unwrap()];
        let own = |ip: &str| is_own_address(&ips, ip.parse().unwrap());
        assert!(own("10.0.0.3") && own("fd00::3"));
        assert!(own("::ffff:10.0.0.3"), "as a dual-stack socket reports it");
        assert!(!own("10.0.0.4") && !own("10.96.0.1") && !own("127.0.0.1"));
        assert!(!is_own_address(&[], "10.0.0.3".parse().unwrap()));
    }

    #[test]
    fn a_congestion_control_the_kernel_lacks_fails_only_when_chosen() {
        let options = |cc: &str| SocketOptions {
            mark: 0,
            congestion_control: Some(cc.into()),
        };
        let err = options("nosuchcc").usable(true).unwrap_err().to_string();
        assert!(
            err.contains("`congestion_control` = \"nosuchcc\"") && err.contains("reno"),
            "{err}"
        );
        let kept = options("nosuchcc").usable(false).unwrap();
        assert_eq!(kept.congestion_control, None, "the default is dropped");
        // reno is built into every kernel.
        let reno = options("reno").usable(true).unwrap();
        assert_eq!(reno.congestion_control.as_deref(), Some("reno"));
    }

    #[tokio::test]
    async fn accepted_connections_inherit_nodelay_and_keepalive_from_the_listener() {
        let factory = SocketFactory::local(SocketOptions::marked(0), "default/test".into());
        let listener = factory.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let s = SockRef::from(&accepted);
        assert!(s.tcp_nodelay().unwrap());
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(180));
        assert_eq!(
            s.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(180)
        );
        let dialed = factory
            .connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        assert!(SockRef::from(&dialed).tcp_nodelay().unwrap());
        assert_eq!(
            SockRef::from(&dialed).tcp_keepalive_time().unwrap(),
            Duration::from_secs(180)
        );
    }

    /// One of a TCP socket's queue sizes, read with `ioctl` `request`.
    fn queue(fd: std::os::fd::RawFd, request: libc::c_ulong) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: these TCP ioctls write one c_int; `fd` is a socket we hold open.
        let rc = unsafe { libc::ioctl(fd, request as _, &mut n) };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        n as usize
    }

    /// Bytes the kernel holds for `s` that it has not sent yet (`SIOCOUTQNSD`).
    fn unsent(s: &TcpStream) -> usize {
        queue(s.as_raw_fd(), libc::SIOCOUTQNSD)
    }

    /// Bytes the kernel holds for `s`, sent and not acked or not sent yet
    /// (`SIOCOUTQ`).
    fn queued(s: &TcpStream) -> usize {
        queue(s.as_raw_fd(), libc::TIOCOUTQ)
    }

    /// Bytes received on `s` that nothing has read yet (`SIOCINQ`).
    fn unread(s: &TcpStream) -> usize {
        queue(s.as_raw_fd(), libc::FIONREAD)
    }

    /// Polls `cond` (every millisecond, at most 5 s) until it holds.
    async fn until(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Writes to `s` until the kernel takes no more; the peer never reads.
    async fn fill(s: &TcpStream) {
        let chunk = vec![7u8; 256 * 1024];
        loop {
            match s.try_write(&chunk) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Full for now. Once every byte sent is acked, what is
                    // left is held back by the peer's closed window and
                    // nothing frees more room: then it is full for good.
                    until("every sent byte acked", || queued(s) == unsent(s)).await;
                    if let Err(e) = s.try_write(&chunk) {
                        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
                        return;
                    }
                }
                Err(e) => panic!("write: {e}"),
            }
        }
    }

    /// A connected pair whose receiver never reads; returns the sender, its
    /// send buffer size, and the receiver.
    async fn stalled_pair(limit: u32) -> (TcpStream, usize, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        // Capped by net.core.wmem_max (208 KiB on a stock kernel): read back below.
        s.set_send_buffer_size(4 << 20).unwrap();
        let sndbuf = s.send_buffer_size().unwrap();
        s.set_nonblocking(true).unwrap();
        let sock = TcpSocket::from_std_stream(s.into());
        let (a, b) = tokio::join!(sock.connect(l.local_addr().unwrap()), l.accept());
        let (a, b) = (a.unwrap(), b.unwrap().0);
        // A small receive window on the idle peer leaves the rest unsent.
        SockRef::from(&b).set_recv_buffer_size(64 * 1024).unwrap();
        limit_unsent(&a, limit).unwrap();
        (a, sndbuf, b)
    }

    #[tokio::test]
    async fn an_unsent_limit_on_the_listener_holds_for_every_accepted_connection() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        limit_unsent(&l, 64 * 1024).unwrap();
        let addr = l.local_addr().unwrap();
        let (_c, accepted) = tokio::join!(TcpStream::connect(addr), l.accept());
        let (a, _) = accepted.unwrap();
        assert_eq!(SockRef::from(&a).tcp_notsent_lowat().unwrap(), 64 * 1024);
    }

    #[tokio::test]
    async fn limit_unsent_caps_the_kernels_unsent_queue_and_zero_leaves_it() {
        const LIMIT: u32 = 32 * 1024;
        let (limited, _, _peer) = stalled_pair(LIMIT).await;
        fill(&limited).await;
        let capped = unsent(&limited);
        // One write may go over the cap by the buffer it was filling.
        assert!(
            capped <= LIMIT as usize + 128 * 1024,
            "{capped} bytes unsent with a {LIMIT}-byte cap"
        );

        let (unlimited, sndbuf, _peer) = stalled_pair(0).await;
        fill(&unlimited).await;
        let queued = unsent(&unlimited);
        assert!(
            queued > sndbuf / 4 && queued > 2 * capped,
            "without a cap the kernel fills the send buffer ({queued} of {sndbuf} bytes unsent, {capped} with the cap)"
        );
    }

    #[tokio::test]
    async fn an_unserved_connection_ends_cleanly_though_the_peer_sent_bytes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut peer, proxy) = pair().await;
        peer.write_all(b"a request the proxy never carries")
            .await
            .unwrap();
        let ending = end_unserved(&proxy);
        tokio::pin!(ending);
        let mut buf = [0u8; 8];
        // Driven together: the proxy's side ends its stream and drops what
        // it was sent unread. Closed with those bytes unread, it would follow
        // its end of stream with a reset.
        tokio::select! {
            _ = &mut ending => panic!("gave up before the peer closed"),
            () = async {
                assert_eq!(peer.read(&mut buf).await.unwrap(), 0, "an end of stream");
                until("the request dropped unread", || unread(&proxy) == 0).await;
            } => {}
        }
        // No reset followed the end of stream: reads would not show it, the
        // state does.
        const TCP_CLOSE_WAIT: u8 = 8;
        assert_eq!(
            super::super::timewait::tcp_state(peer.as_raw_fd()).unwrap(),
            TCP_CLOSE_WAIT,
            "no reset after the end of stream"
        );
        assert!(peer.take_error().unwrap().is_none());
        drop(peer);
        assert!(ending.await, "both closed cleanly, the proxy first");
        // Closed now, it sends no reset either: nothing is left unread.
        assert_eq!(unread(&proxy), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_never_closes_is_given_up_on() {
        let (_peer, proxy) = pair().await;
        let ended = tokio::time::timeout(UNSERVED_DRAIN_TIME * 2, end_unserved(&proxy)).await;
        assert_eq!(ended, Ok(false), "given up on within its time bound");
    }
}
