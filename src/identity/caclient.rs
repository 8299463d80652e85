//! The Istio CA client: a CSR per identity (ECDSA P-256, SAN = the SPIFFE id,
//! `ImpersonatedIdentity` metadata, since the node proxy asks on behalf of its
//! pods) sent to `istio.v1.auth.IstioCertificateService/CreateCertificate`,
//! and the returned chain parsed (leaf first; the last element may hold
//! several roots). The private key never leaves this process.
//!
//! The answer is not taken on its word (`accept`): the leaf must carry the
//! identity asked for and the key we generated, and the chain must lead to
//! the mesh root this proxy was configured with. Those configured roots, not
//! the ones the CA sent, become the trust anchors for peers.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{CertificateParams, KeyPair, SanType, PKCS_ECDSA_P256_SHA256};
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer, UnixTime};
use rustls::server::ParsedCertificate;

use super::ca::{IdentityError, WorkloadCert};
use super::spiffe::Identity;
use crate::proto::ca::istio_certificate_service_client::IstioCertificateServiceClient;
use crate::proto::ca::IstioCertificateRequest;

#[derive(Debug, Clone)]
pub struct CaClient {
    pub address: String,
    /// The root the CA's TLS certificate must chain to (the connection).
    pub root_ca: Option<PathBuf>,
    /// PEM file of the mesh root(s) issued certificates must chain to; read
    /// on every issuance, so a root rotated on disk is picked up.
    pub mesh_root: PathBuf,
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
        let mesh_roots = mesh_roots(&self.mesh_root).map_err(&err)?;
        let resp = IstioCertificateServiceClient::new(channel)
            .create_certificate(req)
            .await
            .map_err(|s| err(format!("CA answered {:?}: {}", s.code(), s.message())))?;
        accept(
            id,
            &key,
            &resp.into_inner().cert_chain,
            &mesh_roots,
            SystemTime::now(),
        )
        .map_err(|reason| err(format!("refused the CA's answer: {reason}")))
    }
}

/// The mesh roots from a PEM file (one or more certificates).
fn mesh_roots(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let what = |reason: String| format!("mesh root {}: {reason}", path.display());
    let pem = std::fs::read_to_string(path).map_err(|e| what(e.to_string()))?;
    let roots = pem_certs(&pem).map_err(what)?;
    if roots.is_empty() {
        return Err(what("no PEM certificate found".into()));
    }
    Ok(roots)
}

