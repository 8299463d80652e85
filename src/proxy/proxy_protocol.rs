//! The PROXY protocol version 2 header (haproxy's PROXY protocol spec,
//! §2.2) that an inbound connection to a workload with a PROXY
//! application tunnel starts with: who the connection came from and where
//! it was going, and, as ztunnel writes it, the peer's SPIFFE identity in
//! TLV `0xD0`. Pure bytes; the socket is written elsewhere.

use std::net::SocketAddr;

use crate::identity::Identity;

/// The 12-byte signature every v2 header starts with.
pub const SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";

/// Version 2, command PROXY.
const VERSION_PROXY: u8 = 0x21;
/// Address family and transport: TCP over IPv4, TCP over IPv6, and
/// "unspecified" (no addresses) over a stream.
const TCP4: u8 = 0x11;
const TCP6: u8 = 0x21;
const UNSPEC_STREAM: u8 = 0x01;

/// The TLV ztunnel carries the peer's identity in (Istio's
/// `PROXY_PROTOCOL_AUTHORITY_TLV`): the SPIFFE URI, no terminator.
pub const PEER_IDENTITY_TLV: u8 = 0xD0;

/// The header for a connection from `src` to `dst`, with `peer`'s identity
/// when the connection's peer proved one. Addresses of two families (which
/// the spec cannot put in one block) are sent as "unspecified", as
/// ztunnel's library does: the application then sees no address, and a
/// reader that skips the block as the spec says skips the identity too.
pub fn header(src: SocketAddr, dst: SocketAddr, peer: Option<&Identity>) -> Vec<u8> {
    let (src, dst) = (canonical(src), canonical(dst));
    let mut addresses = Vec::with_capacity(36);
    let family = match (src, dst) {
        (SocketAddr::V4(s), SocketAddr::V4(d)) => {
            addresses.extend_from_slice(&s.ip().octets());
            addresses.extend_from_slice(&d.ip().octets());
            addresses.extend_from_slice(&s.port().to_be_bytes());
            addresses.extend_from_slice(&d.port().to_be_bytes());
            TCP4
        }
        (SocketAddr::V6(s), SocketAddr::V6(d)) => {
            addresses.extend_from_slice(&s.ip().octets());
            addresses.extend_from_slice(&d.ip().octets());
            addresses.extend_from_slice(&s.port().to_be_bytes());
            addresses.extend_from_slice(&d.port().to_be_bytes());
            TCP6
        }
        _ => UNSPEC_STREAM,
    };
    let identity = peer.map(|p| p.to_string());
    let tlv_len = identity.as_ref().map_or(0, |id| 3 + id.len());
    let len = addresses.len() + tlv_len;
    let mut out = Vec::with_capacity(16 + len);
    out.extend_from_slice(&SIGNATURE);
    out.push(VERSION_PROXY);
    out.push(family);
    // An identity is a few hundred bytes at most (the CA bounds it), far
    // below what the 16-bit lengths hold.
    out.extend_from_slice(&(len as u16).to_be_bytes());
    out.extend_from_slice(&addresses);
    if let Some(id) = identity {
        out.push(PEER_IDENTITY_TLV);
        out.extend_from_slice(&(id.len() as u16).to_be_bytes());
        out.extend_from_slice(id.as_bytes());
    }
    out
}

