//! Host side of probe handling (docs/wire.md §4, last paragraph): the set
//! of enrolled pods' addresses (each entry commented with the pod's uid)
//! and the nat rule that SNATs TCP from the node's own sockets (the
//! kubelet's probes) to those addresses to 169.254.7.127, so the in-pod
//! rules recognise probes and do not capture them.
//!
//! Two back ends, chosen with the in-pod rules' (`NATIVE_NFTABLES`), render
//! the same rule ([`snat_families`]):
//! - iptables: the ipsets `istio-inpod-probes-v4`/`-v6` and the chain
//!   `ISTIO_POSTRT` at position 1 of nat POSTROUTING (Istio CNI's), with
//!   the system's `ipset` and `iptables-restore`;
//! - nftables: istio-cni's host table `inet istio-ambient-nat`, its sets
//!   of the same names and a `postrouting` nat chain at priority 100, with
//!   `nft`; each pod's entries are added and removed one by one (a small
//!   transaction each), never by rewriting the set.
//!
//! "The node's own sockets" is `-m owner --socket-exists` in iptables and
//! `meta skuid 0-4294967295` in nftables: both match exactly the packets
//! that carry a local socket with a file (the kernel's owner match and
//! meta expression test the same thing), so switching back ends changes
//! nothing. istio-cni's nftables rule matches the kubelet's uid instead,
//! which it finds by scanning the host's processes for one named
//! `kubelet`, `kubelite` or `k3s` and fails the agent's start when none
//! is; the kubelet runs as root, so its match is "root's sockets" anyway.
//!
//! Runs in the agent's own (the host's) network namespace.

use std::io::Write;
use std::net::IpAddr;
use std::process::{Command, Stdio};

use super::redirect::{Backend, Family};

pub const SET_V4: &str = "istio-inpod-probes-v4";
pub const SET_V6: &str = "istio-inpod-probes-v6";
/// istio-cni's host table (the same name as the in-pod nat table, in the
/// host's netns).
pub const NFT_TABLE: &str = "istio-ambient-nat";

#[derive(Debug, thiserror::Error)]
#[error("host probe rules: {step}: {reason}")]
pub struct HostProbeError {
    pub step: String,
    pub reason: String,
}

/// The families whose probes are SNATed: the one rule both back ends render.
pub fn snat_families(ipv6: bool) -> &'static [Family] {
    if ipv6 {
        &[Family::V4, Family::V6]
    } else {
        &[Family::V4]
    }
}

fn set_of(family: Family) -> &'static str {
    match family {
        Family::V4 => SET_V4,
        Family::V6 => SET_V6,
    }
}

fn set_of_ip(ip: &IpAddr) -> &'static str {
    if ip.is_ipv6() {
        SET_V6
    } else {
        SET_V4
    }
}

/// The host's probe rules and sets under one back end.
#[derive(Debug, Clone, Copy)]
pub struct HostProbes {
    pub backend: Backend,
    pub ipv6: bool,
}

impl HostProbes {
    /// Creates the sets (keeping what they hold: the pods enrolled before
    /// a restart stay probed meanwhile) and (re)installs the SNAT rule;
    /// what the other back end left on the host is removed.
    pub fn install(&self) -> Result<(), HostProbeError> {
        match self.backend {
            Backend::Iptables => {
                ipt::install(self.ipv6)?;
                nftb::uninstall_if_there();
            }
            Backend::Nftables => {
                nftb::install(self.ipv6)?;
                ipt::uninstall_if_there();
            }
        }
        Ok(())
    }

    /// Adds a pod's addresses, commented with its uid; an address already
    /// there (reused) now belongs to this uid.
    pub fn add_pod(&self, uid: &str, ips: &[IpAddr]) -> Result<(), HostProbeError> {
        match self.backend {
            Backend::Iptables => ipt::add_pod(uid, ips),
            Backend::Nftables => nftb::add_pod(uid, ips),
        }
    }

    /// Removes a pod's addresses, but only entries that still carry its uid.
    pub fn remove_pod(&self, uid: &str, ips: &[IpAddr]) {
        let stale = |list: &[(String, String)], ip: &IpAddr| {
            let ip = ip.to_string();
            list.iter().any(|(i, u)| *i == ip && u == uid)
        };
        for ip in ips {
            let set = set_of_ip(ip);
            let list = match self.backend {
                Backend::Iptables => ipt::members(set),
                Backend::Nftables => nftb::members(set),
            };
            if list.is_some_and(|l| stale(&l, ip)) {
                let removed = match self.backend {
                    Backend::Iptables => ipt::delete(set, &[ip.to_string()]),
                    Backend::Nftables => nftb::delete(set, &[ip.to_string()]),
                };
                if let Err(e) = removed {
                    tracing::warn!(uid, %ip, error = %e, "probe set entry not removed");
                }
            }
        }
    }

