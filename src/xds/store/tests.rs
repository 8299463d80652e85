use std::path::Path;

use super::*;
use crate::xds::types::{BackedServices, Ports};

fn state(yaml: &str) -> Result<State, String> {
    crate::xds::local::parse(Path::new("s.yaml"), yaml).map_err(|e| e.to_string())
}

#[test]
fn services_share_a_vip_and_the_clients_namespace_wins_then_canonical_then_first() {
    let st = state(
        r#"
services:
- {name: a, namespace: one, hostname: db.example.com, vips: ["/10.96.0.30"], ports: {5432: 5432}}
- {name: b, namespace: two, hostname: db.example.com, vips: ["/10.96.0.30"], ports: {5432: 5432}}
- {name: c, namespace: three, hostname: db.example.com, vips: ["/10.96.0.30"], ports: {5432: 5432}, canonical: true}
- {name: hidden, namespace: four, hostname: private.four, vips: ["/10.96.0.31"], ports: {80: 80}, visibility: NAMESPACE}
"#,
    )
    .unwrap();
    let at = |ip: &str, ns: Option<&str>| {
        st.service_by_vip("", ip.parse().unwrap(), ns)
            .map(|s| s.name.clone())
    };
    assert_eq!(
        at("10.96.0.30", Some("two")).as_deref(),
        Some("b"),
        "own namespace"
    );
    assert_eq!(
        at("10.96.0.30", Some("elsewhere")).as_deref(),
        Some("c"),
        "canonical"
    );
    assert_eq!(at("10.96.0.30", None).as_deref(), Some("c"));
    // Namespace-only visibility: seen from its namespace alone.
    assert_eq!(at("10.96.0.31", Some("four")).as_deref(), Some("hidden"));
    assert_eq!(at("10.96.0.31", Some("one")), None);
    // The same namespace/hostname twice is still a conflict.
    let twice = state(
        "services:\n- {name: a, namespace: n, hostname: h, vips: [\"/10.96.0.1\"]}\n- {name: b, namespace: n, hostname: h, vips: [\"/10.96.0.2\"]}\n",
    );
    assert!(twice.unwrap_err().contains("defined twice"));
}

#[test]
fn every_kind_of_refusal_keeps_the_resources_addresses_refused_with_its_reason() {
    use crate::xds::types::{
        ApplicationTunnel, GatewayAddress, GatewayDestination, Rare, TunnelToApp, WeightedWaypoint,
    };
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    let wl = |name: &str, addr: &str| Workload {
        name: name.into(),
        namespace: "ns".into(),
        workload_ips: [ip(addr)].into(),
        ..Workload::default()
    };
    let svc = |name: &str, vip: &str| Service {
        name: name.into(),
        namespace: "ns".into(),
        hostname: format!("{name}.ns"),
        vips: vec![NetworkAddress {
            network: Name::default(),
            address: ip(vip),
        }],
        ..Service::default()
    };
    let mut ext = wl("ext", "10.0.0.1");
    ext.rare = Rare {
        extensions: ["istio.io/x".into()].into(),
        ..Rare::default()
    }
    .boxed();
    let mut gated = wl("gated", "10.0.0.2");
    gated.rare = Rare {
        network_gateway: Some(GatewayAddress {
            destination: GatewayDestination::Address(NetworkAddress {
                network: "n2".into(),
                address: ip("192.0.2.1"),
            }),
            hbone_mtls_port: 15008,
        }),
        ..Rare::default()
    }
    .boxed();
    let mut proxied = wl("proxied", "10.0.0.3");
    proxied.rare = Rare {
        application_tunnel: Some(ApplicationTunnel {
            protocol: TunnelToApp::Proxy,
            port: None,
        }),
        ..Rare::default()
    }
    .boxed();
    let mut own_wp = wl("own-wp", "10.0.0.4");
    own_wp.waypoint = Some(Box::new(GatewayAddress {
        destination: GatewayDestination::Address(NetworkAddress {
            network: Name::default(),
            address: ip("10.0.0.4"),
        }),
        hbone_mtls_port: 15008,
    }));
    let nameless = Workload {
        namespace: "ns".into(),
        workload_ips: [ip("10.0.0.5")].into(),
        ..Workload::default()
    };
    let mut twice = wl("twice", "10.0.0.6");
    twice.uid = "dup".into();
    let mut twice2 = wl("twice2", "10.0.0.7");
    twice2.uid = "dup".into();
    let mut svc_ext = svc("sext", "10.96.0.1");
    svc_ext.extensions = vec!["istio.io/y".into()];
    let mut weightless = svc("weightless", "10.96.0.2");
    weightless.weighted_waypoints = vec![WeightedWaypoint {
        destination: GatewayDestination::Address(NetworkAddress {
            network: Name::default(),
            address: ip("10.0.0.9"),
        }),
        hbone_mtls_port: 15008,
        weight: 0,
    }];
    let defined = svc("defined", "10.96.0.3");
    let mut defined_again = svc("defined", "10.96.0.4");
    defined_again.name = "other".into();
    let (st, errors) = State::build_lenient(
        vec![ext, gated, proxied, own_wp, nameless, twice, twice2],
        vec![svc_ext, weightless, defined, defined_again],
        vec![],
    );
    assert_eq!(errors.len(), 8, "{errors:?}");
    assert!(
        st.workload_by_addr("", ip("10.0.0.2")).is_some(),
        "a workload naming its network's gateway is served"
    );
    for (addr, why) in [
        ("10.0.0.1", "extension"),
        ("10.0.0.3", "PROXY"),
        ("10.0.0.4", "the workload itself"),
        ("10.0.0.5", "name and namespace are required"),
        ("10.0.0.7", "used twice"),
        ("10.96.0.1", "extension"),
        ("10.96.0.2", "total weight of 0"),
        ("10.96.0.4", "defined twice"),
    ] {
        let r = st
            .refused_at("", ip(addr))
            .unwrap_or_else(|| panic!("{addr} is not refused"));
        assert!(r.reason.contains(why), "{addr}: {}", r.reason);
    }
    // What was served stays served, and not refused.
    assert!(st.workload_by_addr("", ip("10.0.0.6")).is_some());
    assert!(st.refused_at("", ip("10.0.0.6")).is_none());
    assert!(st.service_by_vip("", ip("10.96.0.3"), None).is_some());
    assert!(st.refused_host("ns/weightless.ns").is_some());
}

