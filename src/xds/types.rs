//! Resource types of the mesh state: workloads, services and authorization
//! policies, with the serde shape of ztunnel's local config (camelCase).
//!
//! Pure data. Converting xDS protobufs into these types belongs next to the
//! xDS client; the data path only ever reads them through a `State` snapshot.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use serde::Deserialize;

mod address;
mod name;
mod ports;
mod workload;

pub use address::{Ips, NetworkAddress, NetworkAddressRef};
pub use name::Name;
pub use ports::{BackedServices, Ports};
pub use workload::{Rare, Workload};

/// How a workload accepts inbound mesh traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum Protocol {
    /// Mutual TLS + HTTP/2 CONNECT on port 15008: the workload is meshed.
    #[serde(rename = "HBONE")]
    Hbone,
    /// Plain TCP: the workload is known but not meshed.
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum HealthStatus {
    #[default]
    Healthy,
    Unhealthy,
}

/// Whether two strings are equal, never asking `memcmp` about two empty
/// ones. An empty `String` points nowhere (a dangling, unmapped address),
/// and glibc's AVX-512 `memcmp` reads it with a masked load all the same,
/// which the CPU finishes through a microcode assist: 90 ns per comparison
/// of two empty strings on this project's machines (1 ns for two short
/// ones). Most networks, zones and nodes are empty, and routing compares
/// them per endpoint and per lookup.
#[inline]
pub fn same_text(a: &str, b: &str) -> bool {
    a.len() == b.len() && (a.is_empty() || a == b)
}

/// Where a waypoint or gateway is: one address, or a service by name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GatewayDestination {
    Address(NetworkAddress),
    /// `namespace/hostname` of a service.
    Hostname {
        namespace: String,
        hostname: String,
    },
}

impl TryFrom<String> for GatewayDestination {
    type Error = String;
    /// `network/IP` (or a bare IP) is an address; `namespace/hostname` a service.
    fn try_from(s: String) -> Result<Self, String> {
        if let Ok(a) = NetworkAddress::try_from(s.clone()) {
            return Ok(GatewayDestination::Address(a));
        }
        match s.split_once('/') {
            Some((ns, host)) if !ns.is_empty() && !host.is_empty() => {
                Ok(GatewayDestination::Hostname {
                    namespace: ns.to_string(),
                    hostname: host.to_string(),
                })
            }
            _ => Err(format!(
                "{s:?} is neither network/IP nor namespace/hostname"
            )),
        }
    }
}

impl<'de> Deserialize<'de> for GatewayDestination {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        GatewayDestination::try_from(String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for GatewayDestination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GatewayDestination::Address(a) => a.fmt(f),
            GatewayDestination::Hostname {
                namespace,
                hostname,
            } => write!(f, "{namespace}/{hostname}"),
        }
    }
}

/// A waypoint or gateway and the port its HBONE listener takes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewayAddress {
    pub destination: GatewayDestination,
    #[serde(default = "default_hbone_port")]
    pub hbone_mtls_port: u16,
}

fn default_hbone_port() -> u16 {
    crate::constants::HBONE_PORT
}

/// One of several waypoints of a service, chosen in proportion to `weight`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WeightedWaypoint {
    pub destination: GatewayDestination,
    #[serde(default = "default_hbone_port")]
    pub hbone_mtls_port: u16,
    pub weight: u32,
}

impl WeightedWaypoint {
    pub fn gateway(&self) -> GatewayAddress {
        GatewayAddress {
            destination: self.destination.clone(),
            hbone_mtls_port: self.hbone_mtls_port,
        }
    }
}

