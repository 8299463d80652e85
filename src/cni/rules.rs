//! What the in-pod rules do, decided once as data (docs/wire.md §4): which
//! rules a pod gets for its switches ([`pod_rules`]), each named for what it
//! does, with its table, chain and address family. The two back ends render
//! the same list: `redirect` as `iptables-restore` text (Istio CNI's exact
//! text) and `nft` as one nftables transaction (istio-cni's native
//! nftables tables), so they cannot drift apart: a rule added here is a
//! match arm each must render.

use super::redirect::{Family, RedirectOptions};

/// The netfilter table a rule lives in (the iptables table; in nftables,
/// `inet istio-ambient-<table>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Table {
    Mangle,
    Nat,
    Raw,
}

/// The hook a rule's chain hangs from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Prerouting,
    Output,
}

/// One in-pod rule, named for what it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// A connection the proxy opened (its packets carry the proxy's mark)
    /// is marked in conntrack.
    MarkProxyConnections,
    /// Packets of such a connection take the mark back from conntrack, so
    /// that the `ip rule` sends them to table 100 (back to the proxy).
    RestoreProxyMark,
    /// TCP arriving on a virtual machine's interface is the VM's outbound
    /// traffic: to the proxy's outbound port.
    VirtualInterfaceToOutbound(String),
    /// ... and nothing else in the chain applies to it.
    VirtualInterfaceDone(String),
    /// The node's kubelet probes (SNATed to the probe address) reach the
    /// pod's ports uncaptured.
    AcceptProbesIn(Family),
    /// ... and their answers leave uncaptured.
    AcceptProbesOut(Family),
    /// TCP for the pod (but HBONE's port, loopback and the proxy's own
    /// packets) to the proxy's plaintext inbound port.
    InboundToProxy(Family),
    /// The pod's DNS over UDP (off loopback, not the proxy's own) to the
    /// proxy's DNS port. Names no address: both families.
    DnsUdpToProxy,
    /// The pod's DNS over TCP to the proxy's DNS port.
    DnsTcpToProxy(Family),
    /// The proxy's transparent connections' packets (connmark restored)
    /// leave as they are.
    AcceptProxyConnections,
    /// The pod calling itself on its own address stays on loopback.
    AcceptLoopback(Family),
    /// Everything else the pod opens over TCP to the proxy's outbound port.
    OutboundToProxy(Family),
    /// The proxy's DNS queries upstream in conntrack zone 1, apart from
    /// the pod's redirected queries with the same addresses and ports.
    DnsUpstreamZone,
    /// ... and their answers.
    DnsAnswersZone,
}

impl Rule {
    pub fn table(&self) -> Table {
        match self {
            Rule::MarkProxyConnections | Rule::RestoreProxyMark => Table::Mangle,
            Rule::DnsUpstreamZone | Rule::DnsAnswersZone => Table::Raw,
            _ => Table::Nat,
        }
    }

    pub fn hook(&self) -> Hook {
        match self {
            Rule::MarkProxyConnections
            | Rule::VirtualInterfaceToOutbound(_)
            | Rule::VirtualInterfaceDone(_)
            | Rule::AcceptProbesIn(_)
            | Rule::InboundToProxy(_)
            | Rule::DnsAnswersZone => Hook::Prerouting,
            Rule::RestoreProxyMark
            | Rule::AcceptProbesOut(_)
            | Rule::DnsUdpToProxy
            | Rule::DnsTcpToProxy(_)
            | Rule::AcceptProxyConnections
            | Rule::AcceptLoopback(_)
            | Rule::OutboundToProxy(_)
            | Rule::DnsUpstreamZone => Hook::Output,
        }
    }

    /// The one family the rule is for (it names addresses of that
    /// family); `None`: both.
    pub fn family(&self) -> Option<Family> {
        match self {
            Rule::AcceptProbesIn(f)
            | Rule::AcceptProbesOut(f)
            | Rule::InboundToProxy(f)
            | Rule::DnsTcpToProxy(f)
            | Rule::AcceptLoopback(f)
            | Rule::OutboundToProxy(f) => Some(*f),
            _ => None,
        }
    }

    /// Whether an iptables rule set of `family` holds this rule (a rule
    /// for both families is in each).
    pub fn in_family(&self, family: Family) -> bool {
        self.family().is_none_or(|f| f == family)
    }
}

/// A pod's rules for its switches, in order (the order within each chain
/// is the order packets meet them). Each family's rule comes right after
/// the IPv4 one; IPv6 rules only with `opts.ipv6`.
pub fn pod_rules(opts: &RedirectOptions) -> Vec<Rule> {
    let families: &[Family] = if opts.ipv6 {
        &[Family::V4, Family::V6]
    } else {
        &[Family::V4]
    };
    let each = |make: fn(Family) -> Rule| families.iter().map(move |f| make(*f));
    let inbound = !opts.bypass_inbound;
    let mut out = vec![Rule::MarkProxyConnections, Rule::RestoreProxyMark];
    for vif in &opts.virtual_interfaces {
        out.push(Rule::VirtualInterfaceToOutbound(vif.clone()));
        out.push(Rule::VirtualInterfaceDone(vif.clone()));
    }
    if inbound {
        out.extend(each(Rule::AcceptProbesIn));
    }
    out.extend(each(Rule::AcceptProbesOut));
    if inbound {
        out.extend(each(Rule::InboundToProxy));
    }
    if opts.dns_capture {
        out.push(Rule::DnsUdpToProxy);
        out.extend(each(Rule::DnsTcpToProxy));
    }
    out.push(Rule::AcceptProxyConnections);
    out.extend(each(Rule::AcceptLoopback));
    out.extend(each(Rule::OutboundToProxy));
    if opts.dns_capture {
        out.push(Rule::DnsUpstreamZone);
        out.push(Rule::DnsAnswersZone);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switches_decide_which_rules_a_pod_gets() {
        let all = pod_rules(&RedirectOptions::default());
        assert!(all.contains(&Rule::InboundToProxy(Family::V6)));
        assert!(all.contains(&Rule::DnsUpstreamZone));
        let v4_only = pod_rules(&RedirectOptions {
            ipv6: false,
            ..RedirectOptions::default()
        });
        assert!(v4_only.iter().all(|r| r.family() != Some(Family::V6)));
        // Both families' DNS over UDP is captured either way: it names no address.
        assert!(v4_only.contains(&Rule::DnsUdpToProxy));
        let quiet = pod_rules(&RedirectOptions {
            dns_capture: false,
            bypass_inbound: true,
            ..RedirectOptions::default()
        });
        assert!(!quiet.iter().any(|r| matches!(
            r,
            Rule::InboundToProxy(_) | Rule::AcceptProbesIn(_) | Rule::DnsUdpToProxy
        ) || r.table() == Table::Raw));
        // The probes' answers leave uncaptured even with inbound bypassed.
        assert!(quiet.contains(&Rule::AcceptProbesOut(Family::V4)));
    }
}
