//! Which endpoint of a service takes a connection, as ztunnel chooses:
//! endpoints a client cannot use are dropped (unhealthy unless the service
//! allows all, no address, another network, no such port), the rest ranked
//! by the service's routing preferences against the client's own place
//! (STRICT keeps those that share every scope, FAILOVER the best rank
//! present), and one is drawn in proportion to its capacity (capacity 0:
//! never, and it holds no rank). The same code
//! chooses for service VIPs and for waypoint services. Pure: no I/O.

use std::net::IpAddr;

use crate::xds::types::{
    same_text, HealthStatus, IpFamilies, LbHealthPolicy, LbMode, LbScope, Locality, Service,
    Workload,
};
use crate::xds::Endpoint;
use crate::xds::State;

/// Where the client pod stands, as its own workload says (empty fields
/// where the state does not know it yet).
#[derive(Debug, Clone, Copy, Default)]
pub struct Place<'a> {
    pub network: &'a str,
    pub node: &'a str,
    pub cluster: &'a str,
    pub locality: Option<&'a Locality>,
}

impl<'a> Place<'a> {
    /// The place of `workload`, or of an unknown client on `network`.
    pub fn of(workload: Option<&'a Workload>, network: &'a str) -> Place<'a> {
        match workload {
            Some(w) => Place {
                network: &w.network,
                node: &w.node,
                cluster: &w.cluster_id,
                locality: Some(&w.locality),
            },
            None => Place {
                network,
                ..Place::default()
            },
        }
    }

    fn shares(&self, scope: LbScope, w: &Workload) -> bool {
        let loc = |f: fn(&Locality) -> &str| same_text(self.locality.map_or("", f), f(&w.locality));
        match scope {
            LbScope::Region => loc(|l| &l.region),
            LbScope::Zone => loc(|l| &l.zone),
            LbScope::Subzone => loc(|l| &l.subzone),
            LbScope::Node => same_text(self.node, &w.node),
            LbScope::Cluster => same_text(self.cluster, &w.cluster_id),
            LbScope::Network => same_text(self.network, &w.network),
        }
    }
}

/// What the connection needs of an endpoint.
#[derive(Debug, Clone, Copy)]
pub enum Need {
    /// A service port: the endpoint must map it (the service's target
    /// port, or the endpoint's own), and have an address or a hostname.
    Port(u16),
    /// A waypoint: reached on its HBONE port at one of its addresses.
    Waypoint,
}

/// How good an endpoint is for a client under the service's preferences:
/// the number of scopes it shares, in order, up to the first it does not.
/// With NETWORK first, a same-network endpoint outranks every other, and
/// among the rest the other scopes still rank (as ztunnel does). `None`
/// under STRICT when it does not share every scope.
fn rank(service: &Service, client: &Place<'_>, w: &Workload) -> Option<usize> {
    let Some(lb) = &service.load_balancing else {
        return Some(0);
    };
    let prefs = &lb.routing_preferences;
    let network_first = prefs.first() == Some(&LbScope::Network);
    let mut rank = 0;
    let mut bonus = 0;
    for &scope in prefs {
        let shared = client.shares(scope, w);
        if scope == LbScope::Network && network_first {
            if !shared {
                continue;
            }
            bonus = prefs.len() - 1;
        }
        if !shared {
            break;
        }
        rank += 1;
    }
    if lb.mode == LbMode::Strict && rank != prefs.len() {
        return None;
    }
    Some(rank + bonus)
}