/// How a workload wants tunnelled traffic handed to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApplicationTunnel {
    pub protocol: TunnelToApp,
    #[serde(default)]
    pub port: Option<u16>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum TunnelToApp {
    #[default]
    #[serde(rename = "NONE")]
    None,
    /// PROXY protocol in front of the application's bytes.
    #[serde(rename = "PROXY")]
    Proxy,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Locality {
    pub region: Name,
    pub zone: Name,
    pub subzone: Name,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum NetworkMode {
    #[default]
    #[serde(rename = "STANDARD", alias = "Standard")]
    Standard,
    /// Shares the node's network: never indexed by its (the node's) IP.
    #[serde(rename = "HOST_NETWORK", alias = "HostNetwork")]
    HostNetwork,
}

/// A service: virtual IPs and ports in front of the workloads that back it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Service {
    pub name: String,
    pub namespace: String,
    pub hostname: String,
    #[serde(default)]
    pub vips: Vec<NetworkAddress>,
    /// Service port → target port (0 = same port).
    #[serde(default)]
    pub ports: BTreeMap<u16, u16>,
    #[serde(default)]
    pub subject_alt_names: Vec<String>,
    /// Traffic to this service goes through this waypoint.
    #[serde(default)]
    pub waypoint: Option<GatewayAddress>,
    /// Several waypoints, chosen by weight (takes the place of `waypoint`).
    #[serde(default)]
    pub weighted_waypoints: Vec<WeightedWaypoint>,
    /// VIP ranges (ServiceEntry address blocks): any address in one is the
    /// service's, as a VIP is; a VIP that matches exactly wins.
    #[serde(default)]
    pub cidr_vips: Vec<NetworkCidr>,
    #[serde(default, rename = "loadBalancer")]
    pub load_balancing: Option<LoadBalancing>,
    #[serde(default)]
    pub ip_families: Option<IpFamilies>,
    /// The service that names a hostname several services share.
    #[serde(default)]
    pub canonical: bool,
    /// Traffic from ingress gateways also goes through the waypoint.
    #[serde(default)]
    pub ingress_use_waypoint: bool,
    #[serde(default)]
    pub visibility: Visibility,
    /// Service port → application protocol istiod declared (`HTTP11`, ...).
    #[serde(default)]
    pub app_protocols: BTreeMap<u16, String>,
    /// Names of extensions istiod attached (from xDS only).
    #[serde(skip)]
    pub extensions: Vec<String>,
}

/// istiod's load-balancing choices for a service: which endpoints a client
/// prefers (or is held to) by what it shares with them, and whether
/// unhealthy endpoints take traffic. Written as ztunnel's local config
/// writes it (`routingPreferences: [Network, Zone]`, `mode: Failover`) or
/// with istiod's enum names (`ZONE`, `FAILOVER`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct LoadBalancing {
    /// Scopes in order of preference: an endpoint ranks by how many of
    /// them, from the first, it shares with the client.
    #[serde(alias = "routingPreference")]
    pub routing_preferences: Vec<LbScope>,
    pub mode: LbMode,
    pub health_policy: LbHealthPolicy,
}

/// What a client and an endpoint may share (istiod's `LoadBalancing.Scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
pub enum LbScope {
    #[serde(alias = "REGION")]
    Region,
    #[serde(alias = "ZONE")]
    Zone,
    #[serde(alias = "SUBZONE")]
    Subzone,
    #[serde(alias = "NODE")]
    Node,
    #[serde(alias = "CLUSTER")]
    Cluster,
    #[serde(alias = "NETWORK")]
    Network,
}

/// How routing preferences bind (istiod's `LoadBalancing.Mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum LbMode {
    /// Preferences ignored: any endpoint (istiod's `UNSPECIFIED_MODE`).
    #[default]
    #[serde(alias = "UNSPECIFIED_MODE")]
    Standard,
    /// Only endpoints that share every scope with the client; none: refused.
    #[serde(alias = "STRICT")]
    Strict,
    /// The endpoints that share the most scopes, in order, with the client.
    #[serde(alias = "FAILOVER")]
    Failover,
    /// No endpoint choice: the connection goes to its original destination.
    #[serde(alias = "PASSTHROUGH")]
    Passthrough,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum LbHealthPolicy {
    #[default]
    #[serde(alias = "ONLY_HEALTHY")]
    OnlyHealthy,
    /// Unhealthy endpoints take traffic too (`publishNotReadyAddresses`).
    #[serde(alias = "ALLOW_ALL")]
    AllowAll,
}

impl fmt::Display for LbScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LbScope::Region => "REGION",
            LbScope::Zone => "ZONE",
            LbScope::Subzone => "SUBZONE",
            LbScope::Node => "NODE",
            LbScope::Cluster => "CLUSTER",
            LbScope::Network => "NETWORK",
        })
    }
}

