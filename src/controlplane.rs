//! `ambit control-plane`: a small, honest server for labs, CI and the demo —
//! Envoy delta ADS (Istio's `Address` and `Authorization` types) and Istio's
//! `IstioCertificateService`, both from a local-config YAML and a CA root,
//! over TLS. Edits of the file are pushed to every connected proxy as deltas.
//! Production uses istiod; this speaks the same protocol so the proxy's
//! client is the same either way.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures_util::Stream;
use prost::Message;
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status, Streaming};

use crate::config::controlplane::ControlPlaneConfig;
use crate::identity::LocalCa;
use crate::proto::ca::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use crate::proto::ca::{IstioCertificateRequest, IstioCertificateResponse};
use crate::proto::discovery::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use crate::proto::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};
use crate::xds::convert::{self, ADDRESS_TYPE, AUTHORIZATION_TYPE};

/// One served resource: its version and encoded body.
#[derive(Debug, Clone, PartialEq)]
struct Served {
    version: String,
    body: prost_types::Any,
}

/// Everything served, by type URL and resource name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot(HashMap<&'static str, BTreeMap<String, Served>>);

fn served(type_url: &str, bytes: Vec<u8>) -> Served {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    Served {
        version: format!("{:016x}", h.finish()),
        body: prost_types::Any {
            type_url: type_url.to_string(),
            value: bytes,
        },
    }
}

impl Snapshot {
    /// The resources of a local-config file, named as istiod names them.
    pub fn from_state(st: &crate::xds::State) -> Self {
        let mut addresses = BTreeMap::new();
        for w in st.workloads() {
            addresses.insert(
                w.uid.clone(),
                served(ADDRESS_TYPE, convert::workload_to_proto(w).encode_to_vec()),
            );
        }
        for s in st.services() {
            addresses.insert(
                s.key(),
                served(ADDRESS_TYPE, convert::service_to_proto(s).encode_to_vec()),
            );
        }
        let mut policies = BTreeMap::new();
        for p in st.policies() {
            policies.insert(
                p.key(),
                served(
                    AUTHORIZATION_TYPE,
                    convert::authorization_to_proto(p).encode_to_vec(),
                ),
            );
        }
        Snapshot(HashMap::from([
            (ADDRESS_TYPE, addresses),
            (AUTHORIZATION_TYPE, policies),
        ]))
    }

    /// What a client holding `has` (name → version) must receive and drop.
    fn diff(&self, type_url: &str, has: &HashMap<String, String>) -> (Vec<Resource>, Vec<String>) {
        let empty = BTreeMap::new();
        let now = self.0.get(type_url).unwrap_or(&empty);
        let send = now
            .iter()
            .filter(|(name, s)| has.get(*name) != Some(&s.version))
            .map(|(name, s)| Resource {
                version: s.version.clone(),
                resource: Some(s.body.clone()),
                name: name.clone(),
                aliases: vec![],
            })
            .collect();
        let removed = has
            .keys()
            .filter(|n| !now.contains_key(*n))
            .cloned()
            .collect();
        (send, removed)
    }
}

/// Checks the bearer token, when one is required.
#[derive(Clone)]
struct TokenCheck(Option<PathBuf>);

impl TokenCheck {
    #[allow(clippy::result_large_err)] // tonic's own error type, returned straight to tonic
    fn check<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let Some(path) = &self.0 else { return Ok(()) };
        let want = std::fs::read_to_string(path)
            .map_err(|_| Status::unavailable("token file unreadable"))?;
        let got = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if got.strip_prefix("Bearer ").map(str::trim) == Some(want.trim()) {
            Ok(())
        } else {
            Err(Status::unauthenticated("missing or wrong bearer token"))
        }
    }
}

struct Ads {
    snapshot: watch::Receiver<Arc<Snapshot>>,
    token: TokenCheck,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type DeltaAggregatedResourcesStream = ResponseStream;

