//! A resolver's answer to the proxy's own question for a hostname endpoint
//! (`proxy::dns_answer`, the on-demand resolver's check): the first byte
//! is a knob (odd: the question was AAAA, else A), the rest the datagram.
//!
//! Checked beyond "no panic": addresses come only as the question's type,
//! a TTL comes with them and only with them, and an answer whose id is
//! not the question's is never believed.

#![no_main]

use std::sync::OnceLock;

use ambit::proxy::{dns_answer, DnsAnswerRefused};
use hickory_proto::rr::{Name, RecordType};
use libfuzzer_sys::fuzz_target;

const ID: u16 = 0x0A0A;

fn asked() -> &'static Name {
    static NAME: OnceLock<Name> = OnceLock::new();
    NAME.get_or_init(|| Name::from_ascii("api.example.com.").expect("a name"))
}

fuzz_target!(|input: &[u8]| {
    let Some((&knob, packet)) = input.split_first() else {
        return;
    };
    let ty = if knob & 1 == 1 {
        RecordType::AAAA
    } else {
        RecordType::A
    };
    if let Ok((ips, ttl)) = dns_answer(packet, ID, asked(), ty) {
        assert!(ips.iter().all(|ip| ip.is_ipv6() == (ty == RecordType::AAAA)));
        assert_eq!(ips.is_empty(), ttl.is_none());
    }
    if packet.len() >= 2 && u16::from_be_bytes([packet[0], packet[1]]) != ID {
        assert_eq!(
            dns_answer(packet, ID, asked(), ty),
            Err(DnsAnswerRefused::NotOurs)
        );
    }
});
