//! What a refused resource still tells: the addresses and names an
//! Address claims (refused with it, never passed through), and the
//! stand-in a refused policy leaves (failing closed where it applies).
//! Read leniently: the resource is refused because something in it is
//! wrong.

use super::*;

/// What an Address claims (its IPs, VIPs, VIP ranges and names), read
/// leniently from a resource that may be refused: so that a refused
/// resource's addresses are refused too, not passed through.
pub fn claims_of(a: &pb::Address) -> Claims {
    let ip = |b: &[u8]| ip_from(b).ok();
    match &a.r#type {
        Some(pb::address::Type::Workload(w)) => Claims {
            addresses: if w.network_mode == pb::NetworkMode::HostNetwork as i32 {
                Vec::new()
            } else {
                w.addresses
                    .iter()
                    .filter_map(|b| ip(b))
                    .map(|address| NetworkAddress {
                        network: Name::intern(&w.network),
                        address,
                    })
                    .collect()
            },
            ranges: Vec::new(),
            hosts: [w.hostname.clone()]
                .into_iter()
                .filter(|h| !h.is_empty())
                .collect(),
        },
        Some(pb::address::Type::Service(s)) => {
            let mut claims = Claims {
                hosts: vec![format!("{}/{}", s.namespace, s.hostname)],
                ..Claims::default()
            };
            for a in &s.addresses {
                let Some(address) = ip(&a.address) else {
                    continue;
                };
                let full = if address.is_ipv4() { 32 } else { 128 };
                match a.length {
                    Some(l) if l < full => claims.ranges.push(NetworkCidr {
                        network: a.network.clone(),
                        cidr: Cidr {
                            net: address,
                            len: l as u8,
                        },
                    }),
                    _ => claims.addresses.push(NetworkAddress {
                        network: Name::intern(&a.network),
                        address,
                    }),
                }
            }
            claims
        }
        None => Claims::default(),
    }
}

/// What a resource that could not even be decoded claims, from its name:
/// a `network/IP` (an on-demand name) or a service's `namespace/hostname`.
/// A workload's uid names no address.
pub fn claims_of_name(name: &str) -> Claims {
    if let Ok(a) = NetworkAddress::try_from(name.to_string()) {
        return Claims {
            addresses: vec![a],
            ..Claims::default()
        };
    }
    match name.split_once('/') {
        Some((ns, host)) if !ns.is_empty() && !host.is_empty() && !host.contains('/') => Claims {
            hosts: vec![name.to_string()],
            ..Claims::default()
        },
        _ => Claims::default(),
    }
}

/// The stand-in for a policy that was refused, from what could be read of
/// it (`decoded`) or from its xDS name (`namespace/name`): its scope where
/// known (else only where a workload names it), its action where known
/// (else DENY), no rules. It fails closed where it applies (see
/// [`Authorization::refused`]).
pub fn refused_policy(
    decoded: Option<&pb_sec::Authorization>,
    name: &str,
    reason: &str,
) -> Authorization {
    let Some(a) = decoded.filter(|a| !a.name.is_empty()) else {
        return Authorization::refused_stand_in(name, reason.to_string());
    };
    Authorization {
        name: a.name.clone(),
        namespace: a.namespace.clone(),
        scope: match pb_sec::Scope::try_from(a.scope) {
            Ok(pb_sec::Scope::Global) => PolicyScope::Global,
            Ok(pb_sec::Scope::Namespace) => PolicyScope::Namespace,
            Ok(pb_sec::Scope::WorkloadSelector) | Err(_) => PolicyScope::WorkloadSelector,
        },
        action: match pb_sec::Action::try_from(a.action) {
            Ok(pb_sec::Action::Allow) => PolicyAction::Allow,
            Ok(pb_sec::Action::Deny) | Err(_) => PolicyAction::Deny,
        },
        rules: Vec::new(),
        dry_run: a.dry_run,
        refused: Some(reason.to_string()),
    }
}
