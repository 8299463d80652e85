//! `ambit`: picks a role from argv[0] (`ambit-proxy`, ...) or the first
//! argument (`ambit proxy`, ...) and hands over. Nothing else lives here.

use std::process::ExitCode;

use ambit::config::{CommandLine, Layers, ProxyConfig};

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

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().collect();
    let argv0 = args
        .first()
        .map(|a| a.rsplit('/').next().unwrap_or(a).to_string())
        .unwrap_or_default();
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
        "cni" => std::process::exit(ambit::cni::plugin_main::main()),
        "demo" => ambit::demo::run(args),
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