#[test]
fn addresses_are_found_on_their_own_network_only() {
    // The lookups borrow the network's text (no copy per connection);
    // the keys hold it interned, as read from the control plane.
    let st = state(
        "workloads:\n- {name: a, namespace: n, network: net1, workloadIps: [10.0.0.1]}\n- {name: b, namespace: n, workloadIps: [10.0.0.1]}\nservices:\n- {name: s, namespace: n, hostname: s.n, vips: [\"net1/10.96.0.1\"]}\n",
    )
    .unwrap();
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    let name = |w: Option<&Arc<Workload>>| w.map(|w| w.name.to_string());
    assert_eq!(
        name(st.workload_by_addr("net1", ip("10.0.0.1"))),
        Some("a".into())
    );
    assert_eq!(
        name(st.workload_by_addr("", ip("10.0.0.1"))),
        Some("b".into())
    );
    assert_eq!(name(st.workload_by_addr("net2", ip("10.0.0.1"))), None);
    assert!(st.service_by_vip("net1", ip("10.96.0.1"), None).is_some());
    assert!(st.service_by_vip("", ip("10.96.0.1"), None).is_none());
    assert!(st.service_by_vip("net10", ip("10.96.0.1"), None).is_none());
}

#[test]
fn a_workload_updated_keeps_one_copy_of_its_name_for_both_its_maps() {
    // istiod names a workload's resource by its uid: the resource's entry
    // and the uid's queue share the one text, after an update too.
    let uid = "Kubernetes//Pod/n/a";
    let workload = |revision: &str| Workload {
        uid: uid.into(),
        name: "a".into(),
        namespace: "n".into(),
        canonical_revision: revision.into(),
        workload_ips: ["10.0.0.1".parse().unwrap()].into(),
        ..Default::default()
    };
    let mut st = State::default();
    for revision in ["v1", "v2", "v3"] {
        let w = AddressResource::Workload(Arc::new(workload(revision)));
        assert_eq!(st.put_address(uid, revision, w), None);
        let key_of = |keys: Vec<&Name>| keys.into_iter().find(|k| k.as_str() == uid).cloned();
        let entry = key_of(st.addresses.keys().collect()).expect("held");
        let queue = key_of(st.workloads.keys().collect()).expect("served");
        assert!(
            entry.ptr_eq(&queue),
            "two copies of the name after {revision}"
        );
    }
    assert_eq!(
        st.workload_by_addr("", "10.0.0.1".parse().unwrap())
            .map(|w| w.canonical_revision.to_string()),
        Some("v3".into())
    );
}

