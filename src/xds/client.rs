//! The delta ADS client (Envoy delta xDS over gRPC, docs/wire.md §6): subscribes
//! to Istio's `Address` and `Authorization` types, applies every response in
//! one state swap, ACKs it — or NACKs it naming each bad resource and why,
//! while applying the good ones — and reconnects with jittered backoff,
//! sending the versions it holds (`initial_resource_versions`). The last good
//! state keeps serving while the control plane is away.
//!
//! On demand (`XDS_ON_DEMAND`), the client does not take every address: it
//! opts out of the wildcard and subscribes to each `network/IP` the data path
//! asks about ([`XdsClient::fetch`]), keeping those subscriptions across
//! reconnects. Authorization is always wildcard, as in ztunnel.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tokio::sync::mpsc;

use super::ahead::convert_in_order;
use super::convert::{self, ADDRESS_TYPE, AUTHORIZATION_TYPE};
use super::delta::Delta;
pub use super::metrics::XdsMetrics;
use super::store::{State, StateHandle};
use super::stream;
use super::yielding::Applier;
use crate::backoff::Backoff;
use crate::proto::core::Node;
use crate::proto::discovery::{DeltaDiscoveryRequest, Resource};
use crate::proto::rpc;

/// Where and how to reach the control plane.
#[derive(Debug, Clone)]
pub struct XdsConfig {
    /// `https://host:port` (or `http://` in a lab).
    pub address: String,
    pub root_ca: Option<PathBuf>,
    /// Bearer token file, re-read on every connection.
    pub token: Option<PathBuf>,
    pub cluster_id: String,
    pub node_id: String,
    pub metadata: Vec<(String, String)>,
    /// `SO_MARK` of the connection (the proxy's own mark, so pod rules let it out).
    pub mark: u32,
    /// Addresses by subscription to each name asked for, not the wildcard.
    pub on_demand: bool,
    /// How long a connection waits for an on-demand answer.
    pub on_demand_wait: Duration,
    /// The largest response decoded (bytes).
    pub max_message_size: usize,
}

/// The name under which istiod answers an on-demand address subscription.
pub fn address_name(network: &str, ip: std::net::IpAddr) -> String {
    format!("{network}/{ip}")
}

/// The most names subscribed on demand. At the cap, the names answered
/// "unknown" longest ago are unsubscribed to make room; if every name is a
/// known address, an unknown one is not asked about (its connection is
/// routed on what the proxy holds). No peer or application can grow the
/// subscription without bound.
pub const MAX_DEMANDED: usize = 16_384;

/// The data path's one way to ask the control plane for something: an
/// address the state lacks (on demand). Everything else flows one way,
/// control plane → state snapshot → data path; this handle only asks, and the
/// answer arrives as a new snapshot. It exists only with `XDS_ON_DEMAND`.
#[derive(Clone)]
pub struct OnDemand(Arc<XdsClient>);

impl OnDemand {
    /// The handle of `client`, if it fetches on demand.
    pub fn of(client: &Arc<XdsClient>) -> Option<Self> {
        client.cfg.on_demand.then(|| OnDemand(client.clone()))
    }

    /// Asks about `ip` on `network`; returns true once the control plane has
    /// answered (the state then holds the address, if it exists). Waits up to
    /// `xds_on_demand_wait` while a stream is open, else only subscribes.
    pub async fn fetch_address(&self, network: &str, ip: std::net::IpAddr) -> bool {
        self.0.fetch(address_name(network, ip), self.0.wait()).await
    }

