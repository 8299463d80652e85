//! rustls configurations for HBONE: TLS 1.3 only, AES-GCM suites (on
//! aws-lc-rs, with post-quantum key exchange), ALPN `h2`,
//! client certificate required, no SNI, no session resumption; and the SPIFFE
//! checks on both sides (docs/wire.md §5).
//!
//! The server accepts only client chains that lead to our roots *and* carry a
//! SPIFFE id of our trust domain. The client verifies the server's chain in the
//! handshake and checks the server's identity against the expected list right
//! after it ([`verify_peer_identity`]), since that list is per connection.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
};

use super::ca::{IdentityError, WorkloadCert};
use super::crl::{Crls, Side};
use super::spiffe::Identity;
use crate::constants::HBONE_ALPN;

/// Which key exchanges TLS may use: Istio's `COMPLIANCE_POLICY`, as
/// ztunnel reads it (the same variable and value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compliance {
    /// The provider's groups, the post-quantum hybrid X25519MLKEM768 first:
    /// two proxies that both have it use it without being told, and a peer
    /// without it still connects over X25519 (the client sends a share of
    /// each, so no extra round trip).
    #[default]
    Default,
    /// `pqc`: X25519MLKEM768 only, in every role (HBONE both ways, the
    /// control plane and CA clients, `ambit control-plane`).
    Pqc,
}

impl Compliance {
    /// `COMPLIANCE_POLICY`'s value: empty or unset is the default, `pqc`
    /// the post-quantum policy. Istio's FIPS values are taken by a FIPS
    /// build (`--features fips`), whose every policy is FIPS; any other
    /// build refuses them, not ignores them: a proxy must not run as if it
    /// had a FIPS module it lacks.
    pub fn parse(value: &str) -> Result<Compliance, String> {
        match value.trim() {
            "" => Ok(Compliance::Default),
            "pqc" => Ok(Compliance::Pqc),
            "fips-140-2" | "fips-140-3" if cfg!(feature = "fips") => Ok(Compliance::Default),
            v @ ("fips-140-2" | "fips-140-3") => Err(format!(
                "COMPLIANCE_POLICY={v}: this build of Ambit has no FIPS module; use a FIPS build, or unset it"
            )),
            v => Err(format!(
                "COMPLIANCE_POLICY={v:?} is not a policy Ambit knows: use \"pqc\" (post-quantum key exchange only) or leave it unset"
            )),
        }
    }

