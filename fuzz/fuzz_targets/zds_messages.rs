//! ZDS packets both ways, decoded as the agent and the proxy decode them:
//! the proxy's hello and acks (proxy → agent) and the agent's Add, Keep,
//! Del and SnapshotSent requests (agent → proxy).
//!
//! Checked beyond "no panic": a message that decodes is the same after
//! encoding and decoding again, as each side re-sends what it builds.

#![no_main]

use ambit::proto::zds::{WorkloadRequest, WorkloadResponse, ZdsHello};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|packet: &[u8]| {
    round_trip::<ZdsHello>(packet);
    round_trip::<WorkloadRequest>(packet);
    round_trip::<WorkloadResponse>(packet);
});

fn round_trip<M: Message + Default + PartialEq>(packet: &[u8]) {
    let Ok(msg) = M::decode(packet) else {
        return;
    };
    let again = M::decode(msg.encode_to_vec().as_slice()).expect("a re-encoded message decodes");
    assert_eq!(again, msg);
}