/// `::ffff:a.b.c.d` as `a.b.c.d`, so a dual-stack listener's peer and an
/// IPv4 destination make one IPv4 block.
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(super::hbone::canonical(a.ip()), a.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> Identity {
        "spiffe://cluster.local/ns/default/sa/client"
            .parse()
            .unwrap()
    }

    #[test]
    fn an_ipv4_header_with_the_peers_identity_is_laid_out_as_the_spec_says() {
        let h = header(
            "10.0.0.2:40000".parse().unwrap(),
            "10.96.0.10:80".parse().unwrap(),
            Some(&id()),
        );
        let uri = b"spiffe://cluster.local/ns/default/sa/client";
        let mut want = vec![
            0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D, 0x0A, 0x51, 0x55, 0x49, 0x54,
            0x0A, // signature
            0x21, // v2, PROXY
            0x11, // AF_INET, STREAM
        ];
        want.extend_from_slice(&((12 + 3 + uri.len()) as u16).to_be_bytes());
        want.extend_from_slice(&[10, 0, 0, 2, 10, 96, 0, 10]);
        want.extend_from_slice(&[0x9C, 0x40, 0x00, 0x50]); // 40000, 80
        want.push(0xD0);
        want.extend_from_slice(&(uri.len() as u16).to_be_bytes());
        want.extend_from_slice(uri);
        assert_eq!(h, want);
    }

    #[test]
    fn ipv6_mapped_and_mixed_families() {
        // Both IPv6: a 36-byte address block, no TLV without an identity.
        let h = header(
            "[fd00::2]:1234".parse().unwrap(),
            "[fd00::3]:80".parse().unwrap(),
            None,
        );
        assert_eq!(&h[12..16], &[0x21, 0x21, 0x00, 36]);
        assert_eq!(h.len(), 16 + 36);
        assert_eq!(
            &h[16..32],
            &"fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets()
        );
        assert_eq!(&h[48..52], &[0x04, 0xD2, 0x00, 0x50]);
        // A v4-mapped peer with an IPv4 destination: one IPv4 block.
        let h = header(
            "[::ffff:10.0.0.2]:1234".parse().unwrap(),
            "10.0.0.3:80".parse().unwrap(),
            None,
        );
        assert_eq!(&h[13..16], &[0x11, 0x00, 12]);
        // Two families: no addresses, the identity still carried.
        let h = header(
            "10.0.0.2:1234".parse().unwrap(),
            "[fd00::3]:80".parse().unwrap(),
            Some(&id()),
        );
        assert_eq!(h[13], 0x01);
        assert_eq!(h[16], 0xD0);
    }

    /// The same bytes as the `ppp` library (the one ztunnel writes its
    /// headers with) builds for the same connection, and read back by it
    /// as the same addresses and identity.
    #[test]
    fn the_header_is_what_another_implementation_builds_and_reads() {
        use ppp::v2;
        let cases: [(&str, &str, Option<Identity>); 4] = [
            ("10.0.0.2:40000", "10.96.0.10:80", Some(id())),
            ("10.0.0.2:40000", "10.0.0.3:8080", None),
            ("[fd00::2]:50000", "[fd00::10]:443", Some(id())),
            ("10.0.0.2:40000", "[fd00::10]:443", Some(id())),
        ];
        for (src, dst, peer) in cases {
            let (src, dst): (SocketAddr, SocketAddr) = (src.parse().unwrap(), dst.parse().unwrap());
            let ours = header(src, dst, peer.as_ref());
            let mut theirs = v2::Builder::with_addresses(
                v2::Version::Two | v2::Command::Proxy,
                v2::Protocol::Stream,
                (src, dst),
            );
            if let Some(p) = &peer {
                theirs = theirs
                    .write_tlv(PEER_IDENTITY_TLV, p.to_string().as_bytes())
                    .unwrap();
            }
            assert_eq!(ours, theirs.build().unwrap(), "{src} -> {dst}");
            let read = v2::Header::try_from(&ours[..]).unwrap();
            assert_eq!(read.command, v2::Command::Proxy);
            let tlvs: Vec<_> = read.tlvs().map(|t| t.unwrap()).collect();
            let same_family = src.is_ipv4() == dst.is_ipv4();
            match &peer {
                // Without addresses, a reader takes the whole block for
                // them (the spec says to skip it): the identity is there
                // in the bytes, as ztunnel's, but unread.
                Some(_) if !same_family => assert!(tlvs.is_empty()),
                Some(p) => {
                    assert_eq!(tlvs.len(), 1);
                    assert_eq!(tlvs[0].kind, PEER_IDENTITY_TLV);
                    assert_eq!(&tlvs[0].value[..], p.to_string().as_bytes());
                }
                None => assert!(tlvs.is_empty()),
            }
            assert_eq!(
                read.addresses,
                if same_family {
                    (src, dst).into()
                } else {
                    v2::Addresses::Unspecified
                }
            );
        }
    }
}
