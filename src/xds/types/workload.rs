//! A workload: a pod (or VM) of the mesh as the state holds it, and the
//! local config file's form of it.

use serde::Deserialize;

use super::{
    ApplicationTunnel, BackedServices, GatewayAddress, GatewayDestination, HealthStatus, Ips,
    Locality, Name, NetworkMode, Protocol, TunnelToApp,
};
use crate::identity::Identity;

/// A pod (or VM) that can send and receive traffic.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(from = "WorkloadFile")]
pub struct Workload {
    pub uid: Name,
    pub name: Name,
    pub namespace: Name,
    pub service_account: Name,
    pub trust_domain: Name,
    pub workload_ips: Ips,
    pub protocol: Protocol,
    pub node: Name,
    pub network: Name,
    pub cluster_id: Name,
    pub canonical_name: Name,
    pub canonical_revision: Name,
    pub workload_name: Name,
    /// `deployment`, `cronjob`, `pod` or `job` (istiod's `workload_type`).
    pub workload_type: Name,
    pub status: HealthStatus,
    /// Services this workload backs: `"ns/hostname" → {service port: target port}`.
    pub services: BackedServices,
    pub authorization_policies: Box<[Name]>,
    /// Set for a workload reached by name instead of by address.
    pub hostname: Name,
    /// Traffic to this workload goes through this waypoint. (Boxed: a
    /// workload is held once per pod of the mesh, and a gateway is the
    /// largest of its fields.)
    pub waypoint: Option<Box<GatewayAddress>>,
    /// The workload terminates HBONE itself.
    pub native_tunnel: bool,
    /// What few workloads carry (a network gateway, an application
    /// tunnel, a capacity, extensions), boxed: `None` when none is set.
    /// Read through [`Workload::network_gateway`] and its siblings; a
    /// workload is held once per pod of the mesh, and without these it
    /// fits jemalloc's 224-byte class instead of 256.
    pub rare: Option<Box<Rare>>,
    pub locality: Locality,
    pub network_mode: NetworkMode,
}

/// A workload's rarely set fields.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rare {
    /// Reached from other networks through this gateway.
    pub network_gateway: Option<GatewayAddress>,
    pub application_tunnel: Option<ApplicationTunnel>,
    /// Relative weight when load balancing (istiod's `capacity`).
    pub capacity: Option<u32>,
    /// Names of extensions istiod attached (from xDS only).
    pub extensions: Box<[String]>,
}

impl Rare {
    /// Boxed, or `None` when nothing is set (so that equal workloads
    /// compare equal however they were made).
    pub fn boxed(self) -> Option<Box<Rare>> {
        (self != Rare::default()).then(|| Box::new(self))
    }
}

/// A workload as the local config file writes it (ztunnel's form): read
/// into a [`Workload`], its rare fields boxed.
#[derive(Deserialize)]
#[serde(rename = "Workload", rename_all = "camelCase", deny_unknown_fields)]
struct WorkloadFile {
    #[serde(default)]
    uid: Name,
    name: Name,
    namespace: Name,
    #[serde(default = "default_service_account")]
    service_account: Name,
    #[serde(default)]
    trust_domain: Name,
    #[serde(default)]
    workload_ips: Ips,
    #[serde(default)]
    protocol: Protocol,
    #[serde(default)]
    node: Name,
    #[serde(default)]
    network: Name,
    #[serde(default)]
    cluster_id: Name,
    #[serde(default)]
    canonical_name: Name,
    #[serde(default)]
    canonical_revision: Name,
    #[serde(default)]
    workload_name: Name,
    #[serde(default = "default_workload_type")]
    workload_type: Name,
    #[serde(default)]
    status: HealthStatus,
    #[serde(default)]
    services: BackedServices,
    #[serde(default)]
    authorization_policies: Box<[Name]>,
    #[serde(default)]
    hostname: Name,
    #[serde(default)]
    waypoint: Option<Box<GatewayAddress>>,
    #[serde(default)]
    network_gateway: Option<GatewayAddress>,
    #[serde(default)]
    native_tunnel: bool,
    #[serde(default)]
    application_tunnel: Option<ApplicationTunnel>,
    #[serde(default)]
    locality: Locality,
    #[serde(default)]
    network_mode: NetworkMode,
    #[serde(default)]
    capacity: Option<u32>,
}

