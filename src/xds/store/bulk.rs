//! A first push of address resources applied at once: the state's maps
//! built whole (`cow_map::Builder`: each leaf made once at its size)
//! instead of changed resource by resource, where a million workloads
//! would walk and copy a path in each of five maps a million times.
//!
//! Each resource is staged as it arrives (while it is still in the
//! cache, on the thread that applies the push, which otherwise waits on
//! the one converting), as though it will serve; the maps are built when
//! the push ends, after taking out of them those that do not (a name
//! given again, a uid or service key held by an earlier arrival: few).
//!
//! It applies only while no address resource is held (a proxy's first
//! push, or the first after every one was removed); later responses change
//! the state one resource at a time (`change.rs`). The result is the state
//! those changes would make of the same resources in the same order
//! (`tests.rs` checks this on random pushes with every kind of conflict):
//! resources carry their arrival numbers, so which one serves a uid, a
//! service's `namespace/hostname` or an address is decided as before.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::sync::Arc;

use imbl::OrdMap;

use super::change::{invalid_service, invalid_workload, Address, AddressEntry, Queue};
use super::cow_map::Builder;
use super::{
    AddressResource, Claims, Endpoint, Map, Name, NetworkAddress, NetworkCidr, Refused, Service,
    State, Workload,
};

/// Holders staged for a key of an index.
type Holders<K, T> = Builder<K, (u64, Arc<T>)>;

/// The few-keyed maps of staging (namespaces, networks, policy keys),
/// hashed as the state's maps are.
type Small<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Address resources staged for [`State::put_addresses`], each with its
/// arrival number, and the indexes they make if they all serve.
pub struct Bulk {
    /// The arrival numbers handed out so far.
    arrivals: u64,
    entries: Builder<Name, AddressEntry>,
    /// Each refusal's reason, by its arrival (ascending).
    reasons: Vec<(u64, String)>,
    /// Why each resource held but not serving does not, by arrival.
    left_out: HashMap<u64, String>,
    uids: Holders<Name, Workload>,
    hosts: Holders<Name, Service>,
    by_addr: Holders<NetworkAddress, Workload>,
    by_name: Small<Name, Holders<Name, Workload>>,
    endpoints: Builder<Name, (u64, Endpoint)>,
    networks: Small<Name, usize>,
    named: Small<Name, usize>,
    by_vip: Holders<NetworkAddress, Service>,
    ranges: Vec<(u64, (NetworkCidr, Arc<Service>))>,
}

impl Bulk {
    fn next(&mut self) -> u64 {
        self.arrivals += 1;
        self.arrivals
    }

    /// As [`State::put_address`], once the push is put.
    pub fn put(&mut self, name: &str, version: &str, resource: AddressResource) {
        let arrival = self.next();
        let name = Name::from(name);
        let held = Address::of(resource);
        match &held {
            Address::Workload(w) => match invalid_workload(w) {
                Some(reason) => drop(self.left_out.insert(arrival, reason)),
                None => {
                    // One copy of the text for both maps, as one by one.
                    let key = match *name == *w.uid {
                        true => name.clone(),
                        false => w.uid.clone(),
                    };
                    self.uids.push(key, (arrival, w.clone()));
                    self.serve_workload(arrival, w);
                }
            },
            Address::Service(s) => match invalid_service(s) {
                Some(reason) => drop(self.left_out.insert(arrival, reason)),
                None => {
                    let key = s.key();
                    let key = match *name == *key {
                        true => name.clone(),
                        false => key.as_str().into(),
                    };
                    self.hosts.push(key, (arrival, s.clone()));
                    for vip in &s.vips {
                        self.by_vip.push(vip.clone(), (arrival, s.clone()));
                    }
                    for range in &s.cidr_vips {
                        self.ranges.push((arrival, (range.clone(), s.clone())));
                    }
                }
            },
        }
        let entry = AddressEntry {
            held: Some((arrival, held, version.into())),
            refusal: None,
        };
        self.entries.push(name, entry);
    }

    /// As [`State::refuse_address`], once the push is put.
    pub fn refuse(&mut self, name: &str, claims: Claims, reason: String) {
        let arrival = self.next();
        let entry = AddressEntry {
            held: None,
            refusal: Some(Box::new((arrival, claims))),
        };
        self.entries.push(Name::from(name), entry);
        self.reasons.push((arrival, reason));
    }

