//! Key exchange as Istio meshes configure it (issue #52), through the real
//! binary: two dedicated proxies in network namespaces carry a pod's
//! connection over HBONE under `COMPLIANCE_POLICY` (and `TLS12_ENABLED`),
//! and each proxy's log
//! says which group and suite the handshake actually agreed (read from the
//! connection, not from the config).

mod common;

use ambit::lab::{connect_from, echo_roundtrip};
use common::meshed_pair_env;

/// What a proxy logs once an HBONE handshake is done, under these groups.
fn agreed(log: &str, group: &str) -> bool {
    log.lines().any(|l| {
        l.contains("HBONE TLS handshake done")
            && l.contains(&format!("group=Some({group})"))
            && l.contains("suite=Some(TLS13_AES_256_GCM_SHA384)")
            && l.contains("version=TLSv1_3")
    })
}

/// A client and a server proxy, each with its own `COMPLIANCE_POLICY`
/// (`None`: unset); returns whether a round trip made it, and both logs
/// once it did (or did not).
fn round_trip_under(
    tag: &str,
    client_policy: Option<&'static str>,
    server_policy: Option<&'static str>,
) -> (bool, String, String) {
    let env = |policy: Option<&'static str>| policy.map(|p| ("COMPLIANCE_POLICY", p));
    round_trip_with(tag, env(client_policy), env(server_policy))
}

/// [`round_trip_under`] with one more setting (`None`: none) per side.
fn round_trip_with(
    tag: &str,
    client_setting: Option<(&'static str, &'static str)>,
    server_setting: Option<(&'static str, &'static str)>,
) -> (bool, String, String) {
    let env = |setting: Option<(&'static str, &'static str)>| {
        let mut env = vec![("RUST_LOG", "info,ambit::proxy::tls_stream=debug")];
        env.extend(setting);
        env
    };
    let (m, client, server, echo) =
        meshed_pair_env(tag, &env(client_setting), &env(server_setting));
    let ok = connect_from(&client, echo.addr)
        .and_then(|mut c| echo_roundtrip(&mut c, b"pq"))
        .is_ok_and(|got| got == b"pq");
    (ok, m.proxy_log(&client), m.proxy_log(&server))
}

#[test]
fn two_proxies_agree_on_the_post_quantum_hybrid_by_default_and_under_pqc() {
    for (tag, client, server) in [
        ("kxdef", None, None),
        ("kxpqc", Some("pqc"), Some("pqc")),
        ("kxmix", Some("pqc"), None),
    ] {
        let (ok, client_log, server_log) = round_trip_under(tag, client, server);
        assert!(ok, "{tag}: no round trip\n{client_log}\n{server_log}");
        for (side, log) in [("client", &client_log), ("server", &server_log)] {
            assert!(
                agreed(log, "X25519MLKEM768"),
                "{tag}: the {side} proxy's handshake did not agree on X25519MLKEM768 with AES-256-GCM:\n{log}"
            );
        }
    }
}

/// `TLS12_ENABLED=true` allows TLS 1.2 for peers that need it; two
/// proxies that both speak 1.3 still agree on 1.3, on the hybrid group,
/// whichever of them has it on. (A TLS 1.2 peer: the record layer's tests,
/// `proxy::tls_stream::tests::tls12`.)
#[test]
fn with_tls12_enabled_two_proxies_still_agree_on_tls13_and_the_hybrid() {
    let on = Some(("TLS12_ENABLED", "true"));
    for (tag, client, server) in [("t12both", on, on), ("t12srv", None, on)] {
        let (ok, client_log, server_log) = round_trip_with(tag, client, server);
        assert!(ok, "{tag}: no round trip\n{client_log}\n{server_log}");
        for (side, log) in [("client", &client_log), ("server", &server_log)] {
            assert!(
                agreed(log, "X25519MLKEM768"),
                "{tag}: the {side} proxy's handshake did not agree on TLS 1.3, X25519MLKEM768 and AES-256-GCM:\n{log}"
            );
        }
    }
}

#[test]
fn an_unknown_tls12_enabled_value_stops_the_start_and_false_does_not() {
    let bin = env!("CARGO_BIN_EXE_ambit");
    let start = |value: &str| {
        std::process::Command::new(bin)
            .args(["proxy", "--help"])
            .env("TLS12_ENABLED", value)
            .output()
            .unwrap()
    };
    let out = start("yes");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "TLS12_ENABLED=yes: started");
    assert!(stderr.contains("TLS12_ENABLED=\"yes\""), "{stderr}");
    for value in ["true", "false", ""] {
        assert!(start(value).status.success(), "TLS12_ENABLED={value:?}");
    }
}

#[test]
fn an_unknown_or_fips_compliance_policy_stops_the_start_with_the_reason() {
    let bin = env!("CARGO_BIN_EXE_ambit");
    for (value, says) in [
        ("pqc2", "is not a policy Ambit knows"),
        ("fips-140-3", "has no FIPS module"),
    ] {
        let out = std::process::Command::new(bin)
            .args(["proxy", "--help"])
            .env("COMPLIANCE_POLICY", value)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{value}: started");
        assert!(stderr.contains(says), "{value}: {stderr}");
    }
}
