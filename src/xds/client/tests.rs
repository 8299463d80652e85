//! The xDS client's pure parts: resources held and refused, on-demand
//! subscriptions, the state they make.

use super::*;
use crate::proto::discovery::{DeltaDiscoveryResponse, Resource};
use crate::proto::workload as pb;

fn res(name: &str, addr: pb::Address) -> Resource {
    Resource {
        name: name.into(),
        version: "1".into(),
        resource: Some(prost_types::Any {
            type_url: ADDRESS_TYPE.into(),
            value: addr.encode_to_vec(),
        }),
        aliases: vec![],
    }
}

/// A response carrying one policy resource `name` with body `value`.
fn policy_response(name: &str, value: Vec<u8>) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: AUTHORIZATION_TYPE.into(),
        resources: vec![Resource {
            name: name.into(),
            version: "1".into(),
            resource: Some(prost_types::Any {
                type_url: AUTHORIZATION_TYPE.into(),
                value,
            }),
            aliases: vec![],
        }],
        ..Default::default()
    }
}

/// Service `ns/s.ns` at VIP `vip`, port 80 → 8080.
fn svc_at(vip: [u8; 4]) -> pb::Service {
    pb::Service {
        name: "s".into(),
        namespace: "ns".into(),
        hostname: "s.ns".into(),
        addresses: vec![pb::NetworkAddress {
            network: String::new(),
            address: vip.to_vec(),
            length: None,
        }],
        ports: vec![pb::Port {
            service_port: 80,
            target_port: 8080,
            app_protocol: 0,
        }],
        ..Default::default()
    }
}

fn wl(uid: &str, ip: [u8; 4]) -> pb::Address {
    pb::Address {
        r#type: Some(pb::address::Type::Workload(pb::Workload {
            uid: uid.into(),
            name: uid.into(),
            namespace: "ns".into(),
            addresses: vec![ip.to_vec()],
            tunnel_protocol: 1,
            ..Default::default()
        })),
    }
}

#[test]
fn bad_resource_is_named_and_the_rest_applied_then_removed() {
    let mut held = Held::default();
    let bad = pb::Address {
        r#type: Some(pb::address::Type::Workload(pb::Workload {
            uid: "bad".into(),
            addresses: vec![vec![1, 2]],
            ..Default::default()
        })),
    };
    let resp = DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        resources: vec![res("good", wl("good", [10, 0, 0, 1])), res("bad", bad)],
        nonce: "1".into(),
        ..Default::default()
    };
    let rejected = held.apply(resp);
    assert_eq!(rejected.len(), 1);
    assert_eq!(rejected[0].0, "bad");
    let st = held.state();
    assert!(st
        .workload_by_addr("", "10.0.0.1".parse().unwrap())
        .is_some());
    assert_eq!(
        held.versions(ADDRESS_TYPE).len(),
        1,
        "only the good one is held"
    );

    let removal = DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        removed_resources: vec!["good".into()],
        ..Default::default()
    };
    held.apply(removal);
    assert!(held
        .state()
        .workload_by_addr("", "10.0.0.1".parse().unwrap())
        .is_none());
}

#[test]
fn a_refused_address_is_refused_until_it_is_served_or_removed() {
    let mut held = Held::default();
    let ip: std::net::IpAddr = "10.0.0.7".parse().unwrap();
    let vip: std::net::IpAddr = "10.96.0.7".parse().unwrap();
    let send = |held: &mut Held, resources: Vec<Resource>, removed: Vec<String>| {
        held.apply(DeltaDiscoveryResponse {
            type_url: ADDRESS_TYPE.into(),
            resources,
            removed_resources: removed,
            ..Default::default()
        })
    };
    // Refused for a tunnel protocol Ambit does not speak; and a service
    // whose ip families are not known to this build.
    let mut legacy = wl("w", [10, 0, 0, 7]);
    if let Some(pb::address::Type::Workload(w)) = &mut legacy.r#type {
        w.tunnel_protocol = pb::TunnelProtocol::LegacyIstioMtls as i32;
    }
    let svc = |families: i32| pb::Address {
        r#type: Some(pb::address::Type::Service(pb::Service {
            ip_families: families,
            ..svc_at([10, 96, 0, 7])
        })),
    };
    let rejected = send(
        &mut held,
        vec![res("w", legacy), res("ns/s.ns", svc(42))],
        vec![],
    );
    assert_eq!(rejected.len(), 2, "{rejected:?}");
    let st = held.state();
    assert!(st.workload_by_addr("", ip).is_none());
    assert!(st.refused_at("", ip).unwrap().reason.contains("LEGACY"));
    assert!(st
        .refused_at("", vip)
        .unwrap()
        .reason
        .contains("IP families 42"));
    assert!(st.refused_host("ns/s.ns").is_some());
    // Undecodable bytes: refused by the name they came under.
    let garbage = Resource {
        name: "ns/junk.ns".into(),
        version: "1".into(),
        resource: Some(prost_types::Any {
            type_url: ADDRESS_TYPE.into(),
            value: vec![0xff, 0xff, 0xff],
        }),
        aliases: vec![],
    };
    assert_eq!(send(&mut held, vec![garbage], vec![]).len(), 1);
    assert!(held.state().refused_host("ns/junk.ns").is_some());

    // Valid now: served, no longer refused.
    assert!(send(&mut held, vec![res("w", wl("w", [10, 0, 0, 7]))], vec![]).is_empty());
    let st = held.state();
    assert!(st.workload_by_addr("", ip).is_some());
    assert!(st.refused_at("", ip).is_none());
    // Removed: unknown again, neither served nor refused.
    send(&mut held, vec![], vec!["w".into(), "ns/s.ns".into()]);
    let st = held.state();
    assert!(st.workload_by_addr("", ip).is_none() && st.refused_at("", ip).is_none());
    assert!(st.refused_at("", vip).is_none());
}

