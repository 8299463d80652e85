//! BIG TCP on a meshed pod's loopback. Redirection puts extra TCP legs on
//! the pod's `lo` (app → proxy, proxy → app). With `lo`'s default 64 KiB GSO
//! limit they move in 64 KiB packets, each walked through TCP/IP and
//! netfilter and acknowledged. Raising the limit to the most `lo` takes (its
//! TSO limit, 512 KiB on current kernels) lets one packet carry up to eight
//! times as much, so the kernel does a fraction of the per-packet work
//! (measured: HBONE throughput 0.36× → 0.42× direct). Only sockets whose
//! route is `lo` benefit: the application's connection to a redirected
//! destination was routed for `eth0` and keeps that limit. Loopback packets
//! never leave the pod's netns. IPv4 needs Linux 6.3, IPv6 5.19; on older
//! kernels `lo` reports no larger TSO limit and nothing changes.

use std::io;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_REQUEST,
};
use netlink_packet_route::link::{LinkAttribute, LinkMessage};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use crate::netns::Netns;

/// The kernel's default, restored on removal.
const LEGACY_GSO_SIZE: u32 = 64 * 1024;

/// `lo`'s segmentation limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GsoLimits {
    /// GSO limit for IPv6 (IPv4 follows it only up to 64 KiB).
    pub gso: u32,
    /// GSO limit for IPv4 (Linux 6.3+).
    pub gso_ipv4: Option<u32>,
    /// The most the device takes: the size BIG TCP raises the limits to.
    pub tso_max: u32,
}

/// Raises `lo`'s GSO limits to its TSO limit inside `netns`; a limit
/// already as high (set by someone else) is left alone.
pub fn enable(netns: &Netns) -> io::Result<()> {
    netns.run(|| {
        let now = read()?;
        let raise = |v: u32| (v < now.tso_max).then_some(now.tso_max);
        write(raise(now.gso), now.gso_ipv4.and_then(raise))
    })?
}

/// Puts back the kernel default (64 KiB) on a limit that holds the value
/// [`enable`] sets; other values are left alone.
pub fn disable(netns: &Netns) -> io::Result<()> {
    netns.run(|| {
        let now = read()?;
        let ours = |v: u32| (v == now.tso_max && v > LEGACY_GSO_SIZE).then_some(LEGACY_GSO_SIZE);
        write(ours(now.gso), now.gso_ipv4.and_then(ours))
    })?
}

/// `lo`'s GSO limits inside `netns`.
pub fn limits(netns: &Netns) -> io::Result<GsoLimits> {
    netns.run(read)?
}

fn lo_index() -> io::Result<u32> {
    nix::net::if_::if_nametoindex("lo").map_err(io::Error::from)
}

fn read() -> io::Result<GsoLimits> {
    let mut msg = LinkMessage::default();
    msg.header.index = lo_index()?;
    let reply = request(RouteNetlinkMessage::GetLink(msg), NLM_F_REQUEST)?
        .ok_or_else(|| io::Error::other("no RTM_NEWLINK reply for lo"))?;
    let mut limits = GsoLimits {
        gso: LEGACY_GSO_SIZE,
        gso_ipv4: None,
        tso_max: LEGACY_GSO_SIZE,
    };
    for a in reply.attributes {
        match a {
            LinkAttribute::GsoMaxSize(v) => limits.gso = v,
            LinkAttribute::GsoIpv4MaxSize(v) => limits.gso_ipv4 = Some(v),
            LinkAttribute::TsoMaxSize(v) => limits.tso_max = v,
            _ => {}
        }
    }
    Ok(limits)
}

/// Sets the limits given; `None` leaves one as it is.
fn write(gso: Option<u32>, gso_ipv4: Option<u32>) -> io::Result<()> {
    let mut msg = LinkMessage::default();
    msg.header.index = lo_index()?;
    msg.attributes = gso
        .map(LinkAttribute::GsoMaxSize)
        .into_iter()
        .chain(gso_ipv4.map(LinkAttribute::GsoIpv4MaxSize))
        .collect();
    if msg.attributes.is_empty() {
        return Ok(());
    }
    request(RouteNetlinkMessage::SetLink(msg), NLM_F_REQUEST | NLM_F_ACK).map(|_| ())
}

/// Sends one request and waits for its answer: the link message of a GET,
/// or the ACK of a SET (an error reply becomes the call's error).
fn request(msg: RouteNetlinkMessage, flags: u16) -> io::Result<Option<LinkMessage>> {
    let mut sock = Socket::new(NETLINK_ROUTE)?;
    // The kernel answers at once; a wait this long means it never will, and
    // the enrollment waiting on this call must not hang with it.
    nix::sys::socket::setsockopt(
        &sock,
        nix::sys::socket::sockopt::ReceiveTimeout,
        &nix::sys::time::TimeVal::new(2, 0),
    )?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = 1;
    let mut req = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
    req.finalize();
    let mut buf = vec![0; req.buffer_len()];
    req.serialize(&mut buf);
    sock.send(&buf, 0)?;

    let mut rx = Vec::with_capacity(64 * 1024);
    loop {
        rx.clear();
        let n = sock.recv(&mut rx, 0)?;
        let mut at = 0;
        while at < n {
            let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rx[at..n])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
            let len = reply.header.length as usize;
            match reply.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => {
                    return Ok(Some(link))
                }
                NetlinkPayload::Error(e) if e.code.is_some() => return Err(e.to_io()),
                NetlinkPayload::Error(_) | NetlinkPayload::Done(_) => return Ok(None),
                _ => {}
            }
            if len == 0 {
                break;
            }
            at += len;
        }
    }
}