    /// Into every index but the uid's, as [`State::serve_workload`].
    fn serve_workload(&mut self, arrival: u64, w: &Arc<Workload>) {
        for at in State::found_at(w) {
            self.by_addr.push(at, (arrival, w.clone()));
        }
        if !w.workload_ips.is_empty() {
            *self.networks.entry(w.network.clone()).or_default() += 1;
        }
        for (svc, ports) in w.services.iter() {
            let endpoint = Endpoint {
                workload: w.clone(),
                ports: ports.clone(),
            };
            self.endpoints.push(svc.clone(), (arrival, endpoint));
        }
        let names = self
            .by_name
            .entry(w.namespace.clone())
            .or_insert_with(|| Builder::with_capacity(0));
        names.push(w.name.clone(), (arrival, w.clone()));
        for key in &w.authorization_policies {
            *self.named.entry(key.clone()).or_default() += 1;
        }
    }

    /// Takes a workload staged as serving out of the counts; the indexes
    /// lose it in [`Bulk::drop_arrivals`].
    fn unserve_workload(&mut self, w: &Workload) {
        if !w.workload_ips.is_empty() {
            less(&mut self.networks, &w.network);
        }
        for key in &w.authorization_policies {
            less(&mut self.named, key);
        }
    }

    /// Takes the resources of arrivals `gone` out of the indexes.
    fn drop_arrivals(&mut self, gone: &HashSet<u64>) {
        self.by_addr.retain(kept(gone));
        for names in self.by_name.values_mut() {
            names.retain(kept(gone));
        }
        self.by_name.retain(|_, names| !names.is_empty());
        self.endpoints.retain(kept(gone));
        self.by_vip.retain(kept(gone));
        self.ranges.retain(|(a, _)| !gone.contains(a));
    }
}

/// Whether a staged holder's arrival is not among `gone`.
fn kept<T>(gone: &HashSet<u64>) -> impl Fn(&(u64, T)) -> bool + '_ {
    |(a, _)| !gone.contains(a)
}

/// One fewer of `key`; the key goes at none.
fn less(counts: &mut Small<Name, usize>, key: &Name) {
    if let Some(n) = counts.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            counts.remove(key);
        }
    }
}

/// The arrival of what an entry holds, and of its refusal.
fn arrivals(e: &AddressEntry) -> (Option<u64>, Option<u64>) {
    (
        e.held.as_ref().map(|h| h.0),
        e.refusal.as_ref().map(|r| r.0),
    )
}

/// One name staged more than once: what the last put holds, and the last
/// refusal if it came after that put (as those changes in order would
/// leave it). Takes them in any order; what a later put replaced goes to
/// `replaced`.
fn merge(into: &mut AddressEntry, other: AddressEntry, replaced: &mut Vec<(u64, Address)>) {
    let (held, refused) = arrivals(into);
    let (other_held, other_refused) = arrivals(&other);
    let (older, newer_refusal) = match other_held > held {
        true => (std::mem::replace(&mut into.held, other.held), other.refusal),
        false => (other.held, other.refusal),
    };
    replaced.extend(older.map(|(a, held, _)| (a, held)));
    if other_refused > refused {
        into.refusal = newer_refusal;
    }
    let (held, refused) = arrivals(into);
    if refused < held {
        into.refusal = None;
    }
}

/// Staged holders as the index's queues, in arrival order.
fn queue<K: Hash + Eq + Clone, T>(b: Holders<K, T>) -> Map<K, Queue<T>> {
    b.build(|(a, v)| Queue::one(a, v), |q, (a, v)| q.add(a, v))
}

/// A map of keys staged once each.
fn unique<K: Hash + Eq + Clone, V: Clone>(
    entries: impl ExactSizeIterator<Item = (K, V)>,
) -> Map<K, V> {
    let mut b = Builder::with_capacity(entries.len());
    for (k, v) in entries {
        b.push(k, v);
    }
    b.build(|v| v, |_, _| unreachable!("each key staged once"))
}

/// Gives `lost` the holders after the first of each queue of `map`: those
/// left out, for a key an earlier arrival holds.
fn losers<K: Hash + Eq + Clone, T>(map: &Map<K, Queue<T>>, mut lost: impl FnMut(u64, &Arc<T>)) {
    for queue in map.values() {
        for (a, v) in queue.iter().skip(1) {
            lost(a, v);
        }
    }
}

