//! Conversion tests: round trips, and decodes of wire bytes written from
//! Istio's field numbers.

use super::*;
use std::path::Path;

#[test]
fn local_config_round_trips_through_the_wire_types() {
    let st = crate::xds::local::parse(
        Path::new("t.yaml"),
        r#"
workloads:
- {uid: u1, name: a, namespace: n, serviceAccount: sa, workloadIps: [10.0.0.1, "fd00::1"], protocol: HBONE, services: {"n/s.n.svc.cluster.local": {80: 8080}},
   waypoint: {destination: "n/wp.n.svc.cluster.local", hboneMtlsPort: 15009}, workloadType: job, nativeTunnel: true,
   locality: {region: r, zone: z}, capacity: 3, applicationTunnel: {protocol: NONE, port: 15088}}
- {uid: u2, name: h, namespace: n, workloadIps: [10.0.0.2], networkMode: HOST_NETWORK}
services:
- {name: s, namespace: n, hostname: s.n.svc.cluster.local, vips: ["/10.96.0.1"], ports: {80: 8080}, subjectAltNames: ["spiffe://td/ns/n/sa/x"],
   waypoint: {destination: "/10.0.0.9"}, appProtocols: {80: HTTP2}, canonical: true, ipFamilies: DUAL,
   loadBalancer: {healthPolicy: ONLY_HEALTHY}}
- {name: w, namespace: n, hostname: w.n.svc.cluster.local, vips: ["/10.96.0.2"], ports: {80: 8080}, ingressUseWaypoint: true,
   weightedWaypoints: [{destination: "/10.0.0.9", weight: 2}, {destination: "n/wp.n.svc.cluster.local", hboneMtlsPort: 15009, weight: 1}]}
policies:
- {name: p, namespace: n, action: Deny, rules: [[[{namespaces: [!Exact x], sourceIps: [10.0.0.0/8], destinationPorts: [22]}]]]}
"#,
    )
    .unwrap();
    for w in st.workloads() {
        match address_from_proto(workload_to_proto(w)).unwrap() {
            AddressResource::Workload(back) => assert_eq!(back.as_ref(), w.as_ref()),
            other => panic!("{other:?}"),
        }
    }
    for s in st.services() {
        assert_eq!(
            address_from_proto(service_to_proto(s)).unwrap(),
            AddressResource::Service(Arc::new(s.as_ref().clone()))
        );
    }
    for p in st.policies() {
        assert_eq!(
            &authorization_from_proto(authorization_to_proto(p)).unwrap(),
            p.as_ref()
        );
    }
}

#[test]
fn bad_resources_are_named() {
    let w = pb::Workload {
        uid: "u".into(),
        addresses: vec![vec![1, 2, 3]],
        ..Default::default()
    };
    assert!(workload_from_proto(w).unwrap_err().contains("3 bytes"));
    let w = pb::Workload {
        uid: "u".into(),
        tunnel_protocol: 2,
        ..Default::default()
    };
    assert!(workload_from_proto(w).unwrap_err().contains("LEGACY"));
    assert!(address_from_proto(pb::Address { r#type: None }).is_err());
}

/// Protobuf wire bytes written by hand from Istio's field numbers, so
/// the decode is checked against istiod's numbering, not our encoder.
mod wire {
    pub fn varint(mut v: u64) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return out;
            }
            out.push(b | 0x80);
        }
    }
    pub fn num(field: u64, v: u64) -> Vec<u8> {
        [varint(field << 3), varint(v)].concat()
    }
    pub fn bytes(field: u64, b: &[u8]) -> Vec<u8> {
        [varint(field << 3 | 2), varint(b.len() as u64), b.to_vec()].concat()
    }
}

fn decode(bytes: Vec<u8>) -> Result<AddressResource, String> {
    use prost::Message;
    address_from_proto(pb::Address::decode(bytes.as_slice()).map_err(|e| e.to_string())?)
}

