//! Host side of probe handling (docs/wire.md §4, last paragraph): the ipsets
//! `istio-inpod-probes-v4`/`-v6` of enrolled pod IPs (each entry commented with
//! the pod uid) and the nat rule at position 1 of POSTROUTING that SNATs TCP
//! from local sockets (the kubelet's probes) to those IPs to 169.254.7.127, so
//! the in-pod rules recognise probes and do not capture them.
//!
//! Runs in the agent's own (the host's) network namespace, with the system's
//! `ipset` and `iptables-restore`.

use std::io::Write;
use std::net::IpAddr;
use std::process::{Command, Stdio};

use crate::constants::{PROBE_SNAT_V4, PROBE_SNAT_V6};

pub const SET_V4: &str = "istio-inpod-probes-v4";
pub const SET_V6: &str = "istio-inpod-probes-v6";

#[derive(Debug, thiserror::Error)]
#[error("host probe rules: {step}: {reason}")]
pub struct HostProbeError {
    pub step: String,
    pub reason: String,
}

/// The nat rules for one family, as `iptables-restore --noflush` input
/// (Istio's text; the chain is recreated so a restart leaves one copy).
pub fn render(v6: bool) -> String {
    let (set, snat) = if v6 {
        (SET_V6, PROBE_SNAT_V6)
    } else {
        (SET_V4, PROBE_SNAT_V4)
    };
    format!(
        "* nat\n-N ISTIO_POSTRT\n-I POSTROUTING 1 -j ISTIO_POSTRT\n-A ISTIO_POSTRT -m owner --socket-exists -p tcp -m set --match-set {set} dst -j SNAT --to-source {snat}\nCOMMIT\n"
    )
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
        pipe.write_all(text.as_bytes())
            .map_err(|e| err(e.to_string()))?;
    }
    let out = child.wait_with_output().map_err(|e| err(e.to_string()))?;
    if !out.status.success() {
        return Err(err(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Creates the sets and (re)installs the SNAT rule for each family.
pub fn install(ipv6: bool) -> Result<(), HostProbeError> {
    let families: &[bool] = if ipv6 { &[false, true] } else { &[false] };
    for &v6 in families {
        let (set, family, save, restore) = if v6 {
            (SET_V6, "inet6", "ip6tables-save", "ip6tables-restore")
        } else {
            (SET_V4, "inet", "iptables-save", "iptables-restore")
        };
        run(
            "ipset",
            &[
                "create", set, "hash:ip", "family", family, "comment", "-exist",
            ],
            None,
        )?;
        // Drop an older copy of our chain first, so restarts never stack rules.
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
        run(restore, &["--noflush"], Some(&render(v6)))?;
    }
    Ok(())
}

/// Adds (or re-labels) a pod's IPs, commented with its uid.
pub fn add_pod(uid: &str, ips: &[IpAddr]) -> Result<(), HostProbeError> {
    for ip in ips {
        let set = if ip.is_ipv6() { SET_V6 } else { SET_V4 };
        let ip = ip.to_string();
        // Upsert: a reused IP now belongs to this uid.
        let _ = run("ipset", &["del", set, &ip, "-exist"], None);
        run("ipset", &["add", set, &ip, "comment", uid, "-exist"], None)?;
    }
    Ok(())
}

/// Removes a pod's IPs, but only entries that still carry its uid.
pub fn remove_pod(uid: &str, ips: &[IpAddr]) {
    for ip in ips {
        let set = if ip.is_ipv6() { SET_V6 } else { SET_V4 };
        let Ok(list) = run("ipset", &["list", set], None) else {
            continue;
        };
        let ip = ip.to_string();
        if list.lines().any(|l| l == format!("{ip} comment \"{uid}\"")) {
            let _ = run("ipset", &["del", set, &ip, "-exist"], None);
        }
    }
}

/// Removes every entry that is not a held pod's (its IP, commented with
/// its uid): pods deleted while the agent was away, or between its removing
/// a pod and its removing the pod's entries, when it was killed then.
/// Returns how many were removed.
pub fn keep_only(held: &[(String, Vec<IpAddr>)]) -> usize {
    let mut removed = 0;
    for set in [SET_V4, SET_V6] {
        let Ok(list) = run("ipset", &["list", set], None) else {
            continue;
        };
        for (ip, uid) in members(&list) {
            let wanted = held
                .iter()
                .any(|(u, ips)| *u == uid && ips.iter().any(|i| i.to_string() == ip));
            if !wanted && run("ipset", &["del", set, &ip, "-exist"], None).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

/// The (IP, uid comment) entries of an `ipset list` text.
fn members(list: &str) -> Vec<(String, String)> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_read_with_their_uid_comments() {
        let list = "Name: istio-inpod-probes-v4\nType: hash:ip\nHeader: family inet comment\nMembers:\n10.0.0.2 comment \"uid-a\"\n10.0.0.3\n";
        assert_eq!(
            members(list),
            vec![
                ("10.0.0.2".to_string(), "uid-a".to_string()),
                ("10.0.0.3".to_string(), String::new())
            ]
        );
        assert!(members("Name: x\nMembers:\n").is_empty());
    }

    #[test]
    fn renders_istio_host_rule() {
        assert_eq!(
            render(false),
            "* nat\n-N ISTIO_POSTRT\n-I POSTROUTING 1 -j ISTIO_POSTRT\n-A ISTIO_POSTRT -m owner --socket-exists -p tcp -m set --match-set istio-inpod-probes-v4 dst -j SNAT --to-source 169.254.7.127\nCOMMIT\n"
        );
        assert!(render(true).contains(
            "istio-inpod-probes-v6 dst -j SNAT --to-source fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
        ));
    }
}