    /// Removes every entry that is not a held pod's (its IP, commented with
    /// its uid): pods deleted while the agent was away, or between its
    /// removing a pod and its removing the pod's entries, when it was
    /// killed then. Returns how many were removed.
    pub fn keep_only(&self, held: &[(String, Vec<IpAddr>)]) -> usize {
        let mut removed = 0;
        for set in [SET_V4, SET_V6] {
            let list = match self.backend {
                Backend::Iptables => ipt::members(set),
                Backend::Nftables => nftb::members(set),
            };
            let stale: Vec<String> = list
                .unwrap_or_default()
                .into_iter()
                .filter(|(ip, uid)| {
                    !held
                        .iter()
                        .any(|(u, ips)| u == uid && ips.iter().any(|i| i.to_string() == *ip))
                })
                .map(|(ip, _)| ip)
                .collect();
            if stale.is_empty() {
                continue;
            }
            let done = match self.backend {
                Backend::Iptables => ipt::delete(set, &stale),
                Backend::Nftables => nftb::delete(set, &stale),
            };
            match done {
                Ok(()) => removed += stale.len(),
                Err(e) => tracing::warn!(set, error = %e, "stale probe set entries not removed"),
            }
        }
        removed
    }

    /// Makes the sets hold exactly the `held` pods' addresses, each with
    /// its pod's uid (the agent's start): what is missing is added, what
    /// belongs to no held pod (one deleted while the agent was away, or
    /// killed between its removals) or carries another uid is removed.
    /// Returns how many entries were added and removed. Under nftables one
    /// listing per set and one transaction, whatever the number of pods
    /// (an entry at a time would cost a `delete` each, each loading the
    /// whole set); under iptables an `ipset` call per entry.
    pub fn sync(&self, held: &[(String, Vec<IpAddr>)]) -> (usize, usize) {
        if self.backend == Backend::Nftables {
            match nftb::sync(held) {
                Ok(counts) => return counts,
                Err(e) => {
                    tracing::warn!(error = %e, "probe sets not synced in one transaction; one pod at a time")
                }
            }
        }
        let mut added = 0;
        for (uid, ips) in held {
            match self.add_pod(uid, ips) {
                Ok(()) => added += ips.len(),
                Err(e) => {
                    tracing::warn!(uid, error = %e, "probe set not updated; kubelet probes to this pod may be captured")
                }
            }
        }
        (added, self.keep_only(held))
    }

    /// Removes the rule and the sets (the agent uninstalled, not upgraded):
    /// the node is left as before the agent came.
    pub fn uninstall(&self) -> Result<(), HostProbeError> {
        match self.backend {
            Backend::Iptables => ipt::uninstall(),
            Backend::Nftables => nftb::uninstall(),
        }
    }
}

