//! Changing a [`State`] one resource at a time: an address (workload or
//! service) or a policy put, refused or removed, and every index it is in
//! updated in place, in time proportional to what that resource touches.
//!
//! The result is always the state a build from lists would make of the
//! resources held, in their arrival order (`tests.rs` checks this against
//! a rebuild after every step of random sequences). So a resource that
//! loses a conflict (a uid, a `namespace/hostname` or a policy key another
//! holds) is held but left out, refused where it claims, and serves as
//! soon as the one ahead of it goes.

use std::borrow::Borrow;
use std::hash::Hash;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use super::{
    AddressResource, Authorization, Claims, Endpoint, Map, Name, NetworkAddress, NetworkCidr,
    NetworkMode, PolicyScope, Refused, Service, State, Workload,
};

/// Holders of one key in arrival order, each with its arrival number.
/// Almost always one, held in place: its arrival beside its pointer, 16
/// bytes, so that each index's table entry (a million in each of three
/// indexes for a million workloads) is no larger than it must be. More
/// are a list of their own, made anew on a change, marked by the arrival
/// word's top bit ([`MANY`]); arrivals count up from zero and never
/// reach it.
pub(super) struct Queue<T> {
    /// The one holder's arrival, or [`MANY`].
    word: u64,
    holders: Holders<T>,
}

/// The arrival word of a queue of any other number of holders than one.
const MANY: u64 = 1 << 63;

/// A holder and its arrival.
type Holder<T> = (u64, Arc<T>);

/// A queue's holders: which field is set is the arrival word's top bit.
union Holders<T> {
    one: ManuallyDrop<Arc<T>>,
    many: ManuallyDrop<Arc<Vec<Holder<T>>>>,
}

impl<T> Queue<T> {
    pub(super) fn one(arrival: u64, value: Arc<T>) -> Self {
        assert!(arrival < MANY, "arrival numbers never reach 2^63");
        Queue {
            word: arrival,
            holders: Holders {
                one: ManuallyDrop::new(value),
            },
        }
    }

    fn many(holders: Vec<(u64, Arc<T>)>) -> Self {
        Queue {
            word: MANY,
            holders: Holders {
                many: ManuallyDrop::new(Arc::new(holders)),
            },
        }
    }

    /// The one holder, or the list of any other number.
    fn holders(&self) -> Result<(u64, &Arc<T>), &[Holder<T>]> {
        if self.word & MANY == 0 {
            // SAFETY: the top bit clear, `one` is the field set (`Queue::one`).
            Ok((self.word, unsafe { &self.holders.one }))
        } else {
            // SAFETY: the top bit set, `many` is the field set (`Queue::many`).
            Err(unsafe { &self.holders.many })
        }
    }

    /// The first holder and its arrival.
    pub(super) fn first(&self) -> Option<(u64, &Arc<T>)> {
        match self.holders() {
            Ok(one) => Some(one),
            Err(many) => many.first().map(|(a, v)| (*a, v)),
        }
    }

    /// The last holder to arrive and its arrival.
    pub(super) fn last(&self) -> Option<(u64, &Arc<T>)> {
        match self.holders() {
            Ok(one) => Some(one),
            Err(many) => many.last().map(|(a, v)| (*a, v)),
        }
    }

    /// Every holder in arrival order, with its arrival.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, &Arc<T>)> {
        let (one, many) = match self.holders() {
            Ok(one) => (Some(one), &[][..]),
            Err(many) => (None, many),
        };
        one.into_iter().chain(many.iter().map(|(a, v)| (*a, v)))
    }

    fn to_vec(&self) -> Vec<(u64, Arc<T>)> {
        self.iter().map(|(a, v)| (a, v.clone())).collect()
    }

    /// Adds a holder in its place by arrival.
    pub(super) fn add(&mut self, arrival: u64, value: Arc<T>) {
        let mut more = self.to_vec();
        let at = more.partition_point(|(a, _)| *a < arrival);
        more.insert(at, (arrival, value));
        *self = more.into();
    }
}

