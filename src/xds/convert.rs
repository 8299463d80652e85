//! Istio's xDS resources (protobuf) to and from Ambit's state types. Every
//! conversion of received data checks it and names what is wrong, so a bad
//! resource is rejected alone (NACKed) and the rest is applied.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use crate::proto::security as pb_sec;
use crate::proto::workload as pb;
use crate::xds::types::{
    Authorization, Cidr, HealthStatus, NetworkAddress, PolicyAction, PolicyScope, Protocol,
    RbacMatch, Service, ServiceAccountMatch, StringMatch, Workload,
};

pub const ADDRESS_TYPE: &str = "type.googleapis.com/istio.workload.Address";
pub const AUTHORIZATION_TYPE: &str = "type.googleapis.com/istio.security.Authorization";

fn ip_from(bytes: &[u8]) -> Result<IpAddr, String> {
    match bytes.len() {
        4 => Ok(IpAddr::from(
            <[u8; 4]>::try_from(bytes).map_err(|e| e.to_string())?,
        )),
        16 => Ok(IpAddr::from(
            <[u8; 16]>::try_from(bytes).map_err(|e| e.to_string())?,
        )),
        n => Err(format!("address of {n} bytes is neither IPv4 nor IPv6")),
    }
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn port(p: u32) -> Result<u16, String> {
    u16::try_from(p).map_err(|_| format!("port {p} is out of range"))
}

/// A decoded `istio.workload.Address`.
#[derive(Debug, Clone, PartialEq)]
pub enum AddressResource {
    Workload(Box<Workload>),
    Service(Box<Service>),
}

pub fn address_from_proto(a: pb::Address) -> Result<AddressResource, String> {
    match a.r#type {
        Some(pb::address::Type::Workload(w)) => {
            workload_from_proto(w).map(|w| AddressResource::Workload(Box::new(w)))
        }
        Some(pb::address::Type::Service(s)) => {
            service_from_proto(s).map(|s| AddressResource::Service(Box::new(s)))
        }
        None => Err("Address without a workload or a service".into()),
    }
}

pub fn workload_from_proto(w: pb::Workload) -> Result<Workload, String> {
    let protocol = match pb::TunnelProtocol::try_from(w.tunnel_protocol) {
        Ok(pb::TunnelProtocol::Hbone) => Protocol::Hbone,
        Ok(pb::TunnelProtocol::None) => Protocol::Tcp,
        Ok(pb::TunnelProtocol::LegacyIstioMtls) => {
            return Err("tunnel protocol LEGACY_ISTIO_MTLS is not supported".into())
        }
        Err(_) => return Err(format!("unknown tunnel protocol {}", w.tunnel_protocol)),
    };
    let mut services = HashMap::new();
    for (svc, list) in w.services {
        let mut ports = BTreeMap::new();
        for p in list.ports {
            ports.insert(port(p.service_port)?, port(p.target_port)?);
        }
        services.insert(svc, ports);
    }
    Ok(Workload {
        uid: w.uid,
        name: w.name,
        namespace: w.namespace,
        service_account: if w.service_account.is_empty() {
            "default".into()
        } else {
            w.service_account
        },
        trust_domain: w.trust_domain,
        workload_ips: w
            .addresses
            .iter()
            .map(|b| ip_from(b))
            .collect::<Result<_, _>>()?,
        protocol,
        node: w.node,
        network: w.network,
        cluster_id: w.cluster_id,
        canonical_name: w.canonical_name,
        canonical_revision: w.canonical_revision,
        workload_name: w.workload_name,
        status: if w.status == pb::WorkloadStatus::Unhealthy as i32 {
            HealthStatus::Unhealthy
        } else {
            HealthStatus::Healthy
        },
        services,
        authorization_policies: w.authorization_policies,
        ..Default::default()
    })
}

pub fn service_from_proto(s: pb::Service) -> Result<Service, String> {
    let mut ports = BTreeMap::new();
    for p in s.ports {
        ports.insert(port(p.service_port)?, port(p.target_port)?);
    }
    Ok(Service {
        name: s.name,
        namespace: s.namespace,
        hostname: s.hostname,
        vips: s
            .addresses
            .into_iter()
            .map(|a| {
                Ok(NetworkAddress {
                    network: a.network,
                    address: ip_from(&a.address)?,
                })
            })
            .collect::<Result<_, String>>()?,
        ports,
        subject_alt_names: s.subject_alt_names,
        ..Default::default()
    })
}