#[test]
fn an_answer_by_name_alias_or_removal_wakes_only_its_waiters() {
    let mut d = Demand::default();
    let mut rxs = Vec::new();
    for name in ["/10.0.0.1", "/10.0.0.2", "/10.0.0.3"] {
        d.subscribed.insert(name.into());
        let (tx, rx) = tokio::sync::oneshot::channel();
        d.waiters.entry(name.into()).or_default().push(tx);
        rxs.push(rx);
    }
    let mut found = res("w1", wl("w1", [10, 0, 0, 1]));
    found.aliases = vec!["/10.0.0.1".into()];
    let resp = DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        resources: vec![found],
        removed_resources: vec!["/10.0.0.2".into(), "unrelated".into()],
        ..Default::default()
    };
    let woken = d.answered_by(Answers::of(&resp.clone().into()));
    assert_eq!(woken.len(), 2, "the found alias and the absent name");
    for w in woken {
        w.send(()).unwrap();
    }
    assert!(rxs[0].try_recv().is_ok() && rxs[1].try_recv().is_ok());
    assert!(rxs[2].try_recv().is_err(), "not answered yet");
    assert!(d.answered.contains_key("/10.0.0.2") && !d.answered.contains_key("/10.0.0.3"));
    assert!(
        !d.answered.contains_key("unrelated"),
        "only subscribed names count"
    );
    assert_eq!(d.unknown, ["/10.0.0.2"], "answered as unknown");
}

#[test]
fn at_the_cap_the_oldest_unknown_names_make_room_and_known_ones_stay() {
    let mut d = Demand::default();
    for i in 0..MAX_DEMANDED {
        d.subscribed.insert(format!("/n{i}"));
    }
    assert!(!d.make_room(), "all known: no room, nothing unsubscribed");
    assert!(d.unsubscribe.is_empty());
    let resp = DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        removed_resources: (0..MAX_DEMANDED / 8).map(|i| format!("/n{i}")).collect(),
        ..Default::default()
    };
    d.answered_by(Answers::of(&resp.clone().into()));
    assert!(d.make_room());
    let batch = MAX_DEMANDED / 16;
    assert_eq!(d.unsubscribe.len(), batch, "one batch, not one per name");
    assert_eq!(d.unsubscribe[0], "/n0", "oldest unknown first");
    assert!(!d.subscribed.contains("/n0") && !d.answered.contains_key("/n0"));
    assert!(d.subscribed.contains(&format!("/n{}", MAX_DEMANDED - 1)));
    assert_eq!(d.subscribed.len(), MAX_DEMANDED - batch);

    // A name found since it was unknown is skipped when room is made again.
    let next = format!("/n{batch}");
    let mut w = res("w", wl("w", [10, 0, 0, 9]));
    w.aliases = vec![next.clone()];
    d.answered_by(Answers::of(&Delta::from(DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        resources: vec![w],
        ..Default::default()
    })));
    for i in 0..batch {
        d.subscribed.insert(format!("/new{i}"));
    }
    d.unsubscribe.clear();
    assert!(d.make_room());
    assert!(!d.unsubscribe.contains(&next) && d.subscribed.contains(&next));
    assert_eq!(d.unsubscribe[0], format!("/n{}", batch + 1));
}

