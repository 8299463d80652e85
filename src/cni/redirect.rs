//! In-pod redirection rules (docs/wire.md §4): render them as `iptables-restore`
//! text identical to Istio CNI's, apply them inside a pod netns atomically and
//! idempotently, and remove them cleanly.
//!
//! Rendering is pure ([`RedirectRules::render`]); the shell around it runs
//! `iptables-save`/`iptables-restore` and `ip` inside the netns. A first apply
//! uses the exact Istio text; an apply over existing `ISTIO_*` chains uses one
//! restore that flushes and refills them (and replaces the jumps), so the
//! result is the same however often it runs and no packet sees a half state.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use super::loopback;
use super::nft;
use super::rules::{self, pod_rules, Hook, Rule};
use super::virtual_interfaces::{self, VirtualInterfaceRefused};
use crate::constants::{
    CONNMARK, DNS_PORT, HBONE_PORT, INBOUND_PLAINTEXT_PORT, MARK_MASK, OUTBOUND_PORT,
    PROBE_SNAT_V4, PROBE_SNAT_V6, PROXY_MARK, ROUTE_TABLE, RULE_PRIORITY,
};
use crate::netns::Netns;

mod iptables;

pub use iptables::Present;

/// IP family of a rule set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn restore(self) -> &'static str {
        match self {
            Family::V4 => "iptables-restore",
            Family::V6 => "ip6tables-restore",
        }
    }
    fn save(self) -> &'static str {
        match self {
            Family::V4 => "iptables-save",
            Family::V6 => "ip6tables-save",
        }
    }
    pub(super) fn localhost(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.1/32",
            Family::V6 => "::1/128",
        }
    }
    pub(super) fn probe_src(self) -> &'static str {
        match self {
            Family::V4 => PROBE_SNAT_V4,
            Family::V6 => PROBE_SNAT_V6,
        }
    }
    fn any(self) -> &'static str {
        match self {
            Family::V4 => "0.0.0.0/0",
            Family::V6 => "::/0",
        }
    }
    fn ip_flag(self) -> &'static str {
        match self {
            Family::V4 => "-4",
            Family::V6 => "-6",
        }
    }
}

/// Per-pod switches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedirectOptions {
    /// Send the pod's DNS (UDP and TCP port 53) to the proxy's 15053.
    pub dns_capture: bool,
    /// Leave inbound traffic alone (no 15006 redirect, no probe accept).
    pub bypass_inbound: bool,
    /// Also program ip6tables and the IPv6 route.
    pub ipv6: bool,
    /// Interfaces of virtual machines inside the pod (KubeVirt): TCP arriving
    /// on them is the VM's outbound traffic and goes to the proxy's 15001.
    pub virtual_interfaces: Vec<String>,
    /// Raise the pod's loopback GSO limit (BIG TCP, see [`loopback`]).
    pub loopback_big_tcp: bool,
    /// What writes the rules: iptables (Istio CNI's text) or nftables
    /// (istio-cni's native nftables tables, [`super::nft`]).
    pub backend: Backend,
}

/// The rules back end: istio-cni's `NATIVE_NFTABLES` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    #[default]
    Iptables,
    Nftables,
}

impl Default for RedirectOptions {
    fn default() -> Self {
        RedirectOptions {
            dns_capture: true,
            bypass_inbound: false,
            ipv6: true,
            virtual_interfaces: Vec::new(),
            loopback_big_tcp: true,
            backend: Backend::Iptables,
        }
    }
}

/// Errors applying or removing rules; each names the netns and the step.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    #[error("netns {netns}: {step}: {reason}")]
    Step {
        netns: String,
        step: String,
        reason: String,
    },
    #[error(transparent)]
    VirtualInterface(#[from] VirtualInterfaceRefused),
}

/// The rule set of one pod.
#[derive(Debug, Clone, Default)]
pub struct RedirectRules {
    pub opts: RedirectOptions,
}

impl RedirectRules {
    pub fn new(opts: RedirectOptions) -> Self {
        RedirectRules { opts }
    }

    fn families(&self) -> Vec<Family> {
        if self.opts.ipv6 {
            vec![Family::V4, Family::V6]
        } else {
            vec![Family::V4]
        }
    }

