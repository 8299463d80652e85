//! Where a connection goes, as pure decisions over a state snapshot: a
//! service VIP to one of its endpoints, a workload to its own proxy or
//! through its waypoint, anything unknown out of the mesh. No I/O: the
//! listeners (`outbound`, `inbound`) act on what these functions decide.

pub mod endpoints;
pub mod gateway;
pub mod waypoint;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::constants::{HBONE_PORT, SELF_CALL_PORTS};
use crate::identity::Identity;
use crate::xds::types::{same_text, GatewayAddress, LbMode, Protocol, Service, Workload};
use crate::xds::State;
use endpoints::{Need, Place};

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
    /// A service endpoint on another network, through that network's
    /// gateway: HBONE to the gateway (`gateway`, checked against
    /// `gateway_identities`) carrying a CONNECT to `host`:`port`, inside
    /// which mutual TLS to the destination's proxy (checked against
    /// `identities`) and the same CONNECT again ("double HBONE").
    /// With `waypoint`, the endpoint is the service's waypoint's (the
    /// CONNECT still names the service), checked against the waypoint
    /// service's identities.
    Gateway {
        gateway: SocketAddr,
        gateway_identities: Vec<Identity>,
        host: String,
        port: u16,
        identities: Vec<Identity>,
        workload: Arc<Workload>,
        service: Arc<Service>,
        waypoint: bool,
    },
    /// Plain TCP to a known workload that is not meshed.
    Tcp {
        target: SocketAddr,
        workload: Arc<Workload>,
        service: Option<Arc<Service>>,
    },
    /// Not in the mesh (or a service in PASSTHROUGH mode): straight to the
    /// original destination.
    Passthrough { target: SocketAddr },
    /// A service with no endpoint this client may use for that port.
    NoEndpoint {
        service: Arc<Service>,
        reason: String,
    },
    /// The destination has a waypoint that cannot be reached: refused,
    /// never sent around the waypoint.
    NoWaypoint { reason: String },
    /// A pod's connection to one of the proxy's own ports, on loopback or
    /// its own address: passed through, it would reach the proxy again.
    SelfCall,
    /// The destination's resource was refused (NACKed): refused too,
    /// never passed through.
    Refused { resource: String, reason: String },
    /// A service endpoint reached by hostname: resolve it (on demand), then
    /// route to the address as to any workload.
    Hostname {
        workload: Arc<Workload>,
        port: u16,
        service: Arc<Service>,
    },
    /// A workload on another network, called by its address: refused,
    /// never dialled across networks (another network is reached only
    /// through its gateway, by a service's name).
    OtherNetwork {
        workload: Arc<Workload>,
        reason: String,
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
    /// With the namespace, finds the client's own workload (its place, for
    /// load balancing) when its addresses do not.
    pub name: &'a str,
    /// Tells a waypoint's own traffic.
    pub ips: &'a [IpAddr],
}

impl<'a> Client<'a> {
    /// The client's own workload, by address, else by name.
    fn workload(&self, state: &'a State, network: &str) -> Option<&'a Workload> {
        self.ips
            .iter()
            .find_map(|ip| state.workload_by_addr(network, *ip))
            .filter(|w| w.namespace == self.namespace)
            .or_else(|| state.workload_by_name(self.namespace, self.name))
            .map(Arc::as_ref)
    }
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
    if is_self_call(client.ips, dst) {
        return Route::SelfCall;
    }
    let place = Place::of(client.workload(state, network), network);
    let hop = Hop {
        state,
        place: &place,
        source: client.ips,
        dst,
        td: trust_domain,
    };
    if let Some(svc) = state.service_by_vip(network, dst.ip(), Some(client.namespace)) {
        if let Some(gw) = waypoint::of_service(svc) {
            if let Some(r) = hop.via_waypoint(&gw, Some(svc)) {
                return r;
            }
        }
        return to_service(&hop, svc);
    }
    if let Some(w) = state.workload_by_addr(network, dst.ip()) {
        if let Some(gw) = &w.waypoint {
            if let Some(r) = hop.via_waypoint(gw, None) {
                return r;
            }
        }
        return to_workload(w.clone(), dst, None, trust_domain);
    }
    if let Some(w) = state.workload_elsewhere(network, dst.ip()) {
        let reason = format!(
            "{} is workload {}/{} on network {:?}: reached only through its gateway, by one of its services' names",
            dst.ip(),
            w.namespace,
            w.name,
            w.network
        );
        return Route::OtherNetwork {
            workload: w.clone(),
            reason,
        };
    }
    match state.refused_at(network, dst.ip()) {
        Some(r) => Route::Refused {
            resource: r.resource.clone(),
            reason: r.reason.clone(),
        },
        None => Route::Passthrough { target: dst },
    }
}

/// Whether `dst` is one of the proxy's own ports on the pod's loopback, an
/// unspecified address (the kernel's "this host") or one of `pod_ips`.
pub fn is_self_call(pod_ips: &[IpAddr], dst: SocketAddr) -> bool {
    let ip = match dst.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(dst.ip()),
        v4 => v4,
    };
    SELF_CALL_PORTS.contains(&dst.port())
        && (ip.is_loopback() || ip.is_unspecified() || pod_ips.contains(&ip))
}

/// What every step of one routing decision shares.
struct Hop<'a> {
    state: &'a State,
    place: &'a Place<'a>,
    source: &'a [IpAddr],
    dst: SocketAddr,
    td: &'a str,
}

