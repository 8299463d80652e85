//! The mesh state the data path reads: an immutable, indexed snapshot swapped
//! in whole by whichever source owns the state (xDS or the local file).
//!
//! Readers call [`StateHandle::load`] once per connection and never lock;
//! writers build a complete new [`State`] and swap it in one step, so a reader
//! sees either the old state or the new one, never a mix.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::types::{
    same_text, Authorization, HealthStatus, NetworkAddress, NetworkCidr, NetworkMode, PolicyScope,
    Protocol, Service, Workload,
};

/// A workload backing a service, with its own port overrides.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub workload: Arc<Workload>,
    /// Service port → target port for this workload (may override the service's).
    pub ports: std::collections::BTreeMap<u16, u16>,
}

/// One consistent view of workloads, services and policies.
#[derive(Debug, Default)]
pub struct State {
    workloads: HashMap<String, Arc<Workload>>,
    /// Every workload claiming an address, in arrival order.
    by_addr: HashMap<NetworkAddress, Vec<Arc<Workload>>>,
    /// Namespace → name → workload, for finding a pod the agent names;
    /// nested so that a lookup (one per connection, for the pod's own
    /// labels) borrows the names instead of copying them.
    by_name: HashMap<String, HashMap<String, Arc<Workload>>>,
    /// Services may share a VIP (across namespaces): in arrival order.
    services_by_vip: HashMap<NetworkAddress, Vec<Arc<Service>>>,
    /// VIP ranges, matched when no VIP matches exactly.
    services_by_cidr: Vec<(NetworkCidr, Arc<Service>)>,
    services_by_host: HashMap<String, Arc<Service>>,
    /// Addresses and names of resources that were refused: a connection to
    /// one is refused with the reason, never passed through (when no
    /// served resource holds the address).
    refused: Refusals,
    /// The refused resources themselves, when the state was built from
    /// them (a control plane serves them as they are; a proxy never uses
    /// them).
    refused_workloads: Vec<Arc<Workload>>,
    refused_services: Vec<Arc<Service>>,
    endpoints: HashMap<String, Vec<Endpoint>>,
    policies: HashMap<String, Arc<Authorization>>,
    /// Policies a workload names that are not held: denying stand-ins
    /// until they arrive (never "no ALLOW policy, so allow").
    missing_policies: HashMap<String, Arc<Authorization>>,
    /// Namespace-scoped policies by namespace, and the global ones.
    policies_by_ns: HashMap<String, Vec<Arc<Authorization>>>,
    global_policies: Vec<Arc<Authorization>>,
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
            hosts: [w.hostname.clone()]
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

#[derive(Debug, Default)]
struct Refusals {
    by_addr: HashMap<NetworkAddress, Arc<Refused>>,
    by_range: Vec<(NetworkCidr, Arc<Refused>)>,
    by_host: HashMap<String, Arc<Refused>>,
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
    /// (for xDS, where one bad resource rejects only itself).
    pub fn build_lenient(
        workloads: Vec<Workload>,
        services: Vec<Service>,
        policies: Vec<Authorization>,
    ) -> (State, Vec<ResourceError>) {
        let mut st = State::default();
        let mut errors = Vec::new();
        for (i, mut w) in workloads.into_iter().enumerate() {
            let name = format!("workloads[{i}] ({}/{})", w.namespace, w.name);
            if w.uid.is_empty() {
                w.uid = format!("{}/{}", w.namespace, w.name);
            }
            let refusal = if w.name.is_empty() || w.namespace.is_empty() {
                Some("name and namespace are required".to_string())
            } else if let Some(reason) = w.unsupported() {
                Some(reason)
            } else if st.workloads.contains_key(&w.uid) {
                Some(format!("uid {:?} is used twice", w.uid))
            } else {
                None
            };
            if let Some(reason) = refusal {
                let e = ResourceError {
                    resource: name,
                    reason,
                    entry: Some(ListEntry::Workload(i)),
                };
                st.refuse(Claims::of_workload(&w), &e);
                st.refused_workloads.push(Arc::new(w));
                errors.push(e);
                continue;
            }
            let w = Arc::new(w);
            // A hostNetwork workload's IPs are its node's, shared with the
            // node's other hostNetwork pods: it is never found by IP.
            let indexed: &[IpAddr] = match w.network_mode {
                NetworkMode::HostNetwork => &[],
                NetworkMode::Standard => &w.workload_ips,
            };
            // Several workloads may claim an address (an IP reused while
            // the old pod's removal is on its way, a WorkloadEntry beside a
            // pod): all are held; lookups pick as ztunnel does.
            for ip in indexed {
                let key = NetworkAddress {
                    network: w.network.clone(),
                    address: *ip,
                };
                st.by_addr.entry(key).or_default().push(w.clone());
            }
            for (svc, ports) in &w.services {
                st.endpoints.entry(svc.clone()).or_default().push(Endpoint {
                    workload: w.clone(),
                    ports: ports.clone(),
                });
            }
            st.by_name
                .entry(w.namespace.clone())
                .or_default()
                .insert(w.name.clone(), w.clone());
            st.workloads.insert(w.uid.clone(), w);
        }
        for (i, s) in services.into_iter().enumerate() {
            let name = format!("services[{i}] ({}/{})", s.namespace, s.hostname);
            let refusal = if s.hostname.is_empty() || s.namespace.is_empty() {
                Some("hostname and namespace are required".to_string())
            } else if let Some(reason) = s.unsupported() {
                Some(reason)
            } else if st.services_by_host.contains_key(&s.key()) {
                Some(format!("service {} is defined twice", s.key()))
            } else {
                None
            };
            if let Some(reason) = refusal {
                let e = ResourceError {
                    resource: name,
                    reason,
                    entry: Some(ListEntry::Service(i)),
                };
                st.refuse(Claims::of_service(&s), &e);
                st.refused_services.push(Arc::new(s));
                errors.push(e);
                continue;
            }
            let s = Arc::new(s);
            for vip in &s.vips {
                st.services_by_vip
                    .entry(vip.clone())
                    .or_default()
                    .push(s.clone());
            }
            for range in &s.cidr_vips {
                st.services_by_cidr.push((range.clone(), s.clone()));
            }
            st.services_by_host.insert(s.key(), s);
        }
        for (i, p) in policies.into_iter().enumerate() {
            let key = p.key();
            if st.policies.contains_key(&key) {
                errors.push(ResourceError {
                    resource: format!("policies[{i}] ({key})"),
                    reason: "defined twice".into(),
                    entry: Some(ListEntry::Policy(i)),
                });
                continue;
            }
            let p = Arc::new(p);
            match p.scope {
                PolicyScope::Global => st.global_policies.push(p.clone()),
                PolicyScope::Namespace => st
                    .policies_by_ns
                    .entry(p.namespace.clone())
                    .or_default()
                    .push(p.clone()),
                PolicyScope::WorkloadSelector => {}
            }
            st.policies.insert(key, p);
        }
        for w in st.workloads.values() {
            for key in &w.authorization_policies {
                if !st.policies.contains_key(key) && !st.missing_policies.contains_key(key) {
                    let stand_in = Authorization::refused_stand_in(
                        key,
                        "named by the workload but not held (refused, not yet sent, or removed)"
                            .into(),
                    );
                    st.missing_policies.insert(key.clone(), Arc::new(stand_in));
                }
            }
        }
        (st, errors)
    }