impl<T> Clone for Queue<T> {
    fn clone(&self) -> Self {
        match self.holders() {
            Ok((arrival, v)) => Queue::one(arrival, v.clone()),
            Err(_) => Queue {
                word: MANY,
                holders: Holders {
                    // SAFETY: the top bit set, `many` is the field set.
                    many: unsafe { self.holders.many.clone() },
                },
            },
        }
    }
}

impl<T> Drop for Queue<T> {
    fn drop(&mut self) {
        // SAFETY: the field the top bit says is set, dropped once, here.
        unsafe {
            if self.word & MANY == 0 {
                ManuallyDrop::drop(&mut self.holders.one);
            } else {
                ManuallyDrop::drop(&mut self.holders.many);
            }
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Queue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T> From<Vec<(u64, Arc<T>)>> for Queue<T> {
    fn from(mut v: Vec<(u64, Arc<T>)>) -> Self {
        match v.pop() {
            Some((arrival, one)) if v.is_empty() => Queue::one(arrival, one),
            Some(last) => {
                v.push(last);
                v.shrink_to_fit();
                Queue::many(v)
            }
            None => Queue::many(Vec::new()),
        }
    }
}

/// Adds `value` to `key`'s queue, in arrival order; `make` makes the key
/// (an allocation, for a string) only when the map lacks it. True if the
/// queue is new (`value` is its first).
fn enqueue<K, Q, T>(
    map: &mut Map<K, Queue<T>>,
    key: &Q,
    make: impl FnOnce() -> K,
    arrival: u64,
    value: &Arc<T>,
) -> bool
where
    K: Hash + Eq + Clone + Borrow<Q>,
    Q: Hash + Eq + ?Sized,
{
    let (queue, new) = map.get_or_insert_with(key, || (make(), Queue::one(arrival, value.clone())));
    if !new {
        queue.add(arrival, value.clone());
    }
    new
}

/// `key`'s value, made (with the key's allocation) only when missing.
fn slot<'m, V: Clone + Default>(map: &'m mut Map<Name, V>, key: &Name) -> &'m mut V {
    map.get_or_insert_with(key.as_str(), || (key.clone(), V::default()))
        .0
}

/// Takes arrival `arrival` out of `key`'s queue; the key goes with its
/// last holder.
fn dequeue<K, Q, T>(map: &mut Map<K, Queue<T>>, key: &Q, arrival: u64)
where
    K: Hash + Eq + Clone + Borrow<Q>,
    Q: Hash + Eq + ?Sized,
{
    let Some(queue) = map.get(key) else {
        return;
    };
    if !queue.iter().any(|(a, _)| a == arrival) {
        return;
    }
    let rest: Vec<_> = queue
        .iter()
        .filter(|(a, _)| *a != arrival)
        .map(|(a, v)| (a, v.clone()))
        .collect();
    match map.get_mut(key) {
        Some(q) if !rest.is_empty() => *q = rest.into(),
        _ => {
            map.remove(key);
        }
    }
}

/// The first in `key`'s queue, with its arrival number.
fn first_in<K, Q, T>(map: &Map<K, Queue<T>>, key: &Q) -> Option<(u64, Arc<T>)>
where
    K: Hash + Eq + Clone + Borrow<Q>,
    Q: Hash + Eq + ?Sized,
{
    map.get(key)?.first().map(|(a, v)| (a, v.clone()))
}

/// VIP ranges (services', refusals') in arrival order: few, and matched
/// by scanning.
pub(super) type Ranges<T> = Arc<Vec<(u64, (NetworkCidr, Arc<T>))>>;

/// A list in arrival order (for the few entries a map would not help).
pub(super) fn insert_ordered<T: Clone>(list: &mut Arc<Vec<(u64, T)>>, arrival: u64, value: T) {
    let list = Arc::make_mut(list);
    let at = list.partition_point(|(a, _)| *a < arrival);
    list.insert(at, (arrival, value));
}

fn remove_ordered<T: Clone>(list: &mut Arc<Vec<(u64, T)>>, arrival: u64) {
    if list.iter().any(|(a, _)| *a == arrival) {
        Arc::make_mut(list).retain(|(a, _)| *a != arrival);
    }
}

/// What a refused resource claimed, by claim, in arrival order: the first
/// refusal of a claim is the one reported.
#[derive(Debug, Clone, Default)]
pub(super) struct Refusals {
    pub by_addr: Map<NetworkAddress, Queue<Refused>>,
    pub by_range: Ranges<Refused>,
    pub by_host: Map<Name, Queue<Refused>>,
}

impl Refusals {
    pub(super) fn add(&mut self, claims: &Claims, arrival: u64, refused: &Arc<Refused>) {
        for a in &claims.addresses {
            enqueue(&mut self.by_addr, a, || a.clone(), arrival, refused);
        }
        for c in &claims.ranges {
            insert_ordered(&mut self.by_range, arrival, (c.clone(), refused.clone()));
        }
        for h in &claims.hosts {
            enqueue(
                &mut self.by_host,
                h.as_str(),
                || h.as_str().into(),
                arrival,
                refused,
            );
        }
    }