pub fn workload_to_proto(w: &Workload) -> pb::Address {
    let services = w
        .services
        .iter()
        .map(|(k, ports)| {
            let ports = ports
                .iter()
                .map(|(s, t)| pb::Port {
                    service_port: *s as u32,
                    target_port: *t as u32,
                })
                .collect();
            (k.clone(), pb::PortList { ports })
        })
        .collect();
    pb::Address {
        r#type: Some(pb::address::Type::Workload(pb::Workload {
            uid: w.uid.clone(),
            name: w.name.clone(),
            namespace: w.namespace.clone(),
            addresses: w.workload_ips.iter().map(|ip| ip_bytes(*ip)).collect(),
            network: w.network.clone(),
            tunnel_protocol: match w.protocol {
                Protocol::Hbone => pb::TunnelProtocol::Hbone as i32,
                Protocol::Tcp => pb::TunnelProtocol::None as i32,
            },
            trust_domain: w.trust_domain.clone(),
            service_account: w.service_account.clone(),
            node: w.node.clone(),
            canonical_name: w.canonical_name.clone(),
            canonical_revision: w.canonical_revision.clone(),
            workload_name: w.workload_name.clone(),
            authorization_policies: w.authorization_policies.clone(),
            status: match w.status {
                HealthStatus::Healthy => pb::WorkloadStatus::Healthy as i32,
                HealthStatus::Unhealthy => pb::WorkloadStatus::Unhealthy as i32,
            },
            cluster_id: w.cluster_id.clone(),
            services,
        })),
    }
}

pub fn service_to_proto(s: &Service) -> pb::Address {
    pb::Address {
        r#type: Some(pb::address::Type::Service(pb::Service {
            name: s.name.clone(),
            namespace: s.namespace.clone(),
            hostname: s.hostname.clone(),
            addresses: s
                .vips
                .iter()
                .map(|v| pb::NetworkAddress {
                    network: v.network.clone(),
                    address: ip_bytes(v.address),
                })
                .collect(),
            ports: s
                .ports
                .iter()
                .map(|(p, t)| pb::Port {
                    service_port: *p as u32,
                    target_port: *t as u32,
                })
                .collect(),
            subject_alt_names: s.subject_alt_names.clone(),
        })),
    }
}

fn string_match_from(m: pb_sec::StringMatch) -> Result<StringMatch, String> {
    use pb_sec::string_match::MatchType;
    match m.match_type {
        Some(MatchType::Exact(s)) => Ok(StringMatch::Exact(s)),
        Some(MatchType::Prefix(s)) => Ok(StringMatch::Prefix(s)),
        Some(MatchType::Suffix(s)) => Ok(StringMatch::Suffix(s)),
        Some(MatchType::Presence(_)) => Ok(StringMatch::Presence),
        None => Err("empty string match".into()),
    }
}

fn string_match_to(m: &StringMatch) -> pb_sec::StringMatch {
    use pb_sec::string_match::MatchType;
    pb_sec::StringMatch {
        match_type: Some(match m {
            StringMatch::Exact(s) => MatchType::Exact(s.clone()),
            StringMatch::Prefix(s) => MatchType::Prefix(s.clone()),
            StringMatch::Suffix(s) => MatchType::Suffix(s.clone()),
            StringMatch::Presence => MatchType::Presence(()),
        }),
    }
}

fn cidr_from(a: pb_sec::Address) -> Result<Cidr, String> {
    let net = ip_from(&a.address)?;
    let max = if net.is_ipv4() { 32 } else { 128 };
    let len = if a.length == 0 && a.address.is_empty() {
        0
    } else {
        a.length
    };
    if len > max {
        return Err(format!("prefix length {len} for {net}"));
    }
    Ok(Cidr {
        net,
        len: len as u8,
    })
}

fn cidr_to(c: &Cidr) -> pb_sec::Address {
    pb_sec::Address {
        address: ip_bytes(c.net),
        length: c.len as u32,
    }
}

fn sa_from(s: pb_sec::ServiceAccountMatch) -> ServiceAccountMatch {
    ServiceAccountMatch {
        namespace: s.namespace,
        service_account: s.service_account,
    }
}

fn sa_to(s: &ServiceAccountMatch) -> pb_sec::ServiceAccountMatch {
    pb_sec::ServiceAccountMatch {
        namespace: s.namespace.clone(),
        service_account: s.service_account.clone(),
    }
}

fn match_from(m: pb_sec::Match) -> Result<RbacMatch, String> {
    let strings = |v: Vec<pb_sec::StringMatch>| {
        v.into_iter()
            .map(string_match_from)
            .collect::<Result<Vec<_>, _>>()
    };
    let cidrs =
        |v: Vec<pb_sec::Address>| v.into_iter().map(cidr_from).collect::<Result<Vec<_>, _>>();
    let ports = |v: Vec<u32>| v.into_iter().map(port).collect::<Result<Vec<_>, _>>();
    Ok(RbacMatch {
        namespaces: strings(m.namespaces)?,
        not_namespaces: strings(m.not_namespaces)?,
        principals: strings(m.principals)?,
        not_principals: strings(m.not_principals)?,
        service_accounts: m.service_accounts.into_iter().map(sa_from).collect(),
        not_service_accounts: m.not_service_accounts.into_iter().map(sa_from).collect(),
        source_ips: cidrs(m.source_ips)?,
        not_source_ips: cidrs(m.not_source_ips)?,
        destination_ips: cidrs(m.destination_ips)?,
        not_destination_ips: cidrs(m.not_destination_ips)?,
        destination_ports: ports(m.destination_ports)?,
        not_destination_ports: ports(m.not_destination_ports)?,
    })
}

