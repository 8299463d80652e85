//! `ambit control-plane`: a small, honest server for labs, CI and the demo —
//! Envoy delta ADS (Istio's `Address` and `Authorization` types) and Istio's
//! `IstioCertificateService`, both from a local-config YAML and a CA root,
//! over TLS. Edits of the file are pushed to every connected proxy as deltas.
//! A proxy takes every resource (wildcard) or, on demand, only the names it
//! subscribes to: a resource's name or one of its aliases (`network/IP`); a
//! name that matches nothing is answered in `removed_resources`.
//! Production uses istiod; this speaks the same protocol so the proxy's
//! client is the same either way.
//!
//! Two roots, never one: the mesh root signs workload certificates (`ca`,
//! for the identities `auth` allows each caller), and a serving root of its
//! own signs the control plane's TLS certificate, which proxies trust for
//! this connection only (`xds_root_ca`). So no workload certificate can pose
//! as the control plane, and the control plane's key is no mesh identity.

mod auth;
mod ca;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures_util::Stream;
use prost::Message;
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status, Streaming};

use self::auth::TokenFiles;
use crate::config::controlplane::ControlPlaneConfig;
use crate::identity::LocalCa;
use crate::proto::ca::istio_certificate_service_server::IstioCertificateServiceServer;
use crate::proto::discovery::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use crate::proto::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};
use crate::xds::client::address_name;
use crate::xds::convert::{self, ADDRESS_TYPE, AUTHORIZATION_TYPE};

/// One served resource: its version, encoded body and alias names.
#[derive(Debug, Clone, PartialEq)]
struct Served {
    version: String,
    body: prost_types::Any,
    aliases: Vec<String>,
    /// Resources that go along when this one is asked for by name: a
    /// service's workloads, as istiod sends them.
    with: Vec<String>,
}

/// Everything served, by type URL and resource name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot(HashMap<&'static str, BTreeMap<String, Served>>);

fn served(type_url: &str, bytes: Vec<u8>, aliases: Vec<String>) -> Served {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    Served {
        version: format!("{:016x}", h.finish()),
        body: prost_types::Any {
            type_url: type_url.to_string(),
            value: bytes,
        },
        aliases,
        with: Vec::new(),
    }
}

/// What one stream subscribes to, for one type, and what it holds.
#[derive(Debug, Default)]
struct Subscription {
    wildcard: bool,
    names: HashSet<String>,
    /// Name → version the client holds.
    holds: HashMap<String, String>,
}

impl Subscription {
    /// From a stream's first request of a type, read as istiod reads it: an
    /// empty subscribe list is the wildcard; otherwise `*` subscribed and not
    /// unsubscribed is. On-demand clients send `*` in both lists.
    fn first(req: &DeltaDiscoveryRequest) -> Self {
        let star = |v: &[String]| v.iter().any(|n| n == "*");
        let mut sub = Subscription {
            wildcard: req.resource_names_subscribe.is_empty()
                || (star(&req.resource_names_subscribe) && !star(&req.resource_names_unsubscribe)),
            holds: req.initial_resource_versions.clone(),
            ..Default::default()
        };
        sub.names.extend(
            req.resource_names_subscribe
                .iter()
                .filter(|n| *n != "*")
                .cloned(),
        );
        sub
    }

    /// Applies a later request's changes; returns the names newly
    /// subscribed. As in istiod, only a change is answered: a name asked
    /// again is not, and its later changes are pushed anyway.
    fn change(&mut self, req: &DeltaDiscoveryRequest) -> HashSet<String> {
        let mut asked = HashSet::new();
        for n in &req.resource_names_subscribe {
            if n == "*" {
                self.wildcard = true;
            } else if self.names.insert(n.clone()) {
                asked.insert(n.clone());
            }
        }
        for n in &req.resource_names_unsubscribe {
            if n == "*" {
                self.wildcard = false;
            } else {
                self.names.remove(n);
                asked.remove(n);
            }
        }
        asked
    }
}