    /// Holds what a refused resource claimed, so that a connection to it
    /// is refused with `refused`'s reason instead of passed through.
    pub fn refuse(&mut self, claims: Claims, refused: &ResourceError) {
        let r = Arc::new(Refused {
            resource: refused.resource.clone(),
            reason: refused.reason.clone(),
        });
        for a in claims.addresses {
            self.refused.by_addr.entry(a).or_insert_with(|| r.clone());
        }
        for c in claims.ranges {
            self.refused.by_range.push((c, r.clone()));
        }
        for h in claims.hosts {
            self.refused.by_host.entry(h).or_insert_with(|| r.clone());
        }
    }

    /// The refused resource that claimed an address (exactly, or in a
    /// range), if one did. Consulted only when nothing served holds it.
    pub fn refused_at(&self, network: &str, ip: IpAddr) -> Option<&Refused> {
        let key = NetworkAddress {
            network: network.to_string(),
            address: ip,
        };
        if let Some(r) = self.refused.by_addr.get(&key) {
            return Some(r);
        }
        self.refused
            .by_range
            .iter()
            .filter(|(c, _)| same_text(&c.network, network) && c.cidr.contains(ip))
            .max_by_key(|(c, _)| c.cidr.len)
            .map(|(_, r)| r.as_ref())
    }

