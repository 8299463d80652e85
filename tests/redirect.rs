//! End-to-end: the in-pod redirection rules applied to a real netns with the
//! system's iptables — atomic, idempotent, cleanly removed.

use std::process::Command;

use ambit::cni::redirect::{RedirectOptions, RedirectRules};
use ambit::netns::Netns;

struct TempNetns(String);

impl TempNetns {
    fn new(tag: &str) -> (Self, Netns) {
        let name = format!("ambit-rr-{tag}-{}", std::process::id());
        assert!(Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap()
            .success());
        let ns = Netns::named(&name).unwrap();
        assert!(ns
            .command("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .unwrap()
            .success());
        (TempNetns(name), ns)
    }
}

impl Drop for TempNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// `prog`'s output; panics if it fails, so a failed listing is never read
/// as an empty one (which every "has no ..." check would pass).
fn run(ns: &Netns, prog: &str, args: &[&str]) -> String {
    let out = ns.command(prog).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{prog} {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Rules and our chains, without counters or comments, for comparing states.
fn rules(ns: &Netns, save: &str) -> Vec<String> {
    run(ns, save, &[])
        .lines()
        .filter(|l| l.starts_with("-A") || l.starts_with(":ISTIO"))
        .map(|l| l.split(" [").next().unwrap_or(l).to_string())
        .collect()
}

#[test]
fn apply_is_idempotent_and_remove_is_clean() {
    let (_guard, ns) = TempNetns::new("idem");
    assert!(rules(&ns, "iptables-save").is_empty());
    let r = RedirectRules::new(RedirectOptions::default());
    r.apply(&ns).unwrap();
    let once = rules(&ns, "iptables-save");
    assert!(
        once.iter().any(|l| l.contains("REDIRECT --to-ports 15001")),
        "{once:?}"
    );
    assert!(
        once.iter().any(|l| l.contains("REDIRECT --to-ports 15006")),
        "{once:?}"
    );
    assert!(once.iter().any(|l| l.contains("CT --zone 1")), "{once:?}");
    assert_eq!(
        once.iter()
            .filter(|l| *l == "-A PREROUTING -j ISTIO_PRERT")
            .count(),
        3,
        "one jump per table"
    );
    assert_eq!(
        once.len(),
        6 + 6 + 12,
        "6 jumps, 6 chains, 12 rules: {once:?}"
    );
    assert!(rules(&ns, "ip6tables-save")
        .iter()
        .any(|l| l.contains("::1/128")));
    assert!(run(&ns, "ip", &["rule"]).contains("32764:\tfrom all fwmark 0x111/0xfff lookup 100"));
    assert!(run(&ns, "ip", &["route", "show", "table", "100"]).contains("local default dev lo"));

    r.apply(&ns).unwrap();
    assert_eq!(
        rules(&ns, "iptables-save"),
        once,
        "second apply must change nothing"
    );
    assert_eq!(run(&ns, "ip", &["rule"]).matches("lookup 100").count(), 1);

    // Switching DNS capture off reconciles in place: the 15053 rules and raw chains go.
    let no_dns = RedirectRules::new(RedirectOptions {
        dns_capture: false,
        ..Default::default()
    });
    no_dns.apply(&ns).unwrap();
    let now = rules(&ns, "iptables-save");
    assert!(
        !now.iter()
            .any(|l| l.contains("15053") || l.contains("CT --zone")),
        "{now:?}"
    );
    assert!(now.iter().any(|l| l.contains("--to-ports 15001")));

    no_dns.remove(&ns).unwrap();
    assert_eq!(
        rules(&ns, "iptables-save")
            .into_iter()
            .filter(|l| l.contains("ISTIO"))
            .count(),
        0
    );
    assert!(!rules(&ns, "ip6tables-save")
        .iter()
        .any(|l| l.contains("ISTIO")));
    assert!(!run(&ns, "ip", &["rule"]).contains("lookup 100"));
}

#[test]
fn failed_apply_leaves_nothing_behind() {
    let (_guard, ns) = TempNetns::new("fail");
    // A user chain named like ours but referenced by a foreign rule cannot be
    // deleted, so a reconcile that must drop it fails as a whole.
    let setup = "*raw\n:ISTIO_OUTPUT - [0:0]\n-A OUTPUT -p icmp -j ISTIO_OUTPUT\n-A OUTPUT -p udp -j ISTIO_OUTPUT\nCOMMIT\n";
    let mut child = ns
        .command("iptables-restore")
        .arg("--noflush")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), setup.as_bytes()).unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let before = rules(&ns, "iptables-save");
    let r = RedirectRules::new(RedirectOptions {
        dns_capture: false,
        ipv6: false,
        ..Default::default()
    });
    let err = r
        .apply(&ns)
        .expect_err("a chain held by a foreign rule cannot be dropped")
        .to_string();
    assert!(
        err.contains("iptables-restore")
            && err.contains(&format!("ambit-rr-fail-{}", std::process::id())),
        "{err}"
    );
    assert_eq!(
        rules(&ns, "iptables-save"),
        before,
        "a failed apply leaves the netns as it was"
    );
}

#[test]
fn apply_gives_the_pods_loopback_big_tcp_and_remove_takes_it_back() {
    use ambit::cni::loopback::limits;
    let (_guard, ns) = TempNetns::new("bigtcp");
    let before = limits(&ns).unwrap();
    assert_eq!(before.gso, 65536, "{before:?}");
    let r = RedirectRules::new(RedirectOptions::default());
    r.apply(&ns).unwrap();
    let on = limits(&ns).unwrap();
    assert!(on.tso_max >= 256 * 1024, "{on:?}");
    assert_eq!(on.gso, on.tso_max);
    // IPv4 BIG TCP needs Linux 6.3; CI's kernel has it.
    assert_eq!(on.gso_ipv4, Some(on.tso_max));
    // iproute2 sees the same limit.
    let shown = run(&ns, "ip", &["-d", "link", "show", "lo"]);
    assert!(
        shown.contains(&format!("gso_max_size {}", on.tso_max)),
        "{shown}"
    );
    // A bulk transfer over the pod's loopback still arrives whole.
    let l = ns
        .run(|| std::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap()
        .unwrap();
    let addr = l.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut n = 0usize;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match std::io::Read::read(&mut s, &mut buf).unwrap() {
                0 => return n,
                k => n += k,
            }
        }
    });
    let mut c = ns
        .run(move || std::net::TcpStream::connect(addr))
        .unwrap()
        .unwrap();
    std::io::Write::write_all(&mut c, &vec![1u8; 32 << 20]).unwrap();
    drop(c);
    assert_eq!(server.join().unwrap(), 32 << 20);

    // Turned off (AMBIT_POD_LOOPBACK_BIG_TCP=false), a re-apply puts the
    // default back, and applying again keeps it.
    let off = RedirectRules::new(RedirectOptions {
        loopback_big_tcp: false,
        ..RedirectOptions::default()
    });
    off.apply(&ns).unwrap();
    assert_eq!(limits(&ns).unwrap(), before, "re-applied with BIG TCP off");
    off.apply(&ns).unwrap();
    assert_eq!(limits(&ns).unwrap(), before, "and again");

    r.remove(&ns).unwrap();
    assert_eq!(limits(&ns).unwrap(), before, "remove restores the default");
}

