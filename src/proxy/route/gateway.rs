//! A service's endpoint on another network, reached through that network's
//! gateway, as ztunnel reaches it ("double HBONE"): which gateway, at which
//! address and port, checked against which identities, and which identities
//! the destination's proxy must prove at the end of the inner tunnel. Pure:
//! no I/O. Another network's address is never dialled directly, and what
//! cannot be resolved is refused with its reason.

use std::net::{IpAddr, SocketAddr};

use super::endpoints::{self, Need, Place};
use super::waypoint;
use crate::identity::Identity;
use crate::xds::types::{same_text, GatewayDestination, Service, Workload};
use crate::xds::State;

/// How a connection reaches an endpoint on another network: the gateway's
/// address and identities, and the identities the destination's proxy
/// must prove inside the tunnel.
#[derive(Debug, Clone)]
pub struct Through {
    pub gateway: SocketAddr,
    pub gateway_identities: Vec<Identity>,
    pub identities: Vec<Identity>,
}

/// How to reach `w`, an endpoint of `svc` (a service, or a waypoint's
/// service) on another network than the client's, for a connection first
/// sent to `original`: an outer HBONE connection to `w`'s network gateway,
/// checked against the gateway's identity, carrying an inner one checked
/// against `svc`'s identities. An error, the reason, when the network
/// names no gateway, when the gateway cannot be found on that network,
/// when it is the destination or `svc` itself, or when nothing could
/// verify the destination.
pub fn resolve(
    state: &State,
    svc: &Service,
    w: &Workload,
    original: IpAddr,
    td: &str,
) -> Result<Through, String> {
    let Some(gw) = w.network_gateway() else {
        return Err(format!(
            "endpoint {}/{} is on network {:?}, with no gateway to it",
            w.namespace, w.name, w.network
        ));
    };
    if let GatewayDestination::Address(a) = &gw.destination {
        if !same_text(&a.network, &w.network) {
            return Err(format!(
                "gateway {} is on network {:?}, not the endpoint's {:?}",
                gw.destination, a.network, w.network
            ));
        }
    }
    let at = match waypoint::resolve_as(state, gw, "network gateway") {
        Ok(r) => r,
        Err(reason) => return Err(format!("{reason} (network {:?})", w.network)),
    };
    // The gateway: one workload at the address named, or one endpoint of
    // the gateway's service (its HBONE port a service port), both on the
    // destination's network.
    let (gateway, mut gateway_ids, addr) = match at {
        waypoint::Resolved::Workload(g, ip) => {
            (g.clone(), Vec::new(), Some((ip, gw.hbone_mtls_port)))
        }
        waypoint::Resolved::Service(gsvc) => {
            if gsvc.key() == svc.key() {
                return Err(format!(
                    "its gateway {} is the service itself",
                    gw.destination
                ));
            }
            let there = Place {
                network: &w.network,
                ..Place::default()
            };
            let hbone = gw.hbone_mtls_port;
            let ep = match endpoints::choose(state, gsvc, &there, Need::Port(hbone)) {
                Ok(ep) => ep,
                Err(reason) => return Err(format!("network gateway {}: {reason}", gw.destination)),
            };
            let target = gsvc.ports.get(&hbone).copied().unwrap_or(0);
            let port = match ep.ports.get(&hbone).copied().unwrap_or(target) {
                0 => hbone,
                p => p,
            };
            let sans = gsvc.subject_alt_names.iter().filter_map(|s| s.parse().ok());
            let ip = endpoints::address_for(&ep.workload, original, gsvc.ip_families);
            (ep.workload.clone(), sans.collect(), ip.map(|ip| (ip, port)))
        }
    };
    if gateway.uid == w.uid
        || (!w.workload_ips.is_empty() && w.workload_ips == gateway.workload_ips)
    {
        return Err(format!(
            "its gateway {} is the endpoint itself",
            gw.destination
        ));
    }
    if !same_text(&gateway.network, &w.network) {
        return Err(format!(
            "gateway {} is on network {:?}, not the endpoint's {:?}",
            gw.destination, gateway.network, w.network
        ));
    }
    let Some((ip, gw_port)) = addr else {
        return Err(format!("network gateway {} has no address", gw.destination));
    };
    gateway_ids.insert(0, gateway.identity(td));
    // The destination's proxy proves one of the service's identities (for
    // a global service, istiod lists every network's); an endpoint sent
    // with its own addresses and account may prove its own.
    let mut identities: Vec<Identity> = svc
        .subject_alt_names
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    if !w.workload_ips.is_empty() && !w.service_account.is_empty() {
        identities.push(w.identity(td));
    }
    if identities.is_empty() {
        return Err(format!(
            "no identity to verify its endpoints on network {:?} by (the service lists no subjectAltNames)",
            w.network
        ));
    }
    Ok(Through {
        gateway: SocketAddr::new(ip, gw_port),
        gateway_identities: gateway_ids,
        identities,
    })
}