    /// Waits up to `xds_on_demand_wait` for a stream to open (at start-up).
    pub async fn until_connected(&self) {
        let since = std::time::Instant::now();
        while !self.0.connected() && since.elapsed() < self.0.cfg.on_demand_wait {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// On-demand subscriptions and the callers waiting for their answers.
///
/// A name is asked once per stream: istiod answers a subscription change, not
/// a repeat, and pushes later changes of what stays subscribed (a workload
/// that appears at an address it once answered as unknown included).
#[derive(Debug, Default)]
struct Demand {
    /// Every name subscribed; re-subscribed on each new stream.
    subscribed: HashSet<String>,
    /// Names the control plane has answered: true if found, false if unknown.
    answered: HashMap<String, bool>,
    /// Names as they became unknown, oldest first: evicted first. An entry
    /// whose name has since been found (or evicted) is skipped, not searched
    /// out, so a large response costs no more than its own names.
    unknown: std::collections::VecDeque<String>,
    /// To subscribe and unsubscribe on the current stream.
    unsent: Vec<String>,
    unsubscribe: Vec<String>,
    waiters: HashMap<String, Vec<tokio::sync::oneshot::Sender<()>>>,
    /// The cap was hit with nothing to evict (logged once).
    full: bool,
}

/// The names a response answers: its resources' names and aliases, and
/// the names it removes.
struct Answers {
    found: Vec<String>,
    removed: Vec<String>,
}

impl Answers {
    fn of(resp: &Delta) -> Answers {
        let found = resp.resources.iter();
        Answers {
            found: found
                .flat_map(|r| std::iter::once(&r.name).chain(&r.aliases))
                .cloned()
                .collect(),
            removed: resp.removed_resources.clone(),
        }
    }
}

impl Demand {
    /// Marks the names a response answers (by a resource's name or alias, or
    /// as removed) and returns their waiters.
    fn answered_by(&mut self, answers: Answers) -> Vec<tokio::sync::oneshot::Sender<()>> {
        let mut woken = Vec::new();
        let removed = answers.removed.iter().map(|n| (n, false));
        for (name, is_found) in answers.found.iter().map(|n| (n, true)).chain(removed) {
            if !self.subscribed.contains(name) {
                continue;
            }
            let was = self.answered.insert(name.clone(), is_found);
            if !is_found && was != Some(false) {
                self.unknown.push_back(name.clone());
            }
            woken.extend(self.waiters.remove(name).unwrap_or_default());
        }
        woken
    }

    /// Makes room for one more name; false if none can be made.
    fn make_room(&mut self) -> bool {
        if self.subscribed.len() < MAX_DEMANDED {
            return true;
        }
        // Evict a batch, so a stream of new addresses does not send one
        // unsubscribe per connection.
        let batch = (MAX_DEMANDED / 16).max(1);
        while self.subscribed.len() > MAX_DEMANDED - batch {
            let Some(old) = self.unknown.pop_front() else {
                break;
            };
            if self.answered.get(&old) != Some(&false) {
                continue; // found since, or already evicted
            }
            self.subscribed.remove(&old);
            self.answered.remove(&old);
            self.unsubscribe.push(old);
        }
        self.subscribed.len() < MAX_DEMANDED
    }
}

/// The resources held: the state they make, changed resource by resource
/// as responses arrive (with the version of each that serves: what a
/// reconnect tells istiod this proxy has).
#[derive(Debug, Default)]
pub struct Held {
    state: State,
}

impl Held {
    fn versions(&self, type_url: &str) -> HashMap<String, String> {
        let own = |(name, version): (&str, &str)| (name.to_string(), version.to_string());
        match type_url {
            ADDRESS_TYPE => self.state.address_versions().map(own).collect(),
            _ => self.state.policy_versions().map(own).collect(),
        }
    }

    /// Applies one response; returns the rejected resources as (name, reason).
    pub fn apply(&mut self, resp: impl Into<Delta>) -> Vec<(String, String)> {
        self.apply_noting(resp.into(), &mut HashSet::new())
    }

    /// [`Held::apply`], noting in `left_out` the resources held but left
    /// out (for a conflict) as they were put. Each resource of the
    /// response is dropped once converted.
    fn apply_noting(
        &mut self,
        resp: Delta,
        left_out: &mut HashSet<String>,
    ) -> Vec<(String, String)> {
        if resp.type_url != ADDRESS_TYPE && resp.type_url != AUTHORIZATION_TYPE {
            // Nothing of it applies, removals included.
            let why = format!("unknown type {}", resp.type_url);
            let mut rejected: Vec<_> = resp
                .resources
                .into_iter()
                .map(|r| (r.name, why.clone()))
                .collect();
            if rejected.is_empty() {
                rejected.push(("*".into(), why));
            }
            return rejected;
        }
        let mut rejected = Vec::new();
        for name in &resp.removed_resources {
            if resp.type_url == ADDRESS_TYPE {
                self.state.remove_address(name);
            } else {
                self.state.remove_policy(name);
            }
        }
        if resp.type_url == ADDRESS_TYPE {
            // Decoded and converted (on a second thread for a large
            // response), then applied in the response's order: all at once
            // while none is held (a first push), else one by one.
            let bodies = resp.resources.iter().filter(|r| r.resource.is_some());
            let mut bulk = self.state.bulk_addresses(bodies.count());
            convert_in_order(
                resp.resources,
                XDS_NICE,
                convert_address,
                |(r, held)| match (held, &mut bulk) {
                    (None, _) => rejected.push((r.name, "resource has no body".into())),
                    (Some(Ok(a)), Some(bulk)) => bulk.put(&r.name, &r.version, a),
                    (Some(Ok(a)), None) => {
                        let served = self.state.put_address(&r.name, &r.version, a).is_none();
                        note_left_out(left_out, &r.name, served);
                    }
                    (Some(Err((claims, reason))), bulk) => {
                        match bulk {
                            Some(bulk) => bulk.refuse(&r.name, claims, reason.clone()),
                            None => self.state.refuse_address(&r.name, claims, reason.clone()),
                        }
                        rejected.push((r.name, reason));
                    }
                },
            );
            if let Some(bulk) = bulk {
                left_out.extend(self.state.put_addresses(bulk).iter().map(|n| n.to_string()));
            }
            return rejected;
        }
        for r in resp.resources {
            let Some(any) = &r.resource else {
                rejected.push((r.name, "resource has no body".into()));
                continue;
            };
            // The type is Authorization (checked above).
            let decode = || crate::proto::security::Authorization::decode(any.value.as_slice());
            // Read again for a refusal (rare): the conversion takes the
            // decoded one.
            let stand_in =
                |reason: &str| convert::refused_policy(decode().as_ref().ok(), &r.name, reason);
            match decode()
                .map_err(|e| e.to_string())
                .and_then(convert::authorization_from_proto)
            {
                Ok(p) => {
                    let served = self.state.put_policy(&r.name, &r.version, p).is_none();
                    note_left_out(left_out, &r.name, served);
                }
                Err(reason) => {
                    self.state.refuse_policy(&r.name, stand_in(&reason));
                    rejected.push((r.name, reason));
                }
            }
        }
        rejected
    }

    /// Applies one response and returns the state it leaves, and what the
    /// response's NACK names: the resources it carries that are refused,
    /// or left out for a conflict with one held before. A refusal or
    /// conflict held from an earlier response, or of the other type, was
    /// NACKed with the response that brought it and never NACKs a later
    /// one (istiod would take this proxy's view as stale).
    pub fn answer(&mut self, resp: impl Into<Delta>) -> (State, Vec<(String, String)>) {
        let resp = resp.into();
        // Held and serving as it was put: so it stays to the response's end
        // (only one that arrives earlier could take its place). One left
        // out may serve by then, if the one ahead of it went after it:
        // asked again.
        let mut left_out = HashSet::new();
        let addresses = resp.type_url == ADDRESS_TYPE;
        let mut rejected = self.apply_noting(resp, &mut left_out);
        for name in left_out {
            let reason = if addresses {
                self.state.left_out(&name)
            } else {
                self.state.policy_left_out(&name)
            };
            if let Some(reason) = reason {
                rejected.push((name, reason));
            }
        }
        (self.state(), rejected)
    }

    /// The state the resources held make (a copy: its maps are shared).
    pub fn state(&self) -> State {
        self.state.clone()
    }
}

/// An address resource (its body taken) decoded and converted; or
/// refused, with what it claims and why; or `None`, with no body.
type ConvertedAddress = (
    Resource,
    Option<Result<convert::AddressResource, (super::store::Claims, String)>>,
);

/// Decodes and converts an address resource; its body is dropped here.
fn convert_address(mut r: Resource) -> ConvertedAddress {
    let Some(any) = r.resource.take() else {
        return (r, None);
    };
    let decoded = crate::proto::workload::Address::decode(any.value.as_slice());
    // Refused before it is held: a version Ambit cannot serve never
    // replaces the one serving (the NACK leaves it).
    let held = decoded
        .map_err(|e| e.to_string())
        .and_then(convert::address_from_proto)
        .and_then(|a| match a.unsupported() {
            Some(reason) => Err(reason),
            None => Ok(a),
        });
    let held = held.map_err(|reason| {
        // What it claims, read again from its body (the conversion took
        // the decoded one): refusals are rare, a push is mostly valid
        // resources.
        let claims = match crate::proto::workload::Address::decode(any.value.as_slice()) {
            Ok(a) => convert::claims_of(&a),
            Err(_) => convert::claims_of_name(&r.name),
        };
        (claims, reason)
    });
    (r, Some(held))
}

/// Keeps in `left_out` the resources of a response that, as last put,
/// do not serve.
fn note_left_out(left_out: &mut HashSet<String>, name: &str, served: bool) {
    if served {
        left_out.remove(name);
    } else {
        left_out.insert(name.to_string());
    }
}

/// Why a stream ended, in ztunnel's words
/// (`istio_xds_connection_terminations_total{reason}`): `ConnectionError`
/// when no connection was made; `Reconnect` for the statuses a server ends
/// a healthy stream with (its connection age, a GOAWAY, a cancel);
/// `Error` for any other failure; `Complete` for a stream the server
/// closed cleanly.
fn termination_reason(ended: &anyhow::Result<()>) -> &'static str {
    use tonic::Code;
    let Err(e) = ended else {
        return "Complete";
    };
    if let Some(status) = e.downcast_ref::<tonic::Status>() {
        let going_away = status.code() == Code::Unavailable
            && ["transport is closing", "received prior goaway"]
                .iter()
                .any(|m| status.message().contains(m));
        let routine = matches!(
            status.code(),
            Code::Unknown | Code::Cancelled | Code::DeadlineExceeded
        );
        return if routine || going_away {
            "Reconnect"
        } else {
            "Error"
        };
    }
    match e.downcast_ref::<crate::grpc::GrpcError>() {
        Some(crate::grpc::GrpcError::Connect { .. }) => "ConnectionError",
        _ => "Error",
    }
}

/// A stream error in words; a response over the size limit names the
/// limit and the setting. Only such a response's length is read before
/// the stream ends (`stream::Responses`), so nothing of it is buffered or
/// applied.
fn stream_error(status: tonic::Status, limit: usize) -> anyhow::Error {
    if status.code() == tonic::Code::OutOfRange && status.message().contains("length too large") {
        return anyhow::Error::new(status).context(format!(
            "the control plane sent a response larger than this proxy takes \
             (AMBIT_XDS_MAX_MESSAGE_SIZE, {limit} bytes now): nothing of it is applied, \
             the last good state keeps serving; raise the limit to take it"
        ));
    }
    status.into()
}

/// The xDS thread's nice value: when the node's CPUs are all busy, the
/// data path's threads are scheduled ahead of it. Small responses are
/// applied on a thread below it, at `SCHED_IDLE` (`yielding.rs`).
const XDS_NICE: libc::c_int = 10;

/// The running client.
pub struct XdsClient {
    cfg: XdsConfig,
    state: StateHandle,
    held: Arc<tokio::sync::Mutex<Held>>,
    /// Set once the first response of each type is applied.
    pub synced: Arc<AtomicBool>,
    pub metrics: XdsMetrics,
    demand: std::sync::Mutex<Demand>,
    /// Wakes the stream to send newly demanded names.
    demand_added: tokio::sync::Notify,
}

fn node(cfg: &XdsConfig) -> Node {
    use prost_types::{value::Kind, Struct, Value};
    let mut fields: std::collections::BTreeMap<String, Value> = cfg
        .metadata
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                Value {
                    kind: Some(Kind::StringValue(v.clone())),
                },
            )
        })
        .collect();
    fields.insert(
        "CLUSTER_ID".into(),
        Value {
            kind: Some(Kind::StringValue(cfg.cluster_id.clone())),
        },
    );
    Node {
        id: cfg.node_id.clone(),
        cluster: cfg.cluster_id.clone(),
        metadata: Some(Struct { fields }),
    }
}

