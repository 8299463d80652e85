//! Typed configuration for every role, layered defaults < YAML file < environment < flags.
//!
//! A role declares its keys once as a table of [`Key`]s (name, environment
//! variables, default, help). [`Layers`] collects raw string values from each
//! source, remembering where each came from, and the role's typed struct is
//! built from them in one place, so every bad value fails with the key, the
//! value, its origin and what was expected. This module imports no other part
//! of Ambit and does no I/O beyond reading the environment and the file it is
//! given.

pub mod agent;
pub mod controlplane;
pub mod proxy;
pub mod reference;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use proxy::{ProxyConfig, ProxyMode, WorkloadInfo};

/// One configuration key of a role.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// Name in the YAML file; the flag is the same with `-` for `_`.
    pub name: &'static str,
    /// Environment variables that set it, first found wins (Istio's names first).
    pub env: &'static [&'static str],
    /// Default value as text; empty means unset.
    pub default: &'static str,
    /// One line for `--help` and the README table.
    pub help: &'static str,
}

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Default,
    File(PathBuf),
    Env(&'static str),
    Flag,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => f.write_str("default"),
            Origin::File(p) => write!(f, "file {}", p.display()),
            Origin::Env(name) => write!(f, "env {name}"),
            Origin::Flag => f.write_str("flag"),
        }
    }
}

/// Everything that can go wrong while building a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config key `{key}` = {value:?} (from {origin}): expected {expected}")]
    Invalid {
        key: &'static str,
        value: String,
        origin: Origin,
        expected: String,
    },
    #[error("config key `{key}` is required: {hint}")]
    Missing {
        key: &'static str,
        hint: &'static str,
    },
    #[error("unknown config key `{key}` (from {origin}); known keys: {known}")]
    UnknownKey {
        key: String,
        origin: Origin,
        known: String,
    },
    #[error("config file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("flag {flag}: {reason}")]
    Flag { flag: String, reason: String },
}

/// Raw values of a role's keys with their origins, highest layer applied last.
#[derive(Debug, Clone)]
pub struct Layers {
    keys: &'static [Key],
    values: BTreeMap<&'static str, (String, Origin)>,
}

/// What the command line asked for besides key values.
#[derive(Debug, Default, Clone)]
pub struct CommandLine {
    pub config_file: Option<PathBuf>,
    pub print_config: bool,
    pub help: bool,
    pub values: Vec<(String, String)>,
}

impl CommandLine {
    /// Parses `--config F`, `--print-config`, `--help` and `--some-key V` / `--some-key=V`.
    pub fn parse(args: &[String]) -> Result<Self, ConfigError> {
        let mut cl = CommandLine::default();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                return Err(ConfigError::Flag {
                    flag: arg.clone(),
                    reason: "expected --key value".into(),
                });
            };
            let (name, inline) = match flag.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (flag, None),
            };
            match name {
                "print-config" => cl.print_config = true,
                "help" => cl.help = true,
                _ => {
                    let value = match inline {
                        Some(v) => v,
                        None => it.next().cloned().ok_or_else(|| ConfigError::Flag {
                            flag: arg.clone(),
                            reason: "needs a value".into(),
                        })?,
                    };
                    if name == "config" {
                        cl.config_file = Some(PathBuf::from(value));
                    } else {
                        cl.values.push((name.replace('-', "_"), value));
                    }
                }
            }
        }
        Ok(cl)
    }
}

impl Layers {
    /// Defaults only.
    pub fn new(keys: &'static [Key]) -> Self {
        let values = keys
            .iter()
            .filter(|k| !k.default.is_empty())
            .map(|k| (k.name, (k.default.to_string(), Origin::Default)))
            .collect();
        Layers { keys, values }
    }

    /// All layers: defaults, then the file, then `env`, then the flags.
    pub fn resolve(
        keys: &'static [Key],
        cl: &CommandLine,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let mut layers = Layers::new(keys);
        if let Some(path) = &cl.config_file {
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            layers.apply_yaml(path, &text)?;
        }
        layers.apply_env(env);
        for (name, value) in &cl.values {
            layers.set(name, value.clone(), Origin::Flag)?;
        }
        Ok(layers)
    }