    async fn delta_aggregated_resources(
        &self,
        req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        self.token.check(&req)?;
        let peer = req.remote_addr();
        let mut inbound = req.into_inner();
        let mut snapshot = self.snapshot.clone();
        let (tx, rx) = mpsc::channel::<Result<DeltaDiscoveryResponse, Status>>(16);
        tokio::spawn(async move {
            // What the client holds, per subscribed type.
            let mut holds: HashMap<String, HashMap<String, String>> = HashMap::new();
            let mut nonce = 0u64;
            let send = |type_url: &str,
                        holds: &mut HashMap<String, String>,
                        snap: &Snapshot,
                        nonce: &mut u64| {
                let (resources, removed) = snap.diff(type_url, holds);
                if resources.is_empty() && removed.is_empty() && !holds.is_empty() {
                    return None;
                }
                for r in &resources {
                    holds.insert(r.name.clone(), r.version.clone());
                }
                for n in &removed {
                    holds.remove(n);
                }
                *nonce += 1;
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
                        if !req.response_nonce.is_empty() {
                            continue; // an ACK
                        }
                        // A (re)subscription: start from what the client says it holds.
                        let held = holds.entry(req.type_url.clone()).or_default();
                        *held = req.initial_resource_versions.clone();
                        let snap = snapshot.borrow().clone();
                        let first = send(&req.type_url, held, &snap, &mut nonce).unwrap_or_else(|| {
                            nonce += 1;
                            DeltaDiscoveryResponse { type_url: req.type_url.clone(), nonce: nonce.to_string(), ..Default::default() }
                        });
                        if tx.send(Ok(first)).await.is_err() { break }
                    }
                    changed = snapshot.changed() => {
                        if changed.is_err() { break }
                        let snap = snapshot.borrow().clone();
                        for (type_url, held) in holds.iter_mut() {
                            if let Some(resp) = send(type_url, held, &snap, &mut nonce) {
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

struct Ca {
    ca: Arc<LocalCa>,
    trust_domain: String,
    max_ttl: Duration,
    token: TokenCheck,
}

#[tonic::async_trait]
impl IstioCertificateService for Ca {
    async fn create_certificate(
        &self,
        req: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        self.token.check(&req)?;
        let req = req.into_inner();
        let impersonated = req
            .metadata
            .as_ref()
            .and_then(|m| m.fields.get("ImpersonatedIdentity"))
            .and_then(|v| match &v.kind {
                Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            });
        let ttl = Duration::from_secs(req.validity_duration.max(10) as u64).min(self.max_ttl);
        let chain = self
            .ca
            .sign_csr(&req.csr, ttl, &self.trust_domain, impersonated.as_deref())
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        tracing::info!(identity = ?impersonated, ttl_s = ttl.as_secs(), "certificate signed");
        Ok(Response::new(IstioCertificateResponse {
            cert_chain: chain,
        }))
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
    let ca = match (&cfg.ca_cert, &cfg.ca_key) {
        (Some(c), Some(k)) => LocalCa::from_files(c, k)?,
        _ => LocalCa::load_or_generate(&cfg.state_dir, &cfg.trust_domain)?,
    };
    let state = crate::xds::StateHandle::new(crate::xds::local::load(&cfg.local_xds_path)?);
    tokio::spawn(crate::xds::local::watch(
        cfg.local_xds_path.clone(),
        state.clone(),
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

    let server_cert = ca.issue_server(&cfg.tls_sans, Duration::from_secs(365 * 86400))?;
    let mut tls = rustls::ServerConfig::builder_with_provider(crate::identity::tls::provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(server_cert.chain.clone(), server_cert.private_key())?;
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let token = TokenCheck(cfg.token_file.clone());
    let ads = Ads {
        snapshot: snap_rx,
        token: token.clone(),
    };
    let ca_svc = Ca {
        ca: Arc::new(ca),
        trust_domain: cfg.trust_domain.clone(),
        max_ttl: cfg.max_cert_ttl,
        token,
    };
    let listener = tokio::net::TcpListener::bind(cfg.listen_addr)
        .await
        .with_context(|| format!("listening on {}", cfg.listen_addr))?;
    tracing::info!(addr = %cfg.listen_addr, config = %cfg.local_xds_path.display(), sans = ?cfg.tls_sans, "control plane serving delta ADS and CreateCertificate (TLS)");
    let incoming = crate::grpc::tls_incoming(listener, Arc::new(tls));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tonic::transport::Server::builder()
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