    /// Applies the rules, the `ip rule` and the table-100 route inside `netns`.
    /// On any failure, what this call applied is removed again (so are
    /// both back ends' rules). A virtual
    /// interface that is not a plain name, is the loopback or is the pod's
    /// own interface is refused before anything is applied
    /// ([`virtual_interfaces::check`]).
    pub fn apply(&self, netns: &Netns) -> Result<(), RedirectError> {
        let result = self.write(netns, true);
        if result.is_err() {
            let _ = self.remove(netns);
        }
        result
    }

    /// Applies the rules again to a pod that has them (the agent
    /// restarted, perhaps with the other back end or other switches). On
    /// failure the pod keeps what it had: removing it would let its
    /// traffic out uncaptured. Each back end's write is atomic per table
    /// (nftables: one transaction for all), so connections flow on.
    pub fn reapply(&self, netns: &Netns) -> Result<(), RedirectError> {
        self.write(netns, false)?;
        self.take_over(netns);
        Ok(())
    }

    /// One transaction for every table and both families: with `fresh`,
    /// first as for a netns without our tables (a new pod's); if one is
    /// there (the kernel refuses that whole transaction), or without
    /// `fresh`, the one that replaces them.
    fn write_nft(&self, netns: &Netns, fresh: bool) -> Result<(), RedirectError> {
        if fresh {
            match run(
                netns,
                "nft",
                &["-f", "-"],
                Some(&nft::render_fresh(&self.opts)),
            ) {
                Err(RedirectError::Step { reason, .. }) if reason.contains("File exists") => {}
                r => return r.map(drop),
            }
        }
        run(netns, "nft", &["-f", "-"], Some(&nft::render(&self.opts))).map(drop)
    }

    /// Removes what the other back end than ours left in `netns` (a pod
    /// enrolled before under the other back end), after ours are in
    /// force; a back end whose tool this host lacks has left nothing. Not
    /// part of [`RedirectRules::apply`]: a new pod's fresh netns holds
    /// none, and looking costs two `iptables-save`s (or an `nft`) per ADD.
    pub fn take_over(&self, netns: &Netns) {
        self.remove_other_backend(netns);
    }

    /// Whether this host takes our rules, checked once at the agent's
    /// start rather than failing each pod: under nftables, that `nft` is
    /// there and that the kernel accepts a pod's whole transaction
    /// (`nft -c` in the agent's netns: validated, never applied). Under
    /// iptables, nothing is checked up front.
    pub fn check_host(&self) -> Result<(), RedirectError> {
        match self.opts.backend {
            Backend::Iptables => Ok(()),
            Backend::Nftables => {
                let own = Netns::current().map_err(|e| RedirectError::Step {
                    netns: "self".into(),
                    step: "open /proc/thread-self/ns/net".into(),
                    reason: e.to_string(),
                })?;
                run(
                    &own,
                    "nft",
                    &["-c", "-f", "-"],
                    Some(&nft::render(&self.opts)),
                )
                .map(drop)
            }
        }
    }

    /// Writes the rules; `fresh`: try first as for a netns without our
    /// nftables tables (a new pod's), else go straight to replacing them.
    fn write(&self, netns: &Netns, fresh: bool) -> Result<(), RedirectError> {
        let vifs = &self.opts.virtual_interfaces;
        if !vifs.is_empty() {
            // The names first, before anything runs in the netns.
            virtual_interfaces::check(vifs, &[])?;
            virtual_interfaces::check(vifs, &virtual_interfaces::primary(netns))?;
        }
        let result = match self.opts.backend {
            Backend::Iptables => self.families().into_iter().try_for_each(|family| {
                let present = Present::parse(&run(netns, family.save(), &[], None)?);
                let text = if present.is_empty() {
                    self.render(family)
                } else {
                    self.render_reconcile(family, &present)
                };
                run(netns, family.restore(), &["--noflush"], Some(&text))?;
                ensure_route(netns, family)
            }),
            Backend::Nftables => self.write_nft(netns, fresh).and_then(|_| {
                self.families()
                    .into_iter()
                    .try_for_each(|family| ensure_route(netns, family))
            }),
        };
        if result.is_ok() {
            migrate_queued_connections(netns);
            if !self.opts.loopback_big_tcp {
                // Off: a limit an earlier apply raised goes back to the default.
                if let Err(e) = loopback::disable(netns) {
                    tracing::debug!(netns = %netns.path().display(), error = %e, "loopback GSO limit not restored");
                }
            } else if let Err(e) = loopback::enable(netns) {
                tracing::warn!(netns = %netns.path().display(), error = %e, "BIG TCP not enabled on the pod's loopback: traffic through the proxy works, with more per-packet work");
            }
        }
        result
    }