impl XdsClient {
    pub fn new(cfg: XdsConfig, state: StateHandle) -> Arc<Self> {
        Arc::new(XdsClient {
            cfg,
            state,
            held: Default::default(),
            synced: Arc::default(),
            metrics: XdsMetrics::default(),
            demand: Default::default(),
            demand_added: tokio::sync::Notify::new(),
        })
    }

    /// Whether a stream to the control plane is open now.
    pub fn connected(&self) -> bool {
        self.metrics.connected.get() == 1
    }

    /// How long a connection waits for an answer (`xds_on_demand_wait`):
    /// that, with a stream open, or nothing.
    fn wait(&self) -> Duration {
        if self.connected() {
            self.cfg.on_demand_wait
        } else {
            Duration::ZERO
        }
    }

    /// Asks the control plane about `name` (see [`address_name`]) and waits up
    /// to `wait` for its answer, which is then in the state. Returns true once
    /// answered (at once if answered before); false on timeout (the
    /// subscription stays, and goes with the next stream) or when no room is
    /// left (see [`MAX_DEMANDED`]).
    pub async fn fetch(&self, name: String, wait: Duration) -> bool {
        let rx = {
            let mut d = self.demand.lock().unwrap_or_else(|e| e.into_inner());
            if d.answered.contains_key(&name) {
                return true;
            }
            if !d.subscribed.contains(&name) {
                if !d.make_room() {
                    if !std::mem::replace(&mut d.full, true) {
                        tracing::warn!(max = MAX_DEMANDED, "on-demand subscriptions full of known addresses: unknown ones are no longer asked about");
                    }
                    return false;
                }
                d.subscribed.insert(name.clone());
                d.unsent.push(name.clone());
                self.demand_added.notify_one();
            }
            if wait.is_zero() {
                return false;
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            let waiting = d.waiters.entry(name).or_default();
            waiting.retain(|w| !w.is_closed()); // callers that gave up
            waiting.push(tx);
            rx
        };
        matches!(tokio::time::timeout(wait, rx).await, Ok(Ok(())))
    }

    /// Runs [`XdsClient::run`] on a thread of its own, with a runtime of
    /// its own, until the calling runtime ends.
    ///
    /// Why a thread: decoding a response and applying it are CPU work
    /// with no await inside. A full push of a large mesh is hundreds of
    /// megabytes and seconds of it; on the proxy's runtime it would hold
    /// a data-path worker (and the connections queued on it) for that
    /// long. Here it holds only this thread. The data path reads the
    /// state it makes through [`StateHandle`], which takes no lock.
    pub fn spawn_on_own_thread(self: Arc<Self>) -> std::io::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // Dropped when the caller's runtime ends (its task with it), which
        // ends this thread's loop.
        let (alive, ended) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _alive = alive;
            std::future::pending::<()>().await
        });
        std::thread::Builder::new()
            .name("ambit-xds".into())
            .spawn(move || {
                // SAFETY: setpriority on this thread's own id; no memory
                // is passed. A failure leaves the default priority.
                unsafe {
                    libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, XDS_NICE)
                };
                runtime.block_on(async {
                    tokio::select! {
                        () = self.run() => {}
                        _ = ended => {}
                    }
                })
            })?;
        Ok(())
    }

    /// Connects and reconnects forever (jittered backoff, 10 ms → 15 s).
    pub async fn run(self: Arc<Self>) {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(15));
        let mut applier = Applier::start();
        loop {
            let ended = self.session(&mut applier).await;
            self.metrics.connected.set(0);
            self.metrics
                .terminations
                .get_or_create(&vec![("reason".into(), termination_reason(&ended).into())])
                .inc();
            match ended {
                Ok(()) => backoff.reset(),
                Err(e) => {
                    tracing::warn!(addr = %self.cfg.address, error = %e, "xDS stream ended; the last good state keeps serving")
                }
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    async fn session(&self, applier: &mut Applier) -> anyhow::Result<()> {
        let roots = self
            .cfg
            .root_ca
            .as_deref()
            .map(crate::grpc::roots_from)
            .transpose()?;
        let mut channel = crate::grpc::channel(&self.cfg.address, roots, self.cfg.mark).await?;
        let (tx, rx) = mpsc::channel::<DeltaDiscoveryRequest>(16);
        {
            let held = self.held.lock().await;
            for type_url in [ADDRESS_TYPE, AUTHORIZATION_TYPE] {
                let mut req = DeltaDiscoveryRequest {
                    node: Some(node(&self.cfg)),
                    type_url: type_url.into(),
                    initial_resource_versions: held.versions(type_url),
                    ..Default::default()
                };
                if self.cfg.on_demand && type_url == ADDRESS_TYPE {
                    // Not the wildcard: only the names asked for so far. `*` goes
                    // in both lists, as ztunnel does: istiod reads an empty
                    // subscribe list as the wildcard, whatever is unsubscribed.
                    let mut d = self.demand.lock().unwrap_or_else(|e| e.into_inner());
                    d.unsent.clear();
                    d.unsubscribe.clear(); // a new stream starts from the list below
                    req.resource_names_subscribe = std::iter::once("*".to_string())
                        .chain(d.subscribed.iter().cloned())
                        .collect();
                    req.resource_names_unsubscribe = vec!["*".into()];
                }
                tx.send(req).await?;
            }
        }
        let outbound =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        let mut headers = Vec::new();
        if let Some(path) = &self.cfg.token {
            let token = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("token file {}: {e}", path.display()))?;
            let value = format!("Bearer {}", token.trim()).parse().map_err(|_| {
                anyhow::anyhow!("token file {}: not a header value", path.display())
            })?;
            headers.push((http::header::AUTHORIZATION, value));
        }
        let cluster = self.cfg.cluster_id.parse().map_err(|_| {
            anyhow::anyhow!("cluster id {:?}: not a header value", self.cfg.cluster_id)
        })?;
        headers.push((http::HeaderName::from_static("clusterid"), cluster));
        let mut responses =
            stream::open(&mut channel, outbound, headers, self.cfg.max_message_size).await?;
        tracing::info!(addr = %self.cfg.address, "xDS stream open");
        self.metrics.connected.set(1);
        let mut seen: HashSet<String> = HashSet::new();
        loop {
            let resp = tokio::select! {
                r = responses.message() => match r.map_err(|e| stream_error(e, self.cfg.max_message_size))? {
                    Some(r) => r,
                    None => break,
                },
                _ = self.demand_added.notified(), if self.cfg.on_demand => {
                    let (names, dropped) = {
                        let mut d = self.demand.lock().unwrap_or_else(|e| e.into_inner());
                        (std::mem::take(&mut d.unsent), std::mem::take(&mut d.unsubscribe))
                    };
                    if !names.is_empty() || !dropped.is_empty() {
                        tracing::debug!(?names, unsubscribed = dropped.len(), "on-demand subscription");
                        tx.send(DeltaDiscoveryRequest {
                            type_url: ADDRESS_TYPE.into(),
                            resource_names_subscribe: names,
                            resource_names_unsubscribe: dropped,
                            ..Default::default()
                        })
                        .await?;
                    }
                    continue;
                }
            };
            let url = vec![("url".into(), resp.type_url.clone())];
            self.metrics.messages.get_or_create(&url).inc();
            let bytes = resp.resources.iter().filter_map(|r| r.resource.as_ref());
            let bytes: usize = bytes.map(|any| any.value.len()).sum();
            self.metrics
                .message_bytes
                .get_or_create(&url)
                .inc_by(bytes as u64);
            let (type_url, nonce) = (resp.type_url.clone(), resp.nonce.clone());
            let (count, removed) = (resp.resources.len(), resp.removed_resources.len());
            // The names it answers, for on-demand callers: taken before it
            // is applied (which drops its resources as they are held).
            let answers =
                (self.cfg.on_demand && type_url == ADDRESS_TYPE).then(|| Answers::of(&resp));
            let (received_in, applying) = (responses.received_in(), std::time::Instant::now());
            let rejected = {
                let mut held = self.held.clone().lock_owned().await;
                let state = self.state.clone();
                let apply = move || {
                    let (new, rejected) = held.answer(resp);
                    state.store(new);
                    rejected
                };
                match applier.apply(count + removed, apply).await {
                    Ok(rejected) => rejected,
                    Err(lost) => {
                        // What it applied of the response is let go: what
                        // is held (and asked for again) is what serves.
                        self.held.lock().await.state = (*self.state.load()).clone();
                        return Err(lost.into());
                    }
                }
            };
            if let Some(answers) = answers {
                // After the store: a woken caller reads the new state.
                // A rejected resource answers too (as in ztunnel): asking again
                // would get no reply, and the NACK names it.
                let woken = self
                    .demand
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .answered_by(answers);
                for w in woken {
                    let _ = w.send(());
                }
            }
            if type_url == ADDRESS_TYPE || type_url == AUTHORIZATION_TYPE {
                seen.insert(type_url.clone());
            }
            if seen.len() == 2 && !self.synced.swap(true, Ordering::AcqRel) {
                tracing::info!("xDS initial sync complete");
            }
            let error_detail = (!rejected.is_empty()).then(|| {
                let message = rejected
                    .iter()
                    .map(|(n, r)| format!("{n}: {r}"))
                    .collect::<Vec<_>>()
                    .join("; ");
                tracing::warn!(%type_url, %message, "NACK: resources rejected, the rest applied");
                rpc::Status {
                    code: 3,
                    message,
                    details: vec![],
                }
            });
            tracing::debug!(
                %type_url,
                resources = count,
                removed,
                received_ms = received_in.as_millis() as u64,
                applied_ms = applying.elapsed().as_millis() as u64,
                "xDS response applied"
            );
            tx.send(DeltaDiscoveryRequest {
                type_url,
                response_nonce: nonce,
                error_detail,
                ..Default::default()
            })
            .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
