//! The Istio CA client: a CSR per identity (ECDSA P-256, SAN = the SPIFFE id,
//! `ImpersonatedIdentity` metadata, since the node proxy asks on behalf of its
//! pods) sent to `istio.v1.auth.IstioCertificateService/CreateCertificate`,
//! and the returned chain parsed (leaf first; the last element may hold
//! several roots). The private key never leaves this process.

use std::path::PathBuf;
use std::time::Duration;

use rcgen::{CertificateParams, KeyPair, SanType, PKCS_ECDSA_P256_SHA256};
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};

use super::ca::{IdentityError, WorkloadCert};
use super::spiffe::Identity;
use crate::proto::ca::istio_certificate_service_client::IstioCertificateServiceClient;
use crate::proto::ca::IstioCertificateRequest;

#[derive(Debug, Clone)]
pub struct CaClient {
    pub address: String,
    pub root_ca: Option<PathBuf>,
    pub token: Option<PathBuf>,
    pub cluster_id: String,
    /// `SO_MARK` of the connection.
    pub mark: u32,
}

fn pem_certs(pem: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    rustls_pemfile::certs(&mut pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())
}

impl CaClient {
    /// Asks the CA for a certificate for `id`, valid for `ttl`.
    pub async fn issue(&self, id: &Identity, ttl: Duration) -> Result<WorkloadCert, IdentityError> {
        let err = |reason: String| IdentityError::Sign {
            identity: id.to_string(),
            reason,
        };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|e| err(e.to_string()))?;
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![SanType::URI(
            id.to_string()
                .try_into()
                .map_err(|e: rcgen::Error| err(e.to_string()))?,
        )];
        let csr = params
            .serialize_request(&key)
            .and_then(|c| c.pem())
            .map_err(|e| err(e.to_string()))?;
        let roots = self
            .root_ca
            .as_deref()
            .map(crate::grpc::roots_from)
            .transpose()
            .map_err(|e| err(e.to_string()))?;
        let channel = crate::grpc::channel(&self.address, roots, self.mark)
            .await
            .map_err(|e| err(e.to_string()))?;
        let metadata = prost_types::Struct {
            fields: [(
                "ImpersonatedIdentity".to_string(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(id.to_string())),
                },
            )]
            .into(),
        };
        let mut req = tonic::Request::new(IstioCertificateRequest {
            csr,
            validity_duration: ttl.as_secs() as i64,
            metadata: Some(metadata),
        });
        if let Some(path) = &self.token {
            let token = std::fs::read_to_string(path)
                .map_err(|e| err(format!("token file {}: {e}", path.display())))?;
            let value = format!("Bearer {}", token.trim())
                .parse()
                .map_err(|_| err("token is not a valid header value".into()))?;
            req.metadata_mut().insert("authorization", value);
        }
        if let Ok(v) = self.cluster_id.parse() {
            req.metadata_mut().insert("clusterid", v);
        }
        let resp = IstioCertificateServiceClient::new(channel)
            .create_certificate(req)
            .await
            .map_err(|s| err(format!("CA: {}", s.message())))?;
        let chain = resp.into_inner().cert_chain;
        let (last, rest) = chain
            .split_last()
            .ok_or_else(|| err("CA returned an empty chain".into()))?;
        let mut certs = Vec::new();
        for pem in rest {
            certs.extend(pem_certs(pem).map_err(&err)?);
        }
        let roots = pem_certs(last).map_err(&err)?;
        if certs.is_empty() {
            // A single element holds the leaf and then the roots.
            let mut all = roots.clone();
            if all.is_empty() {
                return Err(err("CA returned no certificate".into()));
            }
            certs.push(all.remove(0));
        }
        let leaf = certs[0].clone();
        if super::tls::identity_of(&leaf).as_ref() != Some(id) {
            return Err(err(
                "the CA's certificate does not carry the requested identity".into(),
            ));
        }
        let (_, x509) =
            x509_parser::parse_x509_certificate(&leaf).map_err(|e| err(e.to_string()))?;
        let to_time = |t: x509_parser::time::ASN1Time| {
            std::time::UNIX_EPOCH + Duration::from_secs(t.timestamp().max(0) as u64)
        };
        Ok(WorkloadCert {
            identity: id.clone(),
            not_before: to_time(x509.validity().not_before),
            not_after: to_time(x509.validity().not_after),
            chain: certs,
            roots,
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
        })
    }
}