/// A "VM" netns behind interface `vm0` of the pod; returns the VM's netns.
fn vm_behind(pod_ns: &str, tag: &str) -> (TempNetns, Netns) {
    let (vm_guard, vm) = TempNetns::new(tag);
    let ok = |args: &[&str]| {
        assert!(
            Command::new("ip").args(args).status().unwrap().success(),
            "ip {args:?}"
        )
    };
    ok(&[
        "link",
        "add",
        "vm0",
        "netns",
        pod_ns,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        &vm_guard.0,
    ]);
    ok(&["-n", pod_ns, "addr", "add", "10.99.0.1/30", "dev", "vm0"]);
    ok(&["-n", pod_ns, "link", "set", "vm0", "up"]);
    ok(&[
        "-n",
        &vm_guard.0,
        "addr",
        "add",
        "10.99.0.2/30",
        "dev",
        "eth0",
    ]);
    ok(&["-n", &vm_guard.0, "link", "set", "eth0", "up"]);
    ok(&[
        "-n",
        &vm_guard.0,
        "route",
        "add",
        "default",
        "via",
        "10.99.0.1",
    ]);
    (vm_guard, vm)
}

#[test]
fn a_virtual_interfaces_tcp_reaches_the_outbound_port_with_its_destination() {
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::time::Duration;
    let (pod_guard, pod) = TempNetns::new("vif");
    let (_vm_guard, vm) = vm_behind(&pod_guard.0, "vifvm");
    let listener = pod
        .run(|| TcpListener::bind("0.0.0.0:15001"))
        .unwrap()
        .unwrap();
    listener.set_nonblocking(true).unwrap();
    let target: SocketAddr = "192.0.2.10:80".parse().unwrap();
    let dial = |vm: &Netns| {
        vm.run(move || TcpStream::connect_timeout(&target, Duration::from_millis(1500)))
            .unwrap()
    };

    // Without the interface in the rules, the VM's connection is taken for
    // inbound traffic (15006, where nothing listens here), not outbound.
    let plain = RedirectRules::new(RedirectOptions {
        ipv6: false,
        ..Default::default()
    });
    plain.apply(&pod).unwrap();
    assert!(
        dial(&vm).is_err(),
        "not sent to 15001 without the interface"
    );
    assert!(listener.accept().is_err());

    // With it, the proxy's outbound port gets it, original destination intact.
    let vms = RedirectRules::new(RedirectOptions {
        ipv6: false,
        virtual_interfaces: vec!["vm0".into()],
        ..Default::default()
    });
    vms.apply(&pod).unwrap();
    let _client = dial(&vm).expect("captured to 15001");
    listener.set_nonblocking(false).unwrap();
    let (accepted, from) = listener.accept().unwrap();
    assert_eq!(from.ip().to_string(), "10.99.0.2");
    let orig =
        nix::sys::socket::getsockopt(&accepted, nix::sys::socket::sockopt::OriginalDst).unwrap();
    assert_eq!(u32::from_be(orig.sin_addr.s_addr), 0xC000_020A);
    assert_eq!(u16::from_be(orig.sin_port), 80);
    let nat = rules(&pod, "iptables-save");
    assert!(
        nat.iter()
            .any(|l| l == "-A ISTIO_PRERT -i vm0 -p tcp -j REDIRECT --to-ports 15001"),
        "{nat:?}"
    );

    // Removal takes the capture away again.
    vms.remove(&pod).unwrap();
    assert!(dial(&vm).is_err());
}

