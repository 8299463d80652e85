//! Authorization of inbound connections, and its re-checks: a connection
//! is decided against the policies that select its destination pod's
//! workload, and the ones that passed are tracked while they live; every
//! state change re-checks them, and the ones a new state no longer allows
//! are closed at once. A destination whose workload is not in the state
//! allows nothing (as ztunnel, which refuses traffic for a pod it holds no
//! workload for).
//!
//! A re-check costs what changed, not what is open: the tracked
//! connections are grouped by destination pod, and a change that leaves
//! the policies and a pod's own workload as they were (the same shared
//! values, compared by address) leaves its connections unchecked: their
//! verdicts read nothing else. A mesh's churn (other pods' workloads,
//! services) is then one workload lookup per destination pod; a policy
//! change checks every connection, as before.
//!
//! A connection decided against one state but tracked after the re-check
//! of a newer one would be missed until the next change: each decision
//! notes how many re-checks were begun before it, and one that missed a
//! re-check is checked when it is tracked.
//!
//! A policy change checks every connection: 0.4 µs each, 40 ms for
//! 100,000. With more than [`INLINE_MAX`] connections tracked it runs off
//! the data path's workers (on the runtime's blocking pool), and it takes
//! the lock that tracking and untracking take for at most [`CHUNK`]
//! connections at a time, so a connection opened or closed
//! meanwhile waits for a chunk, not for the whole re-check. A re-check
//! checks only the connections tracked before it began: those tracked
//! since were decided, or checked as they were tracked, against a state
//! at least as new as its own.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use super::pod::{Drain, DrainTrigger};
use super::rbac;
use crate::identity::Identity;
use crate::xds::types::Workload;
use crate::xds::{PolicyView, State, StateHandle};

/// The pod a connection is to, as the agent named it: `namespace`, `name`
/// and `service_account` find its workload in the state. One per pod,
/// shared by its connections.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Destination {
    pub namespace: String,
    pub name: String,
    pub service_account: String,
}

impl Destination {
    /// The destination pod's workload, found as ztunnel finds its local
    /// workload: by namespace and name, with the same service account.
    pub fn workload<'s>(&self, state: &'s State) -> Option<&'s Arc<Workload>> {
        state
            .workload_by_name(&self.namespace, &self.name)
            .filter(|w| w.service_account == self.service_account)
    }
}

/// What a connection was authorized as.
#[derive(Debug, Clone)]
pub struct Authorized {
    pub destination: Arc<Destination>,
    pub peer: Option<Identity>,
    pub src_ip: IpAddr,
    pub target: SocketAddr,
    /// The tracker's re-checks begun before the decision
    /// ([`Tracker::rechecks`]).
    pub since: u64,
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
    /// The destination pod's workload.
    pub fn workload<'s>(&self, state: &'s State) -> Option<&'s Arc<Workload>> {
        self.destination.workload(state)
    }

    /// Applies the destination's policies: `Ok` with the ALLOW policy that
    /// matched (`None`: no ALLOW policy exists), `Err` with why not. A
    /// destination whose workload the state does not hold is denied.
    pub fn check(&self, state: &State) -> Result<Option<String>, Denied> {
        self.check_against(state, self.workload(state))
    }

    /// [`Authorized::check`] with the destination's workload looked up.
    fn check_against(
        &self,
        state: &State,
        workload: Option<&Arc<Workload>>,
    ) -> Result<Option<String>, Denied> {
        let Some(workload) = workload else {
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

    fn log_closed(&self, why: &Denied) {
        tracing::info!(src.addr = %self.src_ip, dst.addr = %self.target, policy = %why, decision = "deny", "open connection closed: no longer allowed by policy");
    }
}

/// Open inbound connections that passed policy.
pub struct Tracker {
    state: StateHandle,
    /// Re-checks begun (changed only under `open`'s lock).
    rechecks: AtomicU64,
    open: Mutex<Open>,
    /// Held through a re-check: one at a time.
    rechecking: Mutex<()>,
}

#[derive(Default)]
struct Open {
    next: u64,
    pods: HashMap<ByAddress, Pod>,
    /// The policies the last re-check read.
    policies: Option<PolicyView>,
}

/// A destination pod's tracked connections.
#[derive(Default)]
struct Pod {
    /// Its workload as the last re-check found it (`None`: not checked
    /// since the first of them was tracked).
    seen: Option<Arc<Workload>>,
    /// By id, in the order tracked: a re-check resumes where its last
    /// chunk ended.
    conns: BTreeMap<u64, (Authorized, DrainTrigger)>,
}

/// What a re-check did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rechecked {
    /// Connections whose verdict was worked out again.
    pub checked: usize,
    /// Of those, the ones closed.
    pub closed: usize,
}

