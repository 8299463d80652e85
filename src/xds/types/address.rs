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

/// A workload's IP addresses: almost always one, held in place (an
/// allocation fewer a workload: 32 bytes of jemalloc's, for a 17-byte
/// address); more in a slice of their own.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Ips(Stored);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Stored {
    One(IpAddr),
    /// None, or two and more.
    Many(Box<[IpAddr]>),
}

impl Default for Ips {
    fn default() -> Self {
        Ips(Stored::Many(Box::default()))
    }
}

impl std::ops::Deref for Ips {
    type Target = [IpAddr];

    fn deref(&self) -> &[IpAddr] {
        match &self.0 {
            Stored::One(ip) => std::slice::from_ref(ip),
            Stored::Many(ips) => ips,
        }
    }
}

impl From<Vec<IpAddr>> for Ips {
    fn from(mut ips: Vec<IpAddr>) -> Self {
        match ips.len() {
            1 => Ips(Stored::One(ips.remove(0))),
            _ => Ips(Stored::Many(ips.into_boxed_slice())),
        }
    }
}

impl<const N: usize> From<[IpAddr; N]> for Ips {
    fn from(ips: [IpAddr; N]) -> Self {
        Vec::from(ips).into()
    }
}

impl FromIterator<IpAddr> for Ips {
    fn from_iter<I: IntoIterator<Item = IpAddr>>(ips: I) -> Self {
        ips.into_iter().collect::<Vec<_>>().into()
    }
}

impl<'a> IntoIterator for &'a Ips {
    type Item = &'a IpAddr;
    type IntoIter = std::slice::Iter<'a, IpAddr>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl fmt::Debug for Ips {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl serde::Serialize for Ips {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for Ips {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Vec::<IpAddr>::deserialize(d)?.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_is_held_in_place_and_any_count_reads_as_given() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(std::mem::size_of::<Ips>(), 24);
        for given in [
            vec![],
            vec![ip("10.0.0.1")],
            vec![ip("10.0.0.1"), ip("fd00::1")],
        ] {
            let ips = Ips::from(given.clone());
            assert_eq!(&ips[..], &given[..]);
            assert_eq!(matches!(ips.0, Stored::One(_)), given.len() == 1);
            assert_eq!(ips, given.iter().copied().collect::<Ips>());
            let json = serde_json::to_value(&ips).unwrap();
            assert_eq!(serde_json::from_value::<Ips>(json).unwrap(), ips);
        }
        assert_eq!(Ips::default(), Ips::from(vec![]));
    }

    #[test]
    fn a_held_workload_fits_jemallocs_224_byte_class() {
        // `Arc<Workload>`: two counts, then the workload. One byte more
        // than 224 and each costs 256 (a million workloads, 32 MB).
        let held = 2 * std::mem::size_of::<usize>() + std::mem::size_of::<super::super::Workload>();
        assert!(held <= 224, "an Arc<Workload> takes {held} bytes");
    }
}
