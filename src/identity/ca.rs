//! The local CA: a root (cert + key) given as PEM files, or generated on first
//! start and kept in a state directory, that signs short-lived workload
//! certificates (ECDSA P-256, URI SAN = SPIFFE id).
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
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber, PKCS_ECDSA_P256_SHA256,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

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
        let (cert, key) = (dir.join(GENERATED_CERT), dir.join(GENERATED_KEY));
        if cert.exists() && key.exists() {
            return Self::from_files(&cert, &key);
        }
        let ca = Self::generate(trust_domain)?;
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
        tracing::info!(dir = %dir.display(), "generated a new local CA root");
        Ok(ca)
    }

    /// A fresh root in memory (ten years).
    pub fn generate(trust_domain: &str) -> Result<Self, IdentityError> {
        let sign_err = |e: rcgen::Error| IdentityError::Sign {
            identity: "local CA root".into(),
            reason: e.to_string(),
        };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(sign_err)?;
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::OrganizationName, trust_domain);
        params
            .distinguished_name
            .push(DnType::CommonName, "Ambit local CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
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

    /// Signs a certificate for `identity`, valid for `ttl` (backdated by a tenth of
    /// `ttl`, at most a minute, for clock skew).
    pub fn issue(&self, identity: &Identity, ttl: Duration) -> Result<WorkloadCert, IdentityError> {
        let sign_err = |reason: String| IdentityError::Sign {
            identity: identity.to_string(),
            reason,
        };
        let key =
            KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|e| sign_err(e.to_string()))?;
        let mut params = CertificateParams::default();
        let uri = identity
            .to_string()
            .try_into()
            .map_err(|e: rcgen::Error| sign_err(e.to_string()))?;
        params.subject_alt_names = vec![SanType::URI(uri)];
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
}

impl LocalCa {
    /// Signs a CSR for one workload identity of `trust_domain` (the SAN must be
    /// exactly that SPIFFE id, and equal `impersonated` when given); returns
    /// the chain as PEM, leaf first, root last.
    pub fn sign_csr(
        &self,
        csr_pem: &str,
        ttl: Duration,
        trust_domain: &str,
        impersonated: Option<&str>,
    ) -> Result<Vec<String>, IdentityError> {
        let err = |reason: String| IdentityError::Sign {
            identity: impersonated.unwrap_or("CSR").to_string(),
            reason,
        };
        let mut csr = rcgen::CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| err(format!("bad CSR: {e}")))?;
        let uris: Vec<String> = csr
            .params
            .subject_alt_names
            .iter()
            .filter_map(|s| match s {
                SanType::URI(u) => Some(u.as_str().to_string()),
                _ => None,
            })
            .collect();
        let [uri] = uris.as_slice() else {
            return Err(err(format!(
                "CSR must carry exactly one URI SAN, has {}",
                uris.len()
            )));
        };
        let id: Identity = uri
            .parse()
            .map_err(|e: super::spiffe::NotAnIdentity| err(e.to_string()))?;
        if id.trust_domain != trust_domain {
            return Err(err(format!("{id} is not in trust domain {trust_domain}")));
        }
        if let Some(want) = impersonated {
            if want != uri {
                return Err(err(format!(
                    "CSR names {uri} but ImpersonatedIdentity is {want}"
                )));
            }
        }
        let now = SystemTime::now();
        csr.params.not_before = (now - (ttl / 10).min(Duration::from_secs(60))).into();
        csr.params.not_after = (now + ttl).into();
        csr.params.is_ca = IsCa::NoCa;
        csr.params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        csr.params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        csr.params.serial_number =
            Some(SerialNumber::from_slice(&fastrand::u128(..).to_be_bytes()));
        let cert = csr
            .signed_by(&self.issuer)
            .map_err(|e| err(e.to_string()))?;
        Ok(vec![cert.pem(), self.root_pem.clone()])
    }

    /// A server certificate for DNS names / IPs (the control plane's own TLS).
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