impl State {
    /// Stages a push of `resources` address resources (those with a
    /// body) to put at once, if no address resource is held (else they
    /// are put one by one).
    pub fn bulk_addresses(&self, resources: usize) -> Option<Bulk> {
        self.addresses.is_empty().then(|| Bulk {
            arrivals: self.arrivals,
            entries: Builder::with_capacity(resources),
            reasons: Vec::new(),
            left_out: HashMap::new(),
            uids: Builder::with_capacity(resources),
            hosts: Builder::with_capacity(0),
            by_addr: Builder::with_capacity(resources),
            by_name: Small::default(),
            endpoints: Builder::with_capacity(resources),
            networks: Small::default(),
            named: Small::default(),
            by_vip: Builder::with_capacity(0),
            ranges: Vec::new(),
        })
    }

    /// Puts the resources staged in `bulk`; returns the names of those
    /// held but left out (as [`State::put_address`] does one by one).
    pub fn put_addresses(&mut self, mut bulk: Bulk) -> Vec<Name> {
        assert!(self.addresses.is_empty(), "staged on an empty state");
        self.arrivals = bulk.arrivals;
        let mut replaced = Vec::new();
        let entries = std::mem::replace(&mut bulk.entries, Builder::with_capacity(0));
        self.addresses = entries.build(|e| e, |into, e| merge(into, e, &mut replaced));

        // What a name given again replaced never serves.
        let mut gone = HashSet::new();
        for (arrival, held) in replaced {
            if bulk.left_out.remove(&arrival).is_none() {
                gone.insert(arrival);
                if let Address::Workload(w) = &held {
                    bulk.unserve_workload(w);
                }
            }
        }
        if !gone.is_empty() {
            bulk.uids.retain(kept(&gone));
            bulk.hosts.retain(kept(&gone));
        }
        let uids = std::mem::replace(&mut bulk.uids, Builder::with_capacity(0));
        self.workloads = queue(uids);
        let hosts = std::mem::replace(&mut bulk.hosts, Builder::with_capacity(0));
        self.services_by_host = queue(hosts);

        // The first of each uid and service key serves.
        let mut lost = Vec::new();
        losers(&self.workloads, |a, w| {
            lost.push((a, w.clone()));
        });
        for (a, w) in lost {
            gone.insert(a);
            bulk.left_out
                .insert(a, format!("uid {:?} is used twice", w.uid));
            bulk.unserve_workload(&w);
        }
        losers(&self.services_by_host, |a, s| {
            gone.insert(a);
            let reason = format!("service {} is defined twice", s.key());
            bulk.left_out.insert(a, reason);
        });
        if !gone.is_empty() {
            bulk.drop_arrivals(&gone);
        }
        self.index(bulk)
    }

    /// The indexes of what serves, the refusals, and what is left out.
    fn index(&mut self, bulk: Bulk) -> Vec<Name> {
        let Bulk {
            reasons,
            mut left_out,
            by_addr,
            by_name,
            endpoints,
            networks,
            named,
            by_vip,
            ranges,
            ..
        } = bulk;
        self.by_addr = queue(by_addr);
        self.by_name = unique(by_name.into_iter().map(|(ns, b)| (ns, queue(b))));
        // One list of the push's endpoints (not one per service, each
        // freed into a size class nothing else then takes).
        self.endpoints = endpoints.build(
            |(a, e)| OrdMap::unit(a, e),
            |list, (a, e)| drop(list.insert(a, e)),
        );
        self.networks = unique(networks.into_iter());
        for key in named.keys() {
            if !self.policies.contains_key(key.as_str()) {
                self.missing_policies
                    .insert(key.clone(), Self::missing(key));
            }
        }
        self.named_policies = unique(named.into_iter());
        self.services_by_vip = queue(by_vip);
        let mut ranges = ranges;
        ranges.sort_by_key(|(a, _)| *a);
        self.services_by_cidr = Arc::new(ranges);

        // Refusals, and those held but left out, by name (few).
        let mut refusals = Vec::new();
        let mut out = Vec::new();
        for (name, entry) in self.addresses.iter() {
            if let Some((arrival, claims)) = entry.refusal.as_deref() {
                refusals.push((name.clone(), *arrival, claims.clone()));
            }
            if left_out.is_empty() {
                continue;
            }
            if let Some((arrival, held, _)) = &entry.held {
                if let Some(reason) = left_out.remove(arrival) {
                    out.push((name.clone(), *arrival, held.clone(), reason));
                }
            }
        }
        for (name, arrival, claims) in refusals {
            let at = reasons.partition_point(|(a, _)| *a < arrival);
            let refused = Arc::new(Refused {
                resource: name.to_string(),
                reason: reasons[at].1.clone(),
            });
            self.refused.add(&claims, arrival, &refused);
        }
        out.into_iter()
            .map(|(name, arrival, held, reason)| {
                self.leave_out(&name, arrival, &held, reason);
                name
            })
            .collect()
    }
}