#[test]
fn workloads_sharing_an_ip_are_both_held() {
    let mut held = Held::default();
    let resp = DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        resources: vec![
            res("a", wl("a", [10, 0, 0, 1])),
            res("b", wl("b", [10, 0, 0, 1])),
        ],
        ..Default::default()
    };
    assert!(held.apply(resp).is_empty());
    let st = held.state();
    assert_eq!(st.workloads().count(), 2);
    let at = st.workload_by_addr("", "10.0.0.1".parse().unwrap());
    assert_eq!(
        at.map(|w| w.name.as_str()),
        Some("b"),
        "the latest of equals"
    );
}

#[test]
fn of_two_workloads_on_one_ip_the_one_updated_last_wins() {
    // Many rounds: a map's order would pick either one now and then.
    for round in 0..64u8 {
        let mut held = Held::default();
        let old = format!("old{round}");
        held.apply(DeltaDiscoveryResponse {
            type_url: ADDRESS_TYPE.into(),
            resources: vec![res(&old, wl(&old, [10, 0, 0, 1]))],
            ..Default::default()
        });
        // The pod IP reused before the old workload's removal arrives;
        // then unrelated resources and an update of the old one.
        let mut resources = vec![res("new", wl("new", [10, 0, 0, 1]))];
        resources.extend((0..round).map(|i| {
            let n = format!("other{i}");
            res(&n, wl(&n, [10, 1, 0, i]))
        }));
        resources.push(res(&old, wl(&old, [10, 0, 0, 1])));
        held.apply(DeltaDiscoveryResponse {
            type_url: ADDRESS_TYPE.into(),
            resources,
            ..Default::default()
        });
        let st = held.state();
        let owner = st
            .workload_by_addr("", "10.0.0.1".parse().unwrap())
            .unwrap();
        assert_eq!(owner.name, old, "round {round}");
        assert_eq!(st.workloads().count(), 2 + round as usize, "round {round}");
    }
}

#[test]
fn a_response_of_an_unknown_type_changes_nothing() {
    let mut held = Held::default();
    let policy = crate::proto::security::Authorization {
        name: "p".into(),
        namespace: "ns".into(),
        ..Default::default()
    };
    let rejected = held.apply(policy_response("ns/p", policy.encode_to_vec()));
    assert!(rejected.is_empty(), "{rejected:?}");
    let rejected = held.apply(DeltaDiscoveryResponse {
        type_url: "type.googleapis.com/some.Other".into(),
        removed_resources: vec!["ns/p".into()],
        ..Default::default()
    });
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert!(rejected[0].1.contains("unknown type"));
    assert_eq!(
        held.versions(AUTHORIZATION_TYPE).len(),
        1,
        "the policy is not removed by another type's removal"
    );
}

#[test]
fn a_refused_policy_stands_in_denying_until_a_valid_one_arrives_or_it_is_removed() {
    use crate::proto::security as sec;
    use crate::xds::types::{PolicyAction, PolicyScope};
    let mut held = Held::default();
    let send =
        |held: &mut Held, name: &str, value: Vec<u8>| held.apply(policy_response(name, value));
    let policy = |extension: bool| sec::Authorization {
        name: "no-l7".into(),
        namespace: "ns".into(),
        scope: sec::Scope::Namespace as i32,
        action: sec::Action::Deny as i32,
        extensions: if extension {
            vec![pb::Extension {
                name: "istio.io/l7".into(),
                config: None,
            }]
        } else {
            vec![]
        },
        ..Default::default()
    };
    assert_eq!(
        send(&mut held, "ns/no-l7", policy(true).encode_to_vec()).len(),
        1
    );
    assert_eq!(send(&mut held, "ns/junk", vec![0xff, 0xff]).len(), 1);
    let st = held.state();
    let refused: Vec<_> = st
        .policies()
        .filter(|p| p.refused.is_some())
        .map(|p| (p.key(), p.scope, p.action))
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(refused.contains(&(
        "ns/no-l7".into(),
        PolicyScope::Namespace,
        PolicyAction::Deny
    )));
    // Unreadable: it applies where a workload names it, and denies.
    assert!(refused.contains(&(
        "ns/junk".into(),
        PolicyScope::WorkloadSelector,
        PolicyAction::Deny
    )));
    assert_eq!(
        held.versions(AUTHORIZATION_TYPE).len(),
        0,
        "stand-ins are never claimed as held"
    );
    // Valid now: held as sent; removed: gone.
    assert!(send(&mut held, "ns/no-l7", policy(false).encode_to_vec()).is_empty());
    assert!(held
        .state()
        .policies()
        .all(|p| p.key() != "ns/no-l7" || p.refused.is_none()));
    held.apply(DeltaDiscoveryResponse {
        type_url: AUTHORIZATION_TYPE.into(),
        removed_resources: vec!["ns/no-l7".into(), "ns/junk".into()],
        ..Default::default()
    });
    assert_eq!(held.state().policies().count(), 0);
}

