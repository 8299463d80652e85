//! The control plane's `IstioCertificateService`: who is asking (their
//! token), which identity they ask for (`ImpersonatedIdentity`, which a node
//! proxy sends for each of its pods), whether they may have it (a node only
//! its own workloads, see `auth`), and only then a certificate that names
//! that identity alone for the key of their CSR. Every refusal is answered
//! with its gRPC code and a reason, and logged.
//!
//! It does not decide what a certificate says (that is
//! [`LocalCa::sign_csr`]) nor read the config file (it is handed the state).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use super::auth::{self, Caller, TokenFiles};
use crate::identity::{Identity, LocalCa};
use crate::proto::ca::istio_certificate_service_server::IstioCertificateService;
use crate::proto::ca::{IstioCertificateRequest, IstioCertificateResponse};
use crate::xds::StateHandle;

/// The metadata field naming the identity asked for.
const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";

pub struct CertificateService {
    /// The mesh root: signs workload certificates only.
    pub ca: Arc<LocalCa>,
    pub trust_domain: String,
    pub max_ttl: Duration,
    pub tokens: TokenFiles,
    /// Which workloads exist, and on which node: the control plane's config.
    pub state: StateHandle,
}

/// The identity a request asks for, from its metadata.
fn impersonated(req: &IstioCertificateRequest) -> Option<&str> {
    let field = req.metadata.as_ref()?.fields.get(IMPERSONATED_IDENTITY)?;
    match &field.kind {
        Some(prost_types::value::Kind::StringValue(s)) => Some(s.as_str()),
        _ => None,
    }
}

/// Logs a refused request and hands its status back.
fn refused(
    caller: &Caller,
    asked: Option<&str>,
    peer: Option<SocketAddr>,
    status: Status,
) -> Status {
    tracing::warn!(
        src.addr = ?peer,
        caller = %caller,
        identity = asked.unwrap_or("-"),
        code = ?status.code(),
        reason = status.message(),
        "certificate refused"
    );
    status
}

#[tonic::async_trait]
impl IstioCertificateService for CertificateService {
    async fn create_certificate(
        &self,
        req: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let caller = self.tokens.authenticate(&req, "CreateCertificate")?;
        let peer = auth::peer(&req);
        let req = req.into_inner();
        let asked = impersonated(&req);
        let refuse = |status: Status| refused(&caller, asked, peer, status);
        let Some(asked_id) = asked else {
            return Err(refuse(Status::invalid_argument(format!(
                "{IMPERSONATED_IDENTITY} metadata is required: the SPIFFE identity asked for"
            ))));
        };
        let id = asked_id
            .parse::<Identity>()
            .map_err(|e| refuse(Status::invalid_argument(e.to_string())))?;
        auth::may_have(&caller, &id, &self.state.load(), &self.trust_domain)
            .map_err(|e| refuse(Status::permission_denied(e.to_string())))?;
        let ttl = Duration::from_secs(req.validity_duration.max(10) as u64).min(self.max_ttl);
        let chain = self
            .ca
            .sign_csr(&req.csr, &id, ttl)
            .map_err(|e| refuse(Status::invalid_argument(e.to_string())))?;
        tracing::info!(identity = %id, caller = %caller, src.addr = ?peer, ttl_s = ttl.as_secs(), "certificate signed");
        Ok(Response::new(IstioCertificateResponse {
            cert_chain: chain,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, KeyPair, SanType, PKCS_ECDSA_P256_SHA256};
    use std::path::PathBuf;

    /// A CA service whose config puts `web` on node-a and `db` on node-b,
    /// with a token per node in a directory of its own.
    fn service(tag: &str) -> (CertificateService, PathBuf) {
        let dir = std::env::temp_dir().join(format!("ambit-cp-ca-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("node-a"), "token-a\n").unwrap();
        std::fs::write(dir.join("node-b"), "token-b\n").unwrap();
        let state = crate::xds::local::parse(
            std::path::Path::new("cp.yaml"),
            "workloads:\n\
             - {uid: a, name: web, namespace: shop, serviceAccount: web, workloadIps: [\"10.0.0.1\"], protocol: HBONE, node: node-a}\n\
             - {uid: b, name: db, namespace: shop, serviceAccount: db, workloadIps: [\"10.0.0.2\"], protocol: HBONE, node: node-b}\n",
        )
        .unwrap();
        let svc = CertificateService {
            ca: Arc::new(LocalCa::generate("cluster.local").unwrap()),
            trust_domain: "cluster.local".into(),
            max_ttl: Duration::from_secs(3600),
            tokens: TokenFiles {
                node_dir: Some(dir.clone()),
                ..TokenFiles::default()
            },
            state: StateHandle::new(state),
        };
        (svc, dir)
    }

    /// What a node proxy sends, with a CSR that also asks for a DNS name.
    fn request(token: &str, identity: Option<&str>) -> Request<IstioCertificateRequest> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = CertificateParams::new(vec!["evil.example".to_string()]).unwrap();
        params.subject_alt_names.push(SanType::URI(
            "spiffe://cluster.local/ns/shop/sa/web".try_into().unwrap(),
        ));
        let csr = params.serialize_request(&key).unwrap().pem().unwrap();
        let metadata = identity.map(|id| prost_types::Struct {
            fields: [(
                IMPERSONATED_IDENTITY.to_string(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(id.into())),
                },
            )]
            .into(),
        });
        let mut req = Request::new(IstioCertificateRequest {
            csr,
            validity_duration: 600,
            metadata,
        });
        req.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        req
    }

    #[tokio::test]
    async fn a_node_gets_its_own_pods_identity_and_nothing_more() {
        let (svc, dir) = service("own");
        let web = "spiffe://cluster.local/ns/shop/sa/web";
        let chain = svc
            .create_certificate(request("token-a", Some(web)))
            .await
            .unwrap()
            .into_inner()
            .cert_chain;
        let leaf = rustls_pemfile::certs(&mut chain[0].as_bytes())
            .next()
            .unwrap()
            .unwrap();
        let (_, x509) = x509_parser::parse_x509_certificate(&leaf).unwrap();
        let san = x509.subject_alternative_name().unwrap().unwrap();
        assert_eq!(
            san.value.general_names,
            [x509_parser::extensions::GeneralName::URI(web)],
            "the DNS name the CSR asked for is not in the certificate"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_node_asking_for_another_nodes_pod_is_refused() {
        let (svc, dir) = service("other");
        let db = "spiffe://cluster.local/ns/shop/sa/db";
        let status = svc
            .create_certificate(request("token-a", Some(db)))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
        assert!(
            status.message().contains("node node-a may not have") && status.message().contains(db),
            "{status:?}"
        );
        assert!(
            svc.create_certificate(request("token-b", Some(db)))
                .await
                .is_ok(),
            "node-b's own pod"
        );
        let status = svc
            .create_certificate(request("token-c", Some(db)))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
        let status = svc
            .create_certificate(request("token-a", None))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains(IMPERSONATED_IDENTITY),
            "{status:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