fn match_to(m: &RbacMatch) -> pb_sec::Match {
    let strings = |v: &[StringMatch]| v.iter().map(string_match_to).collect();
    let cidrs = |v: &[Cidr]| v.iter().map(cidr_to).collect();
    pb_sec::Match {
        namespaces: strings(&m.namespaces),
        not_namespaces: strings(&m.not_namespaces),
        principals: strings(&m.principals),
        not_principals: strings(&m.not_principals),
        source_ips: cidrs(&m.source_ips),
        not_source_ips: cidrs(&m.not_source_ips),
        destination_ips: cidrs(&m.destination_ips),
        not_destination_ips: cidrs(&m.not_destination_ips),
        destination_ports: m.destination_ports.iter().map(|p| *p as u32).collect(),
        not_destination_ports: m.not_destination_ports.iter().map(|p| *p as u32).collect(),
        service_accounts: m.service_accounts.iter().map(sa_to).collect(),
        not_service_accounts: m.not_service_accounts.iter().map(sa_to).collect(),
    }
}

pub fn authorization_from_proto(a: pb_sec::Authorization) -> Result<Authorization, String> {
    let scope = match pb_sec::Scope::try_from(a.scope) {
        Ok(pb_sec::Scope::Global) => PolicyScope::Global,
        Ok(pb_sec::Scope::Namespace) => PolicyScope::Namespace,
        Ok(pb_sec::Scope::WorkloadSelector) => PolicyScope::WorkloadSelector,
        Err(_) => return Err(format!("unknown scope {}", a.scope)),
    };
    let action = match pb_sec::Action::try_from(a.action) {
        Ok(pb_sec::Action::Allow) => PolicyAction::Allow,
        Ok(pb_sec::Action::Deny) => PolicyAction::Deny,
        Err(_) => return Err(format!("unknown action {}", a.action)),
    };
    let rules = a
        .rules
        .into_iter()
        .map(|r| {
            r.clauses
                .into_iter()
                .map(|c| {
                    c.matches
                        .into_iter()
                        .map(match_from)
                        .collect::<Result<Vec<_>, _>>()
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Authorization {
        name: a.name,
        namespace: a.namespace,
        scope,
        action,
        rules,
        dry_run: a.dry_run,
    })
}

pub fn authorization_to_proto(a: &Authorization) -> pb_sec::Authorization {
    pb_sec::Authorization {
        name: a.name.clone(),
        namespace: a.namespace.clone(),
        scope: match a.scope {
            PolicyScope::Global => pb_sec::Scope::Global as i32,
            PolicyScope::Namespace => pb_sec::Scope::Namespace as i32,
            PolicyScope::WorkloadSelector => pb_sec::Scope::WorkloadSelector as i32,
        },
        action: match a.action {
            PolicyAction::Allow => pb_sec::Action::Allow as i32,
            PolicyAction::Deny => pb_sec::Action::Deny as i32,
        },
        rules: a
            .rules
            .iter()
            .map(|r| pb_sec::Rule {
                clauses: r
                    .iter()
                    .map(|c| pb_sec::Clause {
                        matches: c.iter().map(match_to).collect(),
                    })
                    .collect(),
            })
            .collect(),
        dry_run: a.dry_run,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn local_config_round_trips_through_the_wire_types() {
        let st = crate::xds::local::parse(
            Path::new("t.yaml"),
            r#"
workloads:
- {uid: u1, name: a, namespace: n, serviceAccount: sa, workloadIps: [10.0.0.1, "fd00::1"], protocol: HBONE, services: {"n/s.n.svc.cluster.local": {80: 8080}}}
services:
- {name: s, namespace: n, hostname: s.n.svc.cluster.local, vips: ["/10.96.0.1"], ports: {80: 8080}, subjectAltNames: ["spiffe://td/ns/n/sa/x"]}
policies:
- {name: p, namespace: n, action: Deny, rules: [[[{namespaces: [!Exact x], sourceIps: [10.0.0.0/8], destinationPorts: [22]}]]]}
"#,
        )
        .unwrap();
        for w in st.workloads() {
            match address_from_proto(workload_to_proto(w)).unwrap() {
                AddressResource::Workload(back) => assert_eq!(back.as_ref(), w.as_ref()),
                other => panic!("{other:?}"),
            }
        }
        for s in st.services() {
            assert_eq!(
                address_from_proto(service_to_proto(s)).unwrap(),
                AddressResource::Service(Box::new(s.as_ref().clone()))
            );
        }
        for p in st.policies() {
            assert_eq!(
                &authorization_from_proto(authorization_to_proto(p)).unwrap(),
                p.as_ref()
            );
        }
    }

    #[test]
    fn bad_resources_are_named() {
        let w = pb::Workload {
            uid: "u".into(),
            addresses: vec![vec![1, 2, 3]],
            ..Default::default()
        };
        assert!(workload_from_proto(w).unwrap_err().contains("3 bytes"));
        let w = pb::Workload {
            uid: "u".into(),
            tunnel_protocol: 2,
            ..Default::default()
        };
        assert!(workload_from_proto(w).unwrap_err().contains("LEGACY"));
        assert!(address_from_proto(pb::Address { r#type: None }).is_err());
    }
}
