//! The iptables back end's text: the rule set as Istio CNI's
//! `iptables-restore` input, the reconciling restore that replaces our
//! chains in place, the removal, and reading our chains back from
//! `iptables-save`.

use super::*;

/// One table's part of the rule set.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Table {
    name: &'static str,
    /// User chains, in declaration order.
    chains: Vec<&'static str>,
    /// (built-in chain, our chain) jumps, in order.
    jumps: Vec<(&'static str, &'static str)>,
    rules: Vec<String>,
}

/// Our chains and jumps found in an `iptables-save` dump, per table.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Present {
    pub(super) tables: BTreeMap<String, PresentTable>,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct PresentTable {
    pub(super) chains: Vec<String>,
    pub(super) jumps: Vec<(String, String)>,
}

impl Present {
    /// Parses `iptables-save` output, keeping only `ISTIO_*` chains and jumps to them.
    pub fn parse(save: &str) -> Self {
        let mut p = Present::default();
        let mut table: Option<&mut PresentTable> = None;
        for line in save.lines() {
            if let Some(name) = line.strip_prefix('*') {
                table = Some(p.tables.entry(name.trim().to_string()).or_default());
                continue;
            }
            let Some(t) = table.as_deref_mut() else {
                continue;
            };
            if let Some(decl) = line.strip_prefix(':') {
                let chain = decl.split_whitespace().next().unwrap_or_default();
                if chain.starts_with("ISTIO_") {
                    t.chains.push(chain.to_string());
                }
            } else if let Some(rule) = line.strip_prefix("-A ") {
                let words: Vec<&str> = rule.split_whitespace().collect();
                if let [from, "-j", to] = words.as_slice() {
                    if to.starts_with("ISTIO_") && !from.starts_with("ISTIO_") {
                        t.jumps.push((from.to_string(), to.to_string()));
                    }
                }
            }
        }
        p.tables
            .retain(|_, t| !t.chains.is_empty() || !t.jumps.is_empty());
        p
    }

    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }
}

impl RedirectRules {
    fn tables(&self, family: Family) -> Vec<Table> {
        let rules: Vec<Rule> = pod_rules(&self.opts)
            .into_iter()
            .filter(|r| r.in_family(family))
            .collect();
        let mut out = Vec::new();
        for (table, name) in [
            (rules::Table::Mangle, "mangle"),
            (rules::Table::Nat, "nat"),
            (rules::Table::Raw, "raw"),
        ] {
            let text: Vec<String> = rules
                .iter()
                .filter(|r| r.table() == table)
                .map(|r| iptables_rule(r, family))
                .collect();
            // Mangle and nat always (as Istio's); raw only with rules.
            if text.is_empty() && table == rules::Table::Raw {
                continue;
            }
            let (chains, jumps) = match table {
                rules::Table::Mangle => (
                    vec!["ISTIO_PRERT", "ISTIO_OUTPUT"],
                    vec![("PREROUTING", "ISTIO_PRERT"), ("OUTPUT", "ISTIO_OUTPUT")],
                ),
                rules::Table::Nat => (
                    vec!["ISTIO_PRERT", "ISTIO_OUTPUT"],
                    vec![("OUTPUT", "ISTIO_OUTPUT"), ("PREROUTING", "ISTIO_PRERT")],
                ),
                rules::Table::Raw => (
                    vec!["ISTIO_OUTPUT", "ISTIO_PRERT"],
                    vec![("PREROUTING", "ISTIO_PRERT"), ("OUTPUT", "ISTIO_OUTPUT")],
                ),
            };
            out.push(Table {
                name,
                chains,
                jumps,
                rules: text,
            });
        }
        out
    }

    /// The rules as `iptables-restore --noflush` input for a clean netns (Istio's exact text).
    pub fn render(&self, family: Family) -> String {
        let mut s = String::new();
        for t in self.tables(family) {
            s.push_str(&format!("* {}\n", t.name));
            for c in &t.chains {
                s.push_str(&format!("-N {c}\n"));
            }
            for (from, to) in &t.jumps {
                s.push_str(&format!("-A {from} -j {to}\n"));
            }
            for r in &t.rules {
                s.push_str(r);
                s.push('\n');
            }
            s.push_str("COMMIT\n");
        }
        s
    }