    /// The workloads and services refused when this state was built, as
    /// they were given.
    pub fn refused_resources(&self) -> (&[Arc<Workload>], &[Arc<Service>]) {
        (&self.refused_workloads, &self.refused_services)
    }

    /// The refused resource that claimed a name (`namespace/hostname`).
    pub fn refused_host(&self, key: &str) -> Option<&Refused> {
        self.refused.by_host.get(key).map(Arc::as_ref)
    }

    /// Every refused claim as text (`network/ip`, `network/ip/len`,
    /// `namespace/hostname`) with its refusal, for the config dump.
    pub fn refusals(&self) -> impl Iterator<Item = (String, &Refused)> {
        let r = &self.refused;
        r.by_addr
            .iter()
            .map(|(a, r)| (a.to_string(), r.as_ref()))
            .chain(r.by_range.iter().map(|(c, r)| (c.to_string(), r.as_ref())))
            .chain(r.by_host.iter().map(|(h, r)| (h.clone(), r.as_ref())))
    }

    /// The workload at an address. Of several claimants, as ztunnel
    /// ranks them: a Kubernetes pod (uid `...//Pod/...`) in the mesh, then
    /// any pod, then any workload in the mesh, then the rest; the latest to
    /// arrive among equals.
    pub fn workload_by_addr(&self, network: &str, ip: IpAddr) -> Option<&Arc<Workload>> {
        let key = NetworkAddress {
            network: network.to_string(),
            address: ip,
        };
        let rank = |w: &Arc<Workload>| (w.uid.contains("//Pod/"), w.protocol == Protocol::Hbone);
        self.by_addr.get(&key)?.iter().max_by_key(|w| rank(w))
    }

    pub fn workload_by_name(&self, namespace: &str, name: &str) -> Option<&Arc<Workload>> {
        self.by_name.get(namespace)?.get(name)
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
        let key = NetworkAddress {
            network: network.to_string(),
            address: ip,
        };
        if let Some(s) = self
            .services_by_vip
            .get(&key)
            .and_then(|s| best_service(s.iter(), client))
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
        for (range, s) in &self.services_by_cidr {
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
        self.services_by_host
            .values()
            .filter(move |s| s.hostname == hostname)
    }

    pub fn service_by_host(&self, key: &str) -> Option<&Arc<Service>> {
        self.services_by_host.get(key)
    }

    /// Healthy endpoints of a service.
    /// Every workload backing `service`, healthy or not.
    pub fn endpoints<'a>(&'a self, service: &Service) -> impl Iterator<Item = &'a Endpoint> + 'a {
        self.endpoints.get(&service.key()).into_iter().flatten()
    }

    pub fn healthy_endpoints<'a>(
        &'a self,
        service: &Service,
    ) -> impl Iterator<Item = &'a Endpoint> + 'a {
        self.endpoints
            .get(&service.key())
            .into_iter()
            .flatten()
            .filter(|e| e.workload.status == HealthStatus::Healthy)
    }

    pub fn workloads(&self) -> impl Iterator<Item = &Arc<Workload>> {
        self.workloads.values()
    }

    pub fn services(&self) -> impl Iterator<Item = &Arc<Service>> {
        self.services_by_host.values()
    }

