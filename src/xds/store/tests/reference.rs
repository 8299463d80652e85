//! The oracle for `change.rs`: the state that complete lists make, built
//! the plain way, from scratch (as the state itself was built before it
//! was changed in place). Only what the checks compare is kept.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use crate::xds::types::Name;

use super::{Claims, NetworkAddress, NetworkMode, PolicyScope, Service, Workload};
use crate::xds::types::Authorization;

/// What a build from lists serves and refuses.
#[derive(Debug, Default)]
pub struct Reference {
    pub workloads: HashMap<String, Arc<Workload>>,
    by_addr: HashMap<NetworkAddress, Vec<Arc<Workload>>>,
    by_name: HashMap<(String, String), Arc<Workload>>,
    services_by_vip: HashMap<NetworkAddress, Vec<Arc<Service>>>,
    pub services: HashMap<String, Arc<Service>>,
    /// Service key → endpoint uids, in order.
    pub endpoints: HashMap<String, Vec<String>>,
    refused_addrs: HashSet<NetworkAddress>,
    pub refused_hosts: HashSet<String>,
    pub policies: HashMap<String, Arc<Authorization>>,
    /// Namespace → policy keys in order; "" for the global ones.
    pub scoped: HashMap<String, Vec<String>>,
    pub missing: HashSet<String>,
    /// Names of the held resources left out (invalid or conflicting).
    pub left_out: HashSet<String>,
    pub refused_workloads: Vec<String>,
    pub refused_services: Vec<String>,
}

impl Reference {
    /// `addresses`: the valid ones held, by name, in arrival order;
    /// `refusals`: the refused updates standing, by name; `policies`: the
    /// policies deciding, by name, in arrival order.
    pub fn build(
        addresses: &[(String, Result<Workload, Service>)],
        refusals: &[(String, Claims)],
        policies: &[(String, Authorization)],
    ) -> Reference {
        let mut r = Reference::default();
        let refuse = |r: &mut Reference, claims: Claims| {
            r.refused_addrs.extend(claims.addresses);
            r.refused_hosts.extend(claims.hosts);
        };
        for (name, a) in addresses {
            let Ok(w) = a else { continue };
            let mut w = w.clone();
            if w.uid.is_empty() {
                w.uid = format!("{}/{}", w.namespace, w.name).into();
            }
            let invalid = w.name.is_empty() || w.namespace.is_empty() || w.unsupported().is_some();
            if invalid || r.workloads.contains_key(w.uid.as_str()) {
                refuse(&mut r, Claims::of_workload(&w));
                r.refused_workloads.push(w.uid.to_string());
                r.left_out.insert(name.clone());
                continue;
            }
            let w = Arc::new(w);
            if w.network_mode == NetworkMode::Standard {
                for ip in &w.workload_ips {
                    let at = NetworkAddress {
                        network: w.network.clone(),
                        address: *ip,
                    };
                    r.by_addr.entry(at).or_default().push(w.clone());
                }
            }
            for svc in w.services.keys() {
                r.endpoints
                    .entry(svc.to_string())
                    .or_default()
                    .push(w.uid.to_string());
            }
            r.by_name
                .insert((w.namespace.to_string(), w.name.to_string()), w.clone());
            r.workloads.insert(w.uid.to_string(), w);
        }
        for (name, a) in addresses {
            let Err(s) = a else { continue };
            let invalid =
                s.hostname.is_empty() || s.namespace.is_empty() || s.unsupported().is_some();
            if invalid || r.services.contains_key(&s.key()) {
                refuse(&mut r, Claims::of_service(s));
                r.refused_services.push(s.key());
                r.left_out.insert(name.clone());
                continue;
            }
            let s = Arc::new(s.clone());
            for vip in &s.vips {
                r.services_by_vip
                    .entry(vip.clone())
                    .or_default()
                    .push(s.clone());
            }
            r.services.insert(s.key(), s);
        }
        for (name, p) in policies {
            let key = p.key();
            if r.policies.contains_key(&key) {
                r.left_out.insert(name.clone());
                continue;
            }
            let scope = match p.scope {
                PolicyScope::Global => Some(String::new()),
                PolicyScope::Namespace => Some(p.namespace.clone()),
                PolicyScope::WorkloadSelector => None,
            };
            if let Some(scope) = scope {
                r.scoped.entry(scope).or_default().push(key.clone());
            }
            r.policies.insert(key, Arc::new(p.clone()));
        }
        for w in r.workloads.values() {
            for key in &w.authorization_policies {
                if !r.policies.contains_key(key.as_str()) {
                    r.missing.insert(key.to_string());
                }
            }
        }
        for (_, claims) in refusals {
            refuse(&mut r, claims.clone());
        }
        r
    }

    pub fn workload_by_addr(&self, ip: IpAddr) -> Option<&Arc<Workload>> {
        let at = NetworkAddress {
            network: Name::default(),
            address: ip,
        };
        let rank = |w: &Arc<Workload>| {
            (
                w.uid.contains("//Pod/"),
                w.protocol == crate::xds::types::Protocol::Hbone,
            )
        };
        self.by_addr.get(&at)?.iter().max_by_key(|w| rank(w))
    }

    pub fn workload_by_name(&self, namespace: &str, name: &str) -> Option<&Arc<Workload>> {
        self.by_name.get(&(namespace.to_string(), name.to_string()))
    }

    pub fn service_by_vip(&self, ip: IpAddr, client: Option<&str>) -> Option<&Arc<Service>> {
        let at = NetworkAddress {
            network: Name::default(),
            address: ip,
        };
        super::best_service(self.services_by_vip.get(&at)?.iter(), client)
    }

    /// Some refused resource claims `ip`.
    pub fn refused_at(&self, ip: IpAddr) -> bool {
        let at = NetworkAddress {
            network: Name::default(),
            address: ip,
        };
        self.refused_addrs.contains(&at)
    }
}