    fn remove(&mut self, claims: &Claims, arrival: u64) {
        for a in &claims.addresses {
            dequeue(&mut self.by_addr, a, arrival);
        }
        if !claims.ranges.is_empty() {
            remove_ordered(&mut self.by_range, arrival);
        }
        for h in &claims.hosts {
            dequeue(&mut self.by_host, h.as_str(), arrival);
        }
    }
}

/// A valid address resource held (served, or left out for a conflict).
#[derive(Debug, Clone)]
pub(super) enum Address {
    Workload(Arc<Workload>),
    Service(Arc<Service>),
}

impl Address {
    /// A resource as held: a workload without a uid takes
    /// `namespace/name` as its uid.
    pub(super) fn of(resource: AddressResource) -> Address {
        match resource {
            AddressResource::Workload(mut w) => {
                if w.uid.is_empty() {
                    Arc::make_mut(&mut w).uid = format!("{}/{}", w.namespace, w.name).into();
                }
                Address::Workload(w)
            }
            AddressResource::Service(s) => Address::Service(s),
        }
    }

    fn claims(&self) -> Claims {
        match self {
            Address::Workload(w) => Claims::of_workload(w),
            Address::Service(s) => Claims::of_service(s),
        }
    }
}

/// What one address resource holds.
#[derive(Debug, Clone, Default)]
pub(super) struct AddressEntry {
    /// Its valid version, with its arrival and the control plane's
    /// version string for it.
    pub(super) held: Option<(u64, Address, Box<str>)>,
    /// Its latest refused version while it stands (a version Ambit cannot
    /// serve never replaces the one serving): what that claimed, refused.
    /// Boxed: rare, and an entry is in a map node of every resource.
    pub(super) refusal: Option<Box<(u64, Claims)>>,
}

/// What one policy resource holds: its valid version (with the control
/// plane's version string), or else the stand-in for its refused one
/// (which denies where it applies).
#[derive(Debug, Clone, Default)]
pub(super) struct PolicyEntry {
    held: Option<(u64, Arc<Authorization>, Box<str>)>,
    stand_in: Option<(u64, Arc<Authorization>)>,
}

impl PolicyEntry {
    fn deciding(&self) -> Option<(u64, &Arc<Authorization>)> {
        match (&self.held, &self.stand_in) {
            (Some((arrival, p, _)), _) | (None, Some((arrival, p))) => Some((*arrival, p)),
            (None, None) => None,
        }
    }
}

/// Why a workload cannot serve whatever else is held.
pub(super) fn invalid_workload(w: &Workload) -> Option<String> {
    if w.name.is_empty() || w.namespace.is_empty() {
        Some("name and namespace are required".to_string())
    } else {
        w.unsupported()
    }
}

pub(super) fn invalid_service(s: &Service) -> Option<String> {
    if s.hostname.is_empty() || s.namespace.is_empty() {
        Some("hostname and namespace are required".to_string())
    } else {
        s.unsupported()
    }
}

impl State {
    fn next_arrival(&mut self) -> u64 {
        self.arrivals += 1;
        self.arrivals
    }

