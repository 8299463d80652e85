//! The local CA: a root (cert + key) given as PEM files, or generated on first
//! start and kept in a state directory, that signs short-lived workload
//! certificates (ECDSA P-256, URI SAN = SPIFFE id). The same type holds the
//! control plane's serving root, which signs only the control plane's own TLS
//! certificate and is never a mesh root.
//!
//! What a certificate says is decided here, never by the requester: a CSR
//! lends only its public key (after its self-signature is checked); subject,
//! SANs, usages and lifetime come from the identity the caller was allowed.
//! Deciding *which* identity a caller may have is the caller's job (the
//! control plane's CA service).
//!
//! Workload keys are generated in memory and never written anywhere; the only
//! key that touches disk is the CA's own, created with mode 0600 in a 0700
//! directory.

use std::fmt;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber, PKCS_ECDSA_P256_SHA256,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use x509_parser::prelude::FromDer;

use super::spiffe::Identity;

/// Everything that can go wrong issuing or loading certificates.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("CA file {path}: {reason}")]
    CaFile { path: PathBuf, reason: String },
    #[error("signing a certificate for {identity}: {reason}")]
    Sign { identity: String, reason: String },
    #[error("TLS setup for {identity}: {reason}")]
    Tls { identity: String, reason: String },
}

/// A workload's certificate chain and private key. The key is never printed.
pub struct WorkloadCert {
    pub identity: Identity,
    /// Leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// Trust anchors peers' chains must lead to.
    pub roots: Vec<CertificateDer<'static>>,
    pub key: PrivatePkcs8KeyDer<'static>,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

impl fmt::Debug for WorkloadCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkloadCert")
            .field("identity", &self.identity.to_string())
            .field("chain_len", &self.chain.len())
            .field("not_before", &self.not_before)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl Clone for WorkloadCert {
    fn clone(&self) -> Self {
        WorkloadCert {
            identity: self.identity.clone(),
            chain: self.chain.clone(),
            roots: self.roots.clone(),
            key: self.key.clone_key(),
            not_before: self.not_before,
            not_after: self.not_after,
        }
    }
}

impl WorkloadCert {
    pub fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key.clone_key())
    }

    /// When this certificate should be replaced: half-way through its life.
    pub fn refresh_at(&self) -> SystemTime {
        let life = self
            .not_after
            .duration_since(self.not_before)
            .unwrap_or_default();
        self.not_before + life / 2
    }
}

/// A CA that signs workload certificates in-process.
pub struct LocalCa {
    issuer: Issuer<'static, KeyPair>,
    root_der: CertificateDer<'static>,
    root_pem: String,
}

impl fmt::Debug for LocalCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalCa").finish_non_exhaustive()
    }
}

/// File names of a generated root inside the state directory.
pub const GENERATED_CERT: &str = "ca-cert.pem";
pub const GENERATED_KEY: &str = "ca-key.pem";
/// File names of a generated control-plane serving root inside the state directory.
pub const GENERATED_SERVING_CERT: &str = "serving-ca-cert.pem";
pub const GENERATED_SERVING_KEY: &str = "serving-ca-key.pem";

