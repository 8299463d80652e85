//! The mesh state the data path reads: an immutable, indexed snapshot that
//! whichever source owns the state (xDS or the local file) changes one
//! resource at a time and swaps in whole.
//!
//! Readers call [`StateHandle::load`] once per connection and never lock. A
//! writer changes its own copy and swaps it in one step, so a reader sees
//! either the old state or the new one, never a mix. The copy costs nothing
//! and a change costs what it touches, not what the state holds: every map
//! is persistent (a copy shares all its nodes, a change copies only the
//! path to what changed: `cow_map.rs` for the hash maps, imbl's `OrdMap`
//! for a service's endpoints). The changes themselves are in `change.rs`;
//! a first push, into a state holding no address resource, is put at once
//! instead, its maps built whole (`bulk.rs`).

use std::net::IpAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use imbl::OrdMap;

use super::convert::AddressResource;
use super::types::{
    same_text, Authorization, HealthStatus, Name, NetworkAddress, NetworkAddressRef, NetworkCidr,
    NetworkMode, PolicyScope, Protocol, Service, Workload,
};

mod bulk;
mod change;
mod cow_map;

use change::{AddressEntry, PolicyEntry, Queue, Ranges, Refusals};

/// The state's maps: persistent (`cow_map.rs`), hashed with foldhash
/// (seeded per process; SipHash was the largest single cost of a full push).
type Map<K, V> = cow_map::CowMap<K, V>;

/// A workload backing a service, with its own port overrides.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub workload: Arc<Workload>,
    /// Service port → target port for this workload (may override the service's).
    pub ports: super::types::Ports,
}

/// One consistent view of workloads, services and policies.
///
/// Resources arrive one by one, each numbered in arrival order (an update
/// is a new arrival). Where several claim one key, the arrival order
/// decides, as a build from lists in that order would: the first to
/// arrive holds a uid, a service's `namespace/hostname` or a policy key
/// (the others are left out, and take over in turn when it goes); all the
/// workloads at an address, and all the services at a VIP, are held, and
/// lookups rank them.
#[derive(Debug, Clone, Default)]
pub struct State {
    arrivals: u64,
    /// What each address resource holds, by resource name.
    addresses: Map<Name, AddressEntry>,
    /// What each policy resource holds, by resource name.
    policy_entries: Map<Name, PolicyEntry>,
    /// The valid workloads claiming each uid: the first serves. (istiod
    /// names a workload by its uid: the key is the name's, shared.)
    workloads: Map<Name, Queue<Workload>>,
    /// Every served workload claiming an address.
    by_addr: Map<NetworkAddress, Queue<Workload>>,
    /// How many served workloads with addresses each network holds: the
    /// networks an address can be looked up on.
    networks: Map<Name, usize>,
    /// Namespace → name → served workloads of that name: the latest is
    /// found. Nested so that a lookup (one per connection, for the pod's
    /// own labels) borrows the names instead of copying them.
    by_name: Map<Name, Map<Name, Queue<Workload>>>,
    /// Services may share a VIP (across namespaces).
    services_by_vip: Map<NetworkAddress, Queue<Service>>,
    /// VIP ranges, matched when no VIP matches exactly; in arrival order.
    services_by_cidr: Ranges<Service>,
    /// The valid services claiming each `namespace/hostname`: the first serves.
    services_by_host: Map<Name, Queue<Service>>,
    /// Each service's endpoints (by `namespace/hostname`), keyed by their
    /// workload's arrival.
    endpoints: Map<Name, OrdMap<u64, Endpoint>>,
    /// Addresses and names of resources that were refused: a connection to
    /// one is refused with the reason, never passed through (when no
    /// served resource holds the address).
    refused: Refusals,
    /// The refused resources themselves, by arrival (a control plane
    /// serves them as they are; a proxy never uses them).
    refused_workloads: OrdMap<u64, Arc<Workload>>,
    refused_services: OrdMap<u64, Arc<Service>>,
    /// The policies claiming each key (`namespace/name`): the first decides.
    policies: Map<Name, Queue<Authorization>>,
    /// How many times served workloads name each policy key.
    named_policies: Map<Name, usize>,
    /// Policies a workload names that are not held: denying stand-ins
    /// until they arrive (never "no ALLOW policy, so allow").
    missing_policies: Map<Name, Arc<Authorization>>,
    /// Namespace-scoped policies by namespace, and the global ones.
    policies_by_ns: Map<Name, Queue<Authorization>>,
    global_policies: Arc<Vec<(u64, Arc<Authorization>)>>,
}

/// The one serving of those claiming a key.
fn first<T>(queue: &Queue<T>) -> Option<&Arc<T>> {
    queue.first().map(|(_, v)| v)
}

