//! Tests that play the attacker (issue #18), against the real binary in
//! network namespaces: hostile mesh peers, hostile destinations and slow
//! clients (`peers`),
//! processes on the node that try to get a netns enrolled (`enrollment`),
//! and what the proxy refuses where ztunnel does (`fail_closed`). Each
//! attack runs beside the honest case and asserts both that the attack is
//! bounded or refused and that the others are still served.

#[path = "../common/mod.rs"]
mod common;

mod crl;
mod dns;
mod enrollment;
mod fail_closed;
mod peers;
mod privilege;
