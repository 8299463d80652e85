//! Which interfaces a pod may name in `istio.io/reroute-virtual-interfaces`
//! (a KubeVirt VM's, e.g. `k6t-eth0,tap0`). TCP arriving on a virtual
//! interface goes to the outbound proxy as the VM's own traffic, ahead of
//! the inbound redirect: an interface that carries the pod's inbound
//! traffic (its own network interface, the loopback, or a wildcard that
//! matches them) would let that traffic skip the inbound proxy, and with it
//! the pod's authorization policies. So only plain names of other
//! interfaces pass. The checks are pure; finding the pod's own interfaces
//! runs `ip` in its netns. The rules themselves are `redirect.rs`'s.

use crate::constants::POD_INTERFACE;
use crate::netns::Netns;

/// Why a virtual interface is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterfaceRefusal {
    /// Not something iptables could take as one interface's name.
    NotAName,
    /// Holds `+`, which iptables reads as "any interface starting with".
    Wildcard,
    /// The loopback.
    Loopback,
    /// The pod's own network interface.
    Primary,
}

impl std::fmt::Display for InterfaceRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            InterfaceRefusal::NotAName => "not an interface name (1 to 15 of A-Z a-z 0-9 . _ -, not starting with -, not . or ..)",
            InterfaceRefusal::Wildcard => "`+` makes it an iptables wildcard (`tap+` is every interface whose name starts with `tap`); name each VM interface in full",
            InterfaceRefusal::Loopback => "`lo` is the pod's loopback, which the proxy's own deliveries to the application cross; name the VM's interfaces (e.g. `k6t-eth0,tap0`)",
            InterfaceRefusal::Primary => "it is the pod's own network interface, whose inbound traffic would then bypass the inbound proxy and the pod's policies; name the VM's interfaces (e.g. `k6t-eth0,tap0`)",
        })
    }
}

/// A virtual interface refused, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "virtual interface {name:?} (annotation istio.io/reroute-virtual-interfaces) refused: {why}"
)]
pub struct VirtualInterfaceRefused {
    pub name: String,
    pub why: InterfaceRefusal,
}

/// Whether `name` can be an interface name on the iptables command line:
/// Linux's length limit, and only characters that cannot change the rule
/// (`+` included: a wildcard, refused on its own by [`check`]).
pub fn valid_interface(name: &str) -> bool {
    (1..=15).contains(&name.len())
        && name != "."
        && name != ".."
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'+'))
}

/// Checks the virtual interfaces named for a pod: each must be one
/// interface's plain name (no wildcard), and neither the loopback nor one of
/// `primary`, the pod's own network interfaces ([`primary`]).
pub fn check(names: &[String], primary: &[String]) -> Result<(), VirtualInterfaceRefused> {
    for name in names {
        let why = if !valid_interface(name) {
            InterfaceRefusal::NotAName
        } else if name.contains('+') {
            InterfaceRefusal::Wildcard
        } else if name == "lo" {
            InterfaceRefusal::Loopback
        } else if primary.iter().any(|p| p == name) {
            InterfaceRefusal::Primary
        } else {
            continue;
        };
        return Err(VirtualInterfaceRefused {
            name: name.clone(),
            why,
        });
    }
    Ok(())
}

/// The interfaces named by `dev` in `ip -o route show default` output
/// ("default via 10.0.0.1 dev eth0 ...", one line per route, a multipath
/// route's hops on its one line), in order, each once.
fn route_devices(out: &str) -> Vec<String> {
    let mut devices: Vec<String> = Vec::new();
    for line in out.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        for pair in words.windows(2) {
            if pair[0] == "dev" && !devices.iter().any(|d| d == pair[1]) {
                devices.push(pair[1].to_string());
            }
        }
    }
    devices
}

/// The pod's own network interfaces: the one container runtimes create for
/// it ([`POD_INTERFACE`]) and those of its default routes, IPv4 and IPv6
/// (a family without a default route, or without `ip` support in the pod,
/// adds nothing).
pub fn primary(netns: &Netns) -> Vec<String> {
    let mut all = vec![POD_INTERFACE.to_string()];
    for family in ["-4", "-6"] {
        let out = netns
            .command("ip")
            .args([family, "-o", "route", "show", "default"])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output();
        let Ok(out) = out else { continue };
        for dev in route_devices(&String::from_utf8_lossy(&out.stdout)) {
            if !all.contains(&dev) {
                all.push(dev);
            }
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_that_could_change_a_rule_are_refused() {
        for ok in ["eth1", "vm0", "tap+", "br-ex.100", "a_b", "abcdefghijklmno"] {
            assert!(valid_interface(ok), "{ok}");
        }
        for bad in [
            "",
            ".",
            "..",
            "abcdefghijklmnop",
            "eth0 -j ACCEPT",
            "eth0\n-A",
            "eth/0",
            "eth:0",
            "-j",
        ] {
            assert!(!valid_interface(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_virtual_interface_never_names_the_pods_own_traffic() {
        let refused = |names: &[&str], primary: &[&str]| {
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            let primary: Vec<String> = primary.iter().map(|n| n.to_string()).collect();
            check(&names, &primary).err().map(|r| (r.name, r.why))
        };
        // KubeVirt's bridge and tap: fine.
        assert_eq!(refused(&["k6t-eth0", "tap0"], &["eth0"]), None);
        assert_eq!(
            refused(&["tap0", "lo"], &["eth0"]),
            Some(("lo".into(), InterfaceRefusal::Loopback))
        );
        assert_eq!(
            refused(&["eth0"], &["eth0"]),
            Some(("eth0".into(), InterfaceRefusal::Primary))
        );
        assert_eq!(
            refused(&["tap0", "net1"], &["eth0", "net1"]),
            Some(("net1".into(), InterfaceRefusal::Primary)),
            "whatever interface the pod's default route uses"
        );
        for wildcard in ["tap+", "e+", "+"] {
            assert_eq!(
                refused(&[wildcard], &["eth0"]),
                Some((wildcard.into(), InterfaceRefusal::Wildcard)),
                "{wildcard}"
            );
        }
        assert_eq!(
            refused(&["x -j DROP"], &[]),
            Some(("x -j DROP".into(), InterfaceRefusal::NotAName))
        );
        let err = check(&["eth+".to_string()], &[]).unwrap_err().to_string();
        assert!(
            err.contains("\"eth+\"") && err.contains("wildcard"),
            "{err}"
        );
    }

    #[test]
    fn the_default_routes_name_the_pods_interfaces() {
        let out = "default via 10.77.0.1 dev eth0 \n\
                   default proto static metric 100 \\\tnexthop via 10.1.0.1 dev net1 weight 1 \\\tnexthop via 10.2.0.1 dev eth0 weight 1\n";
        assert_eq!(route_devices(out), ["eth0", "net1"]);
        assert!(route_devices("").is_empty());
    }
}
