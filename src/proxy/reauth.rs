//! Re-authorization of open connections: inbound connections that passed
//! policy are tracked while they live, and every state change re-checks them;
//! the ones a new policy no longer allows are closed at once.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::pod::{Drain, DrainTrigger};
use super::rbac;
use crate::identity::Identity;
use crate::xds::{State, StateHandle};

/// What a connection was authorized as.
#[derive(Debug, Clone)]
pub struct Authorized {
    pub namespace: String,
    pub network: String,
    pub peer: Option<Identity>,
    pub src_ip: IpAddr,
    pub target: SocketAddr,
}

impl Authorized {
    /// Applies the destination's policies: `Ok` with the ALLOW policy that
    /// matched (`None`: no ALLOW policy exists), `Err` with the deciding one.
    pub fn check(&self, state: &State) -> Result<Option<String>, String> {
        let selected: &[String] = state
            .workload_by_addr(&self.network, self.target.ip())
            .map(|w| w.authorization_policies.as_slice())
            .unwrap_or_default();
        let conn = rbac::Connection {
            src_identity: self.peer.as_ref(),
            src_ip: self.src_ip,
            dst_ip: self.target.ip(),
            dst_port: self.target.port(),
        };
        let verdict = rbac::evaluate(rbac::applicable(state, &self.namespace, selected), &conn);
        for (policy, would_allow) in &verdict.dry_run {
            tracing::info!(src.addr = %self.src_ip, dst.addr = %self.target, policy = %policy, would_allow, "dry-run policy matched");
        }
        if verdict.allowed {
            Ok(verdict.policy)
        } else {
            Err(verdict.policy.unwrap_or_default())
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
        self.tracker
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

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
                Err(policy) => {
                    tracing::info!(src.addr = %auth.src_ip, dst.addr = %auth.target, policy = %policy, decision = "deny", "open connection closed: no longer allowed by policy");
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
