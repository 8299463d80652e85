//! Where a connection goes, as pure decisions over a state snapshot: a
//! service VIP to one of its endpoints, a workload to its own proxy or
//! through its waypoint, anything unknown out of the mesh. No I/O: the
//! listeners (`outbound`, `inbound`) act on what these functions decide.

pub mod waypoint;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::constants::HBONE_PORT;
use crate::identity::Identity;
use crate::xds::types::{GatewayAddress, Protocol, Service, Workload};
use crate::xds::State;

/// Where an outbound connection goes.
#[derive(Debug, Clone)]
pub enum Route {
    /// Mutual TLS + CONNECT to the destination pod's proxy, or to the
    /// destination's waypoint (`workload` is then the waypoint's, and
    /// `target`, the CONNECT authority, is still the original destination).
    Hbone {
        proxy: SocketAddr,
        target: SocketAddr,
        identities: Vec<Identity>,
        workload: Arc<Workload>,
        service: Option<Arc<Service>>,
        waypoint: bool,
    },
    /// Plain TCP to a known workload that is not meshed.
    Tcp {
        target: SocketAddr,
        workload: Arc<Workload>,
        service: Option<Arc<Service>>,
    },
    /// Not in the mesh: straight to the original destination.
    Passthrough { target: SocketAddr },
    /// A service with no healthy endpoint for that port.
    NoEndpoint { service: Arc<Service> },
    /// The destination has a waypoint that cannot be reached: refused,
    /// never sent around the waypoint.
    NoWaypoint { reason: String },
    /// A service endpoint reached by hostname: resolve it (on demand), then
    /// route to the address as to any workload.
    Hostname {
        workload: Arc<Workload>,
        port: u16,
        service: Arc<Service>,
    },
    /// A hostname that did not resolve.
    Unresolved {
        workload: Arc<Workload>,
        reason: String,
    },
}

/// The pod a connection comes from, as routing sees it.
#[derive(Debug, Clone, Copy)]
pub struct Client<'a> {
    /// Picks among services sharing a VIP, and hides other namespaces'
    /// namespace-only services.
    pub namespace: &'a str,
    /// Tells a waypoint's own traffic.
    pub ips: &'a [IpAddr],
}

/// Decides the route of a connection from `client` to `dst` (pure: reads
/// only `state`).
pub fn route(
    state: &State,
    network: &str,
    client: Client<'_>,
    dst: SocketAddr,
    trust_domain: &str,
) -> Route {
    let source = client.ips;
    if let Some(svc) = state.service_by_vip(network, dst.ip(), Some(client.namespace)) {
        if let Some(gw) = waypoint::of_service(svc) {
            if let Some(r) = via_waypoint(state, &gw, source, dst, Some(svc), trust_domain) {
                return r;
            }
        }
        let Some(&svc_target) = svc.ports.get(&dst.port()) else {
            return Route::NoEndpoint {
                service: svc.clone(),
            };
        };
        let endpoints: Vec<_> = state
            .healthy_endpoints(svc)
            .filter(|e| !e.workload.workload_ips.is_empty() || !e.workload.hostname.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Route::NoEndpoint {
                service: svc.clone(),
            };
        }
        let ep = endpoints[fastrand::usize(..endpoints.len())];
        let port = match ep.ports.get(&dst.port()).copied().unwrap_or(svc_target) {
            0 => dst.port(),
            p => p,
        };
        let Some(&ip) = ep.workload.workload_ips.first() else {
            // Reached by name: resolved when the connection needs it.
            return Route::Hostname {
                workload: ep.workload.clone(),
                port,
                service: svc.clone(),
            };
        };
        let target = SocketAddr::new(ip, port);
        return to_workload(ep.workload.clone(), target, Some(svc.clone()), trust_domain);
    }
    match state.workload_by_addr(network, dst.ip()) {
        Some(w) => {
            if let Some(gw) = &w.waypoint {
                if let Some(r) = via_waypoint(state, gw, source, dst, None, trust_domain) {
                    return r;
                }
            }
            to_workload(w.clone(), dst, None, trust_domain)
        }
        None => Route::Passthrough { target: dst },
    }
}

/// HBONE to the waypoint `gw` with the original destination `dst` as the
/// CONNECT authority, checking the waypoint's identity; `None` when the
/// source is the waypoint itself (its traffic goes on to the destination).
fn via_waypoint(
    state: &State,
    gw: &GatewayAddress,
    source: &[IpAddr],
    dst: SocketAddr,
    service: Option<&Arc<Service>>,
    td: &str,
) -> Option<Route> {
    let resolved = match waypoint::resolve(state, gw) {
        Ok(r) => r,
        Err(reason) => return Some(Route::NoWaypoint { reason }),
    };
    let candidates = &resolved.workloads;
    if waypoint::is_from(candidates, source) {
        return None;
    }
    let w = candidates[fastrand::usize(..candidates.len())].clone();
    let mut identities = vec![w.identity(td)];
    identities.extend(
        resolved
            .sans
            .iter()
            .filter_map(|s| s.parse::<Identity>().ok()),
    );
    Some(Route::Hbone {
        proxy: SocketAddr::new(w.workload_ips[0], gw.hbone_mtls_port),
        target: dst,
        identities,
        workload: w,
        service: service.cloned(),
        waypoint: true,
    })
}

pub fn to_workload(
    workload: Arc<Workload>,
    target: SocketAddr,
    service: Option<Arc<Service>>,
    td: &str,
) -> Route {
    match workload.protocol {
        Protocol::Hbone => {
            let mut identities = vec![workload.identity(td)];
            for san in service.iter().flat_map(|s| &s.subject_alt_names) {
                if let Ok(id) = san.parse::<Identity>() {
                    identities.push(id);
                }
            }
            Route::Hbone {
                proxy: SocketAddr::new(target.ip(), HBONE_PORT),
                target,
                identities,
                workload,
                service,
                waypoint: false,
            }
        }
        Protocol::Tcp => Route::Tcp {
            target,
            workload,
            service,
        },
    }
}

#[cfg(test)]
mod tests;