#[test]
fn a_refused_update_leaves_the_version_that_served_serving() {
    let mut held = Held::default();
    let send = |held: &mut Held, name: &str, version: &str, addr: pb::Address| {
        let mut r = res(name, addr);
        r.version = version.into();
        held.apply(DeltaDiscoveryResponse {
            type_url: ADDRESS_TYPE.into(),
            resources: vec![r],
            ..Default::default()
        })
    };
    let svc = |extension: bool| pb::Address {
        r#type: Some(pb::address::Type::Service(pb::Service {
            extensions: if extension {
                vec![pb::Extension {
                    name: "istio.io/x".into(),
                    config: None,
                }]
            } else {
                vec![]
            },
            ..svc_at([10, 96, 0, 9])
        })),
    };
    let mut gated = wl("w", [10, 0, 0, 9]);
    if let Some(pb::address::Type::Workload(w)) = &mut gated.r#type {
        // A PROXY tunnel on a workload that takes no HBONE.
        w.tunnel_protocol = pb::TunnelProtocol::None as i32;
        w.application_tunnel = Some(pb::ApplicationTunnel {
            protocol: pb::application_tunnel::Protocol::Proxy as i32,
            port: 15088,
        });
    }
    assert!(send(&mut held, "ns/s.ns", "v1", svc(false)).is_empty());
    assert!(send(&mut held, "w", "v1", wl("w", [10, 0, 0, 9])).is_empty());
    // Updates Ambit refuses: NACKed, and the served versions stay.
    assert_eq!(send(&mut held, "ns/s.ns", "v2", svc(true)).len(), 1);
    assert_eq!(send(&mut held, "w", "v2", gated).len(), 1);
    let st = held.state();
    let vip = "10.96.0.9".parse().unwrap();
    assert!(
        st.service_by_vip("", vip, None).is_some(),
        "the service serves"
    );
    let ip = "10.0.0.9".parse().unwrap();
    assert!(st.workload_by_addr("", ip).is_some(), "the workload serves");
    // On reconnect, what is held is what served.
    let versions = held.versions(ADDRESS_TYPE);
    assert_eq!(versions.get("ns/s.ns").map(String::as_str), Some("v1"));
    assert_eq!(versions.get("w").map(String::as_str), Some("v1"));

    // A policy likewise: the version that served keeps deciding.
    let policy = |extension: bool| crate::proto::security::Authorization {
        name: "p".into(),
        namespace: "ns".into(),
        scope: crate::proto::security::Scope::Namespace as i32,
        action: crate::proto::security::Action::Allow as i32,
        extensions: if extension {
            vec![pb::Extension {
                name: "istio.io/l7".into(),
                config: None,
            }]
        } else {
            vec![]
        },
        ..Default::default()
    };
    let send_policy = |held: &mut Held, p: crate::proto::security::Authorization| {
        held.apply(policy_response("ns/p", p.encode_to_vec()))
    };
    assert!(send_policy(&mut held, policy(false)).is_empty());
    assert_eq!(send_policy(&mut held, policy(true)).len(), 1);
    let st = held.state();
    let served: Vec<_> = st.policies().map(|p| p.refused.clone()).collect();
    assert_eq!(served, [None], "the valid version, not a stand-in");
}