    /// Policies that apply to a workload in `namespace` naming `selected`
    /// (`ns/name` keys): the global ones, its namespace's, and the named
    /// workload-selector ones. Indexed: cost does not grow with other namespaces' policies.
    pub fn policies_for<'a>(
        &'a self,
        namespace: &str,
        selected: &'a [String],
    ) -> impl Iterator<Item = &'a Arc<Authorization>> + 'a {
        let ns = self
            .policies_by_ns
            .get(namespace)
            .map(Vec::as_slice)
            .unwrap_or_default();
        self.global_policies.iter().chain(ns.iter()).chain(
            selected
                .iter()
                .filter_map(|k| {
                    self.policies
                        .get(k)
                        .or_else(|| self.missing_policies.get(k))
                })
                .filter(|p| p.scope == PolicyScope::WorkloadSelector),
        )
    }

    pub fn policies(&self) -> impl Iterator<Item = &Arc<Authorization>> {
        self.policies.values()
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

    /// Replaces the state in one atomic step.
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
mod tests {
    use std::path::Path;

    use super::*;

    fn state(yaml: &str) -> Result<State, String> {
        crate::xds::local::parse(Path::new("s.yaml"), yaml).map_err(|e| e.to_string())
    }

    #[test]
    fn services_share_a_vip_and_the_clients_namespace_wins_then_canonical_then_first() {
        let st = state(
            r#"
services:
- {name: a, namespace: one, hostname: db.example.com, vips: ["/10.96.0.30"], ports: {5432: 5432}}
- {name: b, namespace: two, hostname: db.example.com, vips: ["/10.96.0.30"], ports: {5432: 5432}}
- {name: c, namespace: three, hostname: db.example.com, vips: ["/10.96.0.30"], ports: {5432: 5432}, canonical: true}
- {name: hidden, namespace: four, hostname: private.four, vips: ["/10.96.0.31"], ports: {80: 80}, visibility: NAMESPACE}
"#,
        )
        .unwrap();
        let at = |ip: &str, ns: Option<&str>| {
            st.service_by_vip("", ip.parse().unwrap(), ns)
                .map(|s| s.name.clone())
        };
        assert_eq!(
            at("10.96.0.30", Some("two")).as_deref(),
            Some("b"),
            "own namespace"
        );
        assert_eq!(
            at("10.96.0.30", Some("elsewhere")).as_deref(),
            Some("c"),
            "canonical"
        );
        assert_eq!(at("10.96.0.30", None).as_deref(), Some("c"));
        // Namespace-only visibility: seen from its namespace alone.
        assert_eq!(at("10.96.0.31", Some("four")).as_deref(), Some("hidden"));
        assert_eq!(at("10.96.0.31", Some("one")), None);
        // The same namespace/hostname twice is still a conflict.
        let twice = state(
            "services:\n- {name: a, namespace: n, hostname: h, vips: [\"/10.96.0.1\"]}\n- {name: b, namespace: n, hostname: h, vips: [\"/10.96.0.2\"]}\n",
        );
        assert!(twice.unwrap_err().contains("defined twice"));
    }

    #[test]
    fn every_kind_of_refusal_keeps_the_resources_addresses_refused_with_its_reason() {
        use crate::xds::types::{
            ApplicationTunnel, GatewayAddress, GatewayDestination, TunnelToApp, WeightedWaypoint,
        };
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let wl = |name: &str, addr: &str| Workload {
            name: name.into(),
            namespace: "ns".into(),
            workload_ips: vec![ip(addr)],
            ..Workload::default()
        };
        let svc = |name: &str, vip: &str| Service {
            name: name.into(),
            namespace: "ns".into(),
            hostname: format!("{name}.ns"),
            vips: vec![NetworkAddress {
                network: String::new(),
                address: ip(vip),
            }],
            ..Service::default()
        };
        let mut ext = wl("ext", "10.0.0.1");
        ext.extensions = vec!["istio.io/x".into()];
        let mut gated = wl("gated", "10.0.0.2");
        gated.network_gateway = Some(GatewayAddress {
            destination: GatewayDestination::Address(NetworkAddress {
                network: "n2".into(),
                address: ip("192.0.2.1"),
            }),
            hbone_mtls_port: 15008,
        });
        let mut proxied = wl("proxied", "10.0.0.3");
        proxied.application_tunnel = Some(ApplicationTunnel {
            protocol: TunnelToApp::Proxy,
            port: None,
        });
        let mut own_wp = wl("own-wp", "10.0.0.4");
        own_wp.waypoint = Some(GatewayAddress {
            destination: GatewayDestination::Address(NetworkAddress {
                network: String::new(),
                address: ip("10.0.0.4"),
            }),
            hbone_mtls_port: 15008,
        });
        let nameless = Workload {
            namespace: "ns".into(),
            workload_ips: vec![ip("10.0.0.5")],
            ..Workload::default()
        };
        let mut twice = wl("twice", "10.0.0.6");
        twice.uid = "dup".into();
        let mut twice2 = wl("twice2", "10.0.0.7");
        twice2.uid = "dup".into();
        let mut svc_ext = svc("sext", "10.96.0.1");
        svc_ext.extensions = vec!["istio.io/y".into()];
        let mut weightless = svc("weightless", "10.96.0.2");
        weightless.weighted_waypoints = vec![WeightedWaypoint {
            destination: GatewayDestination::Address(NetworkAddress {
                network: String::new(),
                address: ip("10.0.0.9"),
            }),
            hbone_mtls_port: 15008,
            weight: 0,
        }];
        let defined = svc("defined", "10.96.0.3");
        let mut defined_again = svc("defined", "10.96.0.4");
        defined_again.name = "other".into();
        let (st, errors) = State::build_lenient(
            vec![ext, gated, proxied, own_wp, nameless, twice, twice2],
            vec![svc_ext, weightless, defined, defined_again],
            vec![],
        );
        assert_eq!(errors.len(), 9, "{errors:?}");
        for (addr, why) in [
            ("10.0.0.1", "extension"),
            ("10.0.0.2", "network gateway"),
            ("10.0.0.3", "PROXY"),
            ("10.0.0.4", "the workload itself"),
            ("10.0.0.5", "name and namespace are required"),
            ("10.0.0.7", "used twice"),
            ("10.96.0.1", "extension"),
            ("10.96.0.2", "total weight of 0"),
            ("10.96.0.4", "defined twice"),
        ] {
            let r = st
                .refused_at("", ip(addr))
                .unwrap_or_else(|| panic!("{addr} is not refused"));
            assert!(r.reason.contains(why), "{addr}: {}", r.reason);
        }
        // What was served stays served, and not refused.
        assert!(st.workload_by_addr("", ip("10.0.0.6")).is_some());
        assert!(st.refused_at("", ip("10.0.0.6")).is_none());
        assert!(st.service_by_vip("", ip("10.96.0.3"), None).is_some());
        assert!(st.refused_host("ns/weightless.ns").is_some());
    }

    #[test]
    fn host_network_workloads_share_the_node_ip_and_are_not_found_by_it() {
        let st = state(
            r#"
workloads:
- {name: kube-proxy, namespace: kube-system, workloadIps: [192.168.1.10], networkMode: HOST_NETWORK}
- {name: node-exporter, namespace: monitoring, workloadIps: [192.168.1.10], networkMode: HOST_NETWORK}
- {name: app, namespace: shop, workloadIps: [10.0.0.3]}
"#,
        )
        .unwrap();
        assert_eq!(
            st.workloads().count(),
            3,
            "both hostNetwork workloads are held"
        );
        assert!(st
            .workload_by_addr("", "192.168.1.10".parse().unwrap())
            .is_none());
        assert!(st.workload_by_name("monitoring", "node-exporter").is_some());
        assert!(st
            .workload_by_addr("", "10.0.0.3".parse().unwrap())
            .is_some());
    }

    #[test]
    fn workloads_sharing_an_ip_are_all_held_and_the_lookup_ranks_them() {
        let st = state(
            r#"
workloads:
- {uid: c//Pod/n/old, name: old, namespace: n, workloadIps: [10.0.0.9], protocol: HBONE}
- {uid: c//WorkloadEntry/n/vm, name: vm, namespace: n, workloadIps: [10.0.0.9], protocol: HBONE}
- {uid: c//Pod/n/new, name: new, namespace: n, workloadIps: [10.0.0.9], protocol: HBONE}
- {uid: c//Pod/n/plain, name: plain, namespace: n, workloadIps: [10.0.0.8]}
- {uid: c//WorkloadEntry/n/meshed, name: meshed, namespace: n, workloadIps: [10.0.0.8], protocol: HBONE}
"#,
        )
        .unwrap();
        let at = |ip: &str| {
            st.workload_by_addr("", ip.parse().unwrap())
                .map(|w| w.name.clone())
        };
        assert_eq!(st.workloads().count(), 5);
        assert_eq!(
            at("10.0.0.9").as_deref(),
            Some("new"),
            "a meshed pod, the latest"
        );
        assert_eq!(
            at("10.0.0.8").as_deref(),
            Some("plain"),
            "a pod over a WorkloadEntry"
        );
    }
}
