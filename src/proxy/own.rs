//! What a pod says of itself (the labels of its connections' metrics, the
//! `baggage` of its CONNECTs): its workload's fields as the state holds
//! them when a connection opens, so they follow a workload that arrives
//! after the pod, and each update of it.

use std::sync::Arc;

use super::hbone::Baggage;
use super::metrics::WorkloadLabels;
use super::pod::Pod;
use crate::xds::types::Workload;
use crate::xds::State;

/// What a pod says of itself: the labels of its connections' metrics and
/// the `baggage` header of every CONNECT its traffic sends.
#[derive(Debug)]
pub struct Own {
    /// The workload it is derived from; none for a pod the state does not list.
    pub workload: Option<Arc<Workload>>,
    pub labels: WorkloadLabels,
    pub baggage: http::HeaderValue,
}

impl Own {
    /// As the workload `w` says.
    pub fn of(w: &Arc<Workload>) -> Own {
        let labels = WorkloadLabels::of(w);
        // Named by its workload (`k8s.deployment.name=...`); one the
        // state gives no workload name is named as a pod.
        let (workload_type, workload_name) = match w.workload_name.as_str() {
            "" => ("pod", w.name.as_str()),
            name => (w.workload_type.as_str(), name),
        };
        let baggage = Baggage {
            cluster: &labels.cluster,
            namespace: &w.namespace,
            workload_type,
            workload_name,
            service: &labels.canonical_service,
            revision: &labels.canonical_revision,
            region: &w.locality.region,
            zone: &w.locality.zone,
        }
        .header();
        Own {
            workload: Some(w.clone()),
            labels,
            baggage,
        }
    }

    /// For a pod the state does not list (yet): named as a pod, its
    /// canonical service its name, revision `latest`, in the proxy's
    /// `cluster`, with no locality.
    pub fn unlisted(namespace: &str, name: &str, cluster: &str) -> Own {
        let labels = WorkloadLabels {
            workload: name.to_string(),
            namespace: namespace.to_string(),
            canonical_service: name.to_string(),
            canonical_revision: "latest".into(),
            cluster: cluster.to_string(),
            region: "unknown".into(),
            zone: "unknown".into(),
        };
        let baggage = Baggage {
            cluster,
            namespace,
            workload_type: "pod",
            workload_name: name,
            service: name,
            revision: "latest",
            region: "",
            zone: "",
        }
        .header();
        Own {
            workload: None,
            labels,
            baggage,
        }
    }
}

impl Pod {
    /// What the pod says of itself now: as its workload in `state` says
    /// (so its labels follow the workload when it arrives after the pod,
    /// as it usually does, and each update of it), else `unlisted`.
    /// Derived again only when the state's workload for it is a new one.
    pub fn own(&self, state: &State) -> Arc<Own> {
        let now = state.workload_by_name(&self.namespace, &self.name);
        let said = self.said.load();
        let same = match (now, &said.workload) {
            (Some(now), Some(then)) => Arc::ptr_eq(now, then),
            (None, None) => true,
            _ => false,
        };
        if same {
            return arc_swap::Guard::into_inner(said);
        }
        let fresh = match now {
            Some(w) => Arc::new(Own::of(w)),
            None => self.unlisted.clone(),
        };
        self.said.store(fresh.clone());
        fresh
    }
}
