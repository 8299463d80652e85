//! What the fuzz targets share: the knob byte some inputs start with, and
//! the lookups every mesh state must answer, whatever source built it. Only
//! `cargo fuzz` builds this crate; nothing of it ships.

use ambit::xds::types::NetworkMode;
use ambit::xds::State;

/// Splits `data` into a knob (its first byte; 0 when empty) and the input
/// after it. One newline right after the knob is skipped, so a text seed can
/// keep the knob on a line of its own.
pub fn knob(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        None => (0, data),
        Some((k, rest)) => (*k, rest.strip_prefix(b"\n").unwrap_or(rest)),
    }
}

/// What `State::build` and `build_lenient` promise of any state they return:
/// a workload on a pod network is found at each of its addresses, and a
/// service at each of its VIPs. The policy and endpoint lookups run too.
pub fn check_state(state: &State) {
    for w in state.workloads() {
        if w.network_mode == NetworkMode::Standard {
            for ip in &w.workload_ips {
                assert!(
                    state.workload_by_addr(&w.network, *ip).is_some(),
                    "workload {} is not found at its address {ip}",
                    w.uid
                );
            }
        }
        let _ = state
            .policies_for(&w.namespace, &w.authorization_policies)
            .count();
    }
    for s in state.services() {
        for vip in &s.vips {
            assert!(
                state
                    .service_by_vip(&vip.network, vip.address, None)
                    .is_some(),
                "service {} is not found at its VIP {vip}",
                s.key()
            );
        }
        let _ = state.healthy_endpoints(s).count();
    }
}
