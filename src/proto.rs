//! Generated protobuf types (see `build.rs`).

/// ZDS messages, package `istio.workload.zds`.
pub mod zds {
    include!(concat!(env!("OUT_DIR"), "/istio.workload.zds.rs"));
}

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
}