    fn key(&self, name: &str, origin: &Origin) -> Result<&'static Key, ConfigError> {
        self.keys
            .iter()
            .find(|k| k.name == name)
            .ok_or_else(|| ConfigError::UnknownKey {
                key: name.to_string(),
                origin: origin.clone(),
                known: self
                    .keys
                    .iter()
                    .map(|k| k.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    fn set(&mut self, name: &str, value: String, origin: Origin) -> Result<(), ConfigError> {
        let key = self.key(name, &origin)?;
        self.values.insert(key.name, (value, origin));
        Ok(())
    }

    /// A flat YAML mapping of key → scalar.
    pub fn apply_yaml(&mut self, path: &Path, text: &str) -> Result<(), ConfigError> {
        let file_err = |reason: String| ConfigError::File {
            path: path.to_path_buf(),
            reason,
        };
        let doc: serde_yaml::Value =
            serde_yaml::from_str(text).map_err(|e| file_err(e.to_string()))?;
        let map = match doc {
            serde_yaml::Value::Null => return Ok(()),
            serde_yaml::Value::Mapping(m) => m,
            _ => return Err(file_err("expected a mapping of key: value".into())),
        };
        for (k, v) in map {
            let name = k
                .as_str()
                .ok_or_else(|| file_err(format!("key {k:?} is not a string")))?
                .to_string();
            let value = match v {
                serde_yaml::Value::String(s) => s,
                serde_yaml::Value::Number(n) => n.to_string(),
                serde_yaml::Value::Bool(b) => b.to_string(),
                serde_yaml::Value::Null => String::new(),
                other => {
                    return Err(file_err(format!(
                        "key `{name}`: expected a scalar, got {other:?}"
                    )))
                }
            };
            self.set(&name, value, Origin::File(path.to_path_buf()))?;
        }
        Ok(())
    }

    fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) {
        for key in self.keys {
            if let Some((var, value)) = key.env.iter().find_map(|v| env(v).map(|val| (*v, val))) {
                self.values.insert(key.name, (value, Origin::Env(var)));
            }
        }
    }

    /// The raw value of a key, if set.
    pub fn raw(&self, name: &str) -> Option<&(String, Origin)> {
        self.values.get(name).filter(|(v, _)| !v.is_empty())
    }

    /// Whether `name` was set (file, environment or flag) rather than left
    /// at its default.
    pub fn chosen(&self, name: &str) -> bool {
        self.raw(name).is_some_and(|(_, o)| *o != Origin::Default)
    }

    /// Parses a key with `parse`, turning its error text into [`ConfigError::Invalid`].
    pub fn get<T>(
        &self,
        name: &'static str,
        expected: &str,
        parse: impl Fn(&str) -> Option<T>,
    ) -> Result<Option<T>, ConfigError> {
        match self.raw(name) {
            None => Ok(None),
            Some((value, origin)) => {
                parse(value.trim())
                    .map(Some)
                    .ok_or_else(|| ConfigError::Invalid {
                        key: name,
                        value: value.clone(),
                        origin: origin.clone(),
                        expected: expected.to_string(),
                    })
            }
        }
    }

    /// Like [`Layers::get`] for a key that has a default, so it is always set.
    pub fn require<T>(
        &self,
        name: &'static str,
        expected: &str,
        parse: impl Fn(&str) -> Option<T>,
    ) -> Result<T, ConfigError> {
        self.get(name, expected, parse)?
            .ok_or(ConfigError::Missing {
                key: name,
                hint: "it has no default; set it in the file, the environment or a flag",
            })
    }

    /// The effective configuration as YAML, each line annotated with its origin.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for key in self.keys {
            match self.values.get(key.name) {
                Some((v, origin)) => out.push_str(&format!("{}: {:?}  # {origin}\n", key.name, v)),
                None => out.push_str(&format!("{}: \"\"  # unset\n", key.name)),
            }
        }
        out
    }

    /// The key table for `--help`.
    pub fn help(keys: &[Key]) -> String {
        let mut out = String::new();
        for k in keys {
            let env = if k.env.is_empty() {
                String::new()
            } else {
                format!(" [env {}]", k.env.join(", "))
            };
            let default = if k.default.is_empty() {
                String::new()
            } else {
                format!(" (default {})", k.default)
            };
            out.push_str(&format!(
                "  --{:<34} {}{}{}\n",
                k.name.replace('_', "-"),
                k.help,
                default,
                env
            ));
        }
        out
    }
}

/// Parses `90s`, `5m`, `24h`, `500ms` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .unwrap_or((s, "s"));
    let n: u64 = num.parse().ok()?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.checked_mul(60)?),
        "h" => Duration::from_secs(n.checked_mul(3600)?),
        _ => return None,
    };
    Some(d)
}