impl LocalCa {
    /// Loads the root from PEM files.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, IdentityError> {
        let read = |p: &Path| {
            fs::read_to_string(p).map_err(|e| IdentityError::CaFile {
                path: p.into(),
                reason: e.to_string(),
            })
        };
        let (cert_pem, key_pem) = (read(cert)?, read(key)?);
        let key_pair = KeyPair::from_pem(&key_pem).map_err(|e| IdentityError::CaFile {
            path: key.into(),
            reason: format!(
                "not a PKCS#8 PEM private key ({e}); convert with `openssl pkcs8 -topk8 -nocrypt`"
            ),
        })?;
        let root_der = rustls_pemfile::certs(&mut cert_pem.as_bytes())
            .next()
            .and_then(Result::ok)
            .ok_or_else(|| IdentityError::CaFile {
                path: cert.into(),
                reason: "no PEM certificate found".into(),
            })?;
        let issuer =
            Issuer::from_ca_cert_pem(&cert_pem, key_pair).map_err(|e| IdentityError::CaFile {
                path: cert.into(),
                reason: e.to_string(),
            })?;
        Ok(LocalCa {
            issuer,
            root_der,
            root_pem: cert_pem,
        })
    }

    /// Loads the root kept in `dir`, generating and saving one on first start.
    pub fn load_or_generate(dir: &Path, trust_domain: &str) -> Result<Self, IdentityError> {
        Self::load_or_generate_as(dir, GENERATED_CERT, GENERATED_KEY, || {
            Self::generate(trust_domain)
        })
    }

    /// Loads the control plane's serving root kept in `dir`, generating and
    /// saving one on first start (beside, never instead of, the mesh root).
    pub fn load_or_generate_serving(dir: &Path) -> Result<Self, IdentityError> {
        Self::load_or_generate_as(
            dir,
            GENERATED_SERVING_CERT,
            GENERATED_SERVING_KEY,
            Self::generate_serving,
        )
    }

    fn load_or_generate_as(
        dir: &Path,
        cert_name: &str,
        key_name: &str,
        generate: impl FnOnce() -> Result<Self, IdentityError>,
    ) -> Result<Self, IdentityError> {
        let (cert, key) = (dir.join(cert_name), dir.join(key_name));
        if cert.exists() && key.exists() {
            return Self::from_files(&cert, &key);
        }
        let ca = generate()?;
        let dir_err = |e: std::io::Error| IdentityError::CaFile {
            path: dir.into(),
            reason: e.to_string(),
        };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(dir_err)?;
        write_new(&key, &ca.issuer.key().serialize_pem(), 0o600)?;
        write_new(&cert, &ca.root_pem, 0o644)?;
        tracing::info!(dir = %dir.display(), cert = cert_name, "generated a new root");
        Ok(ca)
    }

    /// A fresh mesh root in memory (ten years).
    pub fn generate(trust_domain: &str) -> Result<Self, IdentityError> {
        Self::generate_root(
            trust_domain,
            "Ambit local CA",
            BasicConstraints::Unconstrained,
        )
    }

    /// A fresh root for the control plane's own TLS certificate (ten years).
    /// It signs leaves only (path length 0) and carries no trust domain: the
    /// proxies trust it for the control-plane connection and nothing else.
    pub fn generate_serving() -> Result<Self, IdentityError> {
        Self::generate_root(
            "Ambit control plane",
            "Ambit control-plane serving CA",
            BasicConstraints::Constrained(0),
        )
    }

    fn generate_root(
        organization: &str,
        common_name: &str,
        constraints: BasicConstraints,
    ) -> Result<Self, IdentityError> {
        let sign_err = |e: rcgen::Error| IdentityError::Sign {
            identity: common_name.into(),
            reason: e.to_string(),
        };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(sign_err)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::OrganizationName, organization);
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(constraints);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(3650);
        let cert = params.self_signed(&key).map_err(sign_err)?;
        let root_pem = cert.pem();
        let root_der = cert.der().clone();
        Ok(LocalCa {
            issuer: Issuer::new(params, key),
            root_der,
            root_pem,
        })
    }

    /// Whether `other` signs with the same key: two roots that do are one
    /// authority, whatever their certificates say.
    pub fn same_key_as(&self, other: &LocalCa) -> bool {
        self.issuer.key().public_key_raw() == other.issuer.key().public_key_raw()
    }

    pub fn root(&self) -> &CertificateDer<'static> {
        &self.root_der
    }

    pub fn root_pem(&self) -> &str {
        &self.root_pem
    }

    /// The CA's private key as PKCS#8 PEM, for saving a generated root.
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// A revocation list (PEM) signed by this CA that revokes `revoked`
    /// (certificates it issued), next updated in `next_update`: what an
    /// operator of a local CA, or a test, hands to `crl_path`.
    pub fn revocation_list(
        &self,
        revoked: &[CertificateDer<'_>],
        next_update: Duration,
    ) -> Result<String, IdentityError> {
        let err = |reason: String| IdentityError::Sign {
            identity: "revocation list".into(),
            reason,
        };
        let now = time::OffsetDateTime::now_utc();
        let mut revoked_certs = Vec::new();
        for cert in revoked {
            let (_, x509) = x509_parser::certificate::X509Certificate::from_der(cert)
                .map_err(|e| err(format!("not a certificate: {e}")))?;
            revoked_certs.push(rcgen::RevokedCertParams {
                serial_number: SerialNumber::from_slice(x509.raw_serial()),
                revocation_time: now,
                reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                invalidity_date: None,
            });
        }
        let next = time::Duration::try_from(next_update).map_err(|e| err(e.to_string()))?;
        let params = rcgen::CertificateRevocationListParams {
            this_update: now - time::Duration::minutes(1),
            next_update: now + next,
            crl_number: SerialNumber::from(u64::try_from(now.unix_timestamp()).unwrap_or(1)),
            issuing_distribution_point: None,
            revoked_certs,
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        };
        let crl = params
            .signed_by(&self.issuer)
            .map_err(|e| err(e.to_string()))?;
        crl.pem().map_err(|e| err(e.to_string()))
    }

    /// Signs a certificate for `identity`, valid for `ttl` (backdated by a tenth of
    /// `ttl`, at most a minute, for clock skew).
    pub fn issue(&self, identity: &Identity, ttl: Duration) -> Result<WorkloadCert, IdentityError> {
        let sign_err = |reason: String| IdentityError::Sign {
            identity: identity.to_string(),
            reason,
        };
        let key =
            KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|e| sign_err(e.to_string()))?;
        let (params, not_before, not_after) =
            workload_params(identity, ttl).map_err(|e| sign_err(e.to_string()))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| sign_err(e.to_string()))?;
        Ok(WorkloadCert {
            identity: identity.clone(),
            chain: vec![cert.der().clone()],
            roots: vec![self.root_der.clone()],
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
            not_before,
            not_after,
        })
    }

    /// Signs the public key of a PEM CSR as `identity`, valid for `ttl`;
    /// returns the chain as PEM, leaf first, root last.
    ///
    /// The CSR must be signed by its own key (proof that the requester holds
    /// it), and lends nothing but that key: its subject, SANs, usages and
    /// extensions are ignored. The certificate names `identity` alone, so
    /// which identity that is must already have been decided by the caller.
    pub fn sign_csr(
        &self,
        csr_pem: &str,
        identity: &Identity,
        ttl: Duration,
    ) -> Result<Vec<String>, IdentityError> {
        let err = |reason: String| IdentityError::Sign {
            identity: identity.to_string(),
            reason,
        };
        let public_key = csr_public_key(csr_pem).map_err(&err)?;
        let (params, _, _) = workload_params(identity, ttl).map_err(|e| err(e.to_string()))?;
        let cert = params
            .signed_by(&public_key, &self.issuer)
            .map_err(|e| err(e.to_string()))?;
        Ok(vec![cert.pem(), self.root_pem.clone()])
    }
}