#[test]
fn a_transparent_ipv6_dial_keeps_the_callers_address_through_the_pods_rules() {
    // The shared proxy delivers inbound traffic to the app from the original
    // caller's address (IPV6_TRANSPARENT + IPV6_FREEBIND); the pod's connmark
    // rules and table 100 bring the replies back to that socket.
    let (_guard, ns) = TempNetns::new("tproxy6");
    // A pod's interface, address and default route (the reply is routed
    // there first, then re-routed to table 100 by its restored mark).
    for args in [
        &[
            "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
        ][..],
        &["link", "set", "eth0", "up"],
        &["link", "set", "peer0", "up"],
        &["-6", "addr", "add", "fd01::1/64", "dev", "eth0", "nodad"],
        &["-6", "route", "add", "default", "dev", "eth0"],
    ] {
        assert!(
            ns.command("ip").args(args).status().unwrap().success(),
            "ip {args:?}"
        );
    }
    RedirectRules::new(RedirectOptions::default())
        .apply(&ns)
        .unwrap();
    let listener = ns
        .run(|| std::net::TcpListener::bind("[fd01::1]:0"))
        .unwrap()
        .unwrap();
    let app = listener.local_addr().unwrap();
    let caller: std::net::IpAddr = "fd00::7".parse().unwrap();
    let dialed = ns
        .run(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let factory = ambit::proxy::pod::SocketFactory::local(
                    ambit::proxy::pod::SocketOptions::marked(ambit::constants::PROXY_MARK),
                    "default/vm".into(),
                );
                let s = factory.connect_as(app, caller).await?;
                s.local_addr()
            })
        })
        .unwrap()
        .expect("transparent IPv6 dial");
    assert_eq!(dialed.ip(), caller, "not the fallback to the pod's address");
    let (_conn, peer) = listener.accept().unwrap();
    assert_eq!(peer.ip(), caller, "the app sees the original caller");
}

