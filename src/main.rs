//! `ambit`: picks a role from argv[0] (`ambit-proxy`, ...) or the first
//! argument (`ambit proxy`, ...) and hands over. Nothing else lives here.

use std::process::ExitCode;

use ambit::config::{CommandLine, Layers, ProxyConfig};

const USAGE: &str = "\
ambit — node dataplane for ambient service meshes

Usage: ambit <role> [--config FILE] [--key value ...] [--print-config]

Roles:
  proxy     the L4 HBONE proxy (dedicated mode: run inside the pod's netns)
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