impl fmt::Display for LbMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LbMode::Standard => "UNSPECIFIED_MODE",
            LbMode::Strict => "STRICT",
            LbMode::Failover => "FAILOVER",
            LbMode::Passthrough => "PASSTHROUGH",
        })
    }
}

impl fmt::Display for LbHealthPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LbHealthPolicy::OnlyHealthy => "ONLY_HEALTHY",
            LbHealthPolicy::AllowAll => "ALLOW_ALL",
        })
    }
}

/// The address families a service answers on (istiod's `IPFamilies`;
/// unset: whatever its endpoints have).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum IpFamilies {
    #[serde(alias = "DUAL")]
    Dual,
    #[serde(rename = "IPv4", alias = "IPV4_ONLY")]
    V4,
    #[serde(rename = "IPv6", alias = "IPV6_ONLY")]
    V6,
}

impl IpFamilies {
    pub fn admits(self, ip: IpAddr) -> bool {
        match self {
            IpFamilies::Dual => true,
            IpFamilies::V4 => ip.is_ipv4(),
            IpFamilies::V6 => ip.is_ipv6(),
        }
    }
}

impl fmt::Display for IpFamilies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IpFamilies::Dual => "DUAL",
            IpFamilies::V4 => "IPV4_ONLY",
            IpFamilies::V6 => "IPV6_ONLY",
        })
    }
}

/// A block of addresses in a network, every one of which is the service's
/// VIP: `network/10.96.0.0/16` (the network may be empty: `/10.96.0.0/16`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct NetworkCidr {
    pub network: String,
    pub cidr: Cidr,
}

impl TryFrom<String> for NetworkCidr {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        // `network/ip/len`; a bare `ip/len` has no network.
        let (network, block) = match s.matches('/').count() {
            2 => s.split_once('/').unwrap_or(("", s.as_str())),
            _ => ("", s.as_str()),
        };
        let cidr = Cidr::try_from(block.to_string())
            .map_err(|_| format!("{s:?} is not a range of the form network/IP/length"))?;
        Ok(NetworkCidr {
            network: network.to_string(),
            cidr,
        })
    }
}

impl fmt::Display for NetworkCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.network, self.cidr.net, self.cidr.len)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum Visibility {
    #[default]
    #[serde(rename = "PUBLIC", alias = "Public")]
    Public,
    /// Only workloads of the service's namespace may use it.
    #[serde(rename = "NAMESPACE", alias = "Namespace")]
    Namespace,
}

impl Service {
    /// Why Ambit cannot serve this service as istiod means it, if it cannot:
    /// such a service is refused (NACKed), never routed around.
    pub fn unsupported(&self) -> Option<String> {
        if let Some(e) = self.extensions.first() {
            return Some(format!("extension {e:?} is not supported"));
        }
        let total: u64 = self
            .weighted_waypoints
            .iter()
            .map(|w| u64::from(w.weight))
            .sum();
        if !self.weighted_waypoints.is_empty() && total == 0 {
            return Some("weighted waypoints with a total weight of 0".into());
        }
        None
    }

    /// Whether a workload of namespace `client` may use this service.
    pub fn visible_to(&self, client: &str) -> bool {
        self.visibility == Visibility::Public || self.namespace == client
    }

    /// The key workloads use to name it: `namespace/hostname`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.hostname)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum PolicyScope {
    Global,
    #[default]
    Namespace,
    WorkloadSelector,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum PolicyAction {
    #[default]
    Allow,
    Deny,
}

/// A string condition of a policy match. Written `!Exact foo` (serde_yaml's
/// tag form, as ztunnel reads it) or `{Exact: foo}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "serde_yaml::Value")]
pub enum StringMatch {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Presence,
}

impl TryFrom<serde_yaml::Value> for StringMatch {
    type Error = String;
    fn try_from(v: serde_yaml::Value) -> Result<Self, String> {
        use serde_yaml::Value;
        let (kind, value) = match v {
            Value::Tagged(t) => (
                t.tag.to_string().trim_start_matches('!').to_string(),
                t.value,
            ),
            Value::Mapping(m) if m.len() == 1 => {
                let (k, v) = m.into_iter().next().unwrap_or((Value::Null, Value::Null));
                (k.as_str().unwrap_or_default().to_string(), v)
            }
            Value::String(s) if s == "Presence" => ("Presence".to_string(), Value::Null),
            other => {
                return Err(format!(
                    "expected a string match like `!Exact value`, got {other:?}"
                ))
            }
        };
        let text = || {
            value
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("{kind} needs a string value"))
        };
        match kind.as_str() {
            "Exact" => Ok(StringMatch::Exact(text()?)),
            "Prefix" => Ok(StringMatch::Prefix(text()?)),
            "Suffix" => Ok(StringMatch::Suffix(text()?)),
            "Presence" => Ok(StringMatch::Presence),
            other => Err(format!(
                "unknown string match {other:?}; expected Exact, Prefix, Suffix or Presence"
            )),
        }
    }
}

