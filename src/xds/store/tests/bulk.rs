//! A first push put at once against the same push put one by one.

use std::net::IpAddr;
use std::sync::Arc;

use super::*;

/// A change of one of a few address resource names.
#[derive(Clone)]
enum Change {
    Put(String, String, AddressResource),
    Refuse(String, Claims, String),
    Remove(String),
}

impl Change {
    fn random(rng: &mut fastrand::Rng, names: &[String], removals: bool) -> Change {
        let name = pick(rng, names).clone();
        match rng.u8(..100) {
            0..=69 => {
                let resource = match rng.u8(..3) {
                    0 => AddressResource::Service(Arc::new(service_with_ranges(rng))),
                    _ => AddressResource::Workload(Arc::new(random_workload(rng))),
                };
                Change::Put(name, format!("v{}", rng.u8(..9)), resource)
            }
            70..=84 if removals => Change::Remove(name),
            _ => {
                let claims = match rng.bool() {
                    true => Claims::of_workload(&random_workload(rng)),
                    false => Claims::of_service(&service_with_ranges(rng)),
                };
                Change::Refuse(name, claims, format!("refused {}", rng.u8(..9)))
            }
        }
    }

    fn apply(self, st: &mut State) {
        match self {
            Change::Put(name, version, resource) => drop(st.put_address(&name, &version, resource)),
            Change::Refuse(name, claims, reason) => st.refuse_address(&name, claims, reason),
            Change::Remove(name) => st.remove_address(&name),
        }
    }

    fn stage(self, bulk: &mut crate::xds::store::bulk::Bulk) {
        match self {
            Change::Put(name, version, resource) => bulk.put(&name, &version, resource),
            Change::Refuse(name, claims, reason) => bulk.refuse(&name, claims, reason),
            Change::Remove(_) => unreachable!("a push staged has no removals"),
        }
    }
}

/// A random service, some with VIP ranges over the VIPs looked up.
fn service_with_ranges(rng: &mut fastrand::Rng) -> Service {
    let mut s = random_service(rng);
    for range in ["10.96.0.0/30", "10.96.0.2/31"] {
        if rng.u8(..3) == 0 {
            s.cidr_vips
                .push(NetworkCidr::try_from(range.to_string()).unwrap());
        }
    }
    s
}

/// What [`Seen`] does not show: the reasons, the refusals' text, and
/// the counts and ranges the state keeps beside its lookups.
fn inside(st: &State, names: &[String]) -> String {
    let mut lines: Vec<String> = names
        .iter()
        .map(|n| format!("left out {n}: {:?}", st.left_out(n)))
        .collect();
    let mut refusals: Vec<String> = st
        .refusals()
        .map(|(claim, r)| format!("refused {claim}: {r:?}"))
        .collect();
    refusals.sort();
    lines.extend(refusals);
    let mut counts: Vec<String> = (st
        .networks
        .iter()
        .map(|(n, c)| format!("network {n:?}: {c}")))
    .chain(
        st.named_policies
            .iter()
            .map(|(k, c)| format!("named {k}: {c}")),
    )
    .chain(st.missing_policies.keys().map(|k| format!("missing {k}")))
    .chain(
        st.services_by_cidr
            .iter()
            .map(|(a, (c, s))| format!("range {a} {c} {}", s.key())),
    )
    .collect();
    counts.sort();
    lines.extend(counts);
    lines.join("\n")
}

/// A first push put at once (its maps built whole) makes the state that
/// putting its resources one by one makes, conflicts, refusals and names
/// given twice included; and both then change alike.
#[test]
fn a_first_push_put_at_once_equals_it_put_resource_by_resource() {
    let names: Vec<String> = (0..7).map(|i| format!("r{i}")).collect();
    let policy_names: Vec<String> = (0..4).map(|i| format!("q{i}")).collect();
    let versions = |st: &State| {
        let mut v: Vec<(String, String)> = st
            .address_versions()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        v.sort();
        v
    };
    let mut left_out_seen = 0;
    for seed in 0..600 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut one = State::default();
        for name in &policy_names {
            if rng.bool() {
                one.put_policy(name, "v", random_policy(&mut rng));
            }
        }
        let mut all = one.clone();
        let mut bulk = all.bulk_addresses(0).expect("no address held");
        for _ in 0..rng.usize(0..40) {
            let change = Change::random(&mut rng, &names, false);
            change.clone().stage(&mut bulk);
            change.apply(&mut one);
        }
        let mut left_out: Vec<String> = all
            .put_addresses(bulk)
            .iter()
            .map(|n| n.to_string())
            .collect();
        left_out.sort();
        let expected: Vec<String> = names
            .iter()
            .filter(|n| one.left_out(n).is_some())
            .cloned()
            .collect();
        assert_eq!(left_out, expected, "seed {seed}: the names left out");
        left_out_seen += left_out.len();
        assert_eq!(all.arrivals, one.arrivals, "seed {seed}");
        for step in 0..12 {
            assert_eq!(
                Seen::of_state(&all, &names, &policy_names),
                Seen::of_state(&one, &names, &policy_names),
                "seed {seed}, step {step}"
            );
            assert_eq!(versions(&all), versions(&one), "seed {seed}, step {step}");
            assert_eq!(
                inside(&all, &names),
                inside(&one, &names),
                "seed {seed}, step {step}"
            );
            // Then changed one by one, both alike.
            let change = Change::random(&mut rng, &names, true);
            change.clone().apply(&mut all);
            change.apply(&mut one);
        }
    }
    assert!(left_out_seen > 100, "conflicts were made: {left_out_seen}");
}