impl Snapshot {
    /// The resources of a local-config file, named as istiod names them.
    pub fn from_state(st: &crate::xds::State) -> Self {
        let mut addresses = BTreeMap::new();
        // What Ambit's own state refuses is still sent, as istiod sends
        // it: the proxy refuses it (and its addresses) itself.
        let (refused_workloads, refused_services) = st.refused_resources();
        for w in st.workloads().chain(refused_workloads) {
            let aliases = w
                .workload_ips
                .iter()
                .map(|ip| address_name(&w.network, *ip))
                .collect();
            addresses.insert(
                w.uid.to_string(),
                served(
                    ADDRESS_TYPE,
                    convert::workload_to_proto(w).encode_to_vec(),
                    aliases,
                ),
            );
        }
        for s in st.services().chain(refused_services) {
            let aliases = s
                .vips
                .iter()
                .map(|v| address_name(&v.network, v.address))
                .collect();
            let mut svc = served(
                ADDRESS_TYPE,
                convert::service_to_proto(s).encode_to_vec(),
                aliases,
            );
            let key = s.key();
            svc.with = st
                .workloads()
                .filter(|w| w.services.contains_key(&key))
                .map(|w| w.uid.to_string())
                .collect();
            addresses.insert(key, svc);
        }
        let mut policies = BTreeMap::new();
        for p in st.policies() {
            policies.insert(
                p.key(),
                served(
                    AUTHORIZATION_TYPE,
                    convert::authorization_to_proto(p).encode_to_vec(),
                    vec![],
                ),
            );
        }
        Snapshot(HashMap::from([
            (ADDRESS_TYPE, addresses),
            (AUTHORIZATION_TYPE, policies),
        ]))
    }

    /// What `sub`'s client must receive and drop so that it holds exactly
    /// what it subscribes to (and what goes along). `fresh` names were just
    /// asked for: their resources go out even if held, and those matching
    /// nothing are answered as removed.
    fn diff(
        &self,
        type_url: &str,
        sub: &Subscription,
        fresh: &HashSet<String>,
    ) -> (Vec<Resource>, Vec<String>) {
        let empty = BTreeMap::new();
        let now = self.0.get(type_url).unwrap_or(&empty);
        let named = |names: &HashSet<String>, n: &String, s: &Served| {
            names.contains(n) || s.aliases.iter().any(|a| names.contains(a))
        };
        let (mut wanted, mut resend) = (HashSet::new(), HashSet::new());
        for (n, s) in now {
            let asked = named(fresh, n, s);
            if sub.wildcard || asked || named(&sub.names, n, s) {
                for m in std::iter::once(n).chain(&s.with) {
                    wanted.insert(m.as_str());
                    if asked {
                        resend.insert(m.as_str());
                    }
                }
            }
        }
        let send = now
            .iter()
            .filter(|(n, s)| {
                wanted.contains(n.as_str())
                    && (sub.holds.get(*n) != Some(&s.version) || resend.contains(n.as_str()))
            })
            .map(|(name, s)| Resource {
                version: s.version.clone(),
                resource: Some(s.body.clone()),
                name: name.clone(),
                aliases: s.aliases.clone(),
            })
            .collect();
        let mut removed: Vec<String> = sub
            .holds
            .keys()
            .filter(|n| !now.contains_key(*n) || !wanted.contains(n.as_str()))
            .cloned()
            .collect();
        if !fresh.is_empty() {
            let known: HashSet<&String> = now
                .iter()
                .flat_map(|(n, s)| std::iter::once(n).chain(&s.aliases))
                .collect();
            let mut absent: Vec<String> = fresh
                .iter()
                .filter(|f| !known.contains(f) && !removed.contains(f))
                .cloned()
                .collect();
            absent.sort();
            removed.extend(absent);
        }
        (send, removed)
    }
}

struct Ads {
    snapshot: watch::Receiver<Arc<Snapshot>>,
    tokens: TokenFiles,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type DeltaAggregatedResourcesStream = ResponseStream;