/// `namespace/serviceAccount` condition.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceAccountMatch {
    pub namespace: String,
    pub service_account: String,
}

/// An address block (`10.0.0.0/8`, or a bare address for one host), parsed once at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct Cidr {
    pub net: IpAddr,
    pub len: u8,
}

impl TryFrom<String> for Cidr {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        let bad = || format!("{s:?} is not an IP address or CIDR block");
        let (net, len) = match s.split_once('/') {
            Some((n, l)) => (
                n.parse::<IpAddr>().map_err(|_| bad())?,
                Some(l.parse::<u8>().map_err(|_| bad())?),
            ),
            None => (s.parse::<IpAddr>().map_err(|_| bad())?, None),
        };
        let max = if net.is_ipv4() { 32 } else { 128 };
        let len = len.unwrap_or(max);
        if len > max {
            return Err(bad());
        }
        Ok(Cidr { net, len })
    }
}

impl Cidr {
    /// Whether `ip` is inside this block (IPv4-mapped IPv6 counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(i)) => {
                let mask = if self.len == 0 {
                    0
                } else {
                    u32::MAX << (32 - self.len as u32)
                };
                u32::from(n) & mask == u32::from(i) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(i)) => {
                let mask = if self.len == 0 {
                    0
                } else {
                    u128::MAX << (128 - self.len as u32)
                };
                u128::from(n) & mask == u128::from(i) & mask
            }
            _ => false,
        }
    }
}

/// One match of a policy clause; every listed field must hold.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct RbacMatch {
    pub namespaces: Vec<StringMatch>,
    pub not_namespaces: Vec<StringMatch>,
    pub service_accounts: Vec<ServiceAccountMatch>,
    pub not_service_accounts: Vec<ServiceAccountMatch>,
    pub principals: Vec<StringMatch>,
    pub not_principals: Vec<StringMatch>,
    pub source_ips: Vec<Cidr>,
    pub not_source_ips: Vec<Cidr>,
    pub destination_ips: Vec<Cidr>,
    pub not_destination_ips: Vec<Cidr>,
    pub destination_ports: Vec<u16>,
    pub not_destination_ports: Vec<u16>,
}

/// An L4 authorization policy: rules (OR) of clauses (AND) of matches (OR).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Authorization {
    pub name: String,
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub scope: PolicyScope,
    #[serde(default)]
    pub action: PolicyAction,
    #[serde(default)]
    pub rules: Vec<Vec<Vec<RbacMatch>>>,
    #[serde(default)]
    pub dry_run: bool,
    /// Why the policy was refused, when it was (it needs what Ambit lacks,
    /// names a value this build does not know, could not be read, or is
    /// named by a workload but not held). It cannot be evaluated, so it
    /// fails closed where it applies: a DENY denies every connection, an
    /// ALLOW allows none.
    #[serde(skip)]
    pub refused: Option<String>,
}

impl Authorization {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// A stand-in for a policy that cannot be evaluated, named `ns/name`:
    /// it applies only where a workload names it, and denies.
    pub fn refused_stand_in(key: &str, reason: String) -> Authorization {
        let (namespace, name) = key.split_once('/').unwrap_or(("", key));
        Authorization {
            name: name.to_string(),
            namespace: namespace.to_string(),
            scope: PolicyScope::WorkloadSelector,
            action: PolicyAction::Deny,
            rules: Vec::new(),
            dry_run: false,
            refused: Some(reason),
        }
    }
}