#[test]
fn a_nack_names_only_the_resources_of_the_response_it_answers() {
    use crate::proto::security as sec;
    let mut held = Held::default();
    let names = |rejected: &[(String, String)]| {
        let mut n: Vec<_> = rejected.iter().map(|(name, _)| name.clone()).collect();
        n.sort();
        n
    };
    let unreadable = pb::Address {
        r#type: Some(pb::address::Type::Workload(pb::Workload {
            uid: "unreadable".into(),
            addresses: vec![vec![1, 2]],
            ..Default::default()
        })),
    };
    // One uid under two resource names (the second is left out), and an
    // address that cannot be read.
    let (_, rejected) = held.answer(DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        resources: vec![
            res("first", wl("dup", [10, 0, 0, 1])),
            res("second", wl("dup", [10, 0, 0, 2])),
            res("unreadable", unreadable),
        ],
        ..Default::default()
    });
    assert_eq!(names(&rejected), ["second", "unreadable"], "{rejected:?}");

    // An empty push of the other type, then one of the same type with
    // other resources: both ACKed, though both refusals are still held.
    let (_, rejected) = held.answer(DeltaDiscoveryResponse {
        type_url: AUTHORIZATION_TYPE.into(),
        ..Default::default()
    });
    assert!(rejected.is_empty(), "{rejected:?}");
    let (st, rejected) = held.answer(DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        resources: vec![res("third", wl("third", [10, 0, 0, 3]))],
        ..Default::default()
    });
    assert!(rejected.is_empty(), "{rejected:?}");
    assert!(st
        .workload_by_addr("", "10.0.0.3".parse().unwrap())
        .is_some());
    assert!(
        st.workload_by_addr("", "10.0.0.2".parse().unwrap())
            .is_none(),
        "the left-out resource stays out"
    );

    // Sent again, the left-out resource is NACKed again.
    let (_, rejected) = held.answer(DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        resources: vec![res("second", wl("dup", [10, 0, 0, 2]))],
        ..Default::default()
    });
    assert_eq!(names(&rejected), ["second"]);

    // Policies: one key under two resource names.
    let policy = sec::Authorization {
        name: "p".into(),
        namespace: "ns".into(),
        scope: sec::Scope::Namespace as i32,
        action: sec::Action::Deny as i32,
        ..Default::default()
    };
    let (_, rejected) = held.answer(policy_response("ns/p", policy.encode_to_vec()));
    assert!(rejected.is_empty(), "{rejected:?}");
    let (_, rejected) = held.answer(policy_response("ns/p-again", policy.encode_to_vec()));
    assert_eq!(names(&rejected), ["ns/p-again"]);
    let (_, rejected) = held.answer(DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        removed_resources: vec!["third".into()],
        ..Default::default()
    });
    assert!(rejected.is_empty(), "{rejected:?}");
}

#[test]
fn stream_ends_are_counted_under_ztunnel_s_reasons() {
    use crate::grpc::GrpcError;
    let connect = GrpcError::Connect {
        addr: "https://istiod:15012".into(),
        reason: "connection refused".into(),
    };
    let status = |code, message: &str| Err(tonic::Status::new(code, message).into());
    for (ended, reason) in [
        (Ok(()), "Complete"),
        (Err(connect.into()), "ConnectionError"),
        (status(tonic::Code::Cancelled, ""), "Reconnect"),
        (
            status(tonic::Code::Unavailable, "transport is closing"),
            "Reconnect",
        ),
        (
            status(tonic::Code::Unavailable, "no healthy upstream"),
            "Error",
        ),
        (status(tonic::Code::PermissionDenied, "bad token"), "Error"),
        (Err(anyhow::anyhow!("token file /t: missing")), "Error"),
    ] {
        assert_eq!(termination_reason(&ended), reason, "{ended:?}");
    }
}

/// One uid under two names: sent again in one response, the one left out
/// first and then the one holding the uid, the holder's update goes behind
/// it. The NACK names the state the whole response leaves: the old holder
/// left out, and not the one that now serves.
#[test]
fn a_nack_names_what_is_left_out_once_the_whole_response_is_applied() {
    let mut held = Held::default();
    let (_, rejected) = held.answer(DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        resources: vec![
            res("first", wl("dup", [10, 0, 0, 1])),
            res("second", wl("dup", [10, 0, 0, 2])),
        ],
        ..Default::default()
    });
    let names: Vec<_> = rejected.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["second"]);
    let (st, rejected) = held.answer(DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        resources: vec![
            res("second", wl("dup", [10, 0, 0, 2])),
            res("first", wl("dup", [10, 0, 0, 1])),
        ],
        ..Default::default()
    });
    let names: Vec<_> = rejected.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["first"], "{rejected:?}");
    let at = |ip: &str| st.workload_by_addr("", ip.parse().unwrap()).is_some();
    assert!(at("10.0.0.2") && !at("10.0.0.1"));
}

#[test]
fn a_response_over_the_limit_is_told_in_words_naming_the_setting() {
    // tonic's own text for a message over its decoding limit.
    let status = tonic::Status::out_of_range(
        "Error, decoded message length too large: found 5242880 bytes, the limit is: 4194304 bytes",
    );
    let text = format!("{:#}", stream_error(status, 4 << 20));
    for part in [
        "larger than this proxy takes",
        "AMBIT_XDS_MAX_MESSAGE_SIZE, 4194304 bytes now",
        "last good state keeps serving",
        "found 5242880 bytes",
    ] {
        assert!(text.contains(part), "{part:?} in {text}");
    }
    // Any other error is passed on as it was.
    let other = stream_error(tonic::Status::unavailable("transport is closing"), 4 << 20);
    assert!(other.downcast_ref::<tonic::Status>().is_some());
    assert_eq!(termination_reason(&Err(other)), "Reconnect");
}
