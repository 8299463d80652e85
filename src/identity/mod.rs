//! Workload identity: SPIFFE ids, the local CA, certificate rotation and the
//! rustls configurations HBONE uses. Imports no other part of Ambit.

mod ca;
pub(crate) mod caclient;
pub mod crl;
mod manager;
mod spiffe;
pub(crate) mod tls;

pub use ca::{
    pem, IdentityError, LocalCa, WorkloadCert, GENERATED_CERT, GENERATED_KEY,
    GENERATED_SERVING_CERT, GENERATED_SERVING_KEY,
};
pub use crl::Crls;
pub use manager::{CertManager, CertSource, PodLease, TlsHandle, TlsIdentity};
pub use spiffe::Identity;
pub use tls::{parse_tls12, set_compliance, set_tls12, Compliance};
