//! `/config_dump` on the admin port: the state, certificates, pool and
//! served pods as JSON. Read-only; built per request from snapshots.

use super::{inpod, pool};
use crate::identity::CertManager;
use crate::xds::StateHandle;

pub(super) fn config_dump(
    state: &StateHandle,
    certs: &CertManager,
    pool: &pool::Pool,
    pods: &inpod::PodTable,
) -> String {
    let st = state.load();
    let workloads: Vec<_> = st
        .workloads()
        .map(|w| serde_json::json!({"uid": w.uid, "name": w.name, "namespace": w.namespace, "serviceAccount": w.service_account,
            "workloadIps": w.workload_ips, "protocol": format!("{:?}", w.protocol).to_uppercase()}))
        .collect();
    let services: Vec<_> = st
        .services()
        .map(|s| {
            serde_json::json!({"name": s.name, "namespace": s.namespace, "hostname": s.hostname,
            "vips": s.vips.iter().map(|v| v.to_string()).collect::<Vec<_>>(), "ports": s.ports})
        })
        .collect();
    let policies: Vec<_> = st.policies().map(|p| p.key()).collect();
    let certificates: Vec<_> = certs
        .summary()
        .into_iter()
        .map(|(id, exp)| {
            let secs = exp
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            serde_json::json!({"identity": id, "expiresUnix": secs})
        })
        .collect();
    let served: Vec<_> = pods
        .views()
        .into_iter()
        .map(|p| {
            let cert = certificates
                .iter()
                .find(|c| c["identity"] == p.identity)
                .cloned();
            serde_json::json!({
                "uid": p.uid, "name": p.name, "namespace": p.namespace, "identity": p.identity,
                "ips": p.ips, "netns": {"dev": p.netns.0, "ino": p.netns.1}, "addedUnix": p.added_unix,
                // Serving with its certificate, or still waiting for it from the CA.
                "state": if cert.is_some() { "serving" } else { "certificate pending" },
                "certificateExpiresUnix": cert.map(|c| c["expiresUnix"].clone()),
            })
        })
        .collect();
    serde_json::json!({
        "workloads": workloads, "services": services, "policies": policies, "certificates": certificates,
        "pool": {"open": pool.open(), "dials": pool.dials()},
        "pods": served,
    })
    .to_string()
}
