//! What a workload says of the services it backs, in the few bytes it
//! needs: `Ports` (service port → target port) and `BackedServices`
//! (service → its `Ports`).
//!
//! A workload backs one or two services with one or two ports each. As a
//! `HashMap` of `BTreeMap`s that was three allocations and ~400 bytes per
//! workload; as sorted slices it is two small ones, the service's name is
//! shared (interned), and an endpoint shares its workload's `Ports`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::Deserialize;

use super::Name;

/// `pairs` sorted by key, one per key: the last given, as a map's inserts
/// would leave it. O(n log n) whatever the control plane sends.
fn sorted_last_wins<K: Ord, V>(mut pairs: Vec<(K, V)>) -> Vec<(K, V)> {
    // Stable: of equal keys, the later stays after the earlier.
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    // `later` is removed; its value goes to the one kept.
    pairs.dedup_by(|later, kept| {
        let same = later.0 == kept.0;
        if same {
            std::mem::swap(&mut later.1, &mut kept.1);
        }
        same
    });
    pairs
}

/// Service port → target port, sorted by service port. None or one pair
/// (almost every workload's) is held in place: an allocation fewer for
/// each service a workload backs, in the same 16 bytes. More are shared
/// by clones.
#[derive(Clone, PartialEq, Eq)]
pub struct Ports(Pairs);

#[derive(Clone, PartialEq, Eq)]
enum Pairs {
    /// The first `n` (0 or 1) of the array; an unused pair is `(0, 0)`.
    Few(u8, [(u16, u16); 1]),
    Many(Arc<[(u16, u16)]>),
}

impl Default for Ports {
    fn default() -> Self {
        Ports(Pairs::Few(0, [(0, 0)]))
    }
}

impl fmt::Debug for Ports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Ports {
    /// From pairs in any order; a later pair for a service port wins, as
    /// a map's insert would.
    pub fn new(pairs: impl IntoIterator<Item = (u16, u16)>) -> Ports {
        let v = sorted_last_wins(pairs.into_iter().collect());
        match v[..] {
            [] => Ports::default(),
            [one] => Ports(Pairs::Few(1, [one])),
            _ => Ports(Pairs::Many(v.into())),
        }
    }

    fn pairs(&self) -> &[(u16, u16)] {
        match &self.0 {
            Pairs::Few(n, pairs) => &pairs[..usize::from(*n)],
            Pairs::Many(pairs) => pairs,
        }
    }

    /// The target port of `service_port`.
    pub fn get(&self, service_port: &u16) -> Option<&u16> {
        let pairs = self.pairs();
        pairs
            .binary_search_by_key(service_port, |&(s, _)| s)
            .ok()
            .map(|at| &pairs[at].1)
    }

    pub fn contains_key(&self, service_port: &u16) -> bool {
        self.get(service_port).is_some()
    }

    /// `(service port, target port)` in service-port order.
    pub fn iter(&self) -> impl Iterator<Item = (&u16, &u16)> {
        self.pairs().iter().map(|(s, t)| (s, t))
    }

    pub fn is_empty(&self) -> bool {
        self.pairs().is_empty()
    }
}

impl FromIterator<(u16, u16)> for Ports {
    fn from_iter<I: IntoIterator<Item = (u16, u16)>>(pairs: I) -> Ports {
        Ports::new(pairs)
    }
}

impl<'de> Deserialize<'de> for Ports {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Ports::new(BTreeMap::<u16, u16>::deserialize(d)?))
    }
}

/// The services a workload backs (`namespace/hostname` → its ports),
/// sorted by name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BackedServices(Box<[(Name, Ports)]>);

impl BackedServices {
    /// From pairs in any order; a later pair for a service wins.
    pub fn new(pairs: impl IntoIterator<Item = (Name, Ports)>) -> BackedServices {
        BackedServices(sorted_last_wins(pairs.into_iter().collect()).into_boxed_slice())
    }

    /// The ports of service `key` (`namespace/hostname`).
    pub fn get(&self, key: &str) -> Option<&Ports> {
        self.0
            .binary_search_by(|(s, _)| s.as_str().cmp(key))
            .ok()
            .map(|at| &self.0[at].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// The services' keys, in order.
    pub fn keys(&self) -> impl Iterator<Item = &Name> {
        self.0.iter().map(|(s, _)| s)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&Name, &Ports)> {
        self.0.iter().map(|(s, p)| (s, p))
    }
}

impl<'de> Deserialize<'de> for BackedServices {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // A map in the file: a key written twice is the file's error.
        let map = BTreeMap::<Name, Ports>::deserialize(d)?;
        Ok(BackedServices::new(map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_read_as_the_map_they_stand_for() {
        let p = Ports::new([(443, 8443), (80, 8080), (80, 9090)]);
        assert_eq!(p.get(&80), Some(&9090), "the later pair wins");
        assert_eq!(p.get(&443), Some(&8443));
        assert_eq!(p.get(&81), None);
        assert_eq!(p.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [80, 443]);
        assert!(Ports::new([]).is_empty());
        let clone = p.clone();
        assert_eq!(clone, p);
    }

    #[test]
    fn none_or_one_pair_is_held_in_place_and_reads_the_same() {
        assert_eq!(std::mem::size_of::<Ports>(), 16);
        let one = Ports::new([(80, 8080)]);
        assert!(matches!(one.0, Pairs::Few(1, _)));
        assert_eq!(one.get(&80), Some(&8080));
        assert_eq!(one.get(&0), None, "the unused pair is never read");
        let none = Ports::new([]);
        assert_eq!((none.get(&0), none.is_empty()), (None, true));
        assert_eq!(none, Ports::default());
        // The same pairs however given: equal.
        assert_eq!(Ports::new([(80, 1), (80, 8080)]), one);
        let two = Ports::new([(443, 8443), (80, 8080)]);
        assert!(matches!(two.0, Pairs::Many(_)));
        assert_eq!(format!("{two:?}"), "{80: 8080, 443: 8443}");
    }

    #[test]
    fn backed_services_are_found_by_key() {
        let b = BackedServices::new([
            (Name::intern("ns/b.ns.svc"), Ports::new([(80, 80)])),
            (Name::intern("ns/a.ns.svc"), Ports::new([(81, 8081)])),
        ]);
        assert_eq!(
            b.keys().map(|k| k.as_str()).collect::<Vec<_>>(),
            ["ns/a.ns.svc", "ns/b.ns.svc"]
        );
        assert_eq!(b.get("ns/a.ns.svc").and_then(|p| p.get(&81)), Some(&8081));
        assert!(!b.contains_key("ns/c.ns.svc"));
        let again = BackedServices::new([
            (Name::intern("ns/a.ns.svc"), Ports::new([(81, 1)])),
            (Name::intern("ns/a.ns.svc"), Ports::new([(81, 2)])),
        ]);
        assert_eq!(
            again.get("ns/a.ns.svc").and_then(|p| p.get(&81)),
            Some(&2),
            "the later wins"
        );
        // Many services and ports (a hostile push) in n log n.
        let many = BackedServices::new((0..200_000u32).rev().map(|i| {
            (
                Name::from(format!("ns/s{i}")),
                Ports::new((0..=u16::MAX).rev().take(3).map(|p| (p, p))),
            )
        }));
        assert_eq!(
            many.get("ns/s7").and_then(|p| p.get(&u16::MAX)),
            Some(&u16::MAX)
        );
    }
}
