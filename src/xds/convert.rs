//! Istio's xDS resources (protobuf) to and from Ambit's state types. Every
//! conversion of received data checks it and names what is wrong, so a bad
//! resource is rejected alone (NACKed) and the rest is applied.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use crate::proto::security as pb_sec;
use crate::proto::workload as pb;
use crate::xds::types::{
    ApplicationTunnel, Authorization, BackedServices, Cidr, GatewayAddress, GatewayDestination,
    HealthStatus, IpFamilies, LbHealthPolicy, LbMode, LbScope, LoadBalancing, Locality, Name,
    NetworkAddress, NetworkCidr, NetworkMode, PolicyAction, PolicyScope, Ports, Protocol, Rare,
    RbacMatch, Service, ServiceAccountMatch, StringMatch, TunnelToApp, Visibility,
    WeightedWaypoint, Workload,
};
use crate::xds::Claims;

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
    Workload(Arc<Workload>),
    Service(Arc<Service>),
}

impl AddressResource {
    /// Why Ambit cannot serve it as istiod means it, if it cannot.
    pub fn unsupported(&self) -> Option<String> {
        match self {
            AddressResource::Workload(w) => w.unsupported(),
            AddressResource::Service(s) => s.unsupported(),
        }
    }
}

pub fn address_from_proto(a: pb::Address) -> Result<AddressResource, String> {
    match a.r#type {
        Some(pb::address::Type::Workload(w)) => {
            workload_from_proto(w).map(|w| AddressResource::Workload(Arc::new(w)))
        }
        Some(pb::address::Type::Service(s)) => {
            service_from_proto(s).map(|s| AddressResource::Service(Arc::new(s)))
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
    let workload_type = match pb::WorkloadType::try_from(w.workload_type) {
        Ok(pb::WorkloadType::Deployment) => "deployment",
        Ok(pb::WorkloadType::Cronjob) => "cronjob",
        Ok(pb::WorkloadType::Pod) => "pod",
        Ok(pb::WorkloadType::Job) => "job",
        Err(_) => return Err(format!("unknown workload type {}", w.workload_type)),
    };
    let network_mode = match pb::NetworkMode::try_from(w.network_mode) {
        Ok(pb::NetworkMode::Standard) => NetworkMode::Standard,
        Ok(pb::NetworkMode::HostNetwork) => NetworkMode::HostNetwork,
        Err(_) => return Err(format!("unknown network mode {}", w.network_mode)),
    };
    let application_tunnel = match w.application_tunnel {
        None => None,
        Some(t) => Some(ApplicationTunnel {
            protocol: match pb::application_tunnel::Protocol::try_from(t.protocol) {
                Ok(pb::application_tunnel::Protocol::None) => TunnelToApp::None,
                Ok(pb::application_tunnel::Protocol::Proxy) => TunnelToApp::Proxy,
                Err(_) => {
                    return Err(format!(
                        "unknown application tunnel protocol {}",
                        t.protocol
                    ))
                }
            },
            port: match t.port {
                0 => None,
                p => Some(port(p)?),
            },
        }),
    };
    let waypoint = w.waypoint.map(gateway_from_proto).transpose()?;
    let network_gateway = w.network_gateway.map(gateway_from_proto).transpose()?;
    // One lock of the intern table for all the workload's texts (nothing
    // below interns otherwise).
    let mut table = Name::interner();
    let mut services = Vec::with_capacity(w.services.len());
    for (svc, list) in w.services {
        let ports = list
            .ports
            .iter()
            .map(|p| Ok((port(p.service_port)?, port(p.target_port)?)))
            .collect::<Result<Ports, String>>()?;
        services.push((table.intern(&svc), ports));
    }
    let mut intern = |s: &str| table.intern(s);
    Ok(Workload {
        uid: w.uid.into(),
        name: w.name.into(),
        namespace: intern(&w.namespace),
        service_account: if w.service_account.is_empty() {
            intern("default")
        } else {
            intern(&w.service_account)
        },
        trust_domain: intern(&w.trust_domain),
        workload_ips: w
            .addresses
            .iter()
            .map(|b| ip_from(b))
            .collect::<Result<_, _>>()?,
        protocol,
        node: intern(&w.node),
        network: intern(&w.network),
        cluster_id: intern(&w.cluster_id),
        canonical_name: intern(&w.canonical_name),
        canonical_revision: intern(&w.canonical_revision),
        workload_name: intern(&w.workload_name),
        status: if w.status == pb::WorkloadStatus::Unhealthy as i32 {
            HealthStatus::Unhealthy
        } else {
            HealthStatus::Healthy
        },
        services: BackedServices::new(services),
        authorization_policies: w.authorization_policies.iter().map(|p| intern(p)).collect(),
        hostname: w.hostname.into(),
        waypoint: waypoint.map(Box::new),
        workload_type: intern(workload_type),
        native_tunnel: w.native_tunnel,
        locality: w
            .locality
            .map(|l| Locality {
                region: intern(&l.region),
                zone: intern(&l.zone),
                subzone: intern(&l.subzone),
            })
            .unwrap_or_default(),
        network_mode,
        rare: Rare {
            network_gateway,
            application_tunnel,
            capacity: w.capacity,
            extensions: w.extensions.into_iter().map(|e| e.name).collect(),
        }
        .boxed(),
    })
}

/// A waypoint or gateway; one that names neither an address nor a service is refused.
fn gateway_from_proto(g: pb::GatewayAddress) -> Result<GatewayAddress, String> {
    let destination = match g.destination {
        Some(pb::gateway_address::Destination::Address(a)) => {
            GatewayDestination::Address(NetworkAddress {
                network: Name::intern(&a.network),
                address: ip_from(&a.address)?,
            })
        }
        Some(pb::gateway_address::Destination::Hostname(h)) => {
            if h.namespace.is_empty() || h.hostname.is_empty() {
                return Err("a gateway hostname needs a namespace and a hostname".into());
            }
            GatewayDestination::Hostname {
                namespace: h.namespace,
                hostname: h.hostname,
            }
        }
        None => return Err("a gateway address with no destination".into()),
    };
    let hbone_mtls_port = match g.hbone_mtls_port {
        0 => crate::constants::HBONE_PORT,
        p => port(p)?,
    };
    Ok(GatewayAddress {
        destination,
        hbone_mtls_port,
    })
}

fn enum_name<E: TryFrom<i32>>(
    v: i32,
    name: impl Fn(E) -> &'static str,
    what: &str,
) -> Result<String, String> {
    E::try_from(v)
        .map(|e| name(e).to_string())
        .map_err(|_| format!("unknown {what} {v}"))
}

pub fn service_from_proto(s: pb::Service) -> Result<Service, String> {
    let mut ports = BTreeMap::new();
    let mut app_protocols = BTreeMap::new();
    for p in s.ports {
        let service_port = port(p.service_port)?;
        ports.insert(service_port, port(p.target_port)?);
        let app = enum_name(
            p.app_protocol,
            |a: pb::AppProtocol| a.as_str_name(),
            "app protocol",
        )?;
        if app != "UNKNOWN" {
            app_protocols.insert(service_port, app);
        }
    }
    let load_balancing = s.load_balancing.map(load_balancing_from).transpose()?;
    let ip_families = match pb::IpFamilies::try_from(s.ip_families) {
        Ok(pb::IpFamilies::Automatic) => None,
        Ok(pb::IpFamilies::Ipv4Only) => Some(IpFamilies::V4),
        Ok(pb::IpFamilies::Ipv6Only) => Some(IpFamilies::V6),
        Ok(pb::IpFamilies::Dual) => Some(IpFamilies::Dual),
        Err(_) => return Err(format!("unknown IP families {}", s.ip_families)),
    };
    let visibility = match pb::service::Visibility::try_from(s.visibility) {
        Ok(pb::service::Visibility::Public) => Visibility::Public,
        Ok(pb::service::Visibility::Namespace) => Visibility::Namespace,
        Err(_) => return Err(format!("unknown visibility {}", s.visibility)),
    };
    let weighted_waypoints = s
        .weighted_waypoints
        .into_iter()
        .map(|w| {
            let g = gateway_from_proto(
                w.destination
                    .ok_or("a weighted waypoint with no destination")?,
            )?;
            Ok(WeightedWaypoint {
                destination: g.destination,
                hbone_mtls_port: g.hbone_mtls_port,
                weight: w.weight,
            })
        })
        .collect::<Result<_, String>>()?;
    // A full-length address is a VIP; a shorter one, a range of them.
    let mut vips = Vec::new();
    let mut cidr_vips = Vec::new();
    for a in s.addresses {
        let address = ip_from(&a.address)?;
        let full = if address.is_ipv4() { 32 } else { 128 };
        match a.length {
            None => vips.push(NetworkAddress {
                network: Name::intern(&a.network),
                address,
            }),
            Some(l) if l == full => vips.push(NetworkAddress {
                network: Name::intern(&a.network),
                address,
            }),
            Some(l) if l < full => cidr_vips.push(NetworkCidr {
                network: a.network,
                cidr: Cidr {
                    net: address,
                    len: l as u8,
                },
            }),
            Some(l) => return Err(format!("VIP range {address}/{l}: the length is too long")),
        }
    }
    Ok(Service {
        name: s.name,
        namespace: s.namespace,
        hostname: s.hostname,
        vips: exact(vips),
        cidr_vips: exact(cidr_vips),
        ports,
        subject_alt_names: exact(s.subject_alt_names),
        waypoint: s.waypoint.map(gateway_from_proto).transpose()?,
        weighted_waypoints: exact(weighted_waypoints),
        load_balancing,
        ip_families,
        canonical: s.canonical,
        ingress_use_waypoint: s.ingress_use_waypoint,
        visibility,
        app_protocols,
        extensions: exact(s.extensions.into_iter().map(|e| e.name).collect()),
    })
}

/// istiod's load-balancing block; a scope or mode this build does not know
/// refuses the service (an endpoint choice that ignored it could send
/// traffic where istiod forbids).
fn load_balancing_from(lb: pb::LoadBalancing) -> Result<LoadBalancing, String> {
    use pb::load_balancing::{HealthPolicy, Mode, Scope};
    let routing_preferences = lb
        .routing_preference
        .into_iter()
        .map(|p| match Scope::try_from(p) {
            Ok(Scope::Region) => Ok(LbScope::Region),
            Ok(Scope::Zone) => Ok(LbScope::Zone),
            Ok(Scope::Subzone) => Ok(LbScope::Subzone),
            Ok(Scope::Node) => Ok(LbScope::Node),
            Ok(Scope::Cluster) => Ok(LbScope::Cluster),
            Ok(Scope::Network) => Ok(LbScope::Network),
            Ok(Scope::UnspecifiedScope) | Err(_) => {
                Err(format!("unknown load-balancing routing preference {p}"))
            }
        })
        .collect::<Result<_, _>>()?;
    let mode = match Mode::try_from(lb.mode) {
        Ok(Mode::UnspecifiedMode) => LbMode::Standard,
        Ok(Mode::Strict) => LbMode::Strict,
        Ok(Mode::Failover) => LbMode::Failover,
        Ok(Mode::Passthrough) => LbMode::Passthrough,
        Err(_) => return Err(format!("unknown load-balancing mode {}", lb.mode)),
    };
    let health_policy = match HealthPolicy::try_from(lb.health_policy) {
        Ok(HealthPolicy::OnlyHealthy) => LbHealthPolicy::OnlyHealthy,
        Ok(HealthPolicy::AllowAll) => LbHealthPolicy::AllowAll,
        Err(_) => return Err(format!("unknown health policy {}", lb.health_policy)),
    };
    Ok(LoadBalancing {
        routing_preferences,
        mode,
        health_policy,
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
                    app_protocol: pb::AppProtocol::Unknown as i32,
                })
                .collect();
            (k.to_string(), pb::PortList { ports })
        })
        .collect();
    pb::Address {
        r#type: Some(pb::address::Type::Workload(pb::Workload {
            uid: w.uid.to_string(),
            name: w.name.to_string(),
            namespace: w.namespace.to_string(),
            addresses: w.workload_ips.iter().map(|ip| ip_bytes(*ip)).collect(),
            network: w.network.to_string(),
            tunnel_protocol: match w.protocol {
                Protocol::Hbone => pb::TunnelProtocol::Hbone as i32,
                Protocol::Tcp => pb::TunnelProtocol::None as i32,
            },
            trust_domain: w.trust_domain.to_string(),
            service_account: w.service_account.to_string(),
            node: w.node.to_string(),
            canonical_name: w.canonical_name.to_string(),
            canonical_revision: w.canonical_revision.to_string(),
            workload_name: w.workload_name.to_string(),
            authorization_policies: w
                .authorization_policies
                .iter()
                .map(Name::to_string)
                .collect(),
            status: match w.status {
                HealthStatus::Healthy => pb::WorkloadStatus::Healthy as i32,
                HealthStatus::Unhealthy => pb::WorkloadStatus::Unhealthy as i32,
            },
            cluster_id: w.cluster_id.to_string(),
            services,
            hostname: w.hostname.to_string(),
            waypoint: w.waypoint.as_deref().map(gateway_to_proto),
            network_gateway: w.network_gateway().map(gateway_to_proto),
            workload_type: match w.workload_type.as_str() {
                "cronjob" => pb::WorkloadType::Cronjob,
                "pod" => pb::WorkloadType::Pod,
                "job" => pb::WorkloadType::Job,
                _ => pb::WorkloadType::Deployment,
            } as i32,
            native_tunnel: w.native_tunnel,
            application_tunnel: w.application_tunnel().map(|t| pb::ApplicationTunnel {
                protocol: match t.protocol {
                    TunnelToApp::None => pb::application_tunnel::Protocol::None,
                    TunnelToApp::Proxy => pb::application_tunnel::Protocol::Proxy,
                } as i32,
                port: t.port.map_or(0, u32::from),
            }),
            locality: (w.locality != Locality::default()).then(|| pb::Locality {
                region: w.locality.region.to_string(),
                zone: w.locality.zone.to_string(),
                subzone: w.locality.subzone.to_string(),
            }),
            network_mode: match w.network_mode {
                NetworkMode::Standard => pb::NetworkMode::Standard,
                NetworkMode::HostNetwork => pb::NetworkMode::HostNetwork,
            } as i32,
            extensions: Vec::new(),
            capacity: w.capacity(),
        })),
    }
}

