//! xDS resources as istiod sends them: each chunk of the input is the body
//! of one resource, an `istio.workload.Address` or an
//! `istio.security.Authorization`, applied through the client's `Held` as a
//! delta response is, then built into a state.
//!
//! Input: chunks of [kind byte: even Address, odd Authorization] [length,
//! u16 little-endian] [body]; a short last chunk takes what is left.
//!
//! The whole input is also read as a delta response, by the client's
//! `Delta` and by prost's `DeltaDiscoveryResponse`: both refuse it or both
//! read the same response.
//!
//! Checked beyond "no panic": a resource that converts is the same after a
//! trip through the wire types the control plane serves it with
//! (extensions aside: they are not served, and a resource with any is
//! refused); and the state finds each workload and service at its addresses.

#![no_main]

use ambit::proto::discovery::{DeltaDiscoveryResponse, Resource};
use ambit::proto::{security, workload};
use ambit::xds::client::Held;
use ambit::xds::convert::{self, AddressResource, ADDRESS_TYPE, AUTHORIZATION_TYPE};
use ambit::xds::delta::Delta;
use ambit_fuzz::check_state;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    match (Delta::decode(data), DeltaDiscoveryResponse::decode(data)) {
        (Ok(ours), Ok(prosts)) => assert_eq!(ours, Delta::from(prosts)),
        (Err(_), Err(_)) => {}
        (ours, prosts) => panic!("the client read {ours:?}, prost {prosts:?}"),
    }
    let mut addresses = Vec::new();
    let mut policies = Vec::new();
    for (i, (kind, body)) in chunks(data).into_iter().enumerate() {
        let (list, type_url) = if kind % 2 == 0 {
            address_round_trip(body);
            (&mut addresses, ADDRESS_TYPE)
        } else {
            authorization_round_trip(body);
            (&mut policies, AUTHORIZATION_TYPE)
        };
        list.push(Resource {
            name: format!("r{i}"),
            version: "1".into(),
            resource: Some(prost_types::Any {
                type_url: type_url.into(),
                value: body.to_vec(),
            }),
            ..Default::default()
        });
    }
    let mut held = Held::default();
    for (type_url, resources) in [(ADDRESS_TYPE, addresses), (AUTHORIZATION_TYPE, policies)] {
        held.apply(DeltaDiscoveryResponse {
            type_url: type_url.into(),
            resources,
            ..Default::default()
        });
    }
    let state = held.state();
    check_state(&state);
});

/// The input's (kind, body) chunks.
fn chunks(mut data: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    while let [kind, lo, hi, rest @ ..] = data {
        let len = usize::from(u16::from_le_bytes([*lo, *hi])).min(rest.len());
        let (body, tail) = rest.split_at(len);
        out.push((*kind, body));
        data = tail;
    }
    out
}

fn address_round_trip(body: &[u8]) {
    let Ok(received) = workload::Address::decode(body) else {
        return;
    };
    let Ok(mut held) = convert::address_from_proto(received) else {
        return;
    };
    let served = match &held {
        AddressResource::Workload(w) => convert::workload_to_proto(w),
        AddressResource::Service(s) => convert::service_to_proto(s),
    };
    let again = workload::Address::decode(served.encode_to_vec().as_slice())
        .expect("a served address decodes");
    let again = convert::address_from_proto(again).expect("a served address converts");
    match &mut held {
        AddressResource::Workload(w) => {
            // Served without its extensions (they are not served back).
            let w = std::sync::Arc::make_mut(w);
            if let Some(rare) = w.rare.take() {
                w.rare = ambit::xds::types::Rare {
                    extensions: Box::default(),
                    ..*rare
                }
                .boxed();
            }
        }
        AddressResource::Service(s) => std::sync::Arc::make_mut(s).extensions.clear(),
    }
    assert_eq!(again, held);
}

fn authorization_round_trip(body: &[u8]) {
    let Ok(received) = security::Authorization::decode(body) else {
        return;
    };
    let Ok(held) = convert::authorization_from_proto(received) else {
        return;
    };
    let served = convert::authorization_to_proto(&held);
    let again = security::Authorization::decode(served.encode_to_vec().as_slice())
        .expect("a served policy decodes");
    let again = convert::authorization_from_proto(again).expect("a served policy converts");
    assert_eq!(again, held);
}