/// Checks a `CreateCertificate` answer for `id`, whose CSR carried `key`,
/// against `mesh_roots`, and builds the certificate from it: the leaf must
/// name `id`, hold `key`'s public key, and chain (through the intermediates
/// the answer carries) to one of `mesh_roots`. Peers are then checked
/// against `mesh_roots`, never against roots the CA merely sent.
fn accept(
    id: &Identity,
    key: &KeyPair,
    chain: &[String],
    mesh_roots: &[CertificateDer<'static>],
    now: SystemTime,
) -> Result<WorkloadCert, String> {
    let (last, rest) = chain.split_last().ok_or("the CA returned an empty chain")?;
    let mut certs = Vec::new();
    for pem in rest {
        certs.extend(pem_certs(pem)?);
    }
    let mut sent_roots = pem_certs(last)?;
    if certs.is_empty() {
        // A single element holds the leaf and then the roots.
        if sent_roots.is_empty() {
            return Err("the CA returned no certificate".into());
        }
        certs.push(sent_roots.remove(0));
    }
    let leaf = certs[0].clone();
    if super::tls::identity_of(&leaf).as_ref() != Some(id) {
        return Err("the certificate does not carry the requested identity".into());
    }
    let (_, x509) = x509_parser::parse_x509_certificate(&leaf).map_err(|e| e.to_string())?;
    let signed_key: &[u8] = x509.public_key().subject_public_key.as_ref();
    if signed_key != key.public_key_raw() {
        return Err("the certificate is for another key than the one in our CSR".into());
    }
    let to_time = |t: x509_parser::time::ASN1Time| {
        std::time::UNIX_EPOCH + Duration::from_secs(t.timestamp().max(0) as u64)
    };
    let (not_before, not_after) = (
        to_time(x509.validity().not_before),
        to_time(x509.validity().not_after),
    );

    let mut anchors = rustls::RootCertStore::empty();
    for root in mesh_roots {
        anchors
            .add(root.clone())
            .map_err(|e| format!("configured mesh root unusable: {e}"))?;
    }
    // Everything the CA sent besides the leaf may be a step on the way; only
    // the configured roots are trusted to end it.
    let intermediates: Vec<CertificateDer<'static>> =
        certs[1..].iter().chain(&sent_roots).cloned().collect();
    // Checked at a time inside the leaf's life, so a CA clock slightly ahead
    // of ours is not a broken chain; whether the leaf is usable now is the
    // certificate manager's call.
    let at = now.max(not_before);
    let at = UnixTime::since_unix_epoch(
        at.duration_since(std::time::UNIX_EPOCH)
            .map_err(|e| e.to_string())?,
    );
    let parsed = ParsedCertificate::try_from(&leaf).map_err(|e| e.to_string())?;
    rustls::client::verify_server_cert_signed_by_trust_anchor(
        &parsed,
        &anchors,
        &intermediates,
        at,
        super::tls::provider().signature_verification_algorithms.all,
    )
    .map_err(|e| format!("its chain does not lead to the configured mesh root ({e})"))?;

    Ok(WorkloadCert {
        identity: id.clone(),
        not_before,
        not_after,
        chain: certs,
        roots: mesh_roots.to_vec(),
        key: PrivatePkcs8KeyDer::from(key.serialize_der()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::LocalCa;

    fn csr(key: &KeyPair, id: &Identity) -> String {
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![SanType::URI(id.to_string().try_into().unwrap())];
        params.serialize_request(key).unwrap().pem().unwrap()
    }

    fn key() -> KeyPair {
        KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap()
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn an_answer_from_the_configured_root_is_taken_with_that_root_as_anchor() {
        let mesh = LocalCa::generate("cluster.local").unwrap();
        let id = Identity::new("cluster.local", "default", "web");
        let k = key();
        let chain = mesh.sign_csr(&csr(&k, &id), &id, HOUR).unwrap();
        let cert = accept(&id, &k, &chain, &[mesh.root().clone()], SystemTime::now()).unwrap();
        assert_eq!(cert.identity, id);
        assert_eq!(cert.chain.len(), 1);
        assert_eq!(cert.roots, [mesh.root().clone()]);
    }

    #[test]
    fn an_answer_whose_chain_leads_to_another_root_is_refused() {
        let mesh = LocalCa::generate("cluster.local").unwrap();
        let rogue = LocalCa::generate("cluster.local").unwrap();
        let id = Identity::new("cluster.local", "default", "web");
        let k = key();
        let roots = [mesh.root().clone()];
        // Leaf and root both from another CA: its own word for its root.
        let chain = rogue.sign_csr(&csr(&k, &id), &id, HOUR).unwrap();
        let err = accept(&id, &k, &chain, &roots, SystemTime::now()).unwrap_err();
        assert!(err.contains("configured mesh root"), "{err}");
        // The same leaf, claiming our root: the chain still does not verify.
        let claimed = vec![chain[0].clone(), mesh.root_pem().to_string()];
        let err = accept(&id, &k, &claimed, &roots, SystemTime::now()).unwrap_err();
        assert!(err.contains("configured mesh root"), "{err}");
    }

    #[test]
    fn an_answer_for_another_identity_or_key_is_refused() {
        let mesh = LocalCa::generate("cluster.local").unwrap();
        let roots = [mesh.root().clone()];
        let id = Identity::new("cluster.local", "default", "web");
        let other = Identity::new("cluster.local", "default", "db");
        let k = key();
        let chain = mesh.sign_csr(&csr(&k, &id), &other, HOUR).unwrap();
        let err = accept(&id, &k, &chain, &roots, SystemTime::now()).unwrap_err();
        assert!(err.contains("requested identity"), "{err}");
        let stolen = key();
        let chain = mesh.sign_csr(&csr(&stolen, &id), &id, HOUR).unwrap();
        let err = accept(&id, &k, &chain, &roots, SystemTime::now()).unwrap_err();
        assert!(err.contains("another key"), "{err}");
        let err = accept(&id, &k, &[], &roots, SystemTime::now()).unwrap_err();
        assert!(err.contains("empty chain"), "{err}");
    }

    #[test]
    fn a_mesh_root_file_without_a_certificate_is_a_clear_error() {
        let path = std::env::temp_dir().join(format!("ambit-meshroot-{}.pem", std::process::id()));
        std::fs::write(&path, "junk").unwrap();
        let err = mesh_roots(&path).unwrap_err();
        assert!(
            err.contains("no PEM certificate") && err.contains("ambit-meshroot"),
            "{err}"
        );
        std::fs::remove_file(&path).ok();
        assert!(mesh_roots(&path).unwrap_err().contains("mesh root"));
    }
}