/// `nft list ruleset` in `ns`, each line's words without the counters'
/// values, for comparing states.
fn nft_tables(ns: &Netns) -> Vec<String> {
    run(ns, "nft", &["list", "ruleset"])
        .lines()
        .map(|l| {
            let mut words = Vec::new();
            let mut it = l.split_whitespace();
            while let Some(w) = it.next() {
                if w == "packets" || w == "bytes" {
                    it.next();
                    continue;
                }
                words.push(w);
            }
            words.join(" ")
        })
        .collect()
}

/// Each golden transaction of the nftables back end (src/cni/testdata/nft)
/// is what the kernel takes: checked with `nft -c`, then applied for real
/// into a scratch netns, where it leaves its three tables (two without DNS).
#[test]
fn every_nftables_variant_is_taken_by_the_kernel() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cni/testdata/nft");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        let (_guard, ns) = TempNetns::new(&format!("nft-{name}"));
        let file = path.to_string_lossy().to_string();
        run(&ns, "nft", &["-c", "-f", &file]);
        run(&ns, "nft", &["-f", &file]);
        let tables = run(&ns, "nft", &["list", "tables"]);
        let want = if name == "dns_off" || name == "virtual_interfaces" {
            2
        } else {
            3
        };
        assert_eq!(
            tables.matches("table inet istio-ambient-").count(),
            want,
            "{name}: {tables}"
        );
        // Applied twice, the same.
        let once = nft_tables(&ns);
        run(&ns, "nft", &["-f", &file]);
        assert_eq!(nft_tables(&ns), once, "{name}");
        seen += 1;
    }
    assert_eq!(seen, 5, "every golden checked");
    // The host's transactions (src/cni/testdata/nft-host): the install
    // without and with IPv6, then a pod's entries on top.
    let host = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cni/testdata/nft-host");
    let (_guard, ns) = TempNetns::new("nft-host");
    for name in ["hostprobe", "hostprobe_ipv6", "add_pod", "create_pod"] {
        let file = host
            .join(format!("{name}.nft"))
            .to_string_lossy()
            .to_string();
        run(&ns, "nft", &["-c", "-f", &file]);
        run(&ns, "nft", &["-f", &file]);
    }
    let table = run(&ns, "nft", &["list", "table", "inet", "istio-ambient-nat"]);
    assert_eq!(
        table
            .matches("comment \"9f3c2a1e-0b7d-4c55-8e21-5a6b7c8d9e0f\"")
            .count(),
        4,
        "{table}"
    );
    assert_eq!(table.matches(" snat ip").count(), 2, "{table}");
}