/// A connection to a service's VIP (or VIP range): one of its endpoints,
/// chosen by the service's load-balancing rules, at the port it maps.
fn to_service(hop: &Hop<'_>, svc: &Arc<Service>) -> Route {
    let dst = hop.dst;
    let no_endpoint = |reason: String| Route::NoEndpoint {
        service: svc.clone(),
        reason,
    };
    if svc
        .load_balancing
        .as_ref()
        .is_some_and(|lb| lb.mode == LbMode::Passthrough)
    {
        return Route::Passthrough { target: dst };
    }
    let Some(&svc_target) = svc.ports.get(&dst.port()) else {
        return no_endpoint(format!("service {} has no port {}", svc.key(), dst.port()));
    };
    let ep = match endpoints::choose(hop.state, svc, hop.place, Need::Port(dst.port())) {
        Ok(ep) => ep,
        Err(reason) => return no_endpoint(reason),
    };
    if !same_text(&ep.workload.network, hop.place.network) {
        // Chosen only with its network's gateway (endpoints::choose).
        return match gateway::resolve(hop.state, svc, &ep.workload, dst.ip(), hop.td) {
            Ok(t) => through(t, (ep.workload.clone(), svc.clone(), dst.port()), false),
            Err(reason) => no_endpoint(format!("service {}: {reason}", svc.key())),
        };
    }
    let port = match ep.ports.get(&dst.port()).copied().unwrap_or(svc_target) {
        0 => dst.port(),
        p => p,
    };
    if ep.workload.workload_ips.is_empty() {
        // Reached by name: resolved when the connection needs it.
        return Route::Hostname {
            workload: ep.workload.clone(),
            port,
            service: svc.clone(),
        };
    }
    let Some(ip) = endpoints::address_for(&ep.workload, dst.ip(), svc.ip_families) else {
        return no_endpoint(format!(
            "endpoint {}/{} has no address in the service's families ({})",
            ep.workload.namespace,
            ep.workload.name,
            svc.ip_families.map(|f| f.to_string()).unwrap_or_default()
        ));
    };
    to_workload(
        ep.workload.clone(),
        SocketAddr::new(ip, port),
        Some(svc.clone()),
        hop.td,
    )
}

impl Hop<'_> {
    /// HBONE to the waypoint `gw` with the original destination as the
    /// CONNECT authority, checking the waypoint's identity; `None` when
    /// the source is the waypoint itself (its traffic goes on to the
    /// destination). A waypoint service's endpoint is chosen as any
    /// service's is, on the caller's address family.
    fn via_waypoint(&self, gw: &GatewayAddress, service: Option<&Arc<Service>>) -> Option<Route> {
        let refuse = |reason| Some(Route::NoWaypoint { reason });
        let resolved = match waypoint::resolve(self.state, gw) {
            Ok(r) => r,
            Err(reason) => return refuse(reason),
        };
        if resolved.is_from(self.state, self.source) {
            return None;
        }
        let (w, sans, ip) = match resolved {
            // Named by an address on another network: reached only
            // through that network's gateway, never dialled directly.
            waypoint::Resolved::Workload(w, _) if !same_text(&w.network, self.place.network) => {
                return refuse(format!(
                    "waypoint {} is on network {:?}, reached only through its gateway, which Ambit does not take yet",
                    gw.destination, w.network
                ));
            }
            waypoint::Resolved::Workload(w, at) => (w.clone(), &[][..], Some(at)),
            waypoint::Resolved::Service(wsvc) => {
                match endpoints::choose(self.state, wsvc, self.place, Need::Waypoint) {
                    // A waypoint on another network (istiod sends a global
                    // waypoint service's endpoints there as one workload
                    // with the gateway): through the gateway, naming the
                    // service the client asked for, as ztunnel does; it
                    // takes only service traffic, which names one.
                    Ok(ep) if !same_text(&ep.workload.network, self.place.network) => {
                        let Some(svc) = service else {
                            return refuse(format!(
                                "waypoint {} is on network {:?}: through its gateway it takes only traffic to a service",
                                gw.destination, ep.workload.network
                            ));
                        };
                        let dst = self.dst;
                        return Some(
                            match gateway::resolve(
                                self.state,
                                wsvc,
                                &ep.workload,
                                dst.ip(),
                                self.td,
                            ) {
                                Ok(t) => {
                                    through(t, (ep.workload.clone(), svc.clone(), dst.port()), true)
                                }
                                Err(reason) => Route::NoWaypoint {
                                    reason: format!("waypoint {}: {reason}", gw.destination),
                                },
                            },
                        );
                    }
                    Ok(ep) => (
                        ep.workload.clone(),
                        &wsvc.subject_alt_names[..],
                        endpoints::address_for(&ep.workload, self.dst.ip(), wsvc.ip_families),
                    ),
                    Err(reason) => return refuse(format!("waypoint {}: {reason}", gw.destination)),
                }
            }
        };
        let Some(ip) = ip else {
            return refuse(format!(
                "waypoint {} ({}/{}) has no address",
                gw.destination, w.namespace, w.name
            ));
        };
        let mut identities = vec![w.identity(self.td)];
        identities.extend(sans.iter().filter_map(|s| s.parse::<Identity>().ok()));
        Some(Route::Hbone {
            proxy: SocketAddr::new(ip, gw.hbone_mtls_port),
            target: self.dst,
            identities,
            workload: w,
            service: service.cloned(),
            waypoint: true,
        })
    }
}

/// The route through another network's gateway `t` to `workload`, an
/// endpoint of `service` (or of its waypoint's service), for service port
/// `port`: the CONNECT names the service.
fn through(
    t: gateway::Through,
    (workload, service, port): (Arc<Workload>, Arc<Service>, u16),
    waypoint: bool,
) -> Route {
    Route::Gateway {
        gateway: t.gateway,
        gateway_identities: t.gateway_identities,
        host: service.hostname.to_string(),
        port,
        identities: t.identities,
        workload,
        service,
        waypoint,
    }
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