    async fn delta_aggregated_resources(
        &self,
        req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let caller = self.tokens.authenticate(&req, "DeltaAggregatedResources")?;
        let peer = auth::peer(&req);
        tracing::debug!(peer = ?peer, caller = %caller, "xDS stream opened");
        let mut inbound = req.into_inner();
        let mut snapshot = self.snapshot.clone();
        let (tx, rx) = mpsc::channel::<Result<DeltaDiscoveryResponse, Status>>(16);
        tokio::spawn(async move {
            let mut subs: HashMap<String, Subscription> = HashMap::new();
            let mut nonce = 0u64;
            // The response that brings `sub` up to `snap`, if any is due;
            // `always`: answer even with nothing to say (a first request).
            let mut respond = |type_url: &str,
                               sub: &mut Subscription,
                               snap: &Snapshot,
                               fresh: &HashSet<String>,
                               always: bool| {
                let (resources, removed) = snap.diff(type_url, sub, fresh);
                if resources.is_empty() && removed.is_empty() && !always {
                    return None;
                }
                for r in &resources {
                    sub.holds.insert(r.name.clone(), r.version.clone());
                }
                for n in &removed {
                    sub.holds.remove(n);
                }
                nonce += 1;
                Some(DeltaDiscoveryResponse {
                    type_url: type_url.into(),
                    resources,
                    removed_resources: removed,
                    nonce: nonce.to_string(),
                    ..Default::default()
                })
            };
            loop {
                tokio::select! {
                    msg = inbound.message() => {
                        let req = match msg { Ok(Some(r)) => r, _ => break };
                        if let Some(err) = &req.error_detail {
                            tracing::warn!(peer = ?peer, type_url = %req.type_url, nonce = %req.response_nonce, error = %err.message, "proxy NACKed");
                            continue;
                        }
                        let snap = snapshot.borrow().clone();
                        let resp = match subs.get_mut(&req.type_url) {
                            // A stream's first request of a type: start from what the client holds.
                            None => {
                                let mut sub = Subscription::first(&req);
                                let fresh = sub.names.clone();
                                let resp = respond(&req.type_url, &mut sub, &snap, &fresh, true);
                                subs.insert(req.type_url.clone(), sub);
                                resp
                            }
                            // An ACK, perhaps carrying subscription changes.
                            Some(sub) => {
                                // Unsubscribing is not answered (the client drops what it
                                // no longer wants), as in istiod.
                                let fresh = sub.change(&req);
                                if fresh.is_empty() { continue }
                                respond(&req.type_url, sub, &snap, &fresh, false)
                            }
                        };
                        if let Some(resp) = resp {
                            if tx.send(Ok(resp)).await.is_err() { break }
                        }
                    }
                    changed = snapshot.changed() => {
                        if changed.is_err() { break }
                        let snap = snapshot.borrow().clone();
                        for (type_url, sub) in subs.iter_mut() {
                            if let Some(resp) = respond(type_url, sub, &snap, &HashSet::new(), false) {
                                if tx.send(Ok(resp)).await.is_err() { return }
                            }
                        }
                    }
                }
            }
        });
        let out =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        Ok(Response::new(Box::pin(out)))
    }
}

/// Runs the control plane until SIGTERM/SIGINT.
pub fn run(cfg: ControlPlaneConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(serve(cfg))
}