/// A pod's [`Destination`], one per pod: found by its address, not by
/// hashing its texts (a pod served twice is two groups, each correct).
#[derive(Clone)]
struct ByAddress(Arc<Destination>);

impl PartialEq for ByAddress {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for ByAddress {}

impl std::hash::Hash for ByAddress {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        std::ptr::hash(Arc::as_ptr(&self.0), state)
    }
}

/// Forgets what a re-check noted as checked if it ends part way (a panic).
struct Unfinished<'t>(&'t Tracker);

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        self.0.lock().policies = None;
    }
}

/// The id of a connection denied as it was tracked (ids count up from 0).
const NEVER_TRACKED: u64 = u64::MAX;

/// Keeps a connection tracked; untracks it when dropped.
pub struct Tracked {
    id: u64,
    destination: ByAddress,
    tracker: Arc<Tracker>,
    /// Fires when a policy change denies the connection.
    pub revoked: Drain,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.id == NEVER_TRACKED {
            return;
        }
        let mut open = self.tracker.lock();
        let pods = &mut open.pods;
        if let Some(pod) = pods.get_mut(&self.destination) {
            pod.conns.remove(&self.id);
            if pod.conns.is_empty() {
                pods.remove(&self.destination);
            }
        }
        shrink_when_sparse(pods);
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

/// Connections a re-check checks per hold of the tracker's lock: about
/// 50 µs of a policy check's work.
const CHUNK: usize = 128;

/// Up to this many connections tracked, a re-check runs where the state
/// change was seen (at most about 1 ms, for a policy change).
const INLINE_MAX: usize = 2_000;

impl Tracker {
    pub fn new(state: StateHandle) -> Arc<Self> {
        Arc::new(Tracker {
            state,
            rechecks: AtomicU64::new(0),
            open: Mutex::default(),
            rechecking: Mutex::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        self.open.lock()
    }

    /// Re-checks begun so far: read before a decision, into
    /// [`Authorized::since`].
    pub fn rechecks(&self) -> u64 {
        self.rechecks.load(Ordering::Acquire)
    }

    /// Tracks a connection that passed policy. If a re-check was done
    /// since its decision, it is checked again against the current state
    /// (outside the lock); denied, its `revoked` has already fired and
    /// [`Drain::run`] never starts it.
    pub fn track(self: &Arc<Self>, mut auth: Authorized) -> Tracked {
        let (trigger, revoked) = Drain::new();
        let destination = ByAddress(auth.destination.clone());
        loop {
            // Read before the state is loaded: a re-check counted here
            // had its state before it began, so no newer than the one
            // checked below.
            let done = self.rechecks();
            if done != auth.since {
                if let Err(why) = auth.check(&self.state.load()) {
                    auth.log_closed(&why);
                    trigger.fire();
                    return self.tracked(NEVER_TRACKED, destination, revoked);
                }
                auth.since = done;
            }
            let mut open = self.lock();
            if self.rechecks.load(Ordering::Relaxed) != auth.since {
                continue; // a re-check ran meanwhile, without this one
            }
            let id = open.next;
            open.next += 1;
            open.pods
                .entry(destination.clone())
                .or_default()
                .conns
                .insert(id, (auth, trigger));
            drop(open);
            return self.tracked(id, destination, revoked);
        }
    }

    fn tracked(self: &Arc<Self>, id: u64, destination: ByAddress, revoked: Drain) -> Tracked {
        Tracked {
            id,
            destination,
            tracker: self.clone(),
            revoked,
        }
    }

    /// Re-checks the tracked connections against the handle's state,
    /// loaded as the re-check begins: a connection tracked before then was
    /// decided against a state no newer.
    pub fn recheck_current(&self) -> Rechecked {
        self.recheck_from(|| self.state.load())
    }

    /// Re-checks the tracked connections against `state` (tests and
    /// benches; the proxy re-checks the current state).
    pub fn recheck(&self, state: &State) -> Rechecked {
        self.recheck_from(|| state)
    }

    /// Re-checks the tracked connections against the state `load` gives,
    /// called as the re-check begins, under the lock (those of a pod whose
    /// workload and policies are as the last re-check found them are
    /// left), [`CHUNK`] at a time under the lock.
    fn recheck_from<S: std::ops::Deref<Target = State>>(
        &self,
        load: impl FnOnce() -> S,
    ) -> Rechecked {
        let _one = self.rechecking.lock();
        // What is noted below claims the checks after it: a re-check that
        // does not finish them (a panic) leaves the next to check
        // everything. Made before the lock is taken, so it is dropped
        // after the lock is let go.
        let unfinished = Unfinished(self);
        // Begun under the lock: the state, what it must check, and the
        // count moved on (a connection decided before this point and
        // tracked after it is checked as it is tracked).
        let mut open = self.lock();
        let state = load();
        let policies = state.policy_view();
        let all = open.policies.as_ref() != Some(&policies);
        let todo: Vec<(ByAddress, Option<Arc<Workload>>)> = open
            .pods
            .iter_mut()
            .filter_map(|(key, pod)| {
                let workload = key.0.workload(&state);
                let unchanged = pod
                    .seen
                    .as_ref()
                    .is_some_and(|seen| workload.is_some_and(|w| Arc::ptr_eq(w, seen)));
                if !all && unchanged {
                    return None;
                }
                pod.seen = workload.cloned();
                Some((key.clone(), workload.cloned()))
            })
            .collect();
        open.policies = Some(policies);
        self.rechecks.fetch_add(1, Ordering::Release);
        let tracked_before = open.next;
        drop(open);
        let mut done = Rechecked::default();
        for (key, workload) in &todo {
            let mut from = 0;
            while let Some(next) = self.recheck_chunk(
                key,
                from..tracked_before,
                &state,
                workload.as_ref(),
                &mut done,
            ) {
                from = next;
            }
        }
        std::mem::forget(unfinished);
        shrink_when_sparse(&mut self.lock().pods);
        done
    }

    /// Checks up to [`CHUNK`] of a pod's connections with ids in `ids`,
    /// under the lock; closes the ones denied. Gives the id to go on from,
    /// if any are left.
    fn recheck_chunk(
        &self,
        key: &ByAddress,
        ids: std::ops::Range<u64>,
        state: &State,
        workload: Option<&Arc<Workload>>,
        done: &mut Rechecked,
    ) -> Option<u64> {
        let mut open = self.lock();
        let pod = open.pods.get_mut(key)?;
        let mut closed = Vec::new();
        let mut next = None;
        for (n, (&id, (auth, trigger))) in pod.conns.range(ids).enumerate() {
            if n == CHUNK {
                next = Some(id);
                break;
            }
            done.checked += 1;
            if let Err(why) = auth.check_against(state, workload) {
                auth.log_closed(&why);
                trigger.fire();
                closed.push(id);
            }
        }
        done.closed += closed.len();
        for id in closed {
            pod.conns.remove(&id);
        }
        if pod.conns.is_empty() {
            open.pods.remove(key);
        }
        // Handed to a thread parked waiting for it (a connection being
        // tracked or untracked), if one is: released plainly, this thread
        // would take it back for its next chunk before the waiter woke.
        MutexGuard::unlock_fair(open);
        next
    }

    /// Connections tracked, all pods together (an upper bound on what a
    /// re-check checks).
    fn tracked_count(&self) -> usize {
        self.lock().pods.values().map(|pod| pod.conns.len()).sum()
    }

    /// Re-checks on every state change, for the life of the runtime. With
    /// at most [`INLINE_MAX`] connections tracked the re-check runs in
    /// place (a millisecond at most); with more it goes to the runtime's
    /// blocking pool, off the data path's workers (a policy change checks
    /// every connection: 50 ms at 100,000). Not a thread of its own: that
    /// costs every proxy ~0.25 MB (its stack and allocator arena) for
    /// what most nodes never need, and not the blocking pool every time:
    /// a pool thread ends after 10 s idle and the next takes another
    /// allocator arena, which a mesh whose pods come and go then keeps
    /// (tests/churn.rs).
    pub fn spawn_watcher(self: &Arc<Self>) {
        let tracker = self.clone();
        let mut changes = self.state.subscribe();
        tokio::spawn(async move {
            while changes.changed().await.is_ok() {
                if tracker.tracked_count() <= INLINE_MAX {
                    // A panic ends this re-check, not the watcher (as the
                    // blocking pool's path below): the re-check's guard
                    // leaves the next to check everything.
                    let rechecked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        tracker.recheck_current()
                    }));
                    if rechecked.is_err() {
                        tracing::error!("re-checking open connections failed: a panic");
                    }
                    continue;
                }
                let tracker = tracker.clone();
                let rechecked = tokio::task::spawn_blocking(move || tracker.recheck_current());
                match rechecked.await {
                    Ok(_) => {}
                    Err(e) if e.is_cancelled() => return, // the runtime ends
                    Err(e) => tracing::error!(error = %e, "re-checking open connections failed"),
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;
    use crate::xds::convert::AddressResource;

    fn state(yaml: &str) -> State {
        crate::xds::local::parse(std::path::Path::new("t.yaml"), yaml).unwrap()
    }

    fn web(service_account: &str) -> Arc<Destination> {
        Arc::new(Destination {
            namespace: "shop".into(),
            name: "web".into(),
            service_account: service_account.into(),
        })
    }

    fn to(destination: &Arc<Destination>, since: u64) -> Authorized {
        Authorized {
            destination: destination.clone(),
            peer: Some(Identity::new("cluster.local", "front", "ui")),
            src_ip: "10.0.0.2".parse().unwrap(),
            target: "10.0.0.3:8080".parse().unwrap(),
            since,
        }
    }

    fn to_web(service_account: &str) -> Authorized {
        to(&web(service_account), 0)
    }

    fn did(checked: usize, closed: usize) -> Rechecked {
        Rechecked { checked, closed }
    }

    fn revoked(t: &Tracked) -> bool {
        t.revoked.signalled().now_or_never().is_some()
    }

    const WEB: &str = "workloads:\n- {name: web, namespace: shop, serviceAccount: web-sa, workloadIps: [10.0.0.3], protocol: HBONE}\n";
    const DB: &str = "- {name: db, namespace: shop, serviceAccount: db-sa, workloadIps: [10.0.0.4], protocol: HBONE}\n";
    const DENY_ALL: &str =
        "policies:\n- {name: deny-all, namespace: shop, action: Deny, rules: [[]]}\n";

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
        let tracker = Tracker::new(StateHandle::new(state(WEB)));
        let kept = tracker.track(to_web("web-sa"));
        assert_eq!(tracker.recheck(&state(WEB)).closed, 0);
        assert_eq!(tracker.recheck(&state("workloads: []\n")).closed, 1);
        assert!(revoked(&kept));
    }

    /// The first workload of `yaml`'s state, as a resource to put.
    fn workload(yaml: &str) -> AddressResource {
        AddressResource::Workload(state(yaml).workloads().next().unwrap().clone())
    }

    #[test]
    fn a_change_that_leaves_a_pods_workload_and_the_policies_checks_none_of_its_connections() {
        // Changes applied one by one, as the xDS client makes them: what
        // a change leaves is shared with the state before it.
        let mut st = state(&format!("{WEB}{DB}"));
        let tracker = Tracker::new(StateHandle::new(st.clone()));
        let dest = web("web-sa");
        let held: Vec<Tracked> = (0..100).map(|_| tracker.track(to(&dest, 0))).collect();
        let first = tracker.recheck(&st);
        assert_eq!(first, did(100, 0), "first seen: checked");
        assert_eq!(tracker.recheck(&st), Rechecked::default());

        // Other pods' workloads change: web's connections are left.
        let db = workload(&format!(
            "workloads:\n{}",
            DB.replace("10.0.0.4", "10.0.0.5")
        ));
        st.put_address("workloads[1] (shop/db)", "2", db);
        let cache =
            workload("workloads:\n- {name: cache, namespace: shop, workloadIps: [10.0.0.6]}\n");
        st.put_address("cache", "1", cache);
        assert_eq!(tracker.recheck(&st), Rechecked::default());

        // A policy arrives: every connection is checked, and closed.
        let deny = state(&format!("workloads: []\n{DENY_ALL}"));
        let policy = deny.policies().next().unwrap().as_ref().clone();
        st.put_policy("deny-all", "1", policy);
        assert_eq!(tracker.recheck(&st), did(100, 100));
        assert!(held.iter().all(revoked));
    }

    #[test]
    fn a_change_to_the_pods_own_workload_checks_its_connections() {
        let mut st = state(&format!("{WEB}{DB}"));
        let tracker = Tracker::new(StateHandle::new(st.clone()));
        let kept = tracker.track(to_web("web-sa"));
        let other = tracker.track(to(
            &Arc::new(Destination {
                namespace: "shop".into(),
                name: "db".into(),
                service_account: "db-sa".into(),
            }),
            0,
        ));
        assert_eq!(tracker.recheck(&st), did(2, 0));
        // web's workload moves to another service account: no longer the
        // pod's. Only web's connection is checked.
        let moved = workload(&WEB.replace("web-sa", "other-sa"));
        st.put_address("workloads[0] (shop/web)", "2", moved);
        assert_eq!(tracker.recheck(&st), did(1, 1));
        assert!(revoked(&kept));
        assert!(!revoked(&other));
    }

    #[test]
    fn a_connection_decided_before_a_recheck_it_missed_is_checked_when_tracked() {
        let handle = StateHandle::new(state(WEB));
        let tracker = Tracker::new(handle.clone());
        let dest = web("web-sa");
        // Decided while the state allowed it...
        let since = tracker.rechecks();
        assert_eq!(to(&dest, since).check(&handle.load()), Ok(None));
        // ...then the pod's workload went, and the re-check ran before the
        // connection was tracked: it is closed as it is tracked.
        handle.store(state("workloads: []\n"));
        tracker.recheck(&handle.load());
        let late = tracker.track(to(&dest, since));
        assert!(
            revoked(&late),
            "a connection that missed its re-check stayed open"
        );

        // Tracked before the re-check: the re-check closes it.
        handle.store(state(WEB));
        tracker.recheck(&handle.load());
        let since = tracker.rechecks();
        handle.store(state("workloads: []\n"));
        let early = tracker.track(to(&dest, since));
        assert!(!revoked(&early));
        assert_eq!(tracker.recheck(&handle.load()).closed, 1);
        assert!(revoked(&early));
    }

    #[test]
    fn a_burst_of_connections_leaves_no_large_table_behind() {
        let tracker = Tracker::new(StateHandle::new(state(WEB)));
        let dest = web("web-sa");
        // A thousand pods with a connection each, then one left.
        let mut held: Vec<Tracked> = (0..1000)
            .map(|i| {
                let mut other = (*dest).clone();
                other.name = format!("web-{i}");
                tracker.track(to(&Arc::new(other), 0))
            })
            .collect();
        let grown = tracker.lock().pods.capacity();
        assert!(grown >= 1000, "{grown}");
        let last = tracker.track(to(&dest, 0));
        held.clear();
        let left = tracker.lock().pods.capacity();
        assert!(left <= SPARSE_FLOOR, "a table for {left} kept for one pod");
        // The one left is still tracked, and still rechecked.
        assert_eq!(tracker.recheck(&state("workloads: []\n")).closed, 1);
        drop(last);
        assert!(tracker.lock().pods.is_empty());
    }

    /// A state whose `n` ALLOW policies in web's namespace match no
    /// connection: each check reads them all.
    fn none_allowed(n: usize) -> State {
        let mut yaml = format!("{WEB}policies:\n");
        for i in 0..n {
            yaml.push_str(&format!("- {{name: p{i}, namespace: shop, action: Allow, rules: [[[{{principals: [!Exact cluster.local/ns/x/sa/s{i}]}}]]]}}\n"));
        }
        state(&yaml)
    }

    #[test]
    fn connections_are_tracked_while_a_long_recheck_runs_and_it_checks_only_older_ones() {
        let handle = StateHandle::new(state(WEB));
        let tracker = Tracker::new(handle.clone());
        let dest = web("web-sa");
        const HELD: usize = 40_000;
        let held: Vec<Tracked> = (0..HELD).map(|_| tracker.track(to(&dest, 0))).collect();
        // A policy change that denies them all, re-checked on a thread
        // (about a second here: every connection reads 200 policies).
        handle.store(none_allowed(200));
        let allowing = state(WEB);
        let begun = tracker.rechecks();
        let pass = std::thread::spawn({
            let tracker = tracker.clone();
            move || tracker.recheck_current()
        });
        while tracker.rechecks() == begun {
            std::thread::yield_now();
        }
        // Meanwhile the state allows again, and a connection decided
        // against it is tracked: while the re-check runs, not after it,
        // and the re-check (of an older state) leaves it.
        handle.store(allowing);
        let late = tracker.track(to(&dest, tracker.rechecks()));
        let closed = held.iter().filter(|t| revoked(t)).count();
        assert!(
            closed < HELD,
            "tracking a connection waited for the whole re-check"
        );
        assert_eq!(pass.join().unwrap(), did(HELD, HELD));
        assert!(held.iter().all(revoked));
        assert!(
            !revoked(&late),
            "a connection tracked after the re-check began was checked against its older state"
        );
    }

    #[test]
    fn the_watcher_outlives_a_recheck_that_panics() {
        let handle = StateHandle::new(state(WEB));
        let tracker = Tracker::new(handle.clone());
        let held = tracker.track(to_web("web-sa"));
        // The first closing log line panics (its writer), later ones not.
        struct PanicsOnce(Arc<std::sync::atomic::AtomicBool>);
        impl std::io::Write for PanicsOnce {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                if !self.0.swap(true, Ordering::Relaxed) {
                    panic!("a log writer that panics");
                }
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let panicked = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = panicked.clone();
        let logs = tracing_subscriber::fmt()
            .with_writer(move || PanicsOnce(writer.clone()))
            .finish();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tracing::subscriber::with_default(logs, || {
            runtime.block_on(async {
                tracker.spawn_watcher();
                tokio::task::yield_now().await;
                let denying = format!("{WEB}{DENY_ALL}");
                handle.store(state(&denying));
                while !panicked.load(Ordering::Relaxed) {
                    tokio::task::yield_now().await;
                }
                // The next change is re-checked, and closes it.
                handle.store(state(&denying));
                let closed = tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    held.revoked.signalled(),
                );
                assert!(
                    closed.await.is_ok(),
                    "a re-check that panicked ended the re-checks"
                );
            })
        });
    }

    #[test]
    fn a_recheck_that_ends_part_way_leaves_the_next_to_check_everything() {
        let tracker = Tracker::new(StateHandle::new(state(WEB)));
        let held = tracker.track(to_web("web-sa"));
        // The re-check of a denying state panics as it closes the
        // connection (its log line's writer panics)...
        struct Panics;
        impl std::io::Write for Panics {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                panic!("a log writer that panics")
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let denying = state(&format!("{WEB}{DENY_ALL}"));
        let logs = tracing_subscriber::fmt().with_writer(|| Panics).finish();
        let ended = tracing::subscriber::with_default(logs, || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tracker.recheck(&denying)))
        });
        assert!(ended.is_err());
        assert!(!revoked(&held));
        // ...and the next, of the same state, checks it and closes it.
        assert_eq!(tracker.recheck(&denying), did(1, 1));
        assert!(revoked(&held));
    }
}