    /// The groups this policy allows, by name, for messages.
    pub fn groups(self) -> String {
        provider_for(self)
            .kx_groups
            .iter()
            .map(|g| format!("{:?}", g.name()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

static COMPLIANCE: std::sync::OnceLock<Compliance> = std::sync::OnceLock::new();

/// Sets the process's policy, once, at start, before any TLS
/// configuration is built. rustls' process-wide default, which the
/// Kubernetes client uses, is aws-lc-rs with the default groups whatever
/// the policy: the API server is not part of the mesh (Istio applies the
/// policy to istiod, ztunnel and waypoints), and one built with Go before
/// 1.24 (Kubernetes before 1.33) has no X25519MLKEM768 to agree on.
pub fn set_compliance(policy: Compliance) {
    let _ = COMPLIANCE.set(policy);
    let _ = CryptoProvider::install_default(provider_for(Compliance::Default));
}

/// The process's policy (the default until [`set_compliance`]).
pub fn compliance() -> Compliance {
    COMPLIANCE.get().copied().unwrap_or_default()
}

/// `TLS12_ENABLED`'s value, as ztunnel reads it: `true` adds TLS 1.2;
/// empty, unset or `false` keeps TLS 1.3 alone. Anything else is refused
/// (ztunnel takes it as `false`), so a typo does not silently leave a
/// TLS 1.2 peer unable to connect.
pub fn parse_tls12(value: &str) -> Result<bool, String> {
    match value.trim() {
        "" | "false" => Ok(false),
        "true" => Ok(true),
        v => Err(format!(
            "TLS12_ENABLED={v:?}: use \"true\" (TLS 1.2 allowed beside 1.3) or \"false\""
        )),
    }
}

static TLS12: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Allows TLS 1.2 (`TLS12_ENABLED=true`) in every role the policy covers,
/// once, at start, before any TLS configuration is built.
pub fn set_tls12(enabled: bool) {
    let _ = TLS12.set(enabled);
}

/// Whether TLS 1.2 is allowed (off until [`set_tls12`]).
pub fn tls12() -> bool {
    TLS12.get().copied().unwrap_or(false)
}

/// aws-lc-rs with ztunnel's suites (TLS 1.3 AES-256-GCM, then AES-128-GCM;
/// with `TLS12_ENABLED`, its four TLS 1.2 ones after them) and the
/// process's key-exchange policy.
pub fn provider() -> Arc<CryptoProvider> {
    let p = provider_for(compliance());
    Arc::new(if tls12() { with_tls12(p) } else { p })
}

/// `p` with the TLS 1.2 suites ztunnel adds for `TLS12_ENABLED`: ECDHE
/// with AES-GCM, for ECDSA and RSA keys (all FIPS-approved). TLS 1.2 has no
/// post-quantum key exchange: under `COMPLIANCE_POLICY=pqc` no TLS 1.2
/// handshake can complete, as in ztunnel.
pub fn with_tls12(mut p: CryptoProvider) -> CryptoProvider {
    use rustls::crypto::aws_lc_rs::cipher_suite;
    p.cipher_suites.extend([
        cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        cipher_suite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        cipher_suite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
    ]);
    p
}

/// The TLS versions a configuration on `provider` allows: those it has a
/// suite for (1.3; 1.2 too after [`with_tls12`]).
pub fn versions(provider: &CryptoProvider) -> &'static [&'static rustls::SupportedProtocolVersion] {
    use rustls::version::{TLS12, TLS13};
    static BOTH: &[&rustls::SupportedProtocolVersion] = &[&TLS13, &TLS12];
    let has = |v| provider.cipher_suites.iter().any(|s| s.version() == v);
    match (has(&TLS13), has(&TLS12)) {
        (true, true) => BOTH,
        (false, true) => &BOTH[1..],
        _ => &BOTH[..1],
    }
}

/// [`provider`] under `policy`. A FIPS build starts from aws-lc's FIPS
/// module, whose groups are the FIPS-approved ones (X25519MLKEM768,
/// P-256, P-384; not X25519); both suites are approved.
pub fn provider_for(policy: Compliance) -> CryptoProvider {
    use rustls::crypto::aws_lc_rs::{cipher_suite, kx_group};
    #[cfg(feature = "fips")]
    let mut p = rustls::crypto::default_fips_provider();
    #[cfg(not(feature = "fips"))]
    let mut p = rustls::crypto::aws_lc_rs::default_provider();
    p.cipher_suites = vec![
        cipher_suite::TLS13_AES_256_GCM_SHA384,
        cipher_suite::TLS13_AES_128_GCM_SHA256,
    ];
    if policy == Compliance::Pqc {
        p.kx_groups = vec![kx_group::X25519MLKEM768];
    }
    p
}

/// The SPIFFE id in a certificate's URI SAN, if any.
pub fn identity_of(cert: &CertificateDer<'_>) -> Option<Identity> {
    let (_, x509) = x509_parser::parse_x509_certificate(cert).ok()?;
    let san = x509.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|g| match g {
        x509_parser::extensions::GeneralName::URI(u) => u.parse().ok(),
        _ => None,
    })
}

/// The trust anchors of `cert`'s mesh.
pub fn roots(cert: &WorkloadCert) -> Result<RootCertStore, IdentityError> {
    let mut store = RootCertStore::empty();
    for root in &cert.roots {
        store.add(root.clone()).map_err(|e| tls_err(cert, e))?;
    }
    Ok(store)
}

fn tls_err(cert: &WorkloadCert, e: impl std::fmt::Display) -> IdentityError {
    IdentityError::Tls {
        identity: cert.identity.to_string(),
        reason: e.to_string(),
    }
}

/// Server side of HBONE for the workload holding `cert`; with `crls`, a
/// client chain they revoke is refused.
pub fn server_config(
    cert: &WorkloadCert,
    crls: Option<&Arc<Crls>>,
) -> Result<ServerConfig, IdentityError> {
    server_config_on(cert, crls, provider())
}

/// [`server_config`] on `provider`.
pub(crate) fn server_config_on(
    cert: &WorkloadCert,
    crls: Option<&Arc<Crls>>,
    provider: Arc<CryptoProvider>,
) -> Result<ServerConfig, IdentityError> {
    let roots = Arc::new(roots(cert)?);
    let inner = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| tls_err(cert, e))?;
    let verifier = Arc::new(TrustDomainVerifier {
        inner,
        trust_domain: cert.identity.trust_domain.clone(),
        crls: crls.map(|c| Revocation {
            crls: c.clone(),
            roots,
            algs: provider.signature_verification_algorithms,
        }),
    });
    let versions = versions(&provider);
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|e| tls_err(cert, e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(cert.chain.clone(), cert.private_key())
        .map_err(|e| tls_err(cert, e))?;
    cfg.alpn_protocols = vec![HBONE_ALPN.to_vec()];
    cfg.send_tls13_tickets = 0;
    cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    // The data path's record layer takes the keys after the handshake.
    cfg.enable_secret_extraction = true;
    Ok(cfg)
}

/// Client side of HBONE for the workload holding `cert`; with `crls`, a
/// server chain they revoke is refused.
pub fn client_config(
    cert: &WorkloadCert,
    crls: Option<&Arc<Crls>>,
) -> Result<ClientConfig, IdentityError> {
    client_config_on(cert, crls, provider())
}

/// [`client_config`] on `provider`.
pub(crate) fn client_config_on(
    cert: &WorkloadCert,
    crls: Option<&Arc<Crls>>,
    provider: Arc<CryptoProvider>,
) -> Result<ClientConfig, IdentityError> {
    let roots = Arc::new(roots(cert)?);
    let algs = provider.signature_verification_algorithms;
    let verifier = Arc::new(ChainVerifier {
        roots: roots.clone(),
        algs,
        crls: crls.map(|c| Revocation {
            crls: c.clone(),
            roots,
            algs,
        }),
    });
    let versions = versions(&provider);
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|e| tls_err(cert, e))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(cert.chain.clone(), cert.private_key())
        .map_err(|e| tls_err(cert, e))?;
    cfg.alpn_protocols = vec![HBONE_ALPN.to_vec()];
    cfg.enable_sni = false;
    cfg.resumption = rustls::client::Resumption::disabled();
    // The data path's record layer takes the keys after the handshake.
    cfg.enable_secret_extraction = true;
    Ok(cfg)
}

/// The name handed to rustls on connect; never sent (SNI is off) nor checked.
pub fn hbone_server_name() -> ServerName<'static> {
    ServerName::IpAddress(std::net::Ipv4Addr::UNSPECIFIED.into())
}