    /// What the other back end than ours left in `netns`, removed; a
    /// back end whose tool this host lacks has left nothing.
    fn remove_other_backend(&self, netns: &Netns) {
        let removed = match self.opts.backend {
            Backend::Iptables => Self::remove_nft(netns),
            Backend::Nftables => Self::remove_iptables(netns),
        };
        if let Err(e) = removed {
            tracing::warn!(netns = %netns.path().display(), error = %e, "the other rules back end's rules not removed");
        }
    }

    fn remove_nft(netns: &Netns) -> Result<(), RedirectError> {
        match run(netns, "nft", &["-f", "-"], Some(&nft::render_remove())) {
            Err(RedirectError::Step { reason, .. }) if is_missing_tool(&reason) => Ok(()),
            r => r.map(drop),
        }
    }

    fn remove_iptables(netns: &Netns) -> Result<(), RedirectError> {
        for family in [Family::V4, Family::V6] {
            let Ok(save) = run(netns, family.save(), &[], None) else {
                continue; // no ip6tables (or no iptables) here: nothing of ours either
            };
            let present = Present::parse(&save);
            if !present.is_empty() {
                run(
                    netns,
                    family.restore(),
                    &["--noflush"],
                    Some(&Self::render_remove(&present)),
                )?;
            }
        }
        Ok(())
    }

    /// Removes our rules (of either back end), `ip rule` and route from
    /// `netns`; absent pieces are fine.
    pub fn remove(&self, netns: &Netns) -> Result<(), RedirectError> {
        if let Err(e) = loopback::disable(netns) {
            tracing::debug!(netns = %netns.path().display(), error = %e, "loopback GSO limit not restored");
        }
        match self.opts.backend {
            Backend::Iptables => Self::remove_iptables(netns)?,
            Backend::Nftables => Self::remove_nft(netns)?,
        }
        self.remove_other_backend(netns);
        for family in [Family::V4, Family::V6] {
            let pref = RULE_PRIORITY.to_string();
            while run(
                netns,
                "ip",
                &[family.ip_flag(), "rule", "del", "pref", &pref],
                None,
            )
            .is_ok()
            {}
            let table = ROUTE_TABLE.to_string();
            let _ = run(
                netns,
                "ip",
                &[family.ip_flag(), "route", "flush", "table", &table],
                None,
            );
        }
        Ok(())
    }
}

/// Lets the kernel hand connections still queued on a closing listener to
/// another listener of its `SO_REUSEPORT` group (`net.ipv4.tcp_migrate_req`,
/// Linux 5.14+), so a proxy that exits while its successor listens beside it
/// drops nothing. Best effort: older kernels just lack the knob.
fn migrate_queued_connections(netns: &Netns) {
    // A container's own /proc/sys is read-only; the host's /proc, mounted
    // elsewhere, writes the same per-netns knob (it follows the writer's netns).
    let host = HOST_PROC.get().cloned();
    let set = netns.run(move || {
        let knob = "sys/net/ipv4/tcp_migrate_req";
        std::fs::write(Path::new("/proc").join(knob), "1").or_else(|e| match &host {
            Some(root) if root != Path::new("/proc") => std::fs::write(root.join(knob), "1"),
            _ => Err(e),
        })
    });
    if let Err(e) | Ok(Err(e)) = set.map(|r| r.map(|_| ())) {
        tracing::warn!(netns = %netns.path().display(), error = %e, "tcp_migrate_req not set: connections queued on an exiting proxy may be reset");
    }
}