/// The endpoint of `service` that takes this connection: of the usable
/// endpoints of the best rank, one drawn in proportion to its capacity, in
/// one pass with no allocation (a weighted reservoir: each endpoint of the
/// best rank seen so far replaces the pick with probability weight/total,
/// which leaves each with weight/total at the end). An error says why
/// there is none.
pub fn choose<'a>(
    state: &'a State,
    service: &Service,
    client: &Place<'_>,
    need: Need,
) -> Result<&'a Endpoint, String> {
    let lb = service.load_balancing.as_ref();
    let allow_unhealthy = lb.is_some_and(|l| l.health_policy == LbHealthPolicy::AllowAll);
    // The same for every endpoint: asked once.
    let service_has_port = match need {
        Need::Port(port) => service.ports.contains_key(&port),
        Need::Waypoint => true,
    };
    let (mut seen, mut healthy, mut reachable, mut weighted) = (0, 0, 0, 0);
    // Healthy endpoints on other networks, and those of them whose
    // network names a gateway.
    let (mut remote, mut gated) = (0, 0);
    // The best rank so far, the weight of its endpoints, and the pick.
    let mut best: Option<(usize, u64, &Endpoint)> = None;
    for ep in state.endpoints(service) {
        let w = &ep.workload;
        seen += 1;
        if w.status != HealthStatus::Healthy && !allow_unhealthy {
            continue;
        }
        healthy += 1;
        let addressed = match need {
            Need::Port(_) => !w.workload_ips.is_empty() || !w.hostname.is_empty(),
            Need::Waypoint => !w.workload_ips.is_empty(),
        };
        // Another network is reached only through its gateway, never
        // dialled directly: its endpoints (istiod sends them as one
        // workload with no address and the gateway, ztunnel's "split
        // horizon") are candidates when their network names a gateway
        // (route::gateway takes them there), for a service or a waypoint.
        if !same_text(&w.network, client.network) {
            remote += 1;
            gated += usize::from(w.network_gateway().is_some());
            if w.network_gateway().is_none() {
                continue;
            }
        } else if !addressed {
            continue;
        }
        if let Need::Port(port) = need {
            if !service_has_port && !ep.ports.contains_key(&port) {
                continue;
            }
        }
        reachable += 1;
        // Capacity 0 takes no traffic, so it holds no rank either: a
        // draining endpoint in the client's zone does not keep FAILOVER
        // from the next zone (ztunnel ranks it, then finds no weight).
        let weight = w.weight();
        if weight == 0 {
            continue;
        }
        weighted += 1;
        let Some(r) = rank(service, client, w) else {
            continue;
        };
        best = match best {
            Some((b, _, _)) if r < b => best,
            Some((b, total, pick)) if r == b => {
                let total = total + weight;
                let keep = fastrand::u64(..total) >= weight;
                Some((b, total, if keep { pick } else { ep }))
            }
            _ => Some((r, weight, ep)),
        };
    }
    if let Some((_, _, pick)) = best {
        return Ok(pick);
    }
    let key = service.key();
    Err(if seen == 0 {
        format!("service {key} has no endpoint")
    } else if healthy == 0 {
        format!("service {key} has no healthy endpoint")
    } else if reachable == 0 {
        let port = match need {
            Need::Port(p) => format!(" with port {p}"),
            Need::Waypoint => String::new(),
        };
        let others = match (remote, gated) {
            (0, _) => String::new(),
            (_, 0) => format!("; {remote} on other networks, with no gateway to them"),
            _ => format!("; {remote} on other networks, without the port"),
        };
        format!("service {key} has no healthy endpoint reachable on this network{port}{others}")
    } else if weighted == 0 {
        format!("service {key}: every endpoint it may use has capacity 0")
    } else {
        let prefs: Vec<String> = lb
            .map(|l| {
                l.routing_preferences
                    .iter()
                    .map(|p| p.to_string())
                    .collect()
            })
            .unwrap_or_default();
        format!(
            "service {key}: load balancing STRICT over [{}] leaves no endpoint that shares them with the client",
            prefs.join(", ")
        )
    })
}

/// Which of a workload's addresses to dial for a connection first sent to
/// `original`: that address if it is the workload's, else one of the
/// family the service allows, the caller's family first. `None`: no
/// address the service allows.
pub fn address_for(
    workload: &Workload,
    original: IpAddr,
    families: Option<IpFamilies>,
) -> Option<IpAddr> {
    if workload.workload_ips.contains(&original) {
        return Some(original);
    }
    let allowed = || {
        workload
            .workload_ips
            .iter()
            .copied()
            .filter(move |ip| families.is_none_or(|f| f.admits(*ip)))
    };
    allowed()
        .find(|ip| ip.is_ipv6() == original.is_ipv6())
        .or_else(|| allowed().next())
}