    /// Holds address resource `name` (at the control plane's `version`)
    /// as `resource`, in place of what it held (and of a refusal of it).
    /// Returns why it does not serve, if it does not: until it is put
    /// again, only the removal of the one it conflicts with changes that
    /// (see [`State::left_out`]).
    pub fn put_address(
        &mut self,
        name: &str,
        version: &str,
        resource: AddressResource,
    ) -> Option<String> {
        let arrival = self.next_arrival();
        let name = Name::from(name);
        let held = Address::of(resource);
        // In place of what the name held, in one walk of the map (nothing
        // below reads this map): the old one is let go, then the new held.
        let entry = AddressEntry {
            held: Some((arrival, held.clone(), version.into())),
            refusal: None,
        };
        if let Some(old) = self.addresses.insert(name.clone(), entry) {
            self.release(old);
        }
        self.hold(&name, arrival, &held)
    }

    /// The version of each valid address resource held (what serves, or
    /// would serve, under each name: what a reconnect tells the control
    /// plane this proxy has).
    pub fn address_versions(&self) -> impl Iterator<Item = (&str, &str)> {
        self.addresses.iter().filter_map(|(name, e)| {
            let (_, _, version) = e.held.as_ref()?;
            Some((&**name, &**version))
        })
    }

    /// [`State::address_versions`] for policies.
    pub fn policy_versions(&self) -> impl Iterator<Item = (&str, &str)> {
        self.policy_entries.iter().filter_map(|(name, e)| {
            let (_, _, version) = e.held.as_ref()?;
            Some((&**name, &**version))
        })
    }

    /// An update of address resource `name` that Ambit refuses: what it
    /// claims is refused with `reason` (where nothing served holds it),
    /// and the version held before, if any, keeps serving.
    pub fn refuse_address(&mut self, name: &str, claims: Claims, reason: String) {
        let mut entry = self.addresses.remove(name).unwrap_or_default();
        if let Some((arrival, old)) = entry.refusal.take().map(|r| *r) {
            self.refused.remove(&old, arrival);
        }
        let arrival = self.next_arrival();
        let refused = Arc::new(Refused {
            resource: name.to_string(),
            reason,
        });
        self.refused.add(&claims, arrival, &refused);
        entry.refusal = Some(Box::new((arrival, claims)));
        self.addresses.insert(name.into(), entry);
    }

    /// Address resource `name` is gone, its refusal too.
    pub fn remove_address(&mut self, name: &str) {
        self.drop_address(name);
    }

    fn drop_address(&mut self, name: &str) {
        if let Some(entry) = self.addresses.remove(name) {
            self.release(entry);
        }
    }

    /// Undoes what an address entry held and refused.
    fn release(&mut self, entry: AddressEntry) {
        if let Some((arrival, held, _)) = entry.held {
            self.unhold(arrival, &held);
        }
        if let Some((arrival, claims)) = entry.refusal.map(|r| *r) {
            self.refused.remove(&claims, arrival);
        }
    }

    /// Why the valid version held as address resource `name` does not
    /// serve, if it does not.
    pub fn left_out(&self, name: &str) -> Option<String> {
        let (arrival, held, _) = self.addresses.get(name)?.held.as_ref()?;
        match held {
            Address::Workload(w) => invalid_workload(w).or_else(|| {
                let (first, _) = first_in(&self.workloads, w.uid.as_str())?;
                (first != *arrival).then(|| format!("uid {:?} is used twice", w.uid))
            }),
            Address::Service(s) => invalid_service(s).or_else(|| {
                let key = s.key();
                let (first, _) = first_in(&self.services_by_host, key.as_str())?;
                (first != *arrival).then(|| format!("service {key} is defined twice"))
            }),
        }
    }

