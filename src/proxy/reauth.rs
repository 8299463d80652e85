//! Authorization of inbound connections, and its re-checks: a connection
//! is decided against the policies that select its destination pod's
//! workload, and the ones that passed are tracked while they live; every
//! state change re-checks them, and the ones a new state no longer allows
//! are closed at once. A destination whose workload is not in the state
//! allows nothing (as ztunnel, which refuses traffic for a pod it holds no
//! workload for).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::pod::{Drain, DrainTrigger};
use super::rbac;
use crate::identity::Identity;
use crate::xds::types::Workload;
use crate::xds::{State, StateHandle};

/// What a connection was authorized as.
#[derive(Debug, Clone)]
pub struct Authorized {
    /// The destination pod, as the agent named it: `namespace`, `name` and
    /// `service_account` find its workload in the state.
    pub namespace: String,
    pub name: String,
    pub service_account: String,
    pub peer: Option<Identity>,
    pub src_ip: IpAddr,
    pub target: SocketAddr,
}

/// Why a connection is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denied {
    /// The destination pod's workload is not in the state (not yet, or no
    /// longer): nothing says which policies select it, so nothing is allowed.
    UnknownDestination,
    /// A policy decided: its `ns/name`, or why no ALLOW policy matched.
    Policy(String),
}

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Denied::UnknownDestination => f.write_str("destination workload not in the mesh state"),
            Denied::Policy(p) => f.write_str(p),
        }
    }
}

impl Authorized {
    /// The destination pod's workload, found as ztunnel finds its local
    /// workload: by namespace and name, with the same service account.
    pub fn workload<'s>(&self, state: &'s State) -> Option<&'s Arc<Workload>> {
        state
            .workload_by_name(&self.namespace, &self.name)
            .filter(|w| w.service_account == self.service_account)
    }

    /// Applies the destination's policies: `Ok` with the ALLOW policy that
    /// matched (`None`: no ALLOW policy exists), `Err` with why not. A
    /// destination whose workload the state does not hold is denied.
    pub fn check(&self, state: &State) -> Result<Option<String>, Denied> {
        let Some(workload) = self.workload(state) else {
            return Err(Denied::UnknownDestination);
        };
        let conn = rbac::Connection {
            src_identity: self.peer.as_ref(),
            src_ip: self.src_ip,
            dst_ip: self.target.ip(),
            dst_port: self.target.port(),
        };
        let verdict = rbac::evaluate(rbac::applicable_to(state, workload), &conn);
        for (policy, would_allow) in &verdict.dry_run {
            tracing::info!(src.addr = %self.src_ip, dst.addr = %self.target, policy = %policy, would_allow, "dry-run policy matched");
        }
        if verdict.allowed {
            Ok(verdict.policy)
        } else {
            Err(Denied::Policy(verdict.policy.unwrap_or_default()))
        }
    }
}

/// Open inbound connections that passed policy.
#[derive(Default)]
pub struct Tracker {
    next: AtomicU64,
    open: Mutex<HashMap<u64, (Authorized, DrainTrigger)>>,
}

/// Keeps a connection tracked; untracks it when dropped.
pub struct Tracked {
    id: u64,
    tracker: Arc<Tracker>,
    /// Fires when a policy change denies the connection.
    pub revoked: Drain,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut open = self.tracker.open.lock().unwrap_or_else(|e| e.into_inner());
        open.remove(&self.id);
        shrink_when_sparse(&mut open);
    }
}

/// A map a burst of connections grew keeps its table (hundreds of kB for a
/// thousand) once they are gone: it is given back when a quarter is used.
fn shrink_when_sparse<K: std::hash::Hash + Eq, V>(map: &mut HashMap<K, V>) {
    if map.capacity() > SPARSE_FLOOR && map.len() < map.capacity() / 4 {
        map.shrink_to(map.len() * 2);
    }
}

/// Below this many entries a table is never shrunk.
const SPARSE_FLOOR: usize = 64;