fn gateway_to_proto(g: &GatewayAddress) -> pb::GatewayAddress {
    use pb::gateway_address::Destination;
    pb::GatewayAddress {
        destination: Some(match &g.destination {
            GatewayDestination::Address(a) => Destination::Address(pb::NetworkAddress {
                network: a.network.to_string(),
                address: ip_bytes(a.address),
                length: None,
            }),
            GatewayDestination::Hostname {
                namespace,
                hostname,
            } => Destination::Hostname(pb::NamespacedHostname {
                namespace: namespace.clone(),
                hostname: hostname.clone(),
            }),
        }),
        hbone_mtls_port: u32::from(g.hbone_mtls_port),
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
                    network: v.network.to_string(),
                    address: ip_bytes(v.address),
                    length: None,
                })
                .chain(s.cidr_vips.iter().map(|c| pb::NetworkAddress {
                    network: c.network.clone(),
                    address: ip_bytes(c.cidr.net),
                    length: Some(u32::from(c.cidr.len)),
                }))
                .collect(),
            ports: s
                .ports
                .iter()
                .map(|(p, t)| pb::Port {
                    service_port: *p as u32,
                    target_port: *t as u32,
                    app_protocol: s
                        .app_protocols
                        .get(p)
                        .and_then(|a| pb::AppProtocol::from_str_name(a))
                        .unwrap_or(pb::AppProtocol::Unknown)
                        as i32,
                })
                .collect(),
            subject_alt_names: s.subject_alt_names.clone(),
            waypoint: s.waypoint.as_ref().map(gateway_to_proto),
            load_balancing: s.load_balancing.as_ref().map(load_balancing_to),
            ip_families: match s.ip_families {
                None => pb::IpFamilies::Automatic,
                Some(IpFamilies::V4) => pb::IpFamilies::Ipv4Only,
                Some(IpFamilies::V6) => pb::IpFamilies::Ipv6Only,
                Some(IpFamilies::Dual) => pb::IpFamilies::Dual,
            } as i32,
            extensions: Vec::new(),
            canonical: s.canonical,
            ingress_use_waypoint: s.ingress_use_waypoint,
            weighted_waypoints: s
                .weighted_waypoints
                .iter()
                .map(|w| pb::WeightedWaypoint {
                    destination: Some(gateway_to_proto(&w.gateway())),
                    weight: w.weight,
                })
                .collect(),
            visibility: match s.visibility {
                Visibility::Public => pb::service::Visibility::Public,
                Visibility::Namespace => pb::service::Visibility::Namespace,
            } as i32,
        })),
    }
}

