//! Waypoints on the outbound path, as pure decisions over a state snapshot:
//! which waypoint a service or workload names (one, or one of several by
//! weight), which workloads stand behind it, and whether the connection
//! comes from the waypoint itself (then it goes straight to the
//! destination, never back to the waypoint). No I/O.

use std::net::IpAddr;
use std::sync::Arc;

use crate::xds::types::{GatewayAddress, GatewayDestination, Service, Workload};
use crate::xds::State;

/// The waypoint a service sends its traffic through: one of its weighted
/// waypoints, chosen in proportion to weight, else its single waypoint.
pub fn of_service(svc: &Service) -> Option<GatewayAddress> {
    let total: u64 = svc
        .weighted_waypoints
        .iter()
        .map(|w| u64::from(w.weight))
        .sum();
    if total > 0 {
        let mut at = fastrand::u64(..total);
        for w in &svc.weighted_waypoints {
            match at.checked_sub(u64::from(w.weight)) {
                Some(rest) => at = rest,
                None => return Some(w.gateway()),
            }
        }
    }
    svc.waypoint.clone()
}

/// The workloads that can take traffic for `gw`: the workload at its
/// address, or the healthy endpoints of the service it names (by address or
/// by hostname). An error says why there is none; the caller refuses the
/// connection rather than bypass the waypoint.
pub fn resolve(state: &State, gw: &GatewayAddress) -> Result<Resolved, String> {
    let (name, svc) = match &gw.destination {
        GatewayDestination::Address(a) => {
            if let Some(w) = state.workload_by_addr(&a.network, a.address) {
                return Ok(Resolved {
                    workloads: vec![w.clone()],
                    sans: Vec::new(),
                });
            }
            match state.service_by_vip(&a.network, a.address, None) {
                Some(svc) => (a.to_string(), svc),
                None => return Err(format!("waypoint {a} is not known")),
            }
        }
        GatewayDestination::Hostname {
            namespace,
            hostname,
        } => {
            let key = format!("{namespace}/{hostname}");
            match state.service_by_host(&key) {
                Some(svc) => (key, svc),
                None => return Err(format!("waypoint service {key} is not known")),
            }
        }
    };
    let workloads = endpoints(state, svc);
    if workloads.is_empty() {
        return Err(format!("waypoint {name} has no healthy endpoint"));
    }
    Ok(Resolved {
        workloads,
        sans: svc.subject_alt_names.clone(),
    })
}

/// The workloads behind a waypoint, and the extra identities its service
/// allows (`subject_alt_names`), any of which the client accepts.
pub struct Resolved {
    pub workloads: Vec<Arc<Workload>>,
    pub sans: Vec<String>,
}

fn endpoints(state: &State, svc: &Service) -> Vec<Arc<Workload>> {
    state
        .healthy_endpoints(svc)
        .filter(|e| !e.workload.workload_ips.is_empty())
        .map(|e| e.workload.clone())
        .collect()
}

/// Whether a pod with addresses `source` is one of the waypoint's workloads.
pub fn is_from(candidates: &[Arc<Workload>], source: &[IpAddr]) -> bool {
    candidates
        .iter()
        .any(|w| w.workload_ips.iter().any(|ip| source.contains(ip)))
}