impl Tracker {
    pub fn track(self: &Arc<Self>, auth: Authorized) -> Tracked {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (trigger, revoked) = Drain::new();
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, (auth, trigger));
        Tracked {
            id,
            tracker: self.clone(),
            revoked,
        }
    }

    /// Re-checks every tracked connection against `state`; returns how many were closed.
    pub fn recheck(&self, state: &State) -> usize {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let denied: Vec<u64> = open
            .iter()
            .filter_map(|(id, (auth, _))| match auth.check(state) {
                Ok(_) => None,
                Err(why) => {
                    tracing::info!(src.addr = %auth.src_ip, dst.addr = %auth.target, policy = %why, decision = "deny", "open connection closed: no longer allowed by policy");
                    Some(*id)
                }
            })
            .collect();
        for id in &denied {
            if let Some((_, trigger)) = open.remove(id) {
                trigger.fire();
            }
        }
        denied.len()
    }

    /// Re-checks on every state change, for the life of the process.
    pub fn spawn_watcher(self: &Arc<Self>, state: StateHandle) {
        let tracker = self.clone();
        let mut changes = state.subscribe();
        tokio::spawn(async move {
            while changes.changed().await.is_ok() {
                tracker.recheck(&state.load());
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(yaml: &str) -> State {
        crate::xds::local::parse(std::path::Path::new("t.yaml"), yaml).unwrap()
    }

    fn to_web(service_account: &str) -> Authorized {
        Authorized {
            namespace: "shop".into(),
            name: "web".into(),
            service_account: service_account.into(),
            peer: Some(Identity::new("cluster.local", "front", "ui")),
            src_ip: "10.0.0.2".parse().unwrap(),
            target: "10.0.0.3:8080".parse().unwrap(),
        }
    }

    const WEB: &str = "workloads:\n- {name: web, namespace: shop, serviceAccount: web-sa, workloadIps: [10.0.0.3], protocol: HBONE}\n";

    #[test]
    fn a_destination_the_state_does_not_hold_is_denied_even_with_no_policy() {
        // No policy anywhere: a known destination is allowed by default...
        assert_eq!(to_web("web-sa").check(&state(WEB)), Ok(None));
        // ...one whose workload has not arrived (or is gone) is not.
        let empty = state("workloads: []\n");
        assert_eq!(
            to_web("web-sa").check(&empty),
            Err(Denied::UnknownDestination)
        );
        // Another workload at the pod's address is not the pod's (an old
        // pod's entry for a reused IP): still unknown.
        let reused = state("workloads:\n- {name: old, namespace: shop, serviceAccount: web-sa, workloadIps: [10.0.0.3], protocol: HBONE}\n");
        assert_eq!(
            to_web("web-sa").check(&reused),
            Err(Denied::UnknownDestination)
        );
        // Nor is a workload of that name under another service account.
        assert_eq!(
            to_web("other-sa").check(&state(WEB)),
            Err(Denied::UnknownDestination)
        );
    }

    #[test]
    fn the_policies_are_those_of_the_pods_own_workload() {
        let st = state(&format!(
            "{}policies:\n- {{name: front-only, namespace: shop, action: Allow, rules: [[[{{namespaces: [!Exact front]}}]]]}}\n- {{name: elsewhere, namespace: other, action: Deny, rules: [[]]}}\n",
            WEB.replace("protocol: HBONE}", "protocol: HBONE, authorizationPolicies: [shop/front-only]}")
        ));
        assert_eq!(
            to_web("web-sa").check(&st),
            Ok(Some("shop/front-only".into()))
        );
        let mut stranger = to_web("web-sa");
        stranger.peer = Some(Identity::new("cluster.local", "back", "x"));
        assert_eq!(
            stranger.check(&st),
            Err(Denied::Policy("no ALLOW policy matched".into()))
        );
    }

    #[test]
    fn an_open_connection_is_closed_when_its_destination_leaves_the_state() {
        let tracker = Arc::new(Tracker::default());
        let kept = tracker.track(to_web("web-sa"));
        assert_eq!(tracker.recheck(&state(WEB)), 0);
        assert_eq!(tracker.recheck(&state("workloads: []\n")), 1);
        drop(kept);
    }

    #[test]
    fn a_burst_of_connections_leaves_no_large_table_behind() {
        let tracker = Arc::new(Tracker::default());
        let mut held: Vec<Tracked> = (0..1000).map(|_| tracker.track(to_web("web-sa"))).collect();
        let grown = tracker.open.lock().unwrap().capacity();
        assert!(grown >= 1000, "{grown}");
        let last = held.pop();
        drop(held);
        let left = tracker.open.lock().unwrap().capacity();
        assert!(
            left <= SPARSE_FLOOR,
            "a table for {left} kept for one connection"
        );
        // The one left is still tracked, and still rechecked.
        assert_eq!(tracker.recheck(&state("workloads: []\n")), 1);
        drop(last);
    }
}
