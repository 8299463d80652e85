//! Resource types of the mesh state: workloads, services and authorization
//! policies, with the serde shape of ztunnel's local config (camelCase).
//!
//! Pure data. Converting xDS protobufs into these types belongs next to the
//! xDS client; the data path only ever reads them through a `State` snapshot.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::IpAddr;

use serde::Deserialize;

use crate::identity::Identity;

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

/// An IP address in a network (`network/ip`; the network may be empty).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(try_from = "String")]
pub struct NetworkAddress {
    pub network: String,
    pub address: IpAddr,
}

impl TryFrom<String> for NetworkAddress {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        let (network, ip) = s.split_once('/').unwrap_or(("", s.as_str()));
        let address = ip
            .parse()
            .map_err(|_| format!("{s:?} is not an address of the form network/IP"))?;
        Ok(NetworkAddress {
            network: network.to_string(),
            address,
        })
    }
}

impl fmt::Display for NetworkAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.address)
    }
}

/// A pod (or VM) that can send and receive traffic.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Workload {
    #[serde(default)]
    pub uid: String,
    pub name: String,
    pub namespace: String,
    #[serde(default = "default_service_account")]
    pub service_account: String,
    #[serde(default)]
    pub trust_domain: String,
    #[serde(default)]
    pub workload_ips: Vec<IpAddr>,
    #[serde(default)]
    pub protocol: Protocol,
    #[serde(default)]
    pub node: String,
    #[serde(default)]
    pub network: String,
    #[serde(default)]
    pub cluster_id: String,
    #[serde(default)]
    pub canonical_name: String,
    #[serde(default)]
    pub canonical_revision: String,
    #[serde(default)]
    pub workload_name: String,
    #[serde(default)]
    pub workload_type: String,
    #[serde(default)]
    pub status: HealthStatus,
    /// Services this workload backs: `"ns/hostname" → {service port: target port}`.
    #[serde(default)]
    pub services: HashMap<String, BTreeMap<u16, u16>>,
    #[serde(default)]
    pub authorization_policies: Vec<String>,
    // Fields of ztunnel's format that Ambit accepts but does not act on yet.
    #[serde(default)]
    pub hostname: Option<serde_yaml::Value>,
    #[serde(default)]
    pub waypoint: Option<serde_yaml::Value>,
    #[serde(default)]
    pub network_gateway: Option<serde_yaml::Value>,
    #[serde(default)]
    pub native_tunnel: Option<serde_yaml::Value>,
    #[serde(default)]
    pub application_tunnel: Option<serde_yaml::Value>,
    #[serde(default)]
    pub locality: Option<serde_yaml::Value>,
    #[serde(default)]
    pub network_mode: Option<serde_yaml::Value>,
}

fn default_service_account() -> String {
    "default".to_string()
}

impl Workload {
    /// The SPIFFE identity this workload's certificate carries.
    pub fn identity(&self, default_trust_domain: &str) -> Identity {
        let td = if self.trust_domain.is_empty() {
            default_trust_domain
        } else {
            &self.trust_domain
        };
        Identity::new(td, &self.namespace, &self.service_account)
    }

    /// `canonical_name`, else the workload name, else the pod name.
    pub fn canonical_service(&self) -> &str {
        [&self.canonical_name, &self.workload_name, &self.name]
            .into_iter()
            .find(|s| !s.is_empty())
            .map(String::as_str)
            .unwrap_or("unknown")
    }
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
    #[serde(default)]
    pub waypoint: Option<serde_yaml::Value>,
    #[serde(default)]
    pub load_balancer: Option<serde_yaml::Value>,
    #[serde(default)]
    pub ip_families: Option<serde_yaml::Value>,
}

impl Service {
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
}

impl Authorization {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}
