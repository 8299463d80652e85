//! Generated protobuf types and gRPC services (see `build.rs`).

// The generated modules nest by package (`istio::workload::zds`, ...).
#[allow(clippy::all, missing_docs)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/protos.rs"));
}

/// Envoy's Node, package `envoy.config.core.v3`.
pub use generated::envoy::config::core::v3 as core;
/// Envoy delta xDS, package `envoy.service.discovery.v3`.
pub use generated::envoy::service::discovery::v3 as discovery;
/// `google.rpc.Status`.
pub use generated::google::rpc;
/// Istio authorization resources, package `istio.security`.
pub use generated::istio::security;
/// Istio's certificate service, package `istio.v1.auth`.
pub use generated::istio::v1::auth as ca;
/// Istio workload resources, package `istio.workload`.
pub use generated::istio::workload;
/// ZDS messages, package `istio.workload.zds`.
pub use generated::istio::workload::zds;

#[cfg(test)]
mod tests {
    use super::zds::*;
    use prost::Message;

    #[test]
    fn del_workload_uses_field_two() {
        let bytes = DelWorkload { uid: "u".into() }.encode_to_vec();
        assert_eq!(
            bytes,
            vec![0x12, 1, b'u'],
            "DelWorkload.uid is field 2 on the wire"
        );
        let req = WorkloadRequest {
            payload: Some(workload_request::Payload::Keep(KeepWorkload {
                uid: "u".into(),
            })),
        };
        assert_eq!(req.encode_to_vec()[0], 0x2a, "keep is field 5");
    }

    #[test]
    fn workload_uid_is_field_twenty() {
        let w = super::workload::Workload {
            uid: "u".into(),
            ..Default::default()
        };
        assert_eq!(
            w.encode_to_vec(),
            vec![0xa2, 0x01, 1, b'u'],
            "Workload.uid is field 20"
        );
    }
}