/// The nftables back end through `RedirectRules`: one transaction, no
/// iptables rule written, idempotent, a switch that drops the raw table
/// drops it, a table of ours holding someone else's chain is replaced
/// whole, and removal leaves no table, rule or route.
#[test]
fn nftables_apply_is_idempotent_replaces_stale_tables_and_remove_is_clean() {
    use ambit::cni::redirect::Backend;
    let (_guard, ns) = TempNetns::new("nft-idem");
    // Left by a crash, or by another tool: a table named like ours with a
    // chain of its own.
    run(&ns, "nft", &["add table inet istio-ambient-nat"]);
    run(
        &ns,
        "nft",
        &["add chain inet istio-ambient-nat stray { type nat hook output priority 0 ; }"],
    );
    let nft = |opts: RedirectOptions| {
        RedirectRules::new(RedirectOptions {
            backend: Backend::Nftables,
            ..opts
        })
    };
    let r = nft(RedirectOptions::default());
    r.apply(&ns).unwrap();
    let once = nft_tables(&ns);
    let text = once.join("\n");
    assert!(!text.contains("stray"), "{text}");
    for want in [
        "redirect to :15001",
        "redirect to :15006",
        "redirect to :15053",
        "ct zone set 1",
        "type route hook output",
        "ip6 daddr != ::1",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    assert!(
        !rules(&ns, "iptables-save")
            .iter()
            .any(|l| l.contains("ISTIO")),
        "no iptables rule"
    );
    assert!(run(&ns, "ip", &["rule"]).contains("fwmark 0x111/0xfff lookup 100"));
    r.apply(&ns).unwrap();
    assert_eq!(nft_tables(&ns), once, "second apply must change nothing");

    let no_dns = nft(RedirectOptions {
        dns_capture: false,
        ..Default::default()
    });
    no_dns.apply(&ns).unwrap();
    let tables = run(&ns, "nft", &["list", "tables"]);
    assert!(!tables.contains("istio-ambient-raw"), "{tables}");
    assert!(!nft_tables(&ns).join("\n").contains(":15053"));

    no_dns.remove(&ns).unwrap();
    assert!(!run(&ns, "nft", &["list", "tables"]).contains("istio-ambient"));
    assert!(!run(&ns, "ip", &["rule"]).contains("lookup 100"));
}

/// A pod whose rules were written by iptables, applied again with
/// nftables (the agent restarted with the other setting): the iptables
/// rules go, the nftables tables come. A transaction the kernel refuses
/// changes nothing.
#[test]
fn nftables_takes_over_a_pod_from_iptables_and_a_refused_transaction_changes_nothing() {
    use ambit::cni::redirect::Backend;
    let (_guard, ns) = TempNetns::new("nft-move");
    RedirectRules::new(RedirectOptions::default())
        .apply(&ns)
        .unwrap();
    assert!(rules(&ns, "iptables-save")
        .iter()
        .any(|l| l.contains("ISTIO")));
    let nft = RedirectRules::new(RedirectOptions {
        backend: Backend::Nftables,
        ..Default::default()
    });
    // As the agent restarted with nftables writes a held pod's rules again.
    nft.reapply(&ns).unwrap();
    assert!(!rules(&ns, "iptables-save")
        .iter()
        .any(|l| l.contains("ISTIO")));
    assert!(!rules(&ns, "ip6tables-save")
        .iter()
        .any(|l| l.contains("ISTIO")));
    let before = nft_tables(&ns);
    assert!(before.join("\n").contains("istio-ambient-nat"));
    // A transaction the kernel refuses part of (here, a rule in a chain
    // that does not exist, after our tables' delete) is refused whole.
    let mut child = ns
        .command("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let bad = "add table inet istio-ambient-nat\ndelete table inet istio-ambient-nat\nadd rule inet istio-ambient-nat nowhere accept\n";
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), bad.as_bytes()).unwrap();
    drop(child.stdin.take());
    assert!(!child.wait().unwrap().success(), "the kernel refuses it");
    assert_eq!(
        nft_tables(&ns),
        before,
        "a refused transaction changes nothing"
    );
}

