//! `ambit`: picks a role from argv[0] (`ambit-proxy`, ...) or the first
//! argument (`ambit proxy`, ...) and hands over, after setting what every
//! role shares: the allocator and the key-exchange policy.

use std::process::ExitCode;

use ambit::config::{CommandLine, Layers, ProxyConfig};

/// The allocator of every role: jemalloc. Its size classes keep objects
/// of one size together, so what a pod leaves behind when it goes is whole
/// pages, which it gives back. glibc's malloc kept a pod's freed memory
/// in fragments around longer-lived objects and in per-thread caches: the
/// shared proxy's private memory grew by 0.2–0.5 MB for each 200 pods
/// that came and went, round after round (issue #55, docs/faults.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's settings ([`ambit::alloc::SETTINGS`]), read before `main`
/// runs.
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: ambit::alloc::Settings = ambit::alloc::SETTINGS;

const USAGE: &str = "\
ambit — node dataplane for ambient service meshes

Usage: ambit <role> [--config FILE] [--key value ...] [--print-config]

Roles:
  proxy     the L4 HBONE proxy (shared mode: pods from the agent over ZDS;
            dedicated mode: one pod, run inside its netns)
  agent     the node agent: CNI events, in-pod rules, ZDS server, plugin install
  node      agent and proxy together, for one host
  cni       the CNI plugin (normally run by the container runtime as ambit-cni)
  control-plane
            a small delta-xDS + Istio CA server from a local config (labs, CI; production uses istiod)
  demo      builds a two-pod node in network namespaces on this host and shows traffic
  version   prints the version

`ambit <role> --help` lists the role's configuration keys.
";

const CNI_HELP: &str = "\
ambit cni: the CNI plugin. The container runtime runs it (as ambit-cni, which
the agent installs in the CNI bin dir and chains into the primary conflist)
with CNI_COMMAND, CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME, CNI_ARGS and
CNI_PATH set and the network configuration on stdin. On ADD of a pod the
node enrolls, it tells the agent (<cni_agent_run_dir>/pluginevent.sock) and
fails unless the agent took the pod; it prints the previous result on stdout.
DEL and CHECK succeed without side effects. Logs go to stderr.
";

const DEMO_HELP: &str = "\
ambit demo [--once]: builds a node in network namespaces on this host (as
root): `ambit node` with the real CNI chain, two enrolled pods with a
service and a policy, one pod outside the mesh; sends meshed, service,
passthrough and denied traffic and prints what happened. Ctrl-C cleans up.
  --once   print the table once and exit (used by the tests)
";

/// `--help` or `-h` anywhere in a role's arguments.
fn wants_help(args: &[String]) -> bool {
    args.iter().any(|a| a == "--help" || a == "-h")
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().collect();
    let argv0 = args
        .first()
        .map(|a| a.rsplit('/').next().unwrap_or(a).to_string())
        .unwrap_or_default();
    // Istio's key-exchange policy and ztunnel's switch for TLS 1.2 peers,
    // for every TLS this process speaks. The plugin (run by the container
    // runtime, whose environment does not carry them) keeps the defaults.
    let env = |name| std::env::var(name).unwrap_or_default();
    let crypto = ambit::identity::Compliance::parse(&env("COMPLIANCE_POLICY"))
        .and_then(|policy| Ok((policy, ambit::identity::parse_tls12(&env("TLS12_ENABLED"))?)));
    match crypto {
        Ok((policy, tls12)) => {
            ambit::identity::set_compliance(policy);
            ambit::identity::set_tls12(tls12);
        }
        Err(e) if argv0 != "ambit-cni" && std::env::var_os("CNI_COMMAND").is_none() => {
            eprintln!("ambit: {e}");
            return ExitCode::from(2);
        }
        Err(_) => ambit::identity::set_compliance(Default::default()),
    }
    // The container runtime calls the plugin by its file name with CNI_COMMAND set.
    if argv0 == "ambit-cni" || (std::env::var_os("CNI_COMMAND").is_some() && args.len() == 1) {
        return ExitCode::from(ambit::cni::plugin_main::main() as u8);
    }
    let role = match argv0.strip_prefix("ambit-") {
        Some(r) => r.to_string(),
        None if args.len() > 1 => args.remove(1),
        None => "--help".to_string(),
    };
    let rest = args.get(1..).unwrap_or_default().to_vec();
    match run(&role, &rest) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ambit {role}: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(role: &str, args: &[String]) -> anyhow::Result<()> {
    if matches!(role, "proxy" | "agent" | "node" | "control-plane") {
        ambit::alloc::purge_in_background();
    }
    match role {
        "proxy" => {
            let cl = CommandLine::parse(args)?;
            if cl.help {
                print!(
                    "ambit proxy: configuration keys (file < env < flag)\n\n{}",
                    Layers::help(ambit::config::proxy::PROXY_KEYS)
                );
                return Ok(());
            }
            let (cfg, layers) = ProxyConfig::load(&cl)?;
            if cl.print_config {
                print!("{}", layers.render());
                return Ok(());
            }
            ambit::logging::init(cfg.log_format, &cfg.log_level);
            ambit::proxy::run(cfg)
        }
        "agent" => {
            let cl = CommandLine::parse(args)?;
            if cl.help {
                print!(
                    "ambit agent: configuration keys (file < env < flag)\n\n{}",
                    Layers::help(ambit::config::agent::AGENT_KEYS)
                );
                return Ok(());
            }
            let (cfg, layers) = ambit::config::agent::AgentConfig::load(&cl)?;
            if cl.print_config {
                print!("{}", layers.render());
                return Ok(());
            }
            ambit::logging::init(cfg.log_format, &cfg.log_level);
            ambit::cni::agent::run(cfg)
        }
        "node" => ambit::node::run(args),
        "control-plane" => {
            let cl = CommandLine::parse(args)?;
            if cl.help {
                print!(
                    "ambit control-plane: configuration keys (file < env < flag)\n\n{}",
                    Layers::help(ambit::config::controlplane::CONTROL_PLANE_KEYS)
                );
                return Ok(());
            }
            let (cfg, layers) = ambit::config::controlplane::ControlPlaneConfig::load(&cl)?;
            if cl.print_config {
                print!("{}", layers.render());
                return Ok(());
            }
            ambit::logging::init(cfg.log_format, &cfg.log_level);
            ambit::controlplane::run(cfg)
        }
        "cni" if wants_help(args) => {
            print!("{CNI_HELP}");
            Ok(())
        }
        "cni" => std::process::exit(ambit::cni::plugin_main::main()),
        "demo" if wants_help(args) => {
            print!("{DEMO_HELP}");
            Ok(())
        }
        #[cfg(feature = "lab")]
        "demo" => ambit::demo::run(args),
        #[cfg(not(feature = "lab"))]
        "demo" => anyhow::bail!("this build has no lab (built without the `lab` feature)"),
        "version" | "--version" if wants_help(args) => {
            println!("ambit version: prints the version and exits.");
            Ok(())
        }
        "version" | "--version" => {
            println!("ambit {}", ambit::VERSION);
            Ok(())
        }
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(())
        }
        other => anyhow::bail!("unknown role {other:?}\n\n{USAGE}"),
    }
}
