//! L4 authorization (Istio `AuthorizationPolicy` as ztunnel applies it): which
//! policies apply to a destination workload, and whether a connection is
//! allowed. Pure code over the state's policy values.
//!
//! Order: a matching DENY denies; with no ALLOW policy the connection is
//! allowed; a matching ALLOW allows; otherwise it is denied. A policy that
//! cannot be evaluated (refused, or named by the workload but not held)
//! fails closed: as a DENY it matches every connection it applies to, as an
//! ALLOW none (ztunnel ignores a named policy it does not hold, which
//! allows what the policy may have been sent to forbid). Dry-run policies
//! are evaluated and reported but never decide. Matching: rules OR, clauses
//! AND, matches OR; inside a match every listed field must hold (any positive
//! value, no negative value).

use std::net::IpAddr;

use crate::identity::Identity;
use crate::xds::types::{Authorization, PolicyAction, RbacMatch, StringMatch, Workload};
use crate::xds::State;

/// What policy evaluation looks at.
#[derive(Debug, Clone)]
pub struct Connection<'a> {
    /// The peer's verified identity; `None` for plaintext.
    pub src_identity: Option<&'a Identity>,
    pub src_ip: IpAddr,
    pub dst_ip: IpAddr,
    pub dst_port: u16,
}

/// The verdict, with the policy that decided it (if any) and dry-run notes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: bool,
    /// `ns/name` of the deciding policy; `None` when allowed by default.
    pub policy: Option<String>,
    /// Dry-run policies that would have changed the outcome: (`ns/name`, would-allow).
    pub dry_run: Vec<(String, bool)>,
}

/// The policies that apply to a workload in `namespace` that names `selected`
/// (`ns/name` keys): its namespace's, the global ones, and those it names.
pub fn applicable<'a>(
    state: &'a State,
    namespace: &str,
    selected: &'a [crate::xds::types::Name],
) -> impl Iterator<Item = &'a Authorization> + 'a {
    state.policies_for(namespace, selected).map(|p| p.as_ref())
}

/// [`applicable`] for a workload from the state.
pub fn applicable_to<'a>(
    state: &'a State,
    workload: &'a Workload,
) -> impl Iterator<Item = &'a Authorization> + 'a {
    applicable(state, &workload.namespace, &workload.authorization_policies)
}

/// Decides a connection against `policies`.
pub fn evaluate<'a>(
    policies: impl Iterator<Item = &'a Authorization>,
    conn: &Connection<'_>,
) -> Verdict {
    let subject = Subject {
        conn,
        principal: conn
            .src_identity
            .map(|i| i.to_string().trim_start_matches("spiffe://").to_string()),
    };
    let mut allow_exists = false;
    let mut allow_match = None;
    let mut dry_run = Vec::new();
    let mut deny_match = None;
    for p in policies {
        if let Some(reason) = &p.refused {
            // Not evaluable: it fails closed (a DENY denies every connection
            // it applies to, an ALLOW allows none), dry-run ones excepted.
            match p.action {
                _ if p.dry_run => {}
                PolicyAction::Deny if deny_match.is_none() => {
                    deny_match = Some(format!("{} (refused: {reason})", p.key()))
                }
                PolicyAction::Deny => {}
                PolicyAction::Allow => allow_exists = true,
            }
            continue;
        }
        let hit = policy_matches(p, &subject);
        if p.dry_run {
            if hit {
                dry_run.push((p.key(), p.action == PolicyAction::Allow));
            }
            continue;
        }
        match p.action {
            PolicyAction::Deny if hit && deny_match.is_none() => deny_match = Some(p.key()),
            PolicyAction::Deny => {}
            PolicyAction::Allow => {
                allow_exists = true;
                if hit && allow_match.is_none() {
                    allow_match = Some(p.key());
                }
            }
        }
    }
    if let Some(policy) = deny_match {
        return Verdict {
            allowed: false,
            policy: Some(policy),
            dry_run,
        };
    }
    if !allow_exists {
        return Verdict {
            allowed: true,
            policy: None,
            dry_run,
        };
    }
    match allow_match {
        Some(policy) => Verdict {
            allowed: true,
            policy: Some(policy),
            dry_run,
        },
        None => Verdict {
            allowed: false,
            policy: Some("no ALLOW policy matched".into()),
            dry_run,
        },
    }
}

/// A connection with its principal spelled out once (not once per match).
struct Subject<'a> {
    conn: &'a Connection<'a>,
    principal: Option<String>,
}