    /// Returns why it is left out, if it is.
    fn hold(&mut self, name: &Name, arrival: u64, held: &Address) -> Option<String> {
        match held {
            Address::Workload(w) => {
                if let Some(reason) = invalid_workload(w) {
                    self.leave_out(name, arrival, held, reason.clone());
                    return Some(reason);
                }
                let uid = w.uid.as_str();
                let key = || match **name == *uid {
                    true => name.clone(),
                    false => w.uid.clone(),
                };
                if enqueue(&mut self.workloads, uid, key, arrival, w) {
                    self.serve_workload(arrival, w);
                    return None;
                }
                let reason = format!("uid {:?} is used twice", w.uid);
                self.leave_out(name, arrival, held, reason.clone());
                Some(reason)
            }
            Address::Service(s) => {
                if let Some(reason) = invalid_service(s) {
                    self.leave_out(name, arrival, held, reason.clone());
                    return Some(reason);
                }
                let key = s.key();
                let make = || match **name == *key {
                    true => name.clone(),
                    false => key.as_str().into(),
                };
                if enqueue(&mut self.services_by_host, key.as_str(), make, arrival, s) {
                    self.serve_service(arrival, s);
                    return None;
                }
                let reason = format!("service {key} is defined twice");
                self.leave_out(name, arrival, held, reason.clone());
                Some(reason)
            }
        }
    }

    fn unhold(&mut self, arrival: u64, held: &Address) {
        match held {
            Address::Workload(w) => {
                if invalid_workload(w).is_some() {
                    return self.bring_in(arrival, held);
                }
                let uid = w.uid.as_str();
                let serving = first_in(&self.workloads, uid).map(|(a, _)| a) == Some(arrival);
                dequeue(&mut self.workloads, uid, arrival);
                if !serving {
                    return self.bring_in(arrival, held);
                }
                self.unserve_workload(arrival, w);
                if let Some((next, w)) = first_in(&self.workloads, uid) {
                    self.bring_in(next, &Address::Workload(w.clone()));
                    self.serve_workload(next, &w);
                }
            }
            Address::Service(s) => {
                if invalid_service(s).is_some() {
                    return self.bring_in(arrival, held);
                }
                let key = s.key();
                let serving =
                    first_in(&self.services_by_host, key.as_str()).map(|(a, _)| a) == Some(arrival);
                dequeue(&mut self.services_by_host, key.as_str(), arrival);
                if !serving {
                    return self.bring_in(arrival, held);
                }
                self.unserve_service(arrival, s);
                if let Some((next, s)) = first_in(&self.services_by_host, key.as_str()) {
                    self.bring_in(next, &Address::Service(s.clone()));
                    self.serve_service(next, &s);
                }
            }
        }
    }

    /// Held but not served: refused where it claims, and kept as given.
    pub(super) fn leave_out(&mut self, name: &str, arrival: u64, held: &Address, reason: String) {
        let refused = Arc::new(Refused {
            resource: name.to_string(),
            reason,
        });
        self.refused.add(&held.claims(), arrival, &refused);
        match held {
            Address::Workload(w) => {
                self.refused_workloads.insert(arrival, w.clone());
            }
            Address::Service(sv) => {
                self.refused_services.insert(arrival, sv.clone());
            }
        }
    }

    /// Undoes [`State::leave_out`].
    fn bring_in(&mut self, arrival: u64, held: &Address) {
        self.refused.remove(&held.claims(), arrival);
        match held {
            Address::Workload(_) => drop(self.refused_workloads.remove(&arrival)),
            Address::Service(_) => drop(self.refused_services.remove(&arrival)),
        }
    }

