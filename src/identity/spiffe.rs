//! SPIFFE identities: `spiffe://<trust domain>/ns/<namespace>/sa/<service account>`.

use std::fmt;
use std::str::FromStr;

/// A workload identity as it appears in a certificate's URI SAN.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
}

impl Identity {
    pub fn new(trust_domain: &str, namespace: &str, service_account: &str) -> Self {
        Identity {
            trust_domain: trust_domain.to_string(),
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

/// Why a URI is not a workload identity.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{uri:?} is not a SPIFFE workload identity (spiffe://<td>/ns/<ns>/sa/<sa>)")]
pub struct NotAnIdentity {
    pub uri: String,
}

impl FromStr for Identity {
    type Err = NotAnIdentity;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || NotAnIdentity { uri: s.to_string() };
        let rest = s.strip_prefix("spiffe://").ok_or_else(err)?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            [td, "ns", ns, "sa", sa] if ![td, ns, sa].iter().any(|p| p.is_empty()) => {
                Ok(Identity::new(td, ns, sa))
            }
            _ => Err(err()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects() {
        let id: Identity = "spiffe://cluster.local/ns/default/sa/web".parse().unwrap();
        assert_eq!(id, Identity::new("cluster.local", "default", "web"));
        assert_eq!(id.to_string(), "spiffe://cluster.local/ns/default/sa/web");
        for bad in [
            "cluster.local/ns/a/sa/b",
            "spiffe://td/ns/a",
            "spiffe://td/ns//sa/b",
            "spiffe://td/ns/a/sa/b/c",
        ] {
            assert!(bad.parse::<Identity>().is_err(), "{bad}");
        }
    }
}