/// The public key of a PEM CSR whose self-signature verifies.
fn csr_public_key(csr_pem: &str) -> Result<rcgen::SubjectPublicKeyInfo, String> {
    let der = rustls_pemfile::csr(&mut csr_pem.as_bytes())
        .map_err(|e| format!("bad CSR: {e}"))?
        .ok_or("bad CSR: no PEM CERTIFICATE REQUEST found")?;
    let (_, csr) =
        x509_parser::certification_request::X509CertificationRequest::from_der(der.as_ref())
            .map_err(|e| format!("bad CSR: {e}"))?;
    csr.verify_signature().map_err(|e| {
        format!("the CSR's signature does not verify with the key it carries ({e})")
    })?;
    rcgen::SubjectPublicKeyInfo::from_der(csr.certification_request_info.subject_pki.raw)
        .map_err(|e| format!("the CSR's public key is not one this CA signs: {e}"))
}

/// What every workload certificate says: no subject, the SPIFFE id as the
/// only SAN (critical, since the subject is empty), a leaf for TLS client and
/// server, a random serial, valid from a little before now for `ttl`.
fn workload_params(
    identity: &Identity,
    ttl: Duration,
) -> Result<(CertificateParams, SystemTime, SystemTime), rcgen::Error> {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = vec![SanType::URI(identity.to_string().try_into()?)];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.serial_number = Some(SerialNumber::from_slice(&fastrand::u128(..).to_be_bytes()));
    let now = SystemTime::now();
    let not_before = now - (ttl / 10).min(Duration::from_secs(60));
    let not_after = now + ttl;
    params.not_before = not_before.into();
    params.not_after = not_after.into();
    Ok((params, not_before, not_after))
}