    /// One restore that turns whatever `present` holds into exactly our rules.
    pub fn render_reconcile(&self, family: Family, present: &Present) -> String {
        let wanted = self.tables(family);
        let mut s = String::new();
        let names: std::collections::BTreeSet<&str> = wanted
            .iter()
            .map(|t| t.name)
            .chain(present.tables.keys().map(String::as_str))
            .collect();
        for name in names {
            let want = wanted.iter().find(|t| t.name == name);
            let have = present.tables.get(name);
            s.push_str(&format!("* {name}\n"));
            let mut chains: Vec<&str> = want.map(|t| t.chains.clone()).unwrap_or_default();
            for c in have
                .map(|h| h.chains.iter().map(String::as_str).collect::<Vec<_>>())
                .unwrap_or_default()
            {
                if !chains.contains(&c) {
                    chains.push(c);
                }
            }
            // A chain line creates the chain, or flushes it when it exists.
            for c in &chains {
                s.push_str(&format!(":{c} - [0:0]\n"));
            }
            for (from, to) in have.map(|h| h.jumps.clone()).unwrap_or_default() {
                s.push_str(&format!("-D {from} -j {to}\n"));
            }
            if let Some(t) = want {
                for (from, to) in &t.jumps {
                    s.push_str(&format!("-A {from} -j {to}\n"));
                }
                for r in &t.rules {
                    s.push_str(r);
                    s.push('\n');
                }
            }
            for c in chains
                .iter()
                .filter(|c| !want.is_some_and(|t| t.chains.contains(c)))
            {
                s.push_str(&format!("-X {c}\n"));
            }
            s.push_str("COMMIT\n");
        }
        s
    }

    /// One restore that removes everything `present` holds.
    pub fn render_remove(present: &Present) -> String {
        let mut s = String::new();
        for (name, t) in &present.tables {
            s.push_str(&format!("* {name}\n"));
            for (from, to) in &t.jumps {
                s.push_str(&format!("-D {from} -j {to}\n"));
            }
            for c in &t.chains {
                s.push_str(&format!("-F {c}\n"));
            }
            for c in &t.chains {
                s.push_str(&format!("-X {c}\n"));
            }
            s.push_str("COMMIT\n");
        }
        s
    }
}

/// `rule` as Istio CNI writes it for `family`'s `iptables-restore`.
pub(super) fn iptables_rule(rule: &Rule, family: Family) -> String {
    let mark = format!("0x{PROXY_MARK:x}/0x{MARK_MASK:x}");
    let connmark = format!("0x{CONNMARK:x}/0x{MARK_MASK:x}");
    let lo = family.localhost();
    let probe = family.probe_src();
    let chain = match rule.hook() {
        Hook::Prerouting => "ISTIO_PRERT",
        Hook::Output => "ISTIO_OUTPUT",
    };
    let spec = match rule {
        Rule::MarkProxyConnections => {
            format!("-m mark --mark {mark} -j CONNMARK --set-xmark {connmark}")
        }
        Rule::RestoreProxyMark => format!(
            "-m connmark --mark {connmark} -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff"
        ),
        Rule::VirtualInterfaceToOutbound(vif) => {
            format!("-i {vif} -p tcp -j REDIRECT --to-ports {OUTBOUND_PORT}")
        }
        Rule::VirtualInterfaceDone(vif) => format!("-i {vif} -p tcp -j RETURN"),
        Rule::AcceptProbesIn(_) => format!("-s {probe} -p tcp -m tcp -j ACCEPT"),
        Rule::AcceptProbesOut(_) => format!("-d {probe} -p tcp -m tcp -j ACCEPT"),
        Rule::InboundToProxy(_) => format!(
            "! -d {lo} -p tcp ! --dport {HBONE_PORT} -m mark ! --mark {mark} -j REDIRECT --to-ports {INBOUND_PLAINTEXT_PORT}"
        ),
        Rule::DnsUdpToProxy => format!(
            "! -o lo -p udp -m mark ! --mark {mark} -m udp --dport 53 -j REDIRECT --to-port {DNS_PORT}"
        ),
        Rule::DnsTcpToProxy(_) => format!(
            "! -d {lo} -p tcp --dport 53 -m mark ! --mark {mark} -j REDIRECT --to-ports {DNS_PORT}"
        ),
        Rule::AcceptProxyConnections => format!("-p tcp -m mark --mark {connmark} -j ACCEPT"),
        Rule::AcceptLoopback(_) => format!("! -d {lo} -o lo -j ACCEPT"),
        Rule::OutboundToProxy(_) => format!(
            "! -d {lo} -p tcp -m mark ! --mark {mark} -j REDIRECT --to-ports {OUTBOUND_PORT}"
        ),
        Rule::DnsUpstreamZone => {
            format!("-p udp -m mark --mark {mark} -m udp --dport 53 -j CT --zone 1")
        }
        Rule::DnsAnswersZone => {
            format!("-p udp -m mark ! --mark {mark} -m udp --sport 53 -j CT --zone 1")
        }
    };
    format!("-A {chain} {spec}")
}