#[test]
fn every_workload_field_decodes_from_istios_field_numbers() {
    use wire::{bytes, num};
    let waypoint = [
        bytes(2, &[bytes(1, b"net1"), bytes(2, &[10, 0, 0, 9])].concat()),
        num(3, 15009),
    ]
    .concat();
    let workload = [
        bytes(20, b"uid-1"),
        bytes(1, b"api-0"),
        bytes(2, b"shop"),
        bytes(3, &[10, 0, 0, 3]),
        bytes(21, b"api-0.shop"),
        bytes(4, b"net1"),
        num(5, 1),
        bytes(7, b"api"),
        bytes(8, &waypoint),
        num(12, 2),
        bytes(13, b"api"),
        num(14, 1),
        bytes(23, &[num(1, 0), num(2, 15088)].concat()),
        bytes(
            24,
            &[
                bytes(1, b"eu-west"),
                bytes(2, b"eu-west-1a"),
                bytes(3, b"rack7"),
            ]
            .concat(),
        ),
        num(25, 1),
        bytes(27, &num(1, 4)),
    ]
    .concat();
    let AddressResource::Workload(w) = decode(bytes(1, &workload)).unwrap() else {
        panic!("not a workload");
    };
    assert_eq!(
        (w.uid.as_str(), w.name.as_str(), w.hostname.as_str()),
        ("uid-1", "api-0", "api-0.shop")
    );
    assert_eq!(
        w.waypoint.as_deref().cloned(),
        Some(GatewayAddress {
            destination: GatewayDestination::Address(NetworkAddress {
                network: "net1".into(),
                address: "10.0.0.9".parse().unwrap(),
            }),
            hbone_mtls_port: 15009,
        })
    );
    assert_eq!(w.workload_type, "pod");
    assert!(w.native_tunnel);
    assert_eq!(
        w.application_tunnel(),
        Some(ApplicationTunnel {
            protocol: TunnelToApp::None,
            port: Some(15088)
        })
    );
    assert_eq!(
        (
            w.locality.region.as_str(),
            w.locality.zone.as_str(),
            w.locality.subzone.as_str()
        ),
        ("eu-west", "eu-west-1a", "rack7")
    );
    assert_eq!(w.network_mode, NetworkMode::HostNetwork);
    assert_eq!(w.capacity(), Some(4));
    // A network gateway (field 19) decodes, and the workload is not
    // refused for it (istiod names one on the local network's workloads too).
    let gated = [bytes(20, b"uid-2"), bytes(19, &waypoint)].concat();
    let AddressResource::Workload(g) = decode(bytes(1, &gated)).unwrap() else {
        panic!("not a workload");
    };
    assert_eq!(g.network_gateway(), w.waypoint.as_deref());
    assert_eq!(g.unsupported(), None);
}

#[test]
fn every_service_field_decodes_from_istios_field_numbers() {
    use wire::{bytes, num};
    let by_name = bytes(
        1,
        &[bytes(1, b"shop"), bytes(2, b"wp.shop.svc.cluster.local")].concat(),
    );
    let weighted = |ip: u8, w: u64| {
        bytes(
            13,
            &[
                bytes(1, &bytes(2, &[bytes(2, &[10, 0, 0, ip])].concat())),
                num(2, w),
            ]
            .concat(),
        )
    };
    let service = [
        bytes(1, b"api"),
        bytes(2, b"shop"),
        bytes(3, b"api.shop.svc.cluster.local"),
        bytes(4, &[bytes(1, b""), bytes(2, &[10, 96, 0, 20])].concat()),
        bytes(5, &[num(1, 80), num(2, 8080), num(3, 2)].concat()),
        bytes(6, b"spiffe://cluster.local/ns/shop/sa/api"),
        bytes(7, &by_name),
        bytes(8, &[num(3, 0)].concat()),
        num(9, 3),
        num(11, 1),
        num(12, 1),
        weighted(9, 3),
        weighted(10, 1),
        num(14, 0),
    ]
    .concat();
    let AddressResource::Service(s) = decode(bytes(2, &service)).unwrap() else {
        panic!("not a service");
    };
    assert_eq!(s.key(), "shop/api.shop.svc.cluster.local");
    assert_eq!(s.ports.get(&80), Some(&8080));
    assert_eq!(s.app_protocols.get(&80).map(String::as_str), Some("HTTP2"));
    assert_eq!(
        s.waypoint
            .as_ref()
            .map(|w| (w.destination.to_string(), w.hbone_mtls_port)),
        Some(("shop/wp.shop.svc.cluster.local".to_string(), 15008)),
        "an unset port means 15008"
    );
    assert_eq!(s.ip_families, Some(IpFamilies::Dual));
    assert!(s.canonical && s.ingress_use_waypoint);
    assert_eq!(s.visibility, Visibility::Public);
    assert_eq!(
        s.weighted_waypoints
            .iter()
            .map(|w| (w.destination.to_string(), w.weight))
            .collect::<Vec<_>>(),
        [("/10.0.0.9".to_string(), 3), ("/10.0.0.10".to_string(), 1)]
    );
    assert_eq!(
        s.unsupported(),
        None,
        "only ONLY_HEALTHY load balancing: served"
    );
}