impl LocalCa {
    /// A server certificate for DNS names / IPs (the control plane's own TLS).
    /// Call it on the serving root, never on the mesh root: a mesh root that
    /// signed it would make the control plane's key a mesh credential.
    pub fn issue_server(
        &self,
        sans: &[String],
        ttl: Duration,
    ) -> Result<WorkloadCert, IdentityError> {
        let sign_err = |reason: String| IdentityError::Sign {
            identity: sans.join(","),
            reason,
        };
        let key =
            KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|e| sign_err(e.to_string()))?;
        let mut params =
            CertificateParams::new(sans.to_vec()).map_err(|e| sign_err(e.to_string()))?;
        params.is_ca = IsCa::ExplicitNoCa;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let now = SystemTime::now();
        params.not_before = (now - Duration::from_secs(60)).into();
        params.not_after = (now + ttl).into();
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| sign_err(e.to_string()))?;
        Ok(WorkloadCert {
            identity: Identity::new("", "", ""),
            chain: vec![cert.der().clone()],
            roots: vec![self.root_der.clone()],
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
            not_before: now,
            not_after: now + ttl,
        })
    }
}

/// Writes a file that must not exist yet with `mode`, via a temporary name.
/// `der` as one PEM item labelled `label` (`CERTIFICATE`, `PRIVATE KEY`,
/// …): base64 in lines of 64.
pub fn pem(label: &str, der: &[u8]) -> String {
    use base64::Engine as _;
    let body = base64::engine::general_purpose::STANDARD.encode(der);
    let mut pem = format!("-----BEGIN {label}-----\n");
    for line in body.as_bytes().chunks(64) {
        pem.push_str(&String::from_utf8_lossy(line));
        pem.push('\n');
    }
    pem.push_str(&format!("-----END {label}-----\n"));
    pem
}

