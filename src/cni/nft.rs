//! The in-pod rules in nftables (issue #54): the same rules as the iptables
//! back end ([`super::rules::pod_rules`]), rendered as one `nft -f`
//! transaction over istio-cni's native nftables tables, `inet
//! istio-ambient-nat`, `-mangle` and `-raw` (one table serves IPv4 and
//! IPv6), with its chain names, hooks and priorities. Pure text; `redirect`
//! runs it in the pod's netns.
//!
//! One transaction applies all three tables atomically: each is deleted
//! and made again in it (a table of ours left by an earlier apply, a crash
//! or another tool keeps nothing it held, and a table the switches no
//! longer want is gone), and the kernel takes the whole transaction or
//! none of it. istio-cni flushes its tables instead, which keeps a table
//! it no longer fills and chains it no longer uses.

use super::redirect::{Family, RedirectOptions};
use super::rules::{pod_rules, Hook, Rule, Table};
use crate::constants::{
    CONNMARK, DNS_PORT, HBONE_PORT, INBOUND_PLAINTEXT_PORT, MARK_MASK, OUTBOUND_PORT, PROXY_MARK,
};

/// Our tables, in the order a transaction writes them.
pub const TABLES: [(Table, &str); 3] = [
    (Table::Nat, "istio-ambient-nat"),
    (Table::Mangle, "istio-ambient-mangle"),
    (Table::Raw, "istio-ambient-raw"),
];

/// The transaction that leaves exactly `opts`' rules in a netns.
pub fn render(opts: &RedirectOptions) -> String {
    render_as(opts, false)
}

/// The transaction for a netns with none of our tables (a new pod's): the
/// same tables, each made with `create`, so the whole transaction fails
/// (and changes nothing) if one is there already, for [`render`] to
/// replace it. A table's `delete` costs the kernel a grace period (about
/// 10 ms here, most of an apply), which a fresh netns does not need.
pub fn render_fresh(opts: &RedirectOptions) -> String {
    render_as(opts, true)
}

fn render_as(opts: &RedirectOptions, fresh: bool) -> String {
    let rules = pod_rules(opts);
    let mut s = String::new();
    for (table, name) in TABLES {
        if !fresh {
            // `add` first, so that `delete` never fails on a table not there.
            s.push_str(&format!(
                "add table inet {name}\ndelete table inet {name}\n"
            ));
        }
        let mine: Vec<&Rule> = rules.iter().filter(|r| r.table() == table).collect();
        if mine.is_empty() {
            continue;
        }
        // Types, hooks and priorities as istio-cni's (its library writes
        // the named priorities as numbers: dstnat -100, mangle -150, raw
        // -300); mangle's output is a route chain, so that a mark set
        // there routes the packet again (to table 100).
        let (pre, out, priority) = match table {
            Table::Nat => ("nat", "nat", -100),
            Table::Mangle => ("filter", "route", -150),
            Table::Raw => ("filter", "filter", -300),
        };
        let make = if fresh { "create" } else { "add" };
        s.push_str(&format!("{make} table inet {name}\n"));
        s.push_str(&format!(
            "add chain inet {name} prerouting {{ type {pre} hook prerouting priority {priority} ; }}\n"
        ));
        s.push_str(&format!(
            "add chain inet {name} output {{ type {out} hook output priority {priority} ; }}\n"
        ));
        s.push_str(&format!("add chain inet {name} istio-prerouting\n"));
        s.push_str(&format!("add chain inet {name} istio-output\n"));
        s.push_str(&format!(
            "add rule inet {name} prerouting jump istio-prerouting\n"
        ));
        s.push_str(&format!("add rule inet {name} output jump istio-output\n"));
        for r in mine {
            let chain = match r.hook() {
                Hook::Prerouting => "istio-prerouting",
                Hook::Output => "istio-output",
            };
            s.push_str(&format!("add rule inet {name} {chain} {}\n", rule(r)));
        }
    }
    s
}

/// The transaction that removes our tables (any that are there).
pub fn render_remove() -> String {
    TABLES
        .iter()
        .map(|(_, name)| format!("add table inet {name}\ndelete table inet {name}\n"))
        .collect()
}