    /// The addresses a workload is found at: a hostNetwork workload's IPs
    /// are its node's, shared with the node's other hostNetwork pods, so
    /// it is never found by IP.
    pub(super) fn found_at(w: &Workload) -> impl Iterator<Item = NetworkAddress> + '_ {
        let ips = match w.network_mode {
            NetworkMode::HostNetwork => &[][..],
            NetworkMode::Standard => &w.workload_ips[..],
        };
        ips.iter().map(|ip| NetworkAddress {
            network: w.network.clone(),
            address: *ip,
        })
    }

    /// Into every index but the uid's (whose queue says who serves).
    fn serve_workload(&mut self, arrival: u64, w: &Arc<Workload>) {
        // Several workloads may claim an address (an IP reused while the
        // old pod's removal is on its way, a WorkloadEntry beside a pod):
        // all are held; lookups pick as ztunnel does.
        for at in Self::found_at(w) {
            enqueue(&mut self.by_addr, &at, || at.clone(), arrival, w);
        }
        if !w.workload_ips.is_empty() {
            *slot(&mut self.networks, &w.network) += 1;
        }
        for (svc, ports) in w.services.iter() {
            let endpoint = Endpoint {
                workload: w.clone(),
                ports: ports.clone(),
            };
            slot(&mut self.endpoints, svc).insert(arrival, endpoint);
        }
        let names = slot(&mut self.by_name, &w.namespace);
        enqueue(names, w.name.as_str(), || w.name.clone(), arrival, w);
        for key in &w.authorization_policies {
            self.name_policy(key);
        }
    }

    fn unserve_workload(&mut self, arrival: u64, w: &Workload) {
        for at in Self::found_at(w) {
            dequeue(&mut self.by_addr, &at, arrival);
        }
        if !w.workload_ips.is_empty() {
            let held = slot(&mut self.networks, &w.network);
            *held = held.saturating_sub(1);
            if *held == 0 {
                self.networks.remove(w.network.as_str());
            }
        }
        for svc in w.services.keys() {
            if let Some(endpoints) = self.endpoints.get_mut(svc.as_str()) {
                endpoints.remove(&arrival);
                if endpoints.is_empty() {
                    self.endpoints.remove(svc.as_str());
                }
            }
        }
        if let Some(names) = self.by_name.get_mut(w.namespace.as_str()) {
            dequeue(names, w.name.as_str(), arrival);
            if names.is_empty() {
                self.by_name.remove(w.namespace.as_str());
            }
        }
        for key in &w.authorization_policies {
            self.unname_policy(key);
        }
    }

    fn serve_service(&mut self, arrival: u64, s: &Arc<Service>) {
        for vip in &s.vips {
            enqueue(&mut self.services_by_vip, vip, || vip.clone(), arrival, s);
        }
        for range in &s.cidr_vips {
            insert_ordered(
                &mut self.services_by_cidr,
                arrival,
                (range.clone(), s.clone()),
            );
        }
    }

    fn unserve_service(&mut self, arrival: u64, s: &Service) {
        for vip in &s.vips {
            dequeue(&mut self.services_by_vip, vip, arrival);
        }
        remove_ordered(&mut self.services_by_cidr, arrival);
    }

    /// A served workload names policy `key`: until it is held, a denying
    /// stand-in decides in its place.
    fn name_policy(&mut self, key: &Name) {
        let count = slot(&mut self.named_policies, key);
        *count += 1;
        if *count == 1 && !self.policies.contains_key(key.as_str()) {
            self.missing_policies
                .insert(key.clone(), Self::missing(key));
        }
    }

