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
    Authorization, HealthStatus, NetworkAddress, NetworkMode, PolicyScope, Protocol, Service,
    Workload,
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
    /// (namespace, name) → workload, for finding a pod the agent names.
    by_name: HashMap<(String, String), Arc<Workload>>,
    /// Services may share a VIP (across namespaces): in arrival order.
    services_by_vip: HashMap<NetworkAddress, Vec<Arc<Service>>>,
    services_by_host: HashMap<String, Arc<Service>>,
    endpoints: HashMap<String, Vec<Endpoint>>,
    policies: HashMap<String, Arc<Authorization>>,
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

/// Why a resource could not join the state; names the resource.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{resource}: {reason}")]
pub struct ResourceError {
    pub resource: String,
    pub reason: String,
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
            if w.name.is_empty() || w.namespace.is_empty() {
                errors.push(ResourceError {
                    resource: name,
                    reason: "name and namespace are required".into(),
                });
                continue;
            }
            if let Some(reason) = w.unsupported() {
                errors.push(ResourceError {
                    resource: name,
                    reason,
                });
                continue;
            }
            if st.workloads.contains_key(&w.uid) {
                errors.push(ResourceError {
                    resource: name,
                    reason: format!("uid {:?} is used twice", w.uid),
                });
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
                .insert((w.namespace.clone(), w.name.clone()), w.clone());
            st.workloads.insert(w.uid.clone(), w);
        }
        for (i, s) in services.into_iter().enumerate() {
            let name = format!("services[{i}] ({}/{})", s.namespace, s.hostname);
            if s.hostname.is_empty() || s.namespace.is_empty() {
                errors.push(ResourceError {
                    resource: name,
                    reason: "hostname and namespace are required".into(),
                });
                continue;
            }
            if let Some(reason) = s.unsupported() {
                errors.push(ResourceError {
                    resource: name,
                    reason,
                });
                continue;
            }
            if st.services_by_host.contains_key(&s.key()) {
                errors.push(ResourceError {
                    resource: name,
                    reason: format!("service {} is defined twice", s.key()),
                });
                continue;
            }
            let s = Arc::new(s);
            for vip in &s.vips {
                st.services_by_vip
                    .entry(vip.clone())
                    .or_default()
                    .push(s.clone());
            }
            st.services_by_host.insert(s.key(), s);
        }
        for (i, p) in policies.into_iter().enumerate() {
            let key = p.key();
            if st.policies.contains_key(&key) {
                errors.push(ResourceError {
                    resource: format!("policies[{i}] ({key})"),
                    reason: "defined twice".into(),
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
        (st, errors)
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
        self.by_name.get(&(namespace.to_string(), name.to_string()))
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
        best_service(self.services_by_vip.get(&key)?.iter(), client)
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
                .filter_map(|k| self.policies.get(k))
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