/// ztunnel's choice among services that share a VIP or a hostname.
pub fn best_service<'a>(
    services: impl Iterator<Item = &'a Arc<Service>>,
    client: Option<&str>,
) -> Option<&'a Arc<Service>> {
    let mut pick: Option<&Arc<Service>> = None;
    for s in services.filter(|s| client.is_none_or(|c| s.visible_to(c))) {
        if Some(s.namespace.as_str()) == client {
            return Some(s);
        }
        if s.canonical || pick.is_none() {
            pick = Some(s);
        }
    }
    pick
}

/// A resource Ambit refused, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub resource: String,
    pub reason: String,
}

/// What a refused resource claimed: its addresses, VIP ranges and names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claims {
    pub addresses: Vec<NetworkAddress>,
    pub ranges: Vec<NetworkCidr>,
    /// A service's `namespace/hostname`, or a workload's hostname.
    pub hosts: Vec<String>,
}

impl Claims {
    pub fn of_workload(w: &Workload) -> Claims {
        let addresses = match w.network_mode {
            // The node's own addresses: never claimed by one workload.
            NetworkMode::HostNetwork => Vec::new(),
            NetworkMode::Standard => w
                .workload_ips
                .iter()
                .map(|ip| NetworkAddress {
                    network: w.network.clone(),
                    address: *ip,
                })
                .collect(),
        };
        Claims {
            addresses,
            ranges: Vec::new(),
            hosts: [w.hostname.to_string()]
                .into_iter()
                .filter(|h| !h.is_empty())
                .collect(),
        }
    }

    pub fn of_service(s: &Service) -> Claims {
        Claims {
            addresses: s.vips.clone(),
            ranges: s.cidr_vips.clone(),
            hosts: vec![s.key()],
        }
    }
}

/// Why a resource could not join the state; names the resource.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{resource}: {reason}")]
pub struct ResourceError {
    pub resource: String,
    pub reason: String,
    /// Where in the lists given to [`State::build`] it was; `None` for a
    /// resource refused before any list was made.
    pub entry: Option<ListEntry>,
}

/// A position in the lists a state is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListEntry {
    Workload(usize),
    Service(usize),
    Policy(usize),
}

impl State {
    /// Builds a state from complete lists, rejecting conflicting resources.
    pub fn build(
        workloads: Vec<Workload>,
        services: Vec<Service>,
        policies: Vec<Authorization>,
    ) -> Result<State, Vec<ResourceError>> {
        let (st, errors) = Self::build_lenient(workloads, services, policies);
        if errors.is_empty() {
            Ok(st)
        } else {
            Err(errors)
        }
    }

    /// Builds a state from everything that fits, and names what did not
    /// (for xDS, where one bad resource rejects only itself). The lists
    /// arrive in order: workloads, services, then policies.
    pub fn build_lenient(
        workloads: Vec<Workload>,
        services: Vec<Service>,
        policies: Vec<Authorization>,
    ) -> (State, Vec<ResourceError>) {
        let mut st = State::default();
        let mut errors = Vec::new();
        let mut check = |st: &State, resource: String, entry: ListEntry| {
            let left_out = match entry {
                ListEntry::Policy(_) => st.policy_left_out(&resource),
                _ => st.left_out(&resource),
            };
            if let Some(reason) = left_out {
                errors.push(ResourceError {
                    resource,
                    reason,
                    entry: Some(entry),
                });
            }
        };
        for (i, w) in workloads.into_iter().enumerate() {
            let name = format!("workloads[{i}] ({}/{})", w.namespace, w.name);
            st.put_address(&name, "", AddressResource::Workload(Arc::new(w)));
            check(&st, name, ListEntry::Workload(i));
        }
        for (i, s) in services.into_iter().enumerate() {
            let name = format!("services[{i}] ({}/{})", s.namespace, s.hostname);
            st.put_address(&name, "", AddressResource::Service(Arc::new(s)));
            check(&st, name, ListEntry::Service(i));
        }
        for (i, p) in policies.into_iter().enumerate() {
            let name = format!("policies[{i}] ({})", p.key());
            st.put_policy(&name, "", p);
            check(&st, name, ListEntry::Policy(i));
        }
        (st, errors)
    }

    /// The refused resource that claimed an address (exactly, or in a
    /// range), if one did. Consulted only when nothing served holds it.
    pub fn refused_at(&self, network: &str, ip: IpAddr) -> Option<&Refused> {
        let key = NetworkAddressRef {
            network,
            address: ip,
        };
        if let Some((_, r)) = self.refused.by_addr.get(&key).and_then(|q| q.first()) {
            return Some(r);
        }
        self.refused
            .by_range
            .iter()
            .filter(|(_, (c, _))| same_text(&c.network, network) && c.cidr.contains(ip))
            .max_by_key(|(_, (c, _))| c.cidr.len)
            .map(|(_, (_, r))| r.as_ref())
    }