/// Why a peer's identity was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PeerIdentityError {
    #[error("peer presented no certificate with a SPIFFE identity")]
    Missing,
    #[error("peer identity {got} is not one of the expected {expected}")]
    Unexpected { got: String, expected: String },
}

/// Checks the peer's leaf certificate names one of `expected`.
pub fn verify_peer_identity(
    peer: Option<&[CertificateDer<'_>]>,
    expected: &[Identity],
) -> Result<Identity, PeerIdentityError> {
    let got = peer
        .and_then(|c| c.first())
        .and_then(identity_of)
        .ok_or(PeerIdentityError::Missing)?;
    if expected.contains(&got) {
        Ok(got)
    } else {
        Err(PeerIdentityError::Unexpected {
            got: got.to_string(),
            expected: expected
                .iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }
}

/// What a verifier checks revocation with.
#[derive(Debug)]
struct Revocation {
    crls: Arc<Crls>,
    roots: Arc<RootCertStore>,
    algs: WebPkiSupportedAlgorithms,
}

impl Revocation {
    fn check(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        side: Side,
        now: UnixTime,
    ) -> Result<(), rustls::Error> {
        self.crls.check(
            (end_entity, intermediates),
            &self.roots,
            &self.algs,
            side,
            now,
        )
    }
}

/// Client certificates must chain to our roots, carry our trust domain and
/// not be revoked.
#[derive(Debug)]
struct TrustDomainVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    trust_domain: String,
    crls: Option<Revocation>,
}

impl ClientCertVerifier for TrustDomainVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if let Some(r) = &self.crls {
            r.check(end_entity, intermediates, Side::Inbound, now)?;
        }
        match identity_of(end_entity) {
            Some(id) if id.trust_domain == self.trust_domain => Ok(ClientCertVerified::assertion()),
            _ => Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Server chains must lead to our roots and not be revoked; the name is
/// checked after the handshake.
#[derive(Debug)]
struct ChainVerifier {
    roots: Arc<RootCertStore>,
    algs: WebPkiSupportedAlgorithms,
    crls: Option<Revocation>,
}

impl ServerCertVerifier for ChainVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algs.all,
        )?;
        if let Some(r) = &self.crls {
            r.check(end_entity, intermediates, Side::Outbound, now)?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

/// One HBONE TLS handshake over a pipe, `client` to `server`, each with its
/// own revocation lists; the client's identity as the server saw it, or
/// why either side refused. For tests here and in `crl`.
#[cfg(test)]
pub(crate) async fn test_handshake(
    server: &WorkloadCert,
    server_crls: Option<&Arc<Crls>>,
    client: &WorkloadCert,
    client_crls: Option<&Arc<Crls>>,
) -> Result<Option<Identity>, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (a, b) = tokio::io::duplex(64 * 1024);
    let acceptor =
        tokio_rustls::TlsAcceptor::from(Arc::new(server_config(server, server_crls).unwrap()));
    let connector =
        tokio_rustls::TlsConnector::from(Arc::new(client_config(client, client_crls).unwrap()));
    let srv = tokio::spawn(async move {
        let mut s = acceptor.accept(a).await.map_err(|e| e.to_string())?;
        let peer = s
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(identity_of);
        let mut buf = [0u8; 1];
        s.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(peer)
    });
    match connector.connect(hbone_server_name(), b).await {
        Ok(mut c) => {
            let _ = c.write_all(b"x").await;
            let _ = c.flush().await;
            srv.await.unwrap()
        }
        Err(e) => {
            srv.abort();
            Err(e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::ca::LocalCa;
    use std::time::Duration;

    async fn handshake(
        server: &WorkloadCert,
        client: &WorkloadCert,
    ) -> Result<Option<Identity>, String> {
        test_handshake(server, None, client, None).await
    }

    /// A handshake between a server and a client on these providers: the
    /// key-exchange group and suite the client's connection negotiated.
    async fn negotiated(
        server: CryptoProvider,
        client: CryptoProvider,
    ) -> Result<(rustls::NamedGroup, rustls::CipherSuite), String> {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let ttl = Duration::from_secs(600);
        let s = ca
            .issue(&Identity::new("cluster.local", "ns", "server"), ttl)
            .unwrap();
        let c = ca
            .issue(&Identity::new("cluster.local", "ns", "client"), ttl)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(
            server_config_on(&s, None, Arc::new(server)).unwrap(),
        ));
        let connector = tokio_rustls::TlsConnector::from(Arc::new(
            client_config_on(&c, None, Arc::new(client)).unwrap(),
        ));
        let (a, b) = tokio::io::duplex(64 * 1024);
        let srv = tokio::spawn(async move { acceptor.accept(a).await.map(|_| ()) });
        let conn = connector.connect(hbone_server_name(), b).await;
        let served = srv.await.unwrap();
        let conn = conn.map_err(|e| e.to_string())?;
        served.map_err(|e| e.to_string())?;
        let tls = conn.get_ref().1;
        Ok((
            tls.negotiated_key_exchange_group().unwrap().name(),
            tls.negotiated_cipher_suite().unwrap().suite(),
        ))
    }

    /// A peer limited to X25519, as one without post-quantum groups.
    fn x25519_only() -> CryptoProvider {
        let mut p = provider_for(Compliance::Default);
        p.kx_groups = vec![rustls::crypto::aws_lc_rs::kx_group::X25519];
        p
    }

    // X25519, which a default build offers, is not FIPS-approved.
    #[cfg(not(feature = "fips"))]
    #[tokio::test]
    async fn key_exchange_is_post_quantum_by_default_and_only_that_under_pqc() {
        use rustls::{CipherSuite, NamedGroup};
        let (default, pqc) = (
            || provider_for(Compliance::Default),
            || provider_for(Compliance::Pqc),
        );
        let hybrid = Ok((
            NamedGroup::X25519MLKEM768,
            CipherSuite::TLS13_AES_256_GCM_SHA384,
        ));
        // Two proxies on the default get the hybrid without being told.
        assert_eq!(negotiated(default(), default()).await, hybrid);
        // A peer limited to the hybrid is served under either policy.
        assert_eq!(negotiated(default(), pqc()).await, hybrid);
        assert_eq!(negotiated(pqc(), default()).await, hybrid);
        assert_eq!(negotiated(pqc(), pqc()).await, hybrid);
        // A peer without it still connects under the default...
        assert_eq!(
            negotiated(default(), x25519_only()).await,
            Ok((NamedGroup::X25519, CipherSuite::TLS13_AES_256_GCM_SHA384))
        );
        assert_eq!(
            negotiated(x25519_only(), default()).await.map(|n| n.0),
            Ok(NamedGroup::X25519)
        );
        // ...and is refused under pqc, either way round.
        for refused in [
            negotiated(pqc(), x25519_only()).await,
            negotiated(x25519_only(), pqc()).await,
        ] {
            let err = refused.unwrap_err();
            assert!(
                err.contains("NoKxGroupsInCommon") || err.contains("HandshakeFailure"),
                "{err}"
            );
        }
    }

    /// A FIPS build (`--features fips`, run by .ci/run): every TLS
    /// configuration is on aws-lc's FIPS module and says so; two proxies
    /// agree on the post-quantum hybrid (FIPS-approved here), a peer on
    /// P-256 is served, and one offering only X25519 (not approved) is
    /// refused.
    #[cfg(feature = "fips")]
    #[tokio::test]
    async fn a_fips_build_is_fips_in_every_role_and_refuses_what_fips_does_not() {
        use rustls::crypto::aws_lc_rs::kx_group;
        use rustls::{CipherSuite, NamedGroup};
        assert!(provider().fips());
        let ca = LocalCa::generate("cluster.local").unwrap();
        let cert = ca
            .issue(
                &Identity::new("cluster.local", "ns", "a"),
                Duration::from_secs(600),
            )
            .unwrap();
        assert!(server_config(&cert, None).unwrap().fips());
        assert!(client_config(&cert, None).unwrap().fips());
        let fips = || provider_for(Compliance::Default);
        assert_eq!(
            negotiated(fips(), fips()).await,
            Ok((
                NamedGroup::X25519MLKEM768,
                CipherSuite::TLS13_AES_256_GCM_SHA384
            ))
        );
        let mut p256 = fips();
        p256.kx_groups = vec![kx_group::SECP256R1];
        assert_eq!(
            negotiated(fips(), p256).await.map(|n| n.0),
            Ok(NamedGroup::secp256r1)
        );
        assert!(negotiated(fips(), x25519_only()).await.is_err());
        assert!(negotiated(x25519_only(), fips()).await.is_err());
    }

    #[test]
    fn compliance_policy_values_are_istios_and_the_fips_ones_are_refused_here() {
        assert_eq!(Compliance::parse(""), Ok(Compliance::Default));
        assert_eq!(Compliance::parse("pqc"), Ok(Compliance::Pqc));
        assert_eq!(Compliance::Pqc.groups(), "X25519MLKEM768");
        let default = if cfg!(feature = "fips") {
            "X25519MLKEM768, secp256r1, secp384r1"
        } else {
            "X25519MLKEM768, X25519"
        };
        assert!(
            Compliance::Default.groups().starts_with(default),
            "{}",
            Compliance::Default.groups()
        );
        for v in ["fips-140-2", "fips-140-3"] {
            if cfg!(feature = "fips") {
                assert_eq!(Compliance::parse(v), Ok(Compliance::Default));
            } else {
                assert!(Compliance::parse(v).unwrap_err().contains("no FIPS module"));
            }
        }
        for v in ["PQC", "pq", "yes"] {
            assert!(Compliance::parse(v).unwrap_err().contains("not a policy"));
        }
    }

    #[tokio::test]
    async fn same_ca_same_trust_domain_is_accepted_with_peer_identity() {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let s = ca
            .issue(
                &Identity::new("cluster.local", "ns", "server"),
                Duration::from_secs(600),
            )
            .unwrap();
        let c = ca
            .issue(
                &Identity::new("cluster.local", "ns", "client"),
                Duration::from_secs(600),
            )
            .unwrap();
        let peer = handshake(&s, &c).await.unwrap();
        assert_eq!(
            peer.unwrap().to_string(),
            "spiffe://cluster.local/ns/ns/sa/client"
        );
    }

    #[tokio::test]
    async fn other_ca_or_other_trust_domain_is_refused() {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let other = LocalCa::generate("cluster.local").unwrap();
        let s = ca
            .issue(
                &Identity::new("cluster.local", "ns", "server"),
                Duration::from_secs(600),
            )
            .unwrap();
        let foreign_ca = other
            .issue(
                &Identity::new("cluster.local", "ns", "client"),
                Duration::from_secs(600),
            )
            .unwrap();
        assert!(handshake(&s, &foreign_ca).await.is_err());
        let foreign_td = ca
            .issue(
                &Identity::new("evil.example", "ns", "client"),
                Duration::from_secs(600),
            )
            .unwrap();
        assert!(handshake(&s, &foreign_td).await.is_err());
    }

    #[test]
    fn peer_identity_must_be_expected() {
        let ca = LocalCa::generate("cluster.local").unwrap();
        let id = Identity::new("cluster.local", "ns", "server");
        let s = ca.issue(&id, Duration::from_secs(600)).unwrap();
        assert_eq!(
            verify_peer_identity(Some(&s.chain), std::slice::from_ref(&id)).unwrap(),
            id
        );
        let other = Identity::new("cluster.local", "ns", "other");
        assert!(matches!(
            verify_peer_identity(Some(&s.chain), &[other]),
            Err(PeerIdentityError::Unexpected { .. })
        ));
        assert_eq!(
            verify_peer_identity(None, &[id]),
            Err(PeerIdentityError::Missing)
        );
    }
}