static HOST_PROC: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Where the host's /proc is (`/host/proc` in a container), for the per-pod
/// sysctl. Set once at agent start.
pub fn set_host_proc(path: &Path) {
    let _ = HOST_PROC.set(path.to_path_buf());
}

/// `ip rule add fwmark 0x111/0xfff pref 32764 lookup 100` once, and the local route in table 100.
fn ensure_route(netns: &Netns, family: Family) -> Result<(), RedirectError> {
    let (pref, table) = (RULE_PRIORITY.to_string(), ROUTE_TABLE.to_string());
    let fwmark = format!("0x{CONNMARK:x}/0x{MARK_MASK:x}");
    let rules = run(
        netns,
        "ip",
        &[family.ip_flag(), "rule", "show", "pref", &pref],
        None,
    )?;
    if !rules.contains(&format!("fwmark {fwmark} lookup {table}")) {
        run(
            netns,
            "ip",
            &[
                family.ip_flag(),
                "rule",
                "add",
                "fwmark",
                &fwmark,
                "pref",
                &pref,
                "lookup",
                &table,
            ],
            None,
        )?;
    }
    if family == Family::V6 && ipv6_disabled_on_lo(netns) {
        // No IPv6 in this pod (the kernel refuses the route: "IPv6 is
        // disabled on nexthop device"), so none to send back; as istio-cni.
        return Ok(());
    }
    run(
        netns,
        "ip",
        &[
            family.ip_flag(),
            "route",
            "replace",
            "local",
            family.any(),
            "dev",
            "lo",
            "table",
            &table,
        ],
        None,
    )?;
    Ok(())
}

/// Whether the pod's loopback has IPv6 turned off (its
/// `net.ipv6.conf.lo.disable_ipv6`, or no IPv6 at all in its kernel).
fn ipv6_disabled_on_lo(netns: &Netns) -> bool {
    netns
        .run(|| std::fs::read_to_string("/proc/sys/net/ipv6/conf/lo/disable_ipv6"))
        .is_ok_and(|r| r.map_or(true, |v| v.trim() == "1"))
}

/// Whether a step failed because its program is not installed.
fn is_missing_tool(reason: &str) -> bool {
    reason.contains("No such file or directory") || reason.contains("not found")
}