fn load_balancing_to(lb: &LoadBalancing) -> pb::LoadBalancing {
    use pb::load_balancing::{HealthPolicy, Mode, Scope};
    pb::LoadBalancing {
        routing_preference: lb
            .routing_preferences
            .iter()
            .map(|p| match p {
                LbScope::Region => Scope::Region,
                LbScope::Zone => Scope::Zone,
                LbScope::Subzone => Scope::Subzone,
                LbScope::Node => Scope::Node,
                LbScope::Cluster => Scope::Cluster,
                LbScope::Network => Scope::Network,
            } as i32)
            .collect(),
        mode: match lb.mode {
            LbMode::Standard => Mode::UnspecifiedMode,
            LbMode::Strict => Mode::Strict,
            LbMode::Failover => Mode::Failover,
            LbMode::Passthrough => Mode::Passthrough,
        } as i32,
        health_policy: match lb.health_policy {
            LbHealthPolicy::OnlyHealthy => HealthPolicy::OnlyHealthy,
            LbHealthPolicy::AllowAll => HealthPolicy::AllowAll,
        } as i32,
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

/// `v` holding no more than it has. A decoded list grows by doubling, and
/// a list collected from it in place keeps its allocation, sized for the
/// decoded type: a policy held that way cost three times its size.
fn exact<T>(mut v: Vec<T>) -> Vec<T> {
    v.shrink_to_fit();
    v
}

fn match_from(m: pb_sec::Match) -> Result<RbacMatch, String> {
    let strings = |v: Vec<pb_sec::StringMatch>| {
        v.into_iter()
            .map(string_match_from)
            .collect::<Result<Vec<_>, _>>()
            .map(exact)
    };
    let cidrs = |v: Vec<pb_sec::Address>| {
        v.into_iter()
            .map(cidr_from)
            .collect::<Result<Vec<_>, _>>()
            .map(exact)
    };
    let ports = |v: Vec<u32>| {
        v.into_iter()
            .map(port)
            .collect::<Result<Vec<_>, _>>()
            .map(exact)
    };
    let accounts =
        |v: Vec<pb_sec::ServiceAccountMatch>| exact(v.into_iter().map(sa_from).collect());
    Ok(RbacMatch {
        namespaces: strings(m.namespaces)?,
        not_namespaces: strings(m.not_namespaces)?,
        principals: strings(m.principals)?,
        not_principals: strings(m.not_principals)?,
        service_accounts: accounts(m.service_accounts),
        not_service_accounts: accounts(m.not_service_accounts),
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
        extensions: Vec::new(),
    }
}

pub fn authorization_from_proto(a: pb_sec::Authorization) -> Result<Authorization, String> {
    // An extension changes what the policy means: refuse it rather than
    // enforce something weaker than istiod asked for.
    let extensions = a.extensions.iter().chain(
        a.rules
            .iter()
            .flat_map(|r| &r.clauses)
            .flat_map(|c| &c.matches)
            .flat_map(|m| &m.extensions),
    );
    if let Some(e) = extensions.map(|e| &e.name).next() {
        return Err(format!("extension {e:?} is not supported"));
    }
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
                        .map(exact)
                })
                .collect::<Result<Vec<_>, _>>()
                .map(exact)
        })
        .collect::<Result<Vec<_>, _>>()
        .map(exact)?;
    Ok(Authorization {
        name: a.name,
        namespace: a.namespace,
        scope,
        action,
        rules,
        dry_run: a.dry_run,
        refused: None,
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
        extensions: Vec::new(),
    }
}

mod refused;
pub use refused::{claims_of, claims_of_name, refused_policy};

#[cfg(test)]
mod tests;