impl From<WorkloadFile> for Workload {
    fn from(f: WorkloadFile) -> Workload {
        Workload {
            uid: f.uid,
            name: f.name,
            namespace: f.namespace,
            service_account: f.service_account,
            trust_domain: f.trust_domain,
            workload_ips: f.workload_ips,
            protocol: f.protocol,
            node: f.node,
            network: f.network,
            cluster_id: f.cluster_id,
            canonical_name: f.canonical_name,
            canonical_revision: f.canonical_revision,
            workload_name: f.workload_name,
            workload_type: f.workload_type,
            status: f.status,
            services: f.services,
            authorization_policies: f.authorization_policies,
            hostname: f.hostname,
            waypoint: f.waypoint,
            native_tunnel: f.native_tunnel,
            locality: f.locality,
            network_mode: f.network_mode,
            rare: Rare {
                network_gateway: f.network_gateway,
                application_tunnel: f.application_tunnel,
                capacity: f.capacity,
                extensions: Box::new([]),
            }
            .boxed(),
        }
    }
}

fn default_workload_type() -> Name {
    Name::intern("deployment")
}

fn default_service_account() -> Name {
    Name::intern("default")
}

impl Workload {
    /// The gateway that reaches it from other networks.
    pub fn network_gateway(&self) -> Option<&GatewayAddress> {
        self.rare.as_deref()?.network_gateway.as_ref()
    }

    /// How it wants tunnelled traffic handed to it.
    pub fn application_tunnel(&self) -> Option<ApplicationTunnel> {
        self.rare.as_deref()?.application_tunnel
    }

    /// istiod's `capacity`, if set.
    pub fn capacity(&self) -> Option<u32> {
        self.rare.as_deref()?.capacity
    }

    /// The extensions istiod attached.
    pub fn extensions(&self) -> &[String] {
        self.rare.as_deref().map_or(&[], |r| &r.extensions)
    }

    /// Why Ambit cannot serve this workload as istiod means it, if it
    /// cannot: such a workload is refused (NACKed), never routed around.
    pub fn unsupported(&self) -> Option<String> {
        if let Some(e) = self.extensions().first() {
            return Some(format!("extension {e:?} is not supported"));
        }
        // A network gateway is not refused: istiod names one on every
        // workload of a network that has one, the local network's too (WDS
        // is the same for every client), and a workload of the local
        // network is reached directly; another network's, through its
        // gateway (`proxy::route::gateway`), never dialled directly.
        // A PROXY tunnel is the header an HBONE inbound writes: a workload
        // that takes no HBONE could never be sent it.
        if let Some(t) = self.application_tunnel() {
            if t.protocol == TunnelToApp::Proxy && self.protocol != Protocol::Hbone {
                return Some(
                    "application tunnel PROXY on a workload that does not take HBONE".into(),
                );
            }
        }
        if let Some(GatewayAddress {
            destination: GatewayDestination::Address(a),
            ..
        }) = self.waypoint.as_deref()
        {
            if a.network == self.network && self.workload_ips.contains(&a.address) {
                return Some(format!("its waypoint {a} is the workload itself"));
            }
        }
        None
    }

    /// The SPIFFE identity this workload's certificate carries.
    pub fn identity(&self, default_trust_domain: &str) -> Identity {
        let td = if self.trust_domain.is_empty() {
            default_trust_domain
        } else {
            &self.trust_domain
        };
        Identity::new(td, &self.namespace, &self.service_account)
    }

    /// Its share when load balancing: istiod's `capacity`, 1 when unset, 0
    /// never chosen.
    pub fn weight(&self) -> u64 {
        u64::from(self.capacity().unwrap_or(1))
    }

    /// `canonical_name`, else the workload name, else the pod name.
    pub fn canonical_service(&self) -> &str {
        [&self.canonical_name, &self.workload_name, &self.name]
            .into_iter()
            .find(|s| !s.is_empty())
            .map(Name::as_str)
            .unwrap_or("unknown")
    }
}