    /// The workloads and services held as refused (invalid, or left out
    /// for a conflict), as they were given, in arrival order.
    pub fn refused_resources(
        &self,
    ) -> (
        impl Iterator<Item = &Arc<Workload>>,
        impl Iterator<Item = &Arc<Service>>,
    ) {
        (
            self.refused_workloads.values(),
            self.refused_services.values(),
        )
    }

    /// The refused resource that claimed a name (`namespace/hostname`).
    pub fn refused_host(&self, key: &str) -> Option<&Refused> {
        let (_, r) = self.refused.by_host.get(key)?.first()?;
        Some(r)
    }

    /// Every refused claim as text (`network/ip`, `network/ip/len`,
    /// `namespace/hostname`) with its refusal, for the config dump.
    pub fn refusals(&self) -> impl Iterator<Item = (String, Arc<Refused>)> + '_ {
        let r = &self.refused;
        let first = |q: &Queue<Refused>| q.first().map(|(_, r)| r.clone());
        r.by_addr
            .iter()
            .filter_map(move |(a, q)| Some((a.to_string(), first(q)?)))
            .chain(
                r.by_range
                    .iter()
                    .map(|(_, (c, r))| (c.to_string(), r.clone())),
            )
            .chain(
                r.by_host
                    .iter()
                    .filter_map(move |(h, q)| Some((h.to_string(), first(q)?))),
            )
    }

    /// The workload at an address. Of several claimants, as ztunnel
    /// ranks them: a Kubernetes pod (uid `...//Pod/...`) in the mesh, then
    /// any pod, then any workload in the mesh, then the rest; the latest to
    /// arrive among equals.
    pub fn workload_by_addr(&self, network: &str, ip: IpAddr) -> Option<&Arc<Workload>> {
        let key = NetworkAddressRef {
            network,
            address: ip,
        };
        let rank = |w: &Arc<Workload>| (w.uid.contains("//Pod/"), w.protocol == Protocol::Hbone);
        self.by_addr
            .get(&key)?
            .iter()
            .map(|(_, w)| w)
            .max_by_key(|w| rank(w))
    }

    /// A workload at `ip` on a network other than `network` (the first
    /// found): an address a client on `network` must not be sent to
    /// directly.
    pub fn workload_elsewhere(&self, network: &str, ip: IpAddr) -> Option<&Arc<Workload>> {
        self.networks
            .keys()
            .filter(|n| !same_text(n, network))
            .find_map(|n| self.workload_by_addr(n, ip))
    }

    pub fn workload_by_name(&self, namespace: &str, name: &str) -> Option<&Arc<Workload>> {
        let (_, w) = self.by_name.get(namespace)?.get(name)?.last()?;
        Some(w)
    }

    /// The service a client in namespace `client` (any, if `None`) reaches
    /// at a VIP, as ztunnel picks among services sharing it: only those
    /// visible to the client; one of the client's namespace first, else the
    /// last marked `canonical`, else the first to arrive.
    pub fn service_by_vip(
        &self,
        network: &str,
        ip: IpAddr,
        client: Option<&str>,
    ) -> Option<&Arc<Service>> {
        let key = NetworkAddressRef {
            network,
            address: ip,
        };
        if let Some(s) = self
            .services_by_vip
            .get(&key)
            .and_then(|s| best_service(s.iter().map(|(_, s)| s), client))
        {
            return Some(s);
        }
        self.service_by_range(network, ip, client)
    }

    /// The service whose VIP range holds `ip`, as ztunnel ranks them: of
    /// the ranges visible to the client, one of its namespace first, then
    /// the longest prefix, then `canonical`; the first to arrive among equals.
    fn service_by_range(
        &self,
        network: &str,
        ip: IpAddr,
        client: Option<&str>,
    ) -> Option<&Arc<Service>> {
        // (in the client's namespace, prefix length, canonical)
        type Rank = (bool, u8, bool);
        let mut best: Option<(Rank, &Arc<Service>)> = None;
        for (_, (range, s)) in self.services_by_cidr.iter() {
            if !same_text(&range.network, network)
                || !range.cidr.contains(ip)
                || client.is_some_and(|c| !s.visible_to(c))
            {
                continue;
            }
            let rank = (
                client == Some(s.namespace.as_str()),
                range.cidr.len,
                s.canonical,
            );
            if best.as_ref().is_none_or(|(b, _)| rank > *b) {
                best = Some((rank, s));
            }
        }
        best.map(|(_, s)| s)
    }

    /// Services whose hostname is `hostname` (any namespace).
    pub fn services_named<'a>(
        &'a self,
        hostname: &'a str,
    ) -> impl Iterator<Item = &'a Arc<Service>> + 'a {
        self.services().filter(move |s| s.hostname == hostname)
    }

    pub fn service_by_host(&self, key: &str) -> Option<&Arc<Service>> {
        first(self.services_by_host.get(key)?)
    }

    /// Every workload backing `service`, healthy or not, first to arrive
    /// first.
    pub fn endpoints<'a>(&'a self, service: &Service) -> impl Iterator<Item = &'a Endpoint> + 'a {
        self.endpoints
            .get(service.key().as_str())
            .into_iter()
            .flat_map(OrdMap::values)
    }

    /// The healthy ones of [`State::endpoints`].
    pub fn healthy_endpoints<'a>(
        &'a self,
        service: &Service,
    ) -> impl Iterator<Item = &'a Endpoint> + 'a {
        self.endpoints(service)
            .filter(|e| e.workload.status == HealthStatus::Healthy)
    }

    pub fn workloads(&self) -> impl Iterator<Item = &Arc<Workload>> {
        self.workloads.values().filter_map(first)
    }

    pub fn services(&self) -> impl Iterator<Item = &Arc<Service>> {
        self.services_by_host.values().filter_map(first)
    }

    /// Policies that apply to a workload in `namespace` naming `selected`
    /// (`ns/name` keys): the global ones, its namespace's, and the named
    /// workload-selector ones. Indexed: cost does not grow with other namespaces' policies.
    pub fn policies_for<'a>(
        &'a self,
        namespace: &str,
        selected: &'a [Name],
    ) -> impl Iterator<Item = &'a Arc<Authorization>> + 'a {
        let ns = self.policies_by_ns.get(namespace).into_iter();
        let global = self.global_policies.iter().map(|(_, p)| p);
        global
            .chain(ns.flat_map(|q| q.iter()).map(|(_, p)| p))
            .chain(
                selected
                    .iter()
                    .filter_map(|k| {
                        self.policies
                            .get(k.as_str())
                            .and_then(first)
                            .or_else(|| self.missing_policies.get(k.as_str()))
                    })
                    .filter(|p| p.scope == PolicyScope::WorkloadSelector),
            )
    }

    pub fn policies(&self) -> impl Iterator<Item = &Arc<Authorization>> {
        self.policies.values().filter_map(first)
    }
}