fn run(prog: &str, args: &[&str], stdin: Option<&str>) -> Result<String, HostProbeError> {
    let err = |reason: String| HostProbeError {
        step: format!("{prog} {}", args.join(" ")),
        reason,
    };
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| err(e.to_string()))?;
    if let (Some(mut pipe), Some(text)) = (child.stdin.take(), stdin) {
        // A tool that exits before reading all of it says why on stderr.
        match pipe.write_all(text.as_bytes()) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(err(e.to_string())),
            _ => {}
        }
    }
    let out = child.wait_with_output().map_err(|e| err(e.to_string()))?;
    if !out.status.success() {
        return Err(err(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The iptables back end: ipsets and `ISTIO_POSTRT`.
mod ipt {
    use super::*;

    /// The nat rules for one family, as `iptables-restore --noflush` input
    /// (Istio's text; the chain is recreated so a restart leaves one copy).
    pub fn render(family: Family) -> String {
        format!(
            "* nat\n-N ISTIO_POSTRT\n-I POSTROUTING 1 -j ISTIO_POSTRT\n-A ISTIO_POSTRT -m owner --socket-exists -p tcp -m set --match-set {} dst -j SNAT --to-source {}\nCOMMIT\n",
            set_of(family),
            family.probe_src()
        )
    }

    fn tools(family: Family) -> (&'static str, &'static str, &'static str) {
        match family {
            Family::V4 => ("inet", "iptables-save", "iptables-restore"),
            Family::V6 => ("inet6", "ip6tables-save", "ip6tables-restore"),
        }
    }

    /// Drops our chain (and the jumps to it) from `family`'s nat table.
    fn drop_chain(family: Family) -> Result<(), HostProbeError> {
        let (_, save, restore) = tools(family);
        let current = run(save, &["-t", "nat"], None)?;
        if current.contains(":ISTIO_POSTRT") {
            let jumps = current
                .lines()
                .filter(|l| *l == "-A POSTROUTING -j ISTIO_POSTRT")
                .count();
            let mut text = String::from("* nat\n");
            for _ in 0..jumps {
                text.push_str("-D POSTROUTING -j ISTIO_POSTRT\n");
            }
            text.push_str("-F ISTIO_POSTRT\n-X ISTIO_POSTRT\nCOMMIT\n");
            run(restore, &["--noflush"], Some(&text))?;
        }
        Ok(())
    }

    pub fn install(ipv6: bool) -> Result<(), HostProbeError> {
        for &family in snat_families(ipv6) {
            let (kind, _, restore) = tools(family);
            let set = set_of(family);
            run(
                "ipset",
                &[
                    "create", set, "hash:ip", "family", kind, "comment", "-exist",
                ],
                None,
            )?;
            // Drop an older copy of our chain first, so restarts never stack rules.
            drop_chain(family)?;
            run(restore, &["--noflush"], Some(&render(family)))?;
        }
        Ok(())
    }

    pub fn uninstall() -> Result<(), HostProbeError> {
        for family in [Family::V4, Family::V6] {
            drop_chain(family)?;
            let set = set_of(family);
            if run("ipset", &["list", "-name", set], None).is_ok() {
                run("ipset", &["destroy", set], None)?;
            }
        }
        Ok(())
    }

    /// What iptables left here (an agent that ran with the other back
    /// end), removed; a host without the tools has nothing of it.
    pub fn uninstall_if_there() {
        if let Err(e) = uninstall() {
            tracing::debug!(error = %e, "no iptables probe rules removed");
        }
    }

    pub fn add_pod(uid: &str, ips: &[IpAddr]) -> Result<(), HostProbeError> {
        for ip in ips {
            let set = set_of_ip(ip);
            let ip = ip.to_string();
            // Upsert: a reused IP now belongs to this uid.
            let _ = run("ipset", &["del", set, &ip, "-exist"], None);
            run("ipset", &["add", set, &ip, "comment", uid, "-exist"], None)?;
        }
        Ok(())
    }

    pub fn delete(set: &str, ips: &[String]) -> Result<(), HostProbeError> {
        for ip in ips {
            run("ipset", &["del", set, ip, "-exist"], None)?;
        }
        Ok(())
    }

    /// The (IP, uid comment) entries of `set`; `None` if it cannot be read.
    pub fn members(set: &str) -> Option<Vec<(String, String)>> {
        run("ipset", &["list", set], None)
            .ok()
            .map(|list| parse_members(&list))
    }

    /// The (IP, uid comment) entries of an `ipset list` text.
    pub fn parse_members(list: &str) -> Vec<(String, String)> {
        list.lines()
            .skip_while(|l| !l.starts_with("Members:"))
            .skip(1)
            .filter_map(|l| {
                let (ip, rest) = l.split_once(' ').unwrap_or((l, ""));
                let uid = rest
                    .strip_prefix("comment \"")
                    .and_then(|r| r.strip_suffix('"'))
                    .unwrap_or_default();
                (!ip.is_empty()).then(|| (ip.to_string(), uid.to_string()))
            })
            .collect()
    }
}

/// The nftables back end: istio-cni's host table, its sets and chain.
mod nftb {
    use super::*;

    fn ip(family: Family) -> &'static str {
        match family {
            Family::V4 => "ip",
            Family::V6 => "ip6",
        }
    }

    /// The transaction that makes the sets (an existing set keeps its
    /// entries) and leaves exactly the SNAT rule in our chain.
    pub fn render(ipv6: bool) -> String {
        let t = NFT_TABLE;
        let mut s = format!("add table inet {t}\n");
        for &family in snat_families(ipv6) {
            let kind = match family {
                Family::V4 => "ipv4_addr",
                Family::V6 => "ipv6_addr",
            };
            s.push_str(&format!(
                "add set inet {t} {} {{ type {kind} ; }}\n",
                set_of(family)
            ));
        }
        s.push_str(&format!(
            "add chain inet {t} postrouting {{ type nat hook postrouting priority 100 ; }}\nflush chain inet {t} postrouting\n"
        ));
        for &family in snat_families(ipv6) {
            s.push_str(&format!(
                "add rule inet {t} postrouting meta l4proto tcp meta skuid 0-4294967295 {ip} daddr @{set} counter snat {ip} to {snat}\n",
                ip = ip(family),
                set = set_of(family),
                snat = family.probe_src(),
            ));
        }
        s
    }

    pub fn install(ipv6: bool) -> Result<(), HostProbeError> {
        run("nft", &["-f", "-"], Some(&render(ipv6))).map(drop)
    }

    pub fn uninstall() -> Result<(), HostProbeError> {
        let t = NFT_TABLE;
        let text = format!("add table inet {t}\ndelete table inet {t}\n");
        run("nft", &["-f", "-"], Some(&text)).map(drop)
    }

    /// What nftables left here (an agent that ran with the other back
    /// end), removed; a host without `nft` has nothing of it.
    pub fn uninstall_if_there() {
        if let Err(e) = uninstall() {
            tracing::debug!(error = %e, "no nftables probe rules removed");
        }
    }

    /// The uid as an element's comment: nft takes it inside double
    /// quotes, so a quote, a backslash or a control character (a hostile
    /// uid) would end the string and write a command of its own; and it
    /// holds at most 128 characters.
    pub fn comment(uid: &str) -> Result<&str, HostProbeError> {
        let fine = |b: u8| (b.is_ascii_graphic() || b == b' ') && b != b'"' && b != b'\\';
        if uid.is_empty() || uid.len() > 128 || !uid.bytes().all(fine) {
            return Err(HostProbeError {
                step: "probe set entry".into(),
                reason: format!(
                    "pod uid {uid:?} cannot be an nftables comment (1 to 128 printable characters, no quote or backslash)"
                ),
            });
        }
        Ok(uid)
    }

    /// The usual case, one transaction per pod: its addresses made, with
    /// its uid. It fails whole if one is there already (`create`).
    pub fn render_create(uid: &str, ips: &[IpAddr]) -> Result<String, HostProbeError> {
        render_elements(uid, ips, false)
    }

    /// An address there already (reused, or the pod enrolled again), one
    /// transaction: each address added (so that the delete never fails on
    /// one not there), deleted and added with the uid, so it takes this
    /// pod's uid (`add` alone would keep the old comment).
    pub fn render_add(uid: &str, ips: &[IpAddr]) -> Result<String, HostProbeError> {
        render_elements(uid, ips, true)
    }

    fn render_elements(uid: &str, ips: &[IpAddr], upsert: bool) -> Result<String, HostProbeError> {
        let uid = comment(uid)?;
        let t = NFT_TABLE;
        Ok(ips
            .iter()
            .map(|ip| {
                let set = set_of_ip(ip);
                let element = format!("{set} {{ {ip} comment \"{uid}\" }}");
                match upsert {
                    false => format!("create element inet {t} {element}\n"),
                    true => format!(
                        "add element inet {t} {set} {{ {ip} }}\ndelete element inet {t} {set} {{ {ip} }}\nadd element inet {t} {element}\n"
                    ),
                }
            })
            .collect())
    }

    /// `create` first: it reads no element, where a `delete` makes `nft`
    /// load the whole set (12 ms at 1,000 entries against 1.5 ms).
    pub fn add_pod(uid: &str, ips: &[IpAddr]) -> Result<(), HostProbeError> {
        if ips.is_empty() {
            return Ok(());
        }
        match run("nft", &["-f", "-"], Some(&render_create(uid, ips)?)) {
            Err(e) if e.reason.contains("File exists") => {
                run("nft", &["-f", "-"], Some(&render_add(uid, ips)?)).map(drop)
            }
            r => r.map(drop),
        }
    }

    pub fn delete(set: &str, ips: &[String]) -> Result<(), HostProbeError> {
        let t = NFT_TABLE;
        let text: String = ips
            .iter()
            .map(|ip| {
                format!("add element inet {t} {set} {{ {ip} }}\ndelete element inet {t} {set} {{ {ip} }}\n")
            })
            .collect();
        run("nft", &["-f", "-"], Some(&text)).map(drop)
    }

    /// The (IP, uid comment) entries of `set`; `None` if it cannot be read.
    pub fn members(set: &str) -> Option<Vec<(String, String)>> {
        let json = run("nft", &["-j", "list", "set", "inet", NFT_TABLE, set], None).ok()?;
        parse_members(&json)
    }

    /// The transaction that turns the sets' `present` entries (by set)
    /// into exactly `held`'s, and how many it adds and removes.
    pub fn render_sync(
        held: &[(String, Vec<IpAddr>)],
        present: &[(&str, Vec<(String, String)>)],
    ) -> (String, usize, usize) {
        let t = NFT_TABLE;
        let mut wanted: std::collections::BTreeMap<String, &str> = Default::default();
        for (uid, ips) in held {
            match comment(uid) {
                Ok(uid) => {
                    for ip in ips {
                        wanted.insert(ip.to_string(), uid);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "probe set entry refused"),
            }
        }
        let (mut s, mut added, mut removed) = (String::new(), 0, 0);
        let mut kept = std::collections::BTreeSet::new();
        for (set, entries) in present {
            for (ip, uid) in entries {
                if wanted.get(ip) == Some(&uid.as_str()) {
                    kept.insert(ip.clone());
                } else {
                    s.push_str(&format!("delete element inet {t} {set} {{ {ip} }}\n"));
                    removed += 1;
                }
            }
        }
        for (ip, uid) in &wanted {
            if !kept.contains(ip) {
                let set = if ip.contains(':') { SET_V6 } else { SET_V4 };
                s.push_str(&format!(
                    "add element inet {t} {set} {{ {ip} comment \"{uid}\" }}\n"
                ));
                added += 1;
            }
        }
        (s, added, removed)
    }

    pub fn sync(held: &[(String, Vec<IpAddr>)]) -> Result<(usize, usize), HostProbeError> {
        let mut present = Vec::new();
        for set in [SET_V4, SET_V6] {
            // A set not there (IPv6 off) holds nothing to keep or remove.
            if let Some(entries) = members(set) {
                present.push((set, entries));
            }
        }
        let (text, added, removed) = render_sync(held, &present);
        if !text.is_empty() {
            run("nft", &["-f", "-"], Some(&text))?;
        }
        Ok((added, removed))
    }

    /// The entries of `nft -j list set` output: an element with a comment
    /// is an object, one without is its bare address.
    pub fn parse_members(json: &str) -> Option<Vec<(String, String)>> {
        let v: serde_json::Value = serde_json::from_str(json).ok()?;
        let set = v["nftables"]
            .as_array()?
            .iter()
            .find_map(|o| o.get("set"))?;
        let elems = match set.get("elem") {
            Some(e) => e.as_array()?.clone(),
            None => Vec::new(),
        };
        Some(
            elems
                .iter()
                .filter_map(|e| match e {
                    serde_json::Value::String(ip) => Some((ip.clone(), String::new())),
                    other => {
                        let e = &other["elem"];
                        let ip = e["val"].as_str()?.to_string();
                        let uid = e["comment"].as_str().unwrap_or_default().to_string();
                        Some((ip, uid))
                    }
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipset_members_are_read_with_their_uid_comments() {
        let list = "Name: istio-inpod-probes-v4\nType: hash:ip\nHeader: family inet comment\nMembers:\n10.0.0.2 comment \"uid-a\"\n10.0.0.3\n";
        assert_eq!(
            ipt::parse_members(list),
            vec![
                ("10.0.0.2".to_string(), "uid-a".to_string()),
                ("10.0.0.3".to_string(), String::new())
            ]
        );
        assert!(ipt::parse_members("Name: x\nMembers:\n").is_empty());
    }

    #[test]
    fn nft_set_members_are_read_with_their_uid_comments() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6", "json_schema_version": 1}}, {"set": {"family": "inet", "name": "istio-inpod-probes-v4", "table": "istio-ambient-nat", "type": "ipv4_addr", "handle": 1, "elem": [{"elem": {"val": "10.1.0.5", "comment": "uid-a"}}, "10.1.0.6"]}}]}"#;
        assert_eq!(
            nftb::parse_members(json).unwrap(),
            vec![
                ("10.1.0.5".to_string(), "uid-a".to_string()),
                ("10.1.0.6".to_string(), String::new())
            ]
        );
        let empty = r#"{"nftables": [{"metainfo": {}}, {"set": {"name": "istio-inpod-probes-v6", "type": "ipv6_addr"}}]}"#;
        assert_eq!(nftb::parse_members(empty).unwrap(), vec![]);
        assert_eq!(nftb::parse_members("not json"), None);
    }

    #[test]
    fn renders_istio_host_rule() {
        assert_eq!(
            ipt::render(Family::V4),
            "* nat\n-N ISTIO_POSTRT\n-I POSTROUTING 1 -j ISTIO_POSTRT\n-A ISTIO_POSTRT -m owner --socket-exists -p tcp -m set --match-set istio-inpod-probes-v4 dst -j SNAT --to-source 169.254.7.127\nCOMMIT\n"
        );
        assert!(ipt::render(Family::V6).contains(
            "istio-inpod-probes-v6 dst -j SNAT --to-source fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
        ));
    }

    /// The host transaction, as a golden file (`AMBIT_BLESS=1` rewrites it).
    #[test]
    fn the_nftables_host_rules_are_the_golden_transaction() {
        for (ipv6, name) in [(false, "hostprobe"), (true, "hostprobe_ipv6")] {
            crate::cni::nft::check_golden(&format!("nft-host/{name}"), &nftb::render(ipv6));
        }
        let add = nftb::render_add(
            "9f3c2a1e-0b7d-4c55-8e21-5a6b7c8d9e0f",
            &["10.1.0.5".parse().unwrap(), "fd00::5".parse().unwrap()],
        )
        .unwrap();
        crate::cni::nft::check_golden("nft-host/add_pod", &add);
        let create = nftb::render_create(
            "9f3c2a1e-0b7d-4c55-8e21-5a6b7c8d9e0f",
            &["10.1.0.6".parse().unwrap(), "fd00::6".parse().unwrap()],
        )
        .unwrap();
        crate::cni::nft::check_golden("nft-host/create_pod", &create);
    }

    #[test]
    fn a_sync_adds_what_is_missing_and_removes_what_no_held_pod_owns() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let held = vec![
            ("uid-a".to_string(), vec![ip("10.0.0.2"), ip("fd00::2")]),
            ("uid-b".to_string(), vec![ip("10.0.0.3")]),
            ("bad\"uid".to_string(), vec![ip("10.0.0.9")]),
        ];
        let e = |ip: &str, uid: &str| (ip.to_string(), uid.to_string());
        let present = vec![
            (
                SET_V4,
                vec![
                    e("10.0.0.2", "uid-a"),
                    e("10.0.0.3", "uid-old"),
                    e("10.0.0.4", "uid-gone"),
                ],
            ),
            (SET_V6, vec![]),
        ];
        let (text, added, removed) = nftb::render_sync(&held, &present);
        assert_eq!((added, removed), (2, 2), "{text}");
        assert_eq!(
            text,
            "delete element inet istio-ambient-nat istio-inpod-probes-v4 { 10.0.0.3 }\n\
             delete element inet istio-ambient-nat istio-inpod-probes-v4 { 10.0.0.4 }\n\
             add element inet istio-ambient-nat istio-inpod-probes-v4 { 10.0.0.3 comment \"uid-b\" }\n\
             add element inet istio-ambient-nat istio-inpod-probes-v6 { fd00::2 comment \"uid-a\" }\n"
        );
        // In sync already: nothing to do.
        let present = vec![
            (SET_V4, vec![e("10.0.0.2", "uid-a"), e("10.0.0.3", "uid-b")]),
            (SET_V6, vec![e("fd00::2", "uid-a")]),
        ];
        assert_eq!(
            nftb::render_sync(&held[..2], &present),
            (String::new(), 0, 0)
        );
    }

    #[test]
    fn a_uid_that_would_break_out_of_its_comment_is_refused() {
        let ips = ["10.1.0.5".parse().unwrap()];
        for bad in [
            "a\" ; flush ruleset ; \"",
            "a\nflush ruleset",
            "back\\slash",
            "",
            &"u".repeat(129),
        ] {
            let e = nftb::render_add(bad, &ips).unwrap_err();
            assert!(
                e.to_string().contains("cannot be an nftables comment"),
                "{e}"
            );
        }
        // Uids the agent makes from namespace/name or a container id pass.
        assert!(nftb::render_add("default/client", &ips).is_ok());
        assert!(nftb::render_add(&"c".repeat(64), &ips).is_ok());
    }
}