    fn unname_policy(&mut self, key: &str) {
        let Some(count) = self.named_policies.get_mut(key) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            self.named_policies.remove(key);
            self.missing_policies.remove(key);
        }
    }

    pub(super) fn missing(key: &str) -> Arc<Authorization> {
        Arc::new(Authorization::refused_stand_in(
            key,
            "named by the workload but not held (refused, not yet sent, or removed)".into(),
        ))
    }

    /// Holds policy resource `name` (at the control plane's `version`) as
    /// `policy`, in place of what it held. Returns why it does not decide,
    /// if it does not (as [`State::put_address`]).
    pub fn put_policy(
        &mut self,
        name: &str,
        version: &str,
        policy: Authorization,
    ) -> Option<String> {
        self.remove_policy(name);
        let arrival = self.next_arrival();
        let policy = Arc::new(policy);
        let decides = self.hold_policy(arrival, &policy);
        let entry = PolicyEntry {
            held: Some((arrival, policy, version.into())),
            stand_in: None,
        };
        self.policy_entries.insert(name.into(), entry);
        (!decides).then(|| "defined twice".to_string())
    }

    /// An update of policy resource `name` that Ambit refuses: the valid
    /// version held, if any, keeps deciding; else `stand_in` does (and
    /// denies where it applies).
    pub fn refuse_policy(&mut self, name: &str, stand_in: Authorization) {
        let mut entry = self.policy_entries.remove(name).unwrap_or_default();
        if entry.held.is_none() {
            if let Some((arrival, old)) = entry.stand_in.take() {
                self.unhold_policy(arrival, &old);
            }
            let arrival = self.next_arrival();
            let stand_in = Arc::new(stand_in);
            self.hold_policy(arrival, &stand_in);
            entry.stand_in = Some((arrival, stand_in));
        }
        self.policy_entries.insert(name.into(), entry);
    }

    /// Policy resource `name` is gone, its refusal too.
    pub fn remove_policy(&mut self, name: &str) {
        let Some(entry) = self.policy_entries.remove(name) else {
            return;
        };
        if let Some((arrival, p)) = entry.deciding() {
            self.unhold_policy(arrival, p);
        }
    }

    /// Why the valid version held as policy resource `name` does not
    /// decide, if it does not.
    pub fn policy_left_out(&self, name: &str) -> Option<String> {
        let (arrival, p, _) = self.policy_entries.get(name)?.held.as_ref()?;
        let (first, _) = first_in(&self.policies, p.key().as_str())?;
        (first != *arrival).then(|| "defined twice".to_string())
    }

    /// True if it decides (no other holds its key).
    fn hold_policy(&mut self, arrival: u64, p: &Arc<Authorization>) -> bool {
        let key = p.key();
        let make = || key.as_str().into();
        let first = enqueue(&mut self.policies, key.as_str(), make, arrival, p);
        if first {
            self.serve_policy(arrival, p);
        }
        first
    }

    fn unhold_policy(&mut self, arrival: u64, p: &Authorization) {
        let key = p.key();
        let serving = first_in(&self.policies, key.as_str()).map(|(a, _)| a) == Some(arrival);
        dequeue(&mut self.policies, key.as_str(), arrival);
        if serving {
            self.unserve_policy(arrival, p);
            if let Some((next, p)) = first_in(&self.policies, key.as_str()) {
                self.serve_policy(next, &p);
            }
        }
    }

    /// Into the scope's index (its key's queue says who decides).
    fn serve_policy(&mut self, arrival: u64, p: &Arc<Authorization>) {
        match p.scope {
            PolicyScope::Global => insert_ordered(&mut self.global_policies, arrival, p.clone()),
            PolicyScope::Namespace => {
                let ns = p.namespace.as_str();
                enqueue(&mut self.policies_by_ns, ns, || ns.into(), arrival, p);
            }
            PolicyScope::WorkloadSelector => {}
        }
        self.missing_policies.remove(p.key().as_str());
    }

    fn unserve_policy(&mut self, arrival: u64, p: &Authorization) {
        let key = p.key();
        match p.scope {
            PolicyScope::Global => remove_ordered(&mut self.global_policies, arrival),
            PolicyScope::Namespace => {
                dequeue(&mut self.policies_by_ns, p.namespace.as_str(), arrival)
            }
            PolicyScope::WorkloadSelector => {}
        }
        // Its key's queue is without it already: a next in line decides.
        if self.named_policies.contains_key(key.as_str())
            && !self.policies.contains_key(key.as_str())
        {
            self.missing_policies
                .insert(key.as_str().into(), Self::missing(&key));
        }
    }
}