/// Runs a tool inside `netns`, feeding `stdin`, returning stdout.
fn run(
    netns: &Netns,
    prog: &str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, RedirectError> {
    let err = |reason: String| RedirectError::Step {
        netns: netns.path().display().to_string(),
        step: format!("{prog} {}", args.join(" ")),
        reason,
    };
    let mut cmd: Command = netns.command(prog);
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| err(e.to_string()))?;
    if let Some(mut pipe) = child.stdin.take() {
        if let Some(text) = stdin {
            // A tool that exits before reading all of it says why on
            // stderr, below: that is the error worth reporting.
            match pipe.write_all(text.as_bytes()) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    return Err(err(e.to_string()))
                }
                _ => {}
            }
        }
    }
    let out = child.wait_with_output().map_err(|e| err(e.to_string()))?;
    if !out.status.success() {
        return Err(err(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::virtual_interfaces::InterfaceRefusal;

    fn golden(name: &str) -> &'static str {
        match name {
            "default" => include_str!("testdata/default.golden"),
            "default_ipv6" => include_str!("testdata/default_ipv6.golden"),
            "dns_off" => include_str!("testdata/dns_off.golden"),
            "bypass_inbound" => include_str!("testdata/bypass_inbound.golden"),
            "virtual_interfaces" => include_str!("testdata/virtual_interfaces.golden"),
            _ => unreachable!(),
        }
    }

    #[test]
    fn renders_istio_text_for_each_switch() {
        let all = RedirectOptions::default();
        assert_eq!(
            RedirectRules::new(all.clone()).render(Family::V4),
            golden("default")
        );
        assert_eq!(
            RedirectRules::new(all.clone()).render(Family::V6),
            golden("default_ipv6")
        );
        let dns_off = RedirectOptions {
            dns_capture: false,
            ..all.clone()
        };
        assert_eq!(
            RedirectRules::new(dns_off).render(Family::V4),
            golden("dns_off")
        );
        let bypass = RedirectOptions {
            bypass_inbound: true,
            ..all.clone()
        };
        assert_eq!(
            RedirectRules::new(bypass).render(Family::V4),
            golden("bypass_inbound")
        );
        let vms = RedirectOptions {
            virtual_interfaces: vec!["vm0".into(), "kv1".into()],
            ..all
        };
        assert_eq!(
            RedirectRules::new(vms).render(Family::V4),
            golden("virtual_interfaces")
        );
    }

    #[test]
    fn apply_refuses_a_bad_virtual_interface_before_touching_the_netns() {
        let r = RedirectRules::new(RedirectOptions {
            virtual_interfaces: vec!["vm0".into(), "x -j DROP".into()],
            ..Default::default()
        });
        // Refused before the netns is even looked at.
        let ns = Netns::open("/proc/self/ns/net").unwrap();
        assert!(matches!(
            r.apply(&ns),
            Err(RedirectError::VirtualInterface(r)) if r.name == "x -j DROP" && r.why == InterfaceRefusal::NotAName
        ));
    }

    #[test]
    fn apply_refuses_the_pods_own_interface_before_touching_its_rules() {
        let ns = Netns::open("/proc/self/ns/net").unwrap();
        for (name, why) in [
            ("eth0", InterfaceRefusal::Primary),
            ("lo", InterfaceRefusal::Loopback),
            ("veth+", InterfaceRefusal::Wildcard),
        ] {
            let r = RedirectRules::new(RedirectOptions {
                virtual_interfaces: vec!["vm0".into(), name.into()],
                ..Default::default()
            });
            match r.apply(&ns) {
                Err(RedirectError::VirtualInterface(r)) => {
                    assert_eq!((r.name.as_str(), r.why), (name, why))
                }
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    const SAVE: &str = "# Generated\n*mangle\n:PREROUTING ACCEPT [0:0]\n:ISTIO_PRERT - [0:0]\n-A PREROUTING -j ISTIO_PRERT\n-A PREROUTING -j OTHER\nCOMMIT\n*raw\n:ISTIO_OUTPUT - [0:0]\n-A OUTPUT -j ISTIO_OUTPUT\n-A ISTIO_OUTPUT -p udp -j CT --zone 1\nCOMMIT\n*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n";

    #[test]
    fn finds_our_chains_and_jumps_only() {
        let p = Present::parse(SAVE);
        assert_eq!(p.tables.len(), 2);
        assert_eq!(
            p.tables["mangle"].jumps,
            vec![("PREROUTING".to_string(), "ISTIO_PRERT".to_string())]
        );
        assert!(Present::parse("*filter\n:INPUT ACCEPT\nCOMMIT\n").is_empty());
    }

    #[test]
    fn reconcile_flushes_replaces_jumps_and_drops_stale_chains() {
        let dns_off = RedirectRules::new(RedirectOptions {
            dns_capture: false,
            ..Default::default()
        });
        let text = dns_off.render_reconcile(Family::V4, &Present::parse(SAVE));
        assert!(text.contains("* mangle\n:ISTIO_PRERT - [0:0]\n:ISTIO_OUTPUT - [0:0]\n-D PREROUTING -j ISTIO_PRERT\n-A PREROUTING -j ISTIO_PRERT\n"), "{text}");
        // raw is no longer wanted with DNS capture off: emptied and deleted.
        assert!(text.contains("* raw\n:ISTIO_OUTPUT - [0:0]\n-D OUTPUT -j ISTIO_OUTPUT\n-X ISTIO_OUTPUT\nCOMMIT\n"), "{text}");
        let rm = RedirectRules::render_remove(&Present::parse(SAVE));
        assert_eq!(rm, "* mangle\n-D PREROUTING -j ISTIO_PRERT\n-F ISTIO_PRERT\n-X ISTIO_PRERT\nCOMMIT\n* raw\n-D OUTPUT -j ISTIO_OUTPUT\n-F ISTIO_OUTPUT\n-X ISTIO_OUTPUT\nCOMMIT\n");
    }
}