/// Parses a decimal or `0x` hexadecimal `u32`.
pub fn parse_u32(s: &str) -> Option<u32> {
    match s.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// Parses `text` or `json`.
pub fn parse_log_format(s: &str) -> Option<proxy::LogFormat> {
    match s {
        "text" => Some(proxy::LogFormat::Text),
        "json" => Some(proxy::LogFormat::Json),
        _ => None,
    }
}

/// Parses a comma-separated list; blanks around items and empty items are dropped.
pub fn parse_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(String::from)
        .collect()
}

/// The log keys every role has.
pub const LOG_FORMAT_KEY: Key = Key {
    name: "log_format",
    env: &["LOG_FORMAT"],
    default: "text",
    help: "text or json",
};
pub const LOG_LEVEL_KEY: Key = Key {
    name: "log_level",
    env: &["RUST_LOG"],
    default: "info",
    help: "tracing filter, e.g. info,ambit=debug",
};

/// Parses `true`/`false` (and 1/0, yes/no).
pub fn parse_bool(s: &str) -> Option<bool> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Some(true),
        "false" | "0" | "no" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_drop_blanks_and_empty_items() {
        assert_eq!(parse_list(" a, b ,,c,"), ["a", "b", "c"]);
        assert!(parse_list("").is_empty() && parse_list(" , ").is_empty());
    }

    static KEYS: &[Key] = &[
        Key {
            name: "alpha",
            env: &["ALPHA"],
            default: "1",
            help: "",
        },
        Key {
            name: "beta",
            env: &["BETA", "BETA_OLD"],
            default: "",
            help: "",
        },
    ];

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn layers_apply_in_order_default_file_env_flag() {
        let mut l = Layers::new(KEYS);
        assert_eq!(l.raw("alpha").unwrap().0, "1");
        l.apply_yaml(Path::new("f.yaml"), "alpha: 2\nbeta: x\n")
            .unwrap();
        assert_eq!(
            l.raw("alpha").unwrap(),
            &("2".to_string(), Origin::File("f.yaml".into()))
        );
        l.apply_env(|v| (v == "ALPHA").then(|| "3".to_string()));
        assert_eq!(
            l.raw("alpha").unwrap(),
            &("3".to_string(), Origin::Env("ALPHA"))
        );
        l.set("alpha", "4".into(), Origin::Flag).unwrap();
        assert_eq!(l.raw("alpha").unwrap().0, "4");
        assert_eq!(l.raw("beta").unwrap().0, "x");
    }

    #[test]
    fn bad_value_names_key_value_origin_and_expectation() {
        let mut l = Layers::new(KEYS);
        l.apply_env(|v| (v == "BETA_OLD").then(|| "zz".to_string()));
        let err = l
            .get("beta", "a number", |s| s.parse::<u32>().ok())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "config key `beta` = \"zz\" (from env BETA_OLD): expected a number"
        );
    }

    #[test]
    fn unknown_keys_in_file_and_flags_are_rejected() {
        let mut l = Layers::new(KEYS);
        let err = l.apply_yaml(Path::new("f.yaml"), "gamma: 1").unwrap_err();
        assert!(
            err.to_string().contains("unknown config key `gamma`"),
            "{err}"
        );
        let cl = CommandLine::parse(&args(&["--gamma", "1"])).unwrap();
        assert!(Layers::resolve(KEYS, &cl, |_| None).is_err());
        assert!(Layers::new(KEYS)
            .apply_yaml(Path::new("f"), "[1, 2]")
            .is_err());
    }

    #[test]
    fn command_line_forms() {
        let cl = CommandLine::parse(&args(&[
            "--config",
            "c.yaml",
            "--alpha=5",
            "--print-config",
            "--beta",
            "b",
        ]))
        .unwrap();
        assert_eq!(cl.config_file.as_deref(), Some(Path::new("c.yaml")));
        assert!(cl.print_config);
        assert_eq!(
            cl.values,
            vec![("alpha".into(), "5".into()), ("beta".into(), "b".into())]
        );
        assert!(CommandLine::parse(&args(&["--alpha"])).is_err());
        assert!(CommandLine::parse(&args(&["alpha"])).is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("5m"), Some(Duration::from_secs(300)));
        assert_eq!(parse_duration("24h"), Some(Duration::from_secs(86400)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("7"), Some(Duration::from_secs(7)));
        assert_eq!(parse_duration("7d"), None);
        assert_eq!(parse_duration("x"), None);
        assert_eq!(parse_u32("0x539"), Some(1337));
    }
}