/// The host's probe rule and sets in nftables (what the agent runs in the
/// node's netns): a connection from the host to an enrolled pod arrives
/// from 169.254.7.127, one to a pod not in the set from the host's own
/// address; entries are added and removed one pod at a time, a reused
/// address takes the new pod's uid (the old pod's removal leaves it), a
/// restart keeps the entries, each back end's install removes what the
/// other left, and uninstall leaves nothing.
#[test]
fn host_probe_rules_in_nftables_snat_the_nodes_connections_to_enrolled_pods() {
    use ambit::cni::hostprobe::{HostProbes, NFT_TABLE};
    use ambit::cni::redirect::Backend;
    use std::io::{Read, Write};
    use std::net::{IpAddr, TcpListener, TcpStream};
    let (_h, host) = TempNetns::new("hp-host");
    let (pod_guard, pod) = TempNetns::new("hp-pod");
    run(
        &host,
        "ip",
        &[
            "link",
            "add",
            "hp0",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &pod_guard.0,
        ],
    );
    run(&host, "ip", &["addr", "add", "10.77.0.1/24", "dev", "hp0"]);
    run(&host, "ip", &["link", "set", "hp0", "up"]);
    run(&pod, "ip", &["addr", "add", "10.77.0.2/24", "dev", "eth0"]);
    run(&pod, "ip", &["link", "set", "eth0", "up"]);
    run(&pod, "ip", &["route", "add", "default", "via", "10.77.0.1"]);
    let listener = pod
        .run(|| TcpListener::bind("10.77.0.2:8080"))
        .unwrap()
        .unwrap();
    // The address a connection from the host arrives from, at the pod.
    let probe_source = || -> IpAddr {
        let mut c = host
            .run(|| TcpStream::connect("10.77.0.2:8080"))
            .unwrap()
            .unwrap();
        let (mut s, peer) = listener.accept().unwrap();
        c.write_all(b"p").unwrap();
        let mut b = [0u8; 1];
        s.read_exact(&mut b).unwrap();
        peer.ip()
    };
    let set = |name: &str| run(&host, "nft", &["list", "set", "inet", NFT_TABLE, name]);
    let pod_ip: IpAddr = "10.77.0.2".parse().unwrap();
    let nft = HostProbes {
        backend: Backend::Nftables,
        ipv6: true,
    };
    let in_host = |f: Box<dyn FnOnce(HostProbes) + Send>| host.run(move || f(nft)).unwrap();

    in_host(Box::new(|p| p.install().unwrap()));
    assert_eq!(
        probe_source().to_string(),
        "10.77.0.1",
        "not enrolled: not SNATed"
    );
    in_host(Box::new(move |p| {
        p.add_pod("uid-a", &[pod_ip, "fd00::2".parse().unwrap()])
            .unwrap()
    }));
    assert!(set("istio-inpod-probes-v4").contains("10.77.0.2 comment \"uid-a\""));
    assert!(set("istio-inpod-probes-v6").contains("fd00::2 comment \"uid-a\""));
    assert_eq!(
        probe_source().to_string(),
        "169.254.7.127",
        "enrolled: SNATed"
    );
    // The address reused by another pod: it is that pod's now, and the
    // first pod's removal leaves it.
    in_host(Box::new(move |p| {
        p.add_pod("uid-b", &[pod_ip]).unwrap();
        p.remove_pod("uid-a", &[pod_ip]);
    }));
    let v4 = set("istio-inpod-probes-v4");
    assert!(
        v4.contains("10.77.0.2 comment \"uid-b\"") && !v4.contains("uid-a"),
        "{v4}"
    );
    // A restart: the rule is written again, the entries stay (and the
    // chain holds one rule per family, not two).
    in_host(Box::new(|p| p.install().unwrap()));
    let table = run(&host, "nft", &["list", "table", "inet", NFT_TABLE]);
    assert!(table.contains("10.77.0.2 comment \"uid-b\""), "{table}");
    assert_eq!(
        table.matches("snat ip to 169.254.7.127").count(),
        1,
        "{table}"
    );
    assert_eq!(probe_source().to_string(), "169.254.7.127");
    // Entries of pods no longer held go, one transaction per set.
    let removed = host
        .run(move || nft.keep_only(&[("uid-b".to_string(), vec![pod_ip])]))
        .unwrap();
    assert_eq!(removed, 1, "fd00::2 of uid-a");
    assert!(!set("istio-inpod-probes-v6").contains("fd00::2"));
    // The agent's start: one sync adds the held pods' missing entries,
    // gives a reused address its holder's uid and removes the rest.
    let synced = host
        .run(move || {
            nft.add_pod("uid-gone", &["10.77.0.8".parse().unwrap()])
                .unwrap();
            nft.sync(&[
                ("uid-c".to_string(), vec![pod_ip]),
                ("uid-d".to_string(), vec!["10.77.0.9".parse().unwrap()]),
            ])
        })
        .unwrap();
    assert_eq!(
        synced,
        (2, 2),
        "10.77.0.2 to uid-c and 10.77.0.9 in; uid-b's and 10.77.0.8 out"
    );
    let v4 = set("istio-inpod-probes-v4");
    assert!(
        v4.contains("10.77.0.2 comment \"uid-c\"")
            && v4.contains("10.77.0.9 comment \"uid-d\"")
            && !v4.contains("10.77.0.8"),
        "{v4}"
    );
    assert_eq!(probe_source().to_string(), "169.254.7.127");
    // The agent restarted with iptables: the nftables table goes, the
    // ipset and chain come; and back.
    let ipt = HostProbes {
        backend: Backend::Iptables,
        ipv6: true,
    };
    host.run(move || ipt.install().unwrap()).unwrap();
    assert!(!run(&host, "nft", &["list", "tables"]).contains("inet istio-ambient-nat"));
    assert!(run(&host, "iptables-save", &["-t", "nat"]).contains("ISTIO_POSTRT"));
    in_host(Box::new(|p| p.install().unwrap()));
    assert!(!run(&host, "iptables-save", &["-t", "nat"]).contains("ISTIO_POSTRT"));
    assert!(!run(&host, "ipset", &["list", "-n"]).contains("istio-inpod-probes"));
    // Uninstalled: nothing of ours on the host.
    in_host(Box::new(|p| p.uninstall().unwrap()));
    assert!(!run(&host, "nft", &["list", "tables"]).contains("istio-ambient"));
    assert_eq!(probe_source().to_string(), "10.77.0.1");
}

