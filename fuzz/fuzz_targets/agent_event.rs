//! The body the CNI plugin POSTs to the agent's `/cmdadd`, through the
//! agent's `parse_add_event`.
//!
//! Checked beyond "no panic": an event the agent reads, written again as
//! the plugin writes events, reads back the same.

#![no_main]

use ambit::cni::agent::parse_add_event;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let Ok(event) = parse_add_event(body) else {
        return;
    };
    let resent = serde_json::to_vec(&event).expect("an event serializes");
    let again = parse_add_event(&resent).expect("a re-sent event parses");
    assert_eq!(again, event);
});