/// What a policy verdict reads of a state besides the destination's
/// workload, held as shared copies: two views are equal when none of it
/// changed between them (compared by address, not read).
#[derive(Clone)]
pub struct PolicyView {
    policies: Map<Name, Queue<Authorization>>,
    missing: Map<Name, Arc<Authorization>>,
    by_ns: Map<Name, Queue<Authorization>>,
    global: Arc<Vec<(u64, Arc<Authorization>)>>,
}

impl PartialEq for PolicyView {
    fn eq(&self, other: &Self) -> bool {
        self.policies.same(&other.policies)
            && self.missing.same(&other.missing)
            && self.by_ns.same(&other.by_ns)
            && Arc::ptr_eq(&self.global, &other.global)
    }
}

impl State {
    /// The policies as [`State::policies_for`] reads them.
    pub fn policy_view(&self) -> PolicyView {
        PolicyView {
            policies: self.policies.clone(),
            missing: self.missing_policies.clone(),
            by_ns: self.policies_by_ns.clone(),
            global: self.global_policies.clone(),
        }
    }
}

/// Shared handle to the current state; cheap to clone.
#[derive(Debug, Clone)]
pub struct StateHandle {
    current: Arc<ArcSwap<State>>,
    /// Bumped on every swap, for those who act on changes (policy re-checks).
    version: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for StateHandle {
    fn default() -> Self {
        Self::new(State::default())
    }
}

impl StateHandle {
    pub fn new(state: State) -> Self {
        StateHandle {
            current: Arc::new(ArcSwap::from_pointee(state)),
            version: Arc::new(tokio::sync::watch::channel(0).0),
        }
    }

    /// The current snapshot; hold it for the duration of one decision.
    pub fn load(&self) -> Arc<State> {
        self.current.load_full()
    }

    /// Replaces the state in one atomic step. Readers holding the old one
    /// keep it (and the nodes it shares with the new one) until they let go.
    pub fn store(&self, state: State) {
        self.current.store(Arc::new(state));
        self.version.send_modify(|v| *v += 1);
    }

    /// A receiver that wakes after every [`StateHandle::store`].
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.version.subscribe()
    }
}

#[cfg(test)]
mod tests;
