//! An address in a network: the key of every lookup by address, owned as
//! the state holds it and borrowed as the data path asks for it.

use std::fmt;
use std::net::IpAddr;

use serde::Deserialize;

use super::{same_text, Name};

/// An IP address in a network (`network/ip`; the network may be empty).
#[derive(Debug, Clone, Eq, PartialOrd, Ord, Deserialize)]
#[serde(try_from = "String")]
pub struct NetworkAddress {
    /// Interned when read from the control plane: a mesh names a few
    /// networks, and every workload's address key holds one.
    pub network: Name,
    pub address: IpAddr,
}

/// A [`NetworkAddress`] to look up, borrowing its network: the data path's
/// lookups by address then copy nothing.
#[derive(Debug, Clone, Copy)]
pub struct NetworkAddressRef<'a> {
    pub network: &'a str,
    pub address: IpAddr,
}

/// Hashes as [`NetworkAddress`] does (a `Name` hashes as its text).
impl std::hash::Hash for NetworkAddressRef<'_> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.network.hash(state);
        self.address.hash(state);
    }
}

impl hashbrown::Equivalent<NetworkAddress> for NetworkAddressRef<'_> {
    fn equivalent(&self, key: &NetworkAddress) -> bool {
        self.address == key.address && same_text(self.network, &key.network)
    }
}

/// Equal as the derived comparison would be, but see [`same_text`]: the
/// state's address maps compare keys on every lookup.
impl PartialEq for NetworkAddress {
    fn eq(&self, other: &Self) -> bool {
        self.address == other.address && same_text(&self.network, &other.network)
    }
}

/// Hashes the same fields as [`PartialEq`] compares (as derived).
impl std::hash::Hash for NetworkAddress {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.network.hash(state);
        self.address.hash(state);
    }
}

impl TryFrom<String> for NetworkAddress {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        let (network, ip) = s.split_once('/').unwrap_or(("", s.as_str()));
        let address = ip
            .parse()
            .map_err(|_| format!("{s:?} is not an address of the form network/IP"))?;
        Ok(NetworkAddress {
            network: Name::intern(network),
            address,
        })
    }
}

impl fmt::Display for NetworkAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.address)
    }
}