async fn serve(cfg: ControlPlaneConfig) -> anyhow::Result<()> {
    let (mesh_ca, mesh_root) = match (&cfg.ca_cert, &cfg.ca_key) {
        (Some(c), Some(k)) => (LocalCa::from_files(c, k)?, c.clone()),
        _ => (
            LocalCa::load_or_generate(&cfg.state_dir, &cfg.trust_domain)?,
            cfg.state_dir.join(crate::identity::GENERATED_CERT),
        ),
    };
    let (serving, serving_root) = match (&cfg.serving_ca_cert, &cfg.serving_ca_key) {
        (Some(c), Some(k)) => (LocalCa::from_files(c, k)?, c.clone()),
        _ => (
            LocalCa::load_or_generate_serving(&cfg.state_dir)?,
            cfg.state_dir.join(crate::identity::GENERATED_SERVING_CERT),
        ),
    };
    anyhow::ensure!(
        !serving.same_key_as(&mesh_ca),
        "serving_ca_cert {} has the mesh root's key: the control plane's TLS key would be a mesh credential and a workload certificate could pose as the control plane; give the serving root a key of its own (or unset serving_ca_cert/serving_ca_key to have one generated)",
        serving_root.display()
    );
    // istiod's stand-in: a resource Ambit's proxy refuses is served as
    // written (the proxy is the one to refuse it), the rest as ever.
    let as_istiod = crate::xds::local::OnBadResource::RefuseIt;
    let state =
        crate::xds::StateHandle::new(crate::xds::local::load_as(&cfg.local_xds_path, as_istiod)?);
    tokio::spawn(crate::xds::local::watch_as(
        cfg.local_xds_path.clone(),
        state.clone(),
        as_istiod,
    ));
    let (snap_tx, snap_rx) = watch::channel(Arc::new(Snapshot::from_state(&state.load())));
    let mut changes = state.subscribe();
    let st = state.clone();
    tokio::spawn(async move {
        while changes.changed().await.is_ok() {
            let next = Arc::new(Snapshot::from_state(&st.load()));
            snap_tx.send_if_modified(|cur| {
                let differs = **cur != *next;
                if differs {
                    *cur = next.clone();
                }
                differs
            });
        }
    });

    let server_cert = serving.issue_server(&cfg.tls_sans, Duration::from_secs(365 * 86400))?;
    let provider = crate::identity::tls::provider();
    let versions = crate::identity::tls::versions(&provider);
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)?
        .with_no_client_auth()
        .with_single_cert(server_cert.chain.clone(), server_cert.private_key())?;
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let tokens = TokenFiles {
        any_node: cfg.token_file.clone(),
        node_dir: cfg.node_tokens_dir.clone(),
        ..TokenFiles::default()
    };
    tokens.log_setup(cfg.listen_addr);
    let ads = Ads {
        snapshot: snap_rx,
        tokens: tokens.clone(),
    };
    let ca_svc = ca::CertificateService {
        ca: Arc::new(mesh_ca),
        trust_domain: cfg.trust_domain.clone(),
        max_ttl: cfg.max_cert_ttl,
        tokens,
        state: state.clone(),
    };
    let listener = tokio::net::TcpListener::bind(cfg.listen_addr)
        .await
        .with_context(|| format!("listening on {}", cfg.listen_addr))?;
    tracing::info!(addr = %cfg.listen_addr, config = %cfg.local_xds_path.display(), sans = ?cfg.tls_sans, "control plane serving delta ADS and CreateCertificate (TLS)");
    tracing::info!(xds_root_ca = %serving_root.display(), mesh_root_ca = %mesh_root.display(), "proxies trust this control plane with xds_root_ca (its serving root) and check their certificates against mesh_root_ca");
    let incoming = crate::grpc::tls_incoming(listener, Arc::new(tls));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tonic::transport::Server::builder()
        // A peer that vanishes (or parks a connection that answers no
        // ping) is let go: its stream and what it holds are freed.
        .tcp_keepalive(Some(GRPC_KEEPALIVE))
        .http2_keepalive_interval(Some(GRPC_KEEPALIVE))
        .http2_keepalive_timeout(Some(GRPC_KEEPALIVE_TIMEOUT))
        .add_service(
            AggregatedDiscoveryServiceServer::new(ads)
                .max_decoding_message_size(256 << 20)
                .max_encoding_message_size(256 << 20),
        )
        .add_service(IstioCertificateServiceServer::new(ca_svc))
        .serve_with_incoming_shutdown(incoming, async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        })
        .await?;
    Ok(())
}