fn policy_matches(p: &Authorization, s: &Subject<'_>) -> bool {
    // rules OR; a rule is clauses AND; a clause is matches OR. No rules: matches nothing.
    p.rules.iter().any(|rule| {
        rule.iter()
            .all(|clause| clause.iter().any(|m| match_holds(m, s)))
    })
}

fn any_or_empty<T>(list: &[T], f: impl Fn(&T) -> bool) -> bool {
    list.is_empty() || list.iter().any(f)
}

fn none<T>(list: &[T], f: impl Fn(&T) -> bool) -> bool {
    !list.iter().any(f)
}

fn string_matches(m: &StringMatch, value: Option<&str>) -> bool {
    let Some(v) = value else { return false };
    match m {
        StringMatch::Exact(s) => v == s,
        StringMatch::Prefix(s) => v.starts_with(s.as_str()),
        StringMatch::Suffix(s) => v.ends_with(s.as_str()),
        StringMatch::Presence => !v.is_empty(),
    }
}

fn match_holds(m: &RbacMatch, s: &Subject<'_>) -> bool {
    let c = s.conn;
    let ns = c.src_identity.map(|i| i.namespace.as_str());
    let principal = s.principal.as_deref();
    let sa = |m: &crate::xds::types::ServiceAccountMatch| {
        c.src_identity
            .is_some_and(|i| i.namespace == m.namespace && i.service_account == m.service_account)
    };
    any_or_empty(&m.namespaces, |x| string_matches(x, ns))
        && none(&m.not_namespaces, |x| string_matches(x, ns))
        && any_or_empty(&m.principals, |x| string_matches(x, principal))
        && none(&m.not_principals, |x| string_matches(x, principal))
        && any_or_empty(&m.service_accounts, sa)
        && none(&m.not_service_accounts, sa)
        && any_or_empty(&m.source_ips, |n| n.contains(c.src_ip))
        && none(&m.not_source_ips, |n| n.contains(c.src_ip))
        && any_or_empty(&m.destination_ips, |n| n.contains(c.dst_ip))
        && none(&m.not_destination_ips, |n| n.contains(c.dst_ip))
        && any_or_empty(&m.destination_ports, |p| *p == c.dst_port)
        && none(&m.not_destination_ports, |p| *p == c.dst_port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn state(policies: &str) -> State {
        // The workload names `shop/pinned` where the test defines it (a
        // named policy that is not held denies everything).
        let named = if policies.contains("name: pinned") {
            "[shop/pinned]"
        } else {
            "[]"
        };
        let text = format!(
            "workloads:\n- {{name: web, namespace: shop, workloadIps: [10.0.0.3], protocol: HBONE, authorizationPolicies: {named}}}\npolicies:\n{policies}"
        );
        crate::xds::local::parse(Path::new("t.yaml"), &text).unwrap()
    }

    fn decide(policies: &str, from: Option<(&str, &str)>, src_ip: &str, port: u16) -> Verdict {
        let st = state(policies);
        let w = st.workload_by_name("shop", "web").unwrap().clone();
        let id = from.map(|(ns, sa)| Identity::new("cluster.local", ns, sa));
        let conn = Connection {
            src_identity: id.as_ref(),
            src_ip: src_ip.parse().unwrap(),
            dst_ip: "10.0.0.3".parse().unwrap(),
            dst_port: port,
        };
        evaluate(applicable_to(&st, &w), &conn)
    }

    const FRONT: Option<(&str, &str)> = Some(("front", "ui"));

    #[test]
    fn no_policy_allows() {
        assert!(decide("  []\n", FRONT, "10.0.0.2", 80).allowed);
    }

    #[test]
    fn allow_nothing_denies_everything() {
        // Istio's "allow-nothing": an ALLOW policy with no rules.
        assert!(
            !decide(
                "- {name: allow-nothing, namespace: shop, action: Allow}",
                FRONT,
                "10.0.0.2",
                80
            )
            .allowed
        );
    }

    #[test]
    fn allow_all_with_one_empty_rule() {
        assert!(
            decide(
                "- {name: allow-all, namespace: shop, action: Allow, rules: [[]]}",
                FRONT,
                "10.0.0.2",
                80
            )
            .allowed
        );
    }

    #[test]
    fn deny_beats_allow_and_names_the_policy() {
        let p = "- {name: allow-front, namespace: shop, action: Allow, rules: [[[{namespaces: [!Exact front]}]]]}\n- {name: deny-8080, namespace: shop, action: Deny, rules: [[[{destinationPorts: [8080]}]]]}\n";
        assert_eq!(
            decide(p, FRONT, "10.0.0.2", 80),
            Verdict {
                allowed: true,
                policy: Some("shop/allow-front".into()),
                dry_run: vec![]
            }
        );
        let v = decide(p, FRONT, "10.0.0.2", 8080);
        assert!(!v.allowed);
        assert_eq!(v.policy.as_deref(), Some("shop/deny-8080"));
        assert!(
            !decide(p, Some(("other", "x")), "10.0.0.2", 80).allowed,
            "ALLOW exists, none matches"
        );
    }

    #[test]
    fn principals_without_spiffe_prefix_and_string_forms() {
        let p = "- {name: a, namespace: shop, action: Allow, rules: [[[{principals: [!Exact cluster.local/ns/front/sa/ui, !Suffix /sa/admin]}]]]}\n";
        assert!(decide(p, FRONT, "10.0.0.2", 80).allowed);
        assert!(decide(p, Some(("ops", "admin")), "10.0.0.2", 80).allowed);
        assert!(!decide(p, Some(("ops", "other")), "10.0.0.2", 80).allowed);
        let presence =
            "- {name: a, namespace: shop, action: Allow, rules: [[[{principals: [Presence]}]]]}\n";
        assert!(decide(presence, FRONT, "10.0.0.2", 80).allowed);
        assert!(
            !decide(presence, None, "10.0.0.2", 80).allowed,
            "plaintext has no principal"
        );
    }

    #[test]
    fn clauses_and_matches_combine() {
        // (ns front) AND (port 80 OR port 443)
        let p = "- {name: a, namespace: shop, action: Allow, rules: [[[{namespaces: [!Exact front]}], [{destinationPorts: [80]}, {destinationPorts: [443]}]]]}\n";
        assert!(decide(p, FRONT, "10.0.0.2", 443).allowed);
        assert!(!decide(p, FRONT, "10.0.0.2", 22).allowed);
        assert!(!decide(p, Some(("back", "x")), "10.0.0.2", 80).allowed);
    }

    #[test]
    fn negative_fields_and_cidrs() {
        let p = "- {name: a, namespace: shop, action: Deny, rules: [[[{sourceIps: [10.0.0.0/24], notSourceIps: [10.0.0.9]}]]]}\n";
        assert!(!decide(p, FRONT, "10.0.0.2", 80).allowed);
        assert!(
            decide(p, FRONT, "10.0.0.9", 80).allowed,
            "excluded by notSourceIps"
        );
        assert!(decide(p, FRONT, "10.1.0.2", 80).allowed, "outside the CIDR");
        let sa = "- {name: a, namespace: shop, action: Deny, rules: [[[{notServiceAccounts: [{namespace: front, serviceAccount: ui}]}]]]}\n";
        assert!(decide(sa, FRONT, "10.0.0.2", 80).allowed);
        assert!(!decide(sa, Some(("front", "batch")), "10.0.0.2", 80).allowed);
    }

    #[test]
    fn scope_global_namespace_and_selector() {
        let other_ns = "- {name: a, namespace: elsewhere, action: Deny, rules: [[]]}\n";
        assert!(
            decide(other_ns, FRONT, "10.0.0.2", 80).allowed,
            "another namespace's policy does not apply"
        );
        let global =
            "- {name: a, namespace: istio-system, scope: Global, action: Deny, rules: [[]]}\n";
        assert!(!decide(global, FRONT, "10.0.0.2", 80).allowed);
        let pinned = "- {name: pinned, namespace: shop, scope: WorkloadSelector, action: Deny, rules: [[]]}\n- {name: unpinned, namespace: shop, scope: WorkloadSelector, action: Allow}\n";
        let v = decide(pinned, FRONT, "10.0.0.2", 80);
        assert_eq!(
            (v.allowed, v.policy.as_deref()),
            (false, Some("shop/pinned")),
            "only the named selector policy applies"
        );
    }

    #[test]
    fn a_named_policy_not_held_denies_until_it_arrives() {
        let text = |policies: &str| {
            format!("workloads:\n- {{name: web, namespace: shop, workloadIps: [10.0.0.3], authorizationPolicies: [shop/late]}}\npolicies: {policies}\n")
        };
        let verdict = |st: &State| {
            let w = st.workload_by_name("shop", "web").unwrap();
            let id = Identity::new("cluster.local", "front", "ui");
            let conn = Connection {
                src_identity: Some(&id),
                src_ip: "10.0.0.2".parse().unwrap(),
                dst_ip: "10.0.0.3".parse().unwrap(),
                dst_port: 80,
            };
            evaluate(applicable_to(st, w), &conn)
        };
        let before = crate::xds::local::parse(Path::new("t.yaml"), &text("[]")).unwrap();
        let v = verdict(&before);
        assert!(!v.allowed, "no ALLOW policy held is not 'allow'");
        assert!(
            v.policy
                .as_deref()
                .unwrap()
                .starts_with("shop/late (refused: named by the workload but not held"),
            "{v:?}"
        );
        let arrived = crate::xds::local::parse(
            Path::new("t.yaml"),
            &text("[{name: late, namespace: shop, scope: WorkloadSelector, action: Allow, rules: [[]]}]"),
        )
        .unwrap();
        assert!(verdict(&arrived).allowed);
    }

    #[test]
    fn a_refused_policy_fails_closed_where_it_applies() {
        let refused = |name: &str, action: PolicyAction, scope: crate::xds::types::PolicyScope| {
            Authorization {
                name: name.into(),
                namespace: "shop".into(),
                scope,
                action,
                rules: vec![],
                dry_run: false,
                refused: Some("extension \"istio.io/l7\" is not supported".into()),
            }
        };
        let web = Workload {
            name: "web".into(),
            namespace: "shop".into(),
            workload_ips: ["10.0.0.3".parse().unwrap()].into(),
            ..Workload::default()
        };
        let allow_front: Authorization = serde_yaml::from_str(
            "{name: allow-front, namespace: shop, action: Allow, rules: [[[{namespaces: [!Exact front]}]]]}",
        )
        .unwrap();
        let decide = |policies: Vec<Authorization>, from: &str| {
            let (st, errors) = State::build_lenient(vec![web.clone()], vec![], policies);
            assert!(errors.is_empty(), "{errors:?}");
            let w = st.workload_by_name("shop", "web").unwrap().clone();
            let id = Identity::new("cluster.local", from, "sa");
            let conn = Connection {
                src_identity: Some(&id),
                src_ip: "10.0.0.2".parse().unwrap(),
                dst_ip: "10.0.0.3".parse().unwrap(),
                dst_port: 80,
            };
            evaluate(applicable_to(&st, &w), &conn)
        };
        use crate::xds::types::PolicyScope::{Global, Namespace};
        // A refused DENY in the workload's namespace (or global) denies every
        // connection to it, even one a valid ALLOW allows.
        for scope in [Namespace, Global] {
            let v = decide(
                vec![
                    allow_front.clone(),
                    refused("no-l7", PolicyAction::Deny, scope),
                ],
                "front",
            );
            assert!(!v.allowed, "{scope:?}");
            assert!(v
                .policy
                .unwrap()
                .starts_with("shop/no-l7 (refused: extension"));
        }
        // A refused ALLOW allows nothing itself: only what a valid ALLOW allows.
        assert!(
            !decide(
                vec![refused("l7-allow", PolicyAction::Allow, Namespace)],
                "front"
            )
            .allowed
        );
        let both = vec![
            allow_front.clone(),
            refused("l7-allow", PolicyAction::Allow, Namespace),
        ];
        assert!(decide(both.clone(), "front").allowed);
        assert!(!decide(both, "back").allowed);
        // A refused policy of another namespace does not apply.
        let mut elsewhere = refused("no-l7", PolicyAction::Deny, Namespace);
        elsewhere.namespace = "other".into();
        assert!(decide(vec![elsewhere], "front").allowed);
    }

    #[test]
    fn dry_run_only_reports() {
        let p = "- {name: would-deny, namespace: shop, action: Deny, dryRun: true, rules: [[]]}\n";
        let v = decide(p, FRONT, "10.0.0.2", 80);
        assert!(v.allowed);
        assert_eq!(v.dry_run, vec![("shop/would-deny".to_string(), false)]);
    }

    #[test]
    fn cidr_math() {
        use crate::xds::types::Cidr;
        let c = |s: &str| Cidr::try_from(s.to_string());
        assert!(c("10.0.0.0/8")
            .unwrap()
            .contains("10.200.1.1".parse().unwrap()));
        assert!(!c("10.0.0.0/8")
            .unwrap()
            .contains("11.0.0.1".parse().unwrap()));
        assert!(c("0.0.0.0/0").unwrap().contains("1.2.3.4".parse().unwrap()));
        assert!(c("fd00::/8").unwrap().contains("fd12::1".parse().unwrap()));
        assert!(c("10.0.0.1")
            .unwrap()
            .contains("::ffff:10.0.0.1".parse().unwrap()));
        assert!(c("bogus").is_err() && c("10.0.0.0/33").is_err());
    }
}