#[test]
fn unknown_enums_and_behaviour_ambit_lacks_are_refused_with_a_reason() {
    use wire::{bytes, num};
    let refused = |field: &[u8]| decode(bytes(1, &[bytes(20, b"u"), field.to_vec()].concat()));
    assert!(refused(&num(12, 9))
        .unwrap_err()
        .contains("unknown workload type 9"));
    assert!(refused(&num(25, 7))
        .unwrap_err()
        .contains("unknown network mode 7"));
    assert!(refused(&bytes(8, &num(3, 15008)))
        .unwrap_err()
        .contains("no destination"));
    let svc = |field: Vec<u8>| {
        decode(bytes(
            2,
            &[bytes(1, b"s"), bytes(2, b"n"), bytes(3, b"s.n"), field].concat(),
        ))
    };
    assert!(svc(num(14, 5))
        .unwrap_err()
        .contains("unknown visibility 5"));
    let lacks = |r: Result<AddressResource, String>| match r.unwrap() {
        AddressResource::Service(s) => s.unsupported().unwrap_or_default(),
        AddressResource::Workload(w) => w.unsupported().unwrap_or_default(),
    };
    assert_eq!(lacks(svc(num(14, 1))), "", "NAMESPACE visibility is served");
    // A VIP range (NetworkAddress.length short of the full address) is a
    // range of VIPs; longer than the address, refused.
    let range = bytes(4, &[bytes(2, &[10, 96, 0, 0]), num(3, 24)].concat());
    let AddressResource::Service(r) = svc(range).unwrap() else {
        panic!("not a service")
    };
    assert_eq!(
        (r.vips.len(), r.cidr_vips[0].to_string()),
        (0, "/10.96.0.0/24".to_string())
    );
    let too_long = bytes(4, &[bytes(2, &[10, 96, 0, 0]), num(3, 33)].concat());
    assert!(svc(too_long).unwrap_err().contains("too long"));
    let whole = bytes(4, &[bytes(2, &[10, 96, 0, 1]), num(3, 32)].concat());
    assert!(svc(whole).is_ok(), "a full-length VIP is one address");
    // Load balancing as istiod sends it is served; a scope or mode this
    // build does not know is refused with its number.
    assert_eq!(lacks(svc(bytes(8, &num(2, 1)))), "", "STRICT is served");
    assert!(svc(bytes(8, &num(1, 9)))
        .unwrap_err()
        .contains("routing preference 9"));
    assert!(svc(bytes(8, &num(1, 0)))
        .unwrap_err()
        .contains("routing preference 0"));
    assert!(svc(bytes(8, &num(2, 7)))
        .unwrap_err()
        .contains("load-balancing mode 7"));
    assert!(svc(num(9, 8)).unwrap_err().contains("IP families 8"));
    let zero = bytes(
        13,
        &[bytes(1, &bytes(2, &bytes(2, &[10, 0, 0, 9]))), num(2, 0)].concat(),
    );
    assert!(lacks(svc(zero)).contains("total weight of 0"));
    let ext = bytes(10, &bytes(1, b"istio.io/some-extension"));
    assert!(lacks(svc(ext)).contains("some-extension"));
    let tunnel = bytes(23, &num(1, 1));
    assert!(lacks(refused(&tunnel)).contains("PROXY"));
    // A workload reached by hostname alone is served (resolved on demand).
    let by_hostname_only = bytes(21, b"vm.example.com");
    assert_eq!(lacks(refused(&by_hostname_only)), "");
    // A policy with an extension is refused too: enforcing less than
    // istiod asked for is never the fallback.
    let p = pb_sec::Authorization {
        name: "p".into(),
        extensions: vec![pb::Extension {
            name: "istio.io/l7".into(),
            config: None,
        }],
        ..Default::default()
    };
    assert!(authorization_from_proto(p)
        .unwrap_err()
        .contains("istio.io/l7"));
}

#[test]
fn a_policy_held_keeps_no_room_from_its_decoding() {
    // Decoded lists grow by doubling; converted in place they kept the
    // decoded type's room (a policy held cost three times its size).
    let principal = |k: usize| pb_sec::StringMatch {
        match_type: Some(pb_sec::string_match::MatchType::Exact(format!(
            "cluster.local/ns/a/sa/app-{k}"
        ))),
    };
    let sent = pb_sec::Authorization {
        name: "allow".into(),
        namespace: "a".into(),
        scope: pb_sec::Scope::Namespace as i32,
        action: pb_sec::Action::Allow as i32,
        rules: (0..3)
            .map(|_| pb_sec::Rule {
                clauses: (0..3)
                    .map(|_| pb_sec::Clause {
                        matches: (0..3)
                            .map(|_| pb_sec::Match {
                                principals: (0..3).map(principal).collect(),
                                destination_ports: vec![8080, 8081, 8082],
                                ..Default::default()
                            })
                            .collect(),
                    })
                    .collect(),
            })
            .collect(),
        ..Default::default()
    };
    use prost::Message;
    let decoded = pb_sec::Authorization::decode(sent.encode_to_vec().as_slice()).unwrap();
    let held = authorization_from_proto(decoded).unwrap();
    assert_eq!(held.rules.len(), 3);
    assert_eq!(held.rules.capacity(), 3);
    for clauses in &held.rules {
        assert_eq!(clauses.capacity(), clauses.len());
        for matches in clauses {
            assert_eq!((matches.len(), matches.capacity()), (3, 3));
            for m in matches {
                assert_eq!((m.principals.len(), m.principals.capacity()), (3, 3));
                assert_eq!(m.destination_ports.capacity(), 3);
            }
        }
    }
}