/// Pods of one family: one with only an IPv6 address, one whose kernel has
/// IPv6 turned off. Each back end applies its rules whole to both (the
/// IPv6 rules in force on the IPv6-only pod; no IPv6 route where there is
/// no IPv6: the kernel refuses it there, as istio-cni knows), and removes
/// them leaving nothing.
#[test]
fn pods_of_one_family_get_their_rules_whole_in_either_back_end() {
    use ambit::cni::redirect::Backend;
    for backend in [Backend::Iptables, Backend::Nftables] {
        let tag = format!("{backend:?}").to_lowercase();
        let (_a, v6only) = TempNetns::new(&format!("v6only-{tag}"));
        run(
            &v6only,
            "ip",
            &[
                "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
            ],
        );
        run(
            &v6only,
            "ip",
            &["addr", "add", "fd00:10::5/64", "dev", "eth0", "nodad"],
        );
        run(&v6only, "ip", &["link", "set", "eth0", "up"]);
        let (_b, nov6) = TempNetns::new(&format!("nov6-{tag}"));
        run(
            &nov6,
            "sysctl",
            &["-qw", "net.ipv6.conf.all.disable_ipv6=1"],
        );
        run(&nov6, "sysctl", &["-qw", "net.ipv6.conf.lo.disable_ipv6=1"]);
        let r = RedirectRules::new(RedirectOptions {
            backend,
            ..Default::default()
        });
        for ns in [&v6only, &nov6] {
            r.apply(ns).unwrap_or_else(|e| panic!("{backend:?}: {e}"));
            let v6 = match backend {
                Backend::Iptables => rules(ns, "ip6tables-save").join("\n"),
                Backend::Nftables => nft_tables(ns).join("\n"),
            };
            assert!(
                v6.contains("15001") && v6.contains("15006"),
                "{backend:?}: {v6}"
            );
            assert!(run(ns, "ip", &["-6", "rule", "show"]).contains("lookup 100"));
            let routes = run(ns, "ip", &["-6", "route", "show", "table", "100"]);
            let has_v6 = std::ptr::eq(ns, &v6only);
            assert_eq!(routes.contains("local"), has_v6, "{backend:?}: {routes}");
            r.remove(ns).unwrap();
            assert!(nft_tables(ns).iter().all(|l| !l.contains("istio")));
            assert!(!rules(ns, "iptables-save").join("\n").contains("ISTIO"));
            assert!(!run(ns, "ip", &["-6", "rule", "show"]).contains("lookup 100"));
        }
    }
}