/// How often an idle gRPC connection is pinged (TCP and HTTP/2), and how
/// long its answer may take before the connection is closed.
const GRPC_KEEPALIVE: Duration = Duration::from_secs(30);
const GRPC_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> Snapshot {
        let st = crate::xds::local::parse(
            std::path::Path::new("mesh.yaml"),
            "workloads:\n- {uid: a, name: a, namespace: ns, workloadIps: [\"10.0.0.1\"], protocol: HBONE}\n- {uid: b, name: b, namespace: ns, workloadIps: [\"10.0.0.2\"], protocol: HBONE, services: {\"ns/s.ns.svc.cluster.local\": {80: 8080}}}\nservices:\n- {name: s, namespace: ns, hostname: s.ns.svc.cluster.local, vips: [\"/10.96.0.1\"], ports: {80: 8080}}\n",
        )
        .unwrap();
        Snapshot::from_state(&st)
    }

    fn names(r: &[Resource]) -> Vec<&str> {
        r.iter().map(|r| r.name.as_str()).collect()
    }

    #[test]
    fn a_first_request_without_names_is_the_wildcard() {
        let sub = Subscription::first(&DeltaDiscoveryRequest::default());
        assert!(sub.wildcard);
        let (send, removed) = snapshot().diff(ADDRESS_TYPE, &sub, &HashSet::new());
        assert_eq!(names(&send), ["a", "b", "ns/s.ns.svc.cluster.local"]);
        assert!(removed.is_empty());
        let w = send.iter().find(|r| r.name == "a").unwrap();
        assert_eq!(w.aliases, ["/10.0.0.1"], "a workload's alias is network/IP");
    }

    #[test]
    fn on_demand_gets_what_it_names_by_alias_and_absent_names_as_removed() {
        let snap = snapshot();
        let none = HashSet::new();
        // What on-demand clients send (ztunnel, and ours): `*` in both lists.
        let mut sub = Subscription::first(&DeltaDiscoveryRequest {
            resource_names_subscribe: vec!["*".into()],
            resource_names_unsubscribe: vec!["*".into()],
            ..Default::default()
        });
        assert!(!sub.wildcard);
        let (send, removed) = snap.diff(ADDRESS_TYPE, &sub, &none);
        assert!(send.is_empty() && removed.is_empty(), "nothing asked yet");
        assert!(
            Subscription::first(&DeltaDiscoveryRequest {
                resource_names_unsubscribe: vec!["*".into()],
                ..Default::default()
            })
            .wildcard,
            "an empty subscribe list is the wildcard, as istiod reads it"
        );

        let fresh = sub.change(&DeltaDiscoveryRequest {
            resource_names_subscribe: vec!["/10.0.0.1".into(), "/192.0.2.9".into()],
            ..Default::default()
        });
        let (send, removed) = snap.diff(ADDRESS_TYPE, &sub, &fresh);
        assert_eq!(names(&send), ["a"]);
        assert_eq!(removed, ["/192.0.2.9"], "an unknown name is answered");
        for r in &send {
            sub.holds.insert(r.name.clone(), r.version.clone());
        }

        // Held and unchanged: nothing more. Asking again is no change, and
        // istiod does not answer it.
        let (send, removed) = snap.diff(ADDRESS_TYPE, &sub, &none);
        assert!(send.is_empty() && removed.is_empty());
        let again = sub.change(&DeltaDiscoveryRequest {
            resource_names_subscribe: vec!["/10.0.0.1".into()],
            ..Default::default()
        });
        assert!(again.is_empty());

        // A service's address brings the service and its workloads.
        let fresh = sub.change(&DeltaDiscoveryRequest {
            resource_names_subscribe: vec!["/10.96.0.1".into()],
            ..Default::default()
        });
        let (send, _) = snap.diff(ADDRESS_TYPE, &sub, &fresh);
        assert_eq!(
            names(&send),
            ["b", "ns/s.ns.svc.cluster.local"],
            "the service and its endpoint b"
        );
        for r in &send {
            sub.holds.insert(r.name.clone(), r.version.clone());
        }

        // Unsubscribed: what only that name brought is removed.
        sub.change(&DeltaDiscoveryRequest {
            resource_names_unsubscribe: vec!["/10.96.0.1".into()],
            ..Default::default()
        });
        let (_, mut removed) = snap.diff(ADDRESS_TYPE, &sub, &none);
        removed.sort();
        assert_eq!(
            removed,
            ["b", "ns/s.ns.svc.cluster.local"],
            "a stays: its own address is still subscribed"
        );
    }
}