/// One rule's statement, as istio-cni writes it (with `counter`).
fn rule(rule: &Rule) -> String {
    let proxy = format!("meta mark & 0x{MARK_MASK:x}");
    let not_proxy = format!("{proxy} != 0x{PROXY_MARK:x}");
    let ip = |f: Family| match f {
        Family::V4 => "ip",
        Family::V6 => "ip6",
    };
    let lo = |f: Family| format!("{} daddr != {}", ip(f), f.localhost());
    match rule {
        Rule::MarkProxyConnections => format!(
            "{proxy} == 0x{PROXY_MARK:x} counter ct mark set ct mark & 0x{:x} | 0x{CONNMARK:x}",
            !MARK_MASK
        ),
        Rule::RestoreProxyMark => {
            format!("ct mark & 0x{MARK_MASK:x} == 0x{CONNMARK:x} counter meta mark set ct mark")
        }
        Rule::VirtualInterfaceToOutbound(vif) => {
            format!("iifname \"{vif}\" meta l4proto tcp counter redirect to :{OUTBOUND_PORT}")
        }
        Rule::VirtualInterfaceDone(vif) => {
            format!("iifname \"{vif}\" meta l4proto tcp counter return")
        }
        Rule::AcceptProbesIn(f) => {
            format!("meta l4proto tcp {} saddr {} counter accept", ip(*f), f.probe_src())
        }
        Rule::AcceptProbesOut(f) => {
            format!("meta l4proto tcp {} daddr {} counter accept", ip(*f), f.probe_src())
        }
        Rule::InboundToProxy(f) => format!(
            "{} tcp dport != {HBONE_PORT} {not_proxy} counter redirect to :{INBOUND_PLAINTEXT_PORT}",
            lo(*f)
        ),
        Rule::DnsUdpToProxy => {
            format!("oifname != \"lo\" {not_proxy} udp dport 53 counter redirect to :{DNS_PORT}")
        }
        Rule::DnsTcpToProxy(f) => {
            format!("{} tcp dport 53 {not_proxy} counter redirect to :{DNS_PORT}", lo(*f))
        }
        Rule::AcceptProxyConnections => {
            format!("meta l4proto tcp {proxy} == 0x{CONNMARK:x} counter accept")
        }
        Rule::AcceptLoopback(f) => format!("oifname \"lo\" {} counter accept", lo(*f)),
        Rule::OutboundToProxy(f) => format!(
            "meta l4proto tcp {} {not_proxy} counter redirect to :{OUTBOUND_PORT}",
            lo(*f)
        ),
        Rule::DnsUpstreamZone => {
            format!("udp dport 53 {proxy} == 0x{PROXY_MARK:x} counter ct zone set 1")
        }
        Rule::DnsAnswersZone => format!("udp sport 53 {not_proxy} counter ct zone set 1"),
    }
}

/// Compares `text` with the golden file `src/cni/testdata/<name>.nft`
/// (`AMBIT_BLESS=1` writes it instead).
#[cfg(test)]
pub(crate) fn check_golden(name: &str, text: &str) {
    let path = format!("{}/src/cni/testdata/{name}.nft", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("AMBIT_BLESS").is_some() {
        std::fs::write(&path, text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(text, want, "{name}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden(name: &str) -> &'static str {
        match name {
            "default" => include_str!("testdata/nft/default.nft"),
            "ipv4_only" => include_str!("testdata/nft/ipv4_only.nft"),
            "dns_off" => include_str!("testdata/nft/dns_off.nft"),
            "bypass_inbound" => include_str!("testdata/nft/bypass_inbound.nft"),
            "virtual_interfaces" => include_str!("testdata/nft/virtual_interfaces.nft"),
            _ => unreachable!(),
        }
    }

    /// Every variant's transaction, one golden each (`AMBIT_BLESS=1`
    /// writes them); `tests/redirect.rs` has the kernel check each.
    fn variants() -> Vec<(&'static str, RedirectOptions)> {
        let d = RedirectOptions::default;
        vec![
            ("default", d()),
            ("ipv4_only", RedirectOptions { ipv6: false, ..d() }),
            (
                "dns_off",
                RedirectOptions {
                    dns_capture: false,
                    ..d()
                },
            ),
            (
                "bypass_inbound",
                RedirectOptions {
                    bypass_inbound: true,
                    ..d()
                },
            ),
            (
                "virtual_interfaces",
                RedirectOptions {
                    virtual_interfaces: vec!["net1".into(), "net2".into()],
                    dns_capture: false,
                    ..d()
                },
            ),
        ]
    }

    #[test]
    fn renders_one_transaction_per_variant_as_the_goldens_say() {
        for (name, opts) in variants() {
            let text = render(&opts);
            if std::env::var_os("AMBIT_BLESS").is_some() {
                let path = format!(
                    "{}/src/cni/testdata/nft/{name}.nft",
                    env!("CARGO_MANIFEST_DIR")
                );
                std::fs::write(path, &text).unwrap();
                continue;
            }
            assert_eq!(text, golden(name), "{name}");
        }
    }

    /// The fresh form is the same transaction but for how each table is
    /// made: no delete, `create` in `add`'s place.
    #[test]
    fn the_fresh_transaction_differs_only_in_making_the_tables() {
        for (name, opts) in variants() {
            let full = render(&opts);
            let fresh = render_fresh(&opts);
            let kept: Vec<&str> = full
                .lines()
                .filter(|l| !l.starts_with("delete table"))
                .collect();
            // Of each table's leading `add`, `delete`, `add`: the second add.
            let mut expect = Vec::new();
            let mut i = 0;
            while i < kept.len() {
                let l = kept[i];
                if l.starts_with("add table") {
                    if kept.get(i + 1) == Some(&l) {
                        expect.push(l.replacen("add", "create", 1));
                        i += 2;
                    } else {
                        i += 1; // a table this variant does not want
                    }
                    continue;
                }
                expect.push(l.to_string());
                i += 1;
            }
            assert_eq!(fresh.lines().collect::<Vec<_>>(), expect, "{name}");
            assert!(!fresh.contains("delete"), "{name}");
        }
    }

    #[test]
    fn each_rule_is_one_nftables_rule_and_removal_takes_every_table() {
        for (name, opts) in variants() {
            let text = render(&opts);
            let rules = text
                .lines()
                .filter(|l| l.starts_with("add rule") && !l.contains(" jump "));
            assert_eq!(rules.count(), pod_rules(&opts).len(), "{name}");
        }
        let removed = render_remove();
        assert_eq!(
            removed.matches("delete table inet istio-ambient-").count(),
            3
        );
        assert!(!removed.contains("add rule"));
    }
}
