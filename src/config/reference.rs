//! `docs/configuration.md`, whose key tables are rendered from the roles'
//! key tables so the document cannot drift from the code: a unit test checks
//! that the file starts with [`markdown`] and, with `AMBIT_UPDATE_DOCS=1`,
//! rewrites that part (the hand-written part after [`END`] is kept).

use super::agent::AGENT_KEYS;
use super::controlplane::CONTROL_PLANE_KEYS;
use super::proxy::PROXY_KEYS;
use super::Key;

const PREAMBLE: &str = "\
# Configuration

<!-- The key tables down to the end marker are generated from src/config/ by
     `AMBIT_UPDATE_DOCS=1 cargo test --lib configuration_doc`: edit the tables
     there. Below the marker, the text is written by hand. -->

Every long-lived role reads its keys from, lowest first: the built-in
default, a YAML file (`--config FILE`, keys as named below), the
environment (the variables listed, first found wins; Istio's names first),
and flags (`--key-name value`, the key with `-` for `_`). A bad value fails
at start with the key, the value, where it came from and what was expected.
`ambit <role> --print-config` prints the effective configuration with the
origin of each value; `ambit <role> --help` prints the table below.

`ambit node` runs the agent and the proxy as child processes: both read the
environment, so set their keys there. `ambit cni` is configured by the
conflist entry the agent writes (`cni_agent_run_dir`,
`exclude_namespaces`, `enroll`), never by hand.
";

/// Where the generated part of the document ends.
pub const END: &str = "<!-- end of generated key tables -->\n";

/// The generated part of the document, ending with [`END`].
pub fn markdown() -> String {
    let mut out = PREAMBLE.to_string();
    for (role, about, keys) in [
        ("proxy", "the L4 HBONE proxy", PROXY_KEYS),
        ("agent", "the node agent", AGENT_KEYS),
        (
            "control-plane",
            "the small xDS + CA server for labs and CI",
            CONTROL_PLANE_KEYS,
        ),
    ] {
        out.push_str(&format!("\n## `ambit {role}`: {about}\n\n"));
        out.push_str("| key | environment | default | meaning |\n|---|---|---|---|\n");
        for k in keys {
            out.push_str(&row(k));
        }
    }
    out.push('\n');
    out.push_str(END);
    out
}

fn row(k: &Key) -> String {
    let cell = |s: &str| s.replace('|', "\\|");
    let code = |s: &str| {
        if s.is_empty() {
            String::new()
        } else {
            format!("`{}`", cell(s))
        }
    };
    let env: Vec<String> = k.env.iter().map(|e| code(e)).collect();
    format!(
        "| `{}` | {} | {} | {} |\n",
        k.name,
        env.join(", "),
        code(k.default),
        cell(k.help)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_doc_matches_the_key_tables() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md");
        let want = markdown();
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        if std::env::var_os("AMBIT_UPDATE_DOCS").is_some() {
            let by_hand = have.split_once(END).map_or("", |(_, rest)| rest);
            std::fs::write(&path, format!("{want}{by_hand}")).unwrap();
            return;
        }
        assert!(
            have.starts_with(&want),
            "docs/configuration.md is out of date with the key tables: \
             run `AMBIT_UPDATE_DOCS=1 cargo test --lib configuration_doc` and commit it"
        );
    }

    #[test]
    fn every_key_of_every_role_is_in_the_doc() {
        let doc = markdown();
        for k in PROXY_KEYS
            .iter()
            .chain(AGENT_KEYS)
            .chain(CONTROL_PLANE_KEYS)
        {
            assert!(doc.contains(&format!("| `{}` |", k.name)), "{}", k.name);
        }
    }
}
