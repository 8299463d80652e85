//! Waypoints on the outbound path, as pure decisions over a state snapshot:
//! which waypoint a service or workload names (one, or one of several by
//! weight; by address or, as istiod names them, by service hostname), what
//! stands behind it, and whether the connection comes from the waypoint
//! itself (then it goes straight to the destination, never back to the
//! waypoint). No I/O.

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

/// What stands behind a waypoint: one workload, at the address it was
/// named by, or a service whose endpoints are chosen per connection (by
/// the same rules as any service's).
pub enum Resolved<'a> {
    Workload(&'a Arc<Workload>, IpAddr),
    Service(&'a Arc<Service>),
}

/// What `gw` names: the workload at its address, or the service it names
/// by address or by hostname. An error says why there is none; the caller
/// refuses the connection rather than bypass the waypoint.
pub fn resolve<'a>(state: &'a State, gw: &GatewayAddress) -> Result<Resolved<'a>, String> {
    resolve_as(state, gw, "waypoint")
}

/// [`resolve`], its errors naming `gw` as `what` (a waypoint, a network
/// gateway).
pub fn resolve_as<'a>(
    state: &'a State,
    gw: &GatewayAddress,
    what: &str,
) -> Result<Resolved<'a>, String> {
    match &gw.destination {
        GatewayDestination::Address(a) => {
            if let Some(w) = state.workload_by_addr(&a.network, a.address) {
                return Ok(Resolved::Workload(w, a.address));
            }
            match state.service_by_vip(&a.network, a.address, None) {
                Some(svc) => Ok(Resolved::Service(svc)),
                None => Err(match state.refused_at(&a.network, a.address) {
                    Some(r) => format!("{what} {a} was refused: {}", r.reason),
                    None => format!("{what} {a} is not known"),
                }),
            }
        }
        GatewayDestination::Hostname {
            namespace,
            hostname,
        } => {
            let key = format!("{namespace}/{hostname}");
            match state.service_by_host(&key) {
                Some(svc) => Ok(Resolved::Service(svc)),
                None => Err(match state.refused_host(&key) {
                    Some(r) => format!("{what} service {key} was refused: {}", r.reason),
                    None => format!("{what} service {key} is not known"),
                }),
            }
        }
    }
}

impl Resolved<'_> {
    /// Whether a pod with addresses `source` is one of the waypoint's
    /// workloads (any endpoint, healthy or not: its own traffic never
    /// goes back to a waypoint).
    pub fn is_from(&self, state: &State, source: &[IpAddr]) -> bool {
        let mine = |w: &Workload| w.workload_ips.iter().any(|ip| source.contains(ip));
        match self {
            Resolved::Workload(w, _) => mine(w),
            Resolved::Service(svc) => state.endpoints(svc).any(|e| mine(&e.workload)),
        }
    }
}