/// A first push large enough that every map splits into branches, with
/// a few of everything that does not serve: put at once, it makes the
/// state put one by one makes, lookup by lookup.
#[test]
fn a_large_first_push_put_at_once_equals_it_put_one_by_one() {
    let mut rng = fastrand::Rng::with_seed(46);
    let ip = |i: u32| IpAddr::from((0x0a00_0000 + i).to_be_bytes());
    let mut changes = Vec::new();
    for i in 0..6_000u32 {
        let uid = match rng.u8(..50) {
            0 => {
                // The uid of one given before.
                let j = rng.u32(..i + 1);
                format!("c//Pod/ns{}/w{j}", j % 7)
            }
            _ => format!("c//Pod/ns{}/w{i}", i % 7),
        };
        let svc = Name::from(format!("ns{}/s{}.ns{}", i % 7, i % 300, i % 7));
        let w = Workload {
            uid: Name::from(uid),
            name: Name::from(format!("w{i}")),
            namespace: Name::intern(&format!("ns{}", i % 7)),
            network: Name::intern(["", "west"][(i % 2) as usize]),
            workload_ips: [ip(rng.u32(..5_000))].into(),
            services: BackedServices::new([(svc, Ports::new([(80, 8080)]))]),
            authorization_policies: [Name::from(format!("ns{}/p{}", i % 7, i % 11))].into(),
            ..Workload::default()
        };
        // Now and then a name given again, or a refusal.
        let name = match rng.u8(..40) {
            0 => format!("r{}", rng.u32(..i + 1)),
            _ => format!("r{i}"),
        };
        changes.push(match rng.u8(..60) {
            0 => Change::Refuse(name, Claims::of_workload(&w), "refused".into()),
            _ => Change::Put(name, "v1".into(), AddressResource::Workload(Arc::new(w))),
        });
    }
    for s in 0..330u32 {
        // The last 30 take the keys of the first 30.
        let ns = (s % 300) % 7;
        let svc = Service {
            name: format!("s{}", s % 300),
            namespace: format!("ns{ns}"),
            hostname: format!("s{}.ns{ns}", s % 300),
            vips: vec![NetworkAddress {
                network: Name::default(),
                address: IpAddr::from([10, 96, (s / 256) as u8, s as u8]),
            }],
            ..Service::default()
        };
        let resource = AddressResource::Service(Arc::new(svc));
        changes.push(Change::Put(format!("svc{s}"), "v1".into(), resource));
    }
    let mut one = State::default();
    one.put_policy("p", "v", random_policy(&mut rng));
    let mut all = one.clone();
    let mut bulk = all.bulk_addresses(changes.len()).expect("no address held");
    for change in changes {
        change.clone().stage(&mut bulk);
        change.apply(&mut one);
    }
    let left_out = all.put_addresses(bulk);
    assert!(left_out.len() > 100, "{} left out", left_out.len());
    assert!(left_out.iter().all(|n| one.left_out(n).is_some()));
    let names: Vec<String> = (0..6_000)
        .map(|i| format!("r{i}"))
        .chain((0..330).map(|s| format!("svc{s}")))
        .collect();
    assert_eq!(inside(&all, &names), inside(&one, &names));
    for network in ["", "west"] {
        for i in 0..5_000 {
            let at = |st: &State| st.workload_by_addr(network, ip(i)).map(|w| w.uid.clone());
            assert_eq!(at(&all), at(&one), "{network}/{}", ip(i));
            let elsewhere = |st: &State| st.workload_elsewhere(network, ip(i)).is_some();
            assert_eq!(elsewhere(&all), elsewhere(&one));
        }
    }
    for i in 0..6_000 {
        let ns = format!("ns{}", i % 7);
        let by_name = |st: &State| {
            st.workload_by_name(&ns, &format!("w{i}"))
                .map(|w| w.uid.clone())
        };
        assert_eq!(by_name(&all), by_name(&one));
    }
    let keys = |st: &State| {
        let mut keys: Vec<(String, Vec<Name>)> = st
            .services()
            .map(|s| {
                (
                    s.key(),
                    st.endpoints(s).map(|e| e.workload.uid.clone()).collect(),
                )
            })
            .collect();
        keys.sort();
        keys
    };
    assert_eq!(keys(&all), keys(&one));
    let uids = |st: &State| {
        let mut uids: Vec<Name> = st.workloads().map(|w| w.uid.clone()).collect();
        uids.sort();
        uids
    };
    assert_eq!(uids(&all), uids(&one));
    assert_eq!(all.arrivals, one.arrivals);
    assert!(
        matches!(all.workloads.len(), 5_000..=6_000),
        "{} workloads",
        all.workloads.len()
    );
}
