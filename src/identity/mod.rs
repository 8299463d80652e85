//! Workload identity: SPIFFE ids, the local CA, certificate rotation and the
//! rustls configurations HBONE uses. Builds on `config` only.

pub mod ca;
pub mod caclient;
pub mod manager;
pub mod spiffe;
pub mod tls;

pub use ca::{IdentityError, LocalCa, WorkloadCert};
pub use manager::{CertManager, CertSource, TlsHandle, TlsIdentity};
pub use spiffe::Identity;