fn write_new(path: &Path, contents: &str, mode: u32) -> Result<(), IdentityError> {
    let err = |e: std::io::Error| IdentityError::CaFile {
        path: path.into(),
        reason: e.to_string(),
    };
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(contents.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(err)?;
    fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn generated_root_is_kept_and_reloaded_with_narrow_permissions() {
        let dir = std::env::temp_dir().join(format!("ambit-ca-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let first = LocalCa::load_or_generate(&dir, "cluster.local").unwrap();
        let second = LocalCa::load_or_generate(&dir, "cluster.local").unwrap();
        assert_eq!(
            first.root(),
            second.root(),
            "second start must reuse the saved root"
        );
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join(GENERATED_KEY)), 0o600);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn workload_cert_carries_spiffe_san_and_short_life() {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let id = Identity::new("cluster.local", "default", "web");
        let cert = ca.issue(&id, Duration::from_secs(3600)).unwrap();
        let (_, x509) = x509_parser::parse_x509_certificate(&cert.chain[0]).unwrap();
        let san = x509.subject_alternative_name().unwrap().unwrap();
        let uris: Vec<String> = san
            .value
            .general_names
            .iter()
            .filter_map(|g| match g {
                x509_parser::extensions::GeneralName::URI(u) => Some(u.to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(uris, vec!["spiffe://cluster.local/ns/default/sa/web"]);
        let life = cert.not_after.duration_since(cert.not_before).unwrap();
        assert!(life <= Duration::from_secs(3660));
        assert!(
            !format!("{cert:?}").contains("key:"),
            "Debug must not print the key"
        );
    }

    /// A CSR for `key` that asks for far more than a workload may have: the
    /// control plane's DNS name, an IP, another identity, a subject, a CA bit.
    fn greedy_csr(key: &KeyPair) -> String {
        let mut params =
            CertificateParams::new(vec!["istiod.istio-system.svc".to_string()]).unwrap();
        params
            .subject_alt_names
            .push(SanType::IpAddress("10.0.0.1".parse().unwrap()));
        params.subject_alt_names.push(SanType::URI(
            "spiffe://cluster.local/ns/istio-system/sa/istiod"
                .try_into()
                .unwrap(),
        ));
        params.distinguished_name.push(DnType::CommonName, "istiod");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.serialize_request(key).unwrap().pem().unwrap()
    }

    #[test]
    fn a_csr_lends_its_key_and_nothing_else() {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
        let id = Identity::new("cluster.local", "default", "web");
        let chain = ca
            .sign_csr(&greedy_csr(&key), &id, Duration::from_secs(3600))
            .unwrap();
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[1], ca.root_pem(), "the root comes last");
        let leaf = rustls_pemfile::certs(&mut chain[0].as_bytes())
            .next()
            .unwrap()
            .unwrap();
        let (_, x509) = x509_parser::parse_x509_certificate(&leaf).unwrap();
        let san = x509.subject_alternative_name().unwrap().unwrap();
        assert_eq!(
            san.value.general_names,
            [x509_parser::extensions::GeneralName::URI(
                "spiffe://cluster.local/ns/default/sa/web"
            )],
            "only the granted SPIFFE id: no DNS, IP or other URI SAN from the CSR"
        );
        assert!(san.critical, "with an empty subject the SAN is critical");
        assert_eq!(
            x509.subject().iter().count(),
            0,
            "no subject copied from the CSR: {}",
            x509.subject()
        );
        assert!(!x509.is_ca(), "the CSR's CA bit is not honoured");
        let got: &[u8] = x509.public_key().subject_public_key.as_ref();
        assert_eq!(got, key.public_key_raw(), "the CSR's key is the one signed");
    }

    #[test]
    fn a_csr_not_signed_by_the_key_it_carries_is_refused() {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let (holder, victim) = (
            KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap(),
            KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap(),
        );
        // Signed by `holder`, but carrying `victim`'s public key.
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![SanType::URI(
            "spiffe://cluster.local/ns/default/sa/web"
                .try_into()
                .unwrap(),
        )];
        let mut der = params.serialize_request(&holder).unwrap().der().to_vec();
        let (ours, theirs) = (holder.public_key_raw(), victim.public_key_raw());
        let at = der
            .windows(ours.len())
            .position(|w| w == ours)
            .expect("the CSR carries its key");
        der[at..at + ours.len()].copy_from_slice(theirs);
        let pem = super::pem("CERTIFICATE REQUEST", &der);
        let id = Identity::new("cluster.local", "default", "web");
        let err = ca
            .sign_csr(&pem, &id, Duration::from_secs(3600))
            .unwrap_err()
            .to_string();
        assert!(err.contains("signature does not verify"), "{err}");
        let err = ca
            .sign_csr("not a CSR", &id, Duration::from_secs(3600))
            .unwrap_err()
            .to_string();
        assert!(err.contains("bad CSR"), "{err}");
    }

    #[test]
    fn the_serving_root_is_generated_beside_the_mesh_root_and_distinct() {
        let dir = std::env::temp_dir().join(format!("ambit-ca-serving-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mesh = LocalCa::load_or_generate(&dir, "cluster.local").unwrap();
        let serving = LocalCa::load_or_generate_serving(&dir).unwrap();
        assert!(!serving.same_key_as(&mesh) && mesh.same_key_as(&mesh));
        assert_ne!(serving.root(), mesh.root());
        let again = LocalCa::load_or_generate_serving(&dir).unwrap();
        assert_eq!(again.root(), serving.root(), "kept across restarts");
        assert!(dir.join(GENERATED_SERVING_KEY).exists() && dir.join(GENERATED_KEY).exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_key_file_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("ambit-ca-bad-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let (c, k) = (dir.join("c.pem"), dir.join("k.pem"));
        fs::write(&c, "junk").unwrap();
        fs::write(&k, "junk").unwrap();
        let err = LocalCa::from_files(&c, &k).unwrap_err().to_string();
        assert!(err.contains("k.pem") && err.contains("PKCS#8"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