#[test]
fn host_network_workloads_share_the_node_ip_and_are_not_found_by_it() {
    let st = state(
        r#"
workloads:
- {name: kube-proxy, namespace: kube-system, workloadIps: [192.168.1.10], networkMode: HOST_NETWORK}
- {name: node-exporter, namespace: monitoring, workloadIps: [192.168.1.10], networkMode: HOST_NETWORK}
- {name: app, namespace: shop, workloadIps: [10.0.0.3]}
"#,
    )
    .unwrap();
    assert_eq!(
        st.workloads().count(),
        3,
        "both hostNetwork workloads are held"
    );
    assert!(st
        .workload_by_addr("", "192.168.1.10".parse().unwrap())
        .is_none());
    assert!(st.workload_by_name("monitoring", "node-exporter").is_some());
    assert!(st
        .workload_by_addr("", "10.0.0.3".parse().unwrap())
        .is_some());
}

#[test]
fn workloads_sharing_an_ip_are_all_held_and_the_lookup_ranks_them() {
    let st = state(
        r#"
workloads:
- {uid: c//Pod/n/old, name: old, namespace: n, workloadIps: [10.0.0.9], protocol: HBONE}
- {uid: c//WorkloadEntry/n/vm, name: vm, namespace: n, workloadIps: [10.0.0.9], protocol: HBONE}
- {uid: c//Pod/n/new, name: new, namespace: n, workloadIps: [10.0.0.9], protocol: HBONE}
- {uid: c//Pod/n/plain, name: plain, namespace: n, workloadIps: [10.0.0.8]}
- {uid: c//WorkloadEntry/n/meshed, name: meshed, namespace: n, workloadIps: [10.0.0.8], protocol: HBONE}
"#,
    )
    .unwrap();
    let at = |ip: &str| {
        st.workload_by_addr("", ip.parse().unwrap())
            .map(|w| w.name.clone())
    };
    assert_eq!(st.workloads().count(), 5);
    assert_eq!(
        at("10.0.0.9").as_deref(),
        Some("new"),
        "a meshed pod, the latest"
    );
    assert_eq!(
        at("10.0.0.8").as_deref(),
        Some("plain"),
        "a pod over a WorkloadEntry"
    );
}

mod reference;

use crate::xds::types::PolicyAction;
use reference::Reference;

const IPS: [[u8; 4]; 4] = [[10, 0, 0, 1], [10, 0, 0, 2], [10, 0, 0, 3], [10, 0, 0, 4]];
const VIPS: [[u8; 4]; 3] = [[10, 96, 0, 1], [10, 96, 0, 2], [10, 96, 0, 3]];
const POLICY_KEYS: [&str; 3] = ["a/p0", "b/p1", "a/p2"];

fn pick<'a, T>(rng: &mut fastrand::Rng, of: &'a [T]) -> &'a T {
    &of[rng.usize(..of.len())]
}

fn random_workload(rng: &mut fastrand::Rng) -> Workload {
    let ip = |rng: &mut fastrand::Rng| IpAddr::from(*pick(rng, &IPS));
    let mut ips = vec![ip(rng)];
    if rng.bool() {
        ips.push(ip(rng));
    }
    let services = match rng.u8(..3) {
        0 => BackedServices::default(),
        1 => BackedServices::new([(Name::intern("a/s0.a"), Ports::new([(80, 8080)]))]),
        _ => BackedServices::new([(Name::intern("b/s1.b"), Ports::new([(80, 9090)]))]),
    };
    Workload {
        uid: Name::from(*pick(
            rng,
            &["c//Pod/a/w0", "c//Pod/a/w1", "c//WorkloadEntry/b/w2", ""],
        )),
        name: Name::from(*pick(rng, &["w0", "w1", "w2", ""])),
        namespace: Name::intern(pick::<&str>(rng, &["a", "b"])),
        workload_ips: ips.into(),
        protocol: if rng.bool() {
            Protocol::Hbone
        } else {
            Protocol::Tcp
        },
        network_mode: if rng.u8(..5) == 0 {
            NetworkMode::HostNetwork
        } else {
            NetworkMode::Standard
        },
        services,
        authorization_policies: POLICY_KEYS
            .iter()
            .filter(|_| rng.u8(..3) == 0)
            .map(|k| Name::intern(k))
            .collect(),
        ..Workload::default()
    }
}

fn random_service(rng: &mut fastrand::Rng) -> Service {
    let (name, namespace, hostname) = *pick(
        rng,
        &[("s0", "a", "s0.a"), ("s1", "b", "s1.b"), ("s2", "a", "")],
    );
    Service {
        name: name.into(),
        namespace: namespace.into(),
        hostname: hostname.into(),
        vips: vec![NetworkAddress {
            network: Name::default(),
            address: IpAddr::from(*pick(rng, &VIPS)),
        }],
        canonical: rng.bool(),
        ..Service::default()
    }
}

fn random_policy(rng: &mut fastrand::Rng) -> Authorization {
    let key = *pick(rng, &POLICY_KEYS);
    let (namespace, name) = key.split_once('/').unwrap();
    Authorization {
        name: name.into(),
        namespace: namespace.into(),
        scope: *pick(
            rng,
            &[
                PolicyScope::Global,
                PolicyScope::Namespace,
                PolicyScope::WorkloadSelector,
            ],
        ),
        action: PolicyAction::Allow,
        rules: Vec::new(),
        dry_run: false,
        refused: None,
    }
}

/// What a user of the state can see of it, as text: the same for a state
/// and for the reference built from the same resources.
struct Seen {
    lines: Vec<String>,
}

impl Seen {
    fn of_state(st: &State, names: &[String], policy_names: &[String]) -> String {
        let mut s = Seen { lines: Vec::new() };
        let mut uids: Vec<_> = st.workloads().map(|w| w.uid.clone()).collect();
        uids.sort();
        s.put("workloads", uids);
        for ip in IPS {
            let ip = IpAddr::from(ip);
            s.put(
                &format!("at {ip}"),
                st.workload_by_addr("", ip).map(|w| w.uid.clone()),
            );
            s.put(&format!("refused {ip}"), st.refused_at("", ip).is_some());
        }
        for vip in VIPS {
            let vip = IpAddr::from(vip);
            for client in [None, Some("a"), Some("b")] {
                let found = st.service_by_vip("", vip, client).map(|s| s.key());
                s.put(&format!("vip {vip} from {client:?}"), found);
            }
            s.put(&format!("refused {vip}"), st.refused_at("", vip).is_some());
        }
        for ns in ["a", "b"] {
            for name in ["w0", "w1", "w2"] {
                let found = st.workload_by_name(ns, name).map(|w| w.uid.clone());
                s.put(&format!("name {ns}/{name}"), found);
            }
        }
        let mut keys: Vec<_> = st.services().map(|s| s.key()).collect();
        keys.sort();
        for key in &keys {
            let svc = st.service_by_host(key).unwrap();
            let uids: Vec<_> = st.endpoints(svc).map(|e| e.workload.uid.clone()).collect();
            s.put(&format!("endpoints {key}"), uids);
        }
        s.put("services", keys);
        for key in ["a/s0.a", "b/s1.b", "a/"] {
            s.put(&format!("refused {key}"), st.refused_host(key).is_some());
        }
        let mut policies: Vec<_> = st.policies().map(|p| p.key()).collect();
        policies.sort();
        s.put("policies", policies);
        let selected: Vec<Name> = POLICY_KEYS.iter().map(|k| Name::intern(k)).collect();
        for ns in ["a", "b", "c"] {
            let applied: Vec<_> = st
                .policies_for(ns, &selected)
                .map(|p| (p.key(), p.refused.is_some()))
                .collect();
            s.put(&format!("policies for {ns}"), applied);
        }
        let (ws, ss) = st.refused_resources();
        s.put(
            "refused workloads",
            ws.map(|w| w.uid.clone()).collect::<Vec<_>>(),
        );
        s.put("refused services", ss.map(|s| s.key()).collect::<Vec<_>>());
        for name in names {
            s.put(&format!("left out {name}"), st.left_out(name).is_some());
        }
        for name in policy_names {
            s.put(
                &format!("left out {name}"),
                st.policy_left_out(name).is_some(),
            );
        }
        s.lines.join("\n")
    }

    fn of_reference(r: &Reference, names: &[String], policy_names: &[String]) -> String {
        let mut s = Seen { lines: Vec::new() };
        let mut uids: Vec<_> = r.workloads.keys().cloned().collect();
        uids.sort();
        s.put("workloads", uids);
        for ip in IPS {
            let ip = IpAddr::from(ip);
            s.put(
                &format!("at {ip}"),
                r.workload_by_addr(ip).map(|w| w.uid.clone()),
            );
            s.put(&format!("refused {ip}"), r.refused_at(ip));
        }
        for vip in VIPS {
            let vip = IpAddr::from(vip);
            for client in [None, Some("a"), Some("b")] {
                let found = r.service_by_vip(vip, client).map(|s| s.key());
                s.put(&format!("vip {vip} from {client:?}"), found);
            }
            s.put(&format!("refused {vip}"), r.refused_at(vip));
        }
        for ns in ["a", "b"] {
            for name in ["w0", "w1", "w2"] {
                let found = r.workload_by_name(ns, name).map(|w| w.uid.clone());
                s.put(&format!("name {ns}/{name}"), found);
            }
        }
        let mut keys: Vec<_> = r.services.keys().cloned().collect();
        keys.sort();
        for key in &keys {
            let uids = r.endpoints.get(key).cloned().unwrap_or_default();
            s.put(&format!("endpoints {key}"), uids);
        }
        s.put("services", keys);
        for key in ["a/s0.a", "b/s1.b", "a/"] {
            s.put(&format!("refused {key}"), r.refused_hosts.contains(key));
        }
        let mut policies: Vec<_> = r.policies.keys().cloned().collect();
        policies.sort();
        s.put("policies", policies);
        for ns in ["a", "b", "c"] {
            let scoped = |n: &str| r.scoped.get(n).cloned().unwrap_or_default();
            let mut applied: Vec<_> = scoped("")
                .into_iter()
                .chain(scoped(ns))
                .map(|k| (k.clone(), r.policies[&k].refused.is_some()))
                .collect();
            for k in POLICY_KEYS {
                match r.policies.get(k) {
                    Some(p) if p.scope == PolicyScope::WorkloadSelector => {
                        applied.push((k.to_string(), p.refused.is_some()))
                    }
                    None if r.missing.contains(k) => applied.push((k.to_string(), true)),
                    _ => {}
                }
            }
            s.put(&format!("policies for {ns}"), applied);
        }
        s.put("refused workloads", r.refused_workloads.clone());
        s.put("refused services", r.refused_services.clone());
        for name in names.iter().chain(policy_names) {
            s.put(&format!("left out {name}"), r.left_out.contains(name));
        }
        s.lines.join("\n")
    }

    fn put(&mut self, what: &str, value: impl std::fmt::Debug) {
        self.lines.push(format!("{what}: {value:?}"));
    }
}

fn sorted_names<T>(list: &[(String, T)]) -> Vec<String> {
    let mut names: Vec<String> = list.iter().map(|(n, _)| n.clone()).collect();
    names.sort();
    names
}

/// Random sequences of puts, refusals and removals, as xDS would send
/// them: after every step the state changed in place shows what a build
/// from scratch of the resources then held shows, and the copy taken
/// before the step still shows what it showed.
#[test]
fn a_state_changed_resource_by_resource_equals_one_built_from_scratch() {
    for seed in 0..300 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut st = State::default();
        // What is held, in arrival order, as the reference takes it.
        let mut addresses: Vec<(String, Result<Workload, Service>)> = Vec::new();
        let mut refusals: Vec<(String, Claims)> = Vec::new();
        let mut valid: Vec<(String, Authorization)> = Vec::new();
        let mut stand_ins: Vec<(String, Authorization)> = Vec::new();
        let names: Vec<String> = (0..6).map(|i| format!("r{i}")).collect();
        let policy_names: Vec<String> = (0..4).map(|i| format!("q{i}")).collect();
        let mut log = Vec::new();
        let mut before: Option<(State, String)> = None;
        for _ in 0..40 {
            let name = pick(&mut rng, &names).clone();
            let policy_name = pick(&mut rng, &policy_names).clone();
            match rng.u8(..100) {
                n @ 0..=44 => {
                    // A workload, or (a third of the time) a service.
                    let a = match n {
                        0..=29 => Ok(random_workload(&mut rng)),
                        _ => Err(random_service(&mut rng)),
                    };
                    log.push(format!("put {name} {a:?}"));
                    let resource = match a.clone() {
                        Ok(w) => AddressResource::Workload(Arc::new(w)),
                        Err(s) => AddressResource::Service(Arc::new(s)),
                    };
                    st.put_address(&name, "v", resource);
                    addresses.retain(|(n, _)| *n != name);
                    refusals.retain(|(n, _)| *n != name);
                    addresses.push((name, a));
                }
                45..=54 => {
                    log.push(format!("remove {name}"));
                    st.remove_address(&name);
                    addresses.retain(|(n, _)| *n != name);
                    refusals.retain(|(n, _)| *n != name);
                }
                55..=64 => {
                    let claims = Claims::of_workload(&random_workload(&mut rng));
                    log.push(format!("refuse {name} {claims:?}"));
                    st.refuse_address(&name, claims.clone(), "refused".into());
                    refusals.retain(|(n, _)| *n != name);
                    refusals.push((name, claims));
                }
                65..=79 => {
                    let p = random_policy(&mut rng);
                    log.push(format!("put policy {policy_name} {p:?}"));
                    st.put_policy(&policy_name, "v", p.clone());
                    valid.retain(|(n, _)| *n != policy_name);
                    stand_ins.retain(|(n, _)| *n != policy_name);
                    valid.push((policy_name, p));
                }
                80..=89 => {
                    log.push(format!("remove policy {policy_name}"));
                    st.remove_policy(&policy_name);
                    valid.retain(|(n, _)| *n != policy_name);
                    stand_ins.retain(|(n, _)| *n != policy_name);
                }
                _ => {
                    // Its own key: a stand-in never conflicts with a
                    // valid policy of another resource.
                    let key = format!("x/refused-{policy_name}");
                    let p = Authorization::refused_stand_in(&key, "refused".into());
                    log.push(format!("refuse policy {policy_name}"));
                    st.refuse_policy(&policy_name, p.clone());
                    if !valid.iter().any(|(n, _)| *n == policy_name) {
                        stand_ins.retain(|(n, _)| *n != policy_name);
                        stand_ins.push((policy_name, p));
                    }
                }
            }
            let deciding: Vec<_> = valid.iter().chain(&stand_ins).cloned().collect();
            let reference = Reference::build(&addresses, &refusals, &deciding);
            let expected = Seen::of_reference(&reference, &names, &policy_names);
            let seen = Seen::of_state(&st, &names, &policy_names);
            if seen != expected {
                let diff: Vec<_> = seen
                    .lines()
                    .zip(expected.lines())
                    .filter(|(a, b)| a != b)
                    .map(|(a, b)| format!("  changed in place: {a}\n  built from scratch: {b}"))
                    .collect();
                panic!(
                    "seed {seed}, after:\n{}\ndiffers:\n{}",
                    log.join("\n"),
                    diff.join("\n")
                );
            }
            // The versions a reconnect sends: every valid resource held.
            let held = |v: &mut dyn Iterator<Item = (&str, &str)>| {
                let mut names: Vec<String> = v.map(|(n, _)| n.to_string()).collect();
                names.sort();
                names
            };
            assert_eq!(held(&mut st.address_versions()), sorted_names(&addresses));
            assert_eq!(held(&mut st.policy_versions()), sorted_names(&valid));
            if let Some((copy, was)) = before.take() {
                let now = Seen::of_state(&copy, &names, &policy_names);
                assert_eq!(
                    now,
                    was,
                    "seed {seed}: a copy changed after:\n{}",
                    log.join("\n")
                );
            }
            before = Some((st.clone(), seen));
        }
    }
}

#[test]
fn a_queue_is_sixteen_bytes_and_gives_back_its_holders_in_order() {
    use super::change::Queue;
    assert_eq!(std::mem::size_of::<Queue<Workload>>(), 16);
    let holders: Vec<(u64, Arc<String>)> = (0..4u64)
        .map(|i| (i * 10, Arc::new(format!("h{i}"))))
        .collect();
    for n in 0..=holders.len() {
        let given = holders[..n].to_vec();
        let q = Queue::from(given.clone());
        let read: Vec<(u64, Arc<String>)> = q.iter().map(|(a, v)| (a, v.clone())).collect();
        assert_eq!(read, given);
        let ends = |v: Option<&(u64, Arc<String>)>| v.map(|(a, h)| (*a, h.clone()));
        assert_eq!(q.first().map(|(a, v)| (a, v.clone())), ends(given.first()));
        assert_eq!(q.last().map(|(a, v)| (a, v.clone())), ends(given.last()));
        // A clone shares the holders; dropping both lets them go.
        let copy = q.clone();
        assert_eq!(copy.iter().count(), n);
        drop((q, copy, read, given));
        assert!(holders.iter().all(|(_, h)| Arc::strong_count(h) == 1));
    }
}

mod bulk;
