//! The proxy's configuration: layering, defaults and bad values.

use super::*;

fn layers(env: &[(&str, &str)], flags: &[&str]) -> Result<ProxyConfig, ConfigError> {
    let args: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
    let cl = CommandLine::parse(&args).unwrap();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let l = Layers::resolve(PROXY_KEYS, &cl, |k| {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    })?;
    ProxyConfig::from_layers(&l)
}

const BASE: &[(&str, &str)] = &[
    ("PROXY_WORKLOAD_INFO", "default/web/web-sa"),
    ("LOCAL_XDS_PATH", "/etc/mesh.yaml"),
];

#[test]
fn defaults_match_istio() {
    let c = layers(BASE, &[]).unwrap();
    assert_eq!(c.trust_domain, "cluster.local");
    assert_eq!(c.packet_mark, 1337);
    assert_eq!(c.stream_window, 4 << 20);
    assert_eq!(c.connection_window, 16 << 20);
    assert_eq!(c.frame_size, 1 << 20);
    assert_eq!(c.pool_max_streams, 100);
    assert_eq!(c.pool_spread, None, "auto: the worker threads");
    assert_eq!(c.hbone_unsent_limit, 128 * 1024);
    assert_eq!(c.workload_info.unwrap().service_account, "web-sa");
}

#[test]
fn the_pool_spread_is_auto_or_a_count_of_connections() {
    let spread = |v: &str| {
        let mut env = BASE.to_vec();
        env.push(("AMBIT_POOL_SPREAD", v));
        layers(&env, &[]).map(|c| c.pool_spread)
    };
    assert_eq!(spread("auto").unwrap(), None);
    assert_eq!(spread("1").unwrap(), Some(1));
    assert_eq!(spread("8").unwrap(), Some(8));
    for bad in ["0", "257", "-1", "two"] {
        let err = spread(bad).unwrap_err().to_string();
        assert!(err.contains("pool_spread"), "{bad:?}: {err}");
    }
}

#[test]
fn the_on_demand_wait_is_a_duration_up_to_a_minute() {
    let wait = |v: &str| {
        let mut env = BASE.to_vec();
        env.push(("AMBIT_XDS_ON_DEMAND_WAIT", v));
        layers(&env, &[]).map(|c| c.xds_on_demand_wait)
    };
    assert_eq!(wait("500ms").unwrap(), Duration::from_millis(500));
    assert_eq!(
        layers(BASE, &[]).unwrap().xds_on_demand_wait,
        Duration::from_secs(2)
    );
    for v in ["0s", "2m", "soon"] {
        let err = wait(v).unwrap_err().to_string();
        assert!(
            err.contains("`xds_on_demand_wait`") && err.contains("from 1ms to 60s"),
            "{v}: {err}"
        );
    }
}

#[test]
fn the_hbone_unsent_limit_is_zero_or_a_sane_byte_count() {
    for (v, want) in [
        ("0", Some(0)),
        ("0x8000", Some(32 * 1024)),
        ("4096", Some(4096)),
    ] {
        let mut env = BASE.to_vec();
        env.push(("AMBIT_HBONE_UNSENT_LIMIT", v));
        assert_eq!(
            layers(&env, &[]).ok().map(|c| c.hbone_unsent_limit),
            want,
            "{v}"
        );
    }
    for v in ["100", "2147483648", "-1", "lots"] {
        let mut env = BASE.to_vec();
        env.push(("AMBIT_HBONE_UNSENT_LIMIT", v));
        let err = layers(&env, &[]).unwrap_err().to_string();
        assert!(
            err.contains("`hbone_unsent_limit`") && err.contains("0 (no limit) or a byte count"),
            "{v}: {err}"
        );
    }
}

#[test]
fn congestion_control_is_cubic_unless_set_and_empty_means_the_kernels() {
    let cc = |v: Option<&str>| {
        let mut env = BASE.to_vec();
        env.extend(v.map(|v| ("AMBIT_CONGESTION_CONTROL", v)));
        layers(&env, &[]).map(|c| c.congestion_control.map(|a| a.to_string()))
    };
    assert_eq!(cc(None).unwrap().as_deref(), Some("cubic"));
    let chosen = |env: &[(&str, &str)]| layers(env, &[]).unwrap().congestion_control_chosen;
    assert!(!chosen(BASE), "the default is not a choice");
    assert!(chosen(
        &[BASE, &[("AMBIT_CONGESTION_CONTROL", "cubic")]].concat()
    ));
    assert_eq!(cc(Some("bbr")).unwrap().as_deref(), Some("bbr"));
    assert_eq!(cc(Some("")).unwrap(), None);
    assert_eq!(cc(Some("  ")).unwrap(), None, "blank is empty");
    for v in ["BBR", "cubic;reno", "a_name_too_long_x", "bbr reno"] {
        let err = cc(Some(v)).unwrap_err().to_string();
        assert!(
            err.contains("`congestion_control`") && err.contains("an algorithm's name"),
            "{v}: {err}"
        );
    }
}

#[test]
fn drain_follows_the_grace_period_unless_set() {
    let mut env = BASE.to_vec();
    env.push(("TERMINATION_GRACE_PERIOD_SECONDS", "30"));
    assert_eq!(
        layers(&env, &[]).unwrap().drain_timeout,
        Duration::from_secs(25)
    );
    env.push(("CONNECTION_TERMINATION_DEADLINE", "7s"));
    assert_eq!(
        layers(&env, &[]).unwrap().drain_timeout,
        Duration::from_secs(7)
    );
    let short = [BASE, &[("TERMINATION_GRACE_PERIOD_SECONDS", "8")]].concat();
    assert_eq!(
        layers(&short, &[]).unwrap().drain_timeout,
        Duration::from_secs(7)
    );
    assert_eq!(
        layers(BASE, &[]).unwrap().drain_timeout,
        Duration::from_secs(5)
    );
}

#[test]
fn durations_that_would_overflow_a_clock_are_refused() {
    for (var, value, key, expected) in [
        (
            "CONNECTION_TERMINATION_DEADLINE",
            "18446744073709551615s",
            "`drain_timeout`",
            "up to 24h",
        ),
        ("AMBIT_DRAIN_TIMEOUT", "25h", "`drain_timeout`", "up to 24h"),
        (
            "TERMINATION_GRACE_PERIOD_SECONDS",
            "18446744073709551615",
            "`termination_grace_period`",
            "up to 86400",
        ),
        ("SECRET_TTL", "9000h", "`cert_ttl`", "to 8760h"),
    ] {
        let env = [BASE, &[(var, value)]].concat();
        let Err(err) = layers(&env, &[]) else {
            panic!("{var}={value} accepted");
        };
        let err = err.to_string();
        assert!(err.contains(key) && err.contains(expected), "{var}: {err}");
    }
    let ok = [BASE, &[("TERMINATION_GRACE_PERIOD_SECONDS", "86400")]].concat();
    assert_eq!(
        layers(&ok, &[]).unwrap().drain_timeout,
        Duration::from_secs(86_395)
    );
}

#[test]
fn flags_beat_env() {
    let mut env = BASE.to_vec();
    env.push(("TRUST_DOMAIN", "env.example"));
    let c = layers(&env, &["--trust-domain", "flag.example"]).unwrap();
    assert_eq!(c.trust_domain, "flag.example");
}

#[test]
fn bad_values_fail_with_key_and_expectation() {
    let mut env = BASE.to_vec();
    env.push(("PACKET_MARK", "lots"));
    let err = layers(&env, &[]).unwrap_err().to_string();
    assert_eq!(err, "config key `packet_mark` = \"lots\" (from env PACKET_MARK): expected a non-zero number (decimal or 0x hex)");
    let err = layers(
        &[("LOCAL_XDS_PATH", "/x"), ("PROXY_WORKLOAD_INFO", "a/b")],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("`workload_info` = \"a/b\""), "{err}");
    let err = layers(
        &[("LOCAL_XDS_PATH", "/x"), ("PROXY_MODE", "dedicated")],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("`workload_info` is required"), "{err}");
    // The control plane in plaintext only when asked for by name.
    let err = layers(BASE, &["--xds-address", "http://istiod:15010"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`xds_address`") && err.contains("insecure_control_plane"),
        "{err}"
    );
    let err = layers(BASE, &["--ca-address", "http://istiod:15010"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("`ca_address`"), "{err}");
    let c = layers(
        BASE,
        &[
            "--xds-address",
            "http://istiod:15010",
            "--insecure-control-plane",
            "true",
        ],
    )
    .unwrap();
    assert_eq!(c.xds_address.as_deref(), Some("http://istiod:15010"));
    let err = layers(BASE, &["--cluster-domain", "corp internal"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`cluster_domain` = \"corp internal\"") && err.contains("a DNS name"),
        "{err}"
    );
    let c = layers(BASE, &["--cluster-domain", "Corp.Internal."]).unwrap();
    assert_eq!(c.cluster_domain, "corp.internal");
    let err = layers(BASE, &["--proxy-mode", "sideways"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("expected shared or dedicated"), "{err}");
    assert!(
        layers(&[("LOCAL_XDS_PATH", "/x")], &[]).is_ok(),
        "shared mode needs no workload_info"
    );
    let err = layers(BASE, &["--ca-cert", "/ca.pem"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("`ca_key` is required"), "{err}");
}

#[test]
fn the_memory_budget_is_auto_zero_or_a_size_of_at_least_16_mi() {
    use super::parse_memory_budget as parse;
    assert_eq!(parse("auto"), Some(None));
    assert_eq!(parse("0"), Some(Some(0)));
    assert_eq!(parse("512Mi"), Some(Some(512 << 20)));
    assert_eq!(parse("2Gi"), Some(Some(2 << 30)));
    assert_eq!(parse("268435456"), Some(Some(256 << 20)));
    for bad in [
        "",
        "1Mi",
        "12MB",
        "-1",
        "1.5Gi",
        "99999999999999999999Gi",
        "Mi",
    ] {
        assert_eq!(parse(bad), None, "{bad:?}");
    }
}

#[test]
fn the_mesh_root_is_set_or_inferred_from_a_root_file_never_from_system() {
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut env = BASE.to_vec();
        env.push(("CA_ADDRESS", "https://istiod:15012"));
        env.extend_from_slice(extra);
        layers(&env, &[])
    };
    // Istio's layout: the root the CA's TLS chains to is the mesh root.
    let c = with(&[("XDS_ROOT_CA", "/istio/root-cert.pem")]).unwrap();
    assert_eq!(c.mesh_root_ca, Some("/istio/root-cert.pem".into()));
    let c = with(&[
        ("XDS_ROOT_CA", "/xds.pem"),
        ("CA_ROOT_CA", "/ca.pem"),
        ("AMBIT_MESH_ROOT_CA", "/mesh.pem"),
    ])
    .unwrap();
    assert_eq!(c.mesh_root_ca, Some("/mesh.pem".into()));
    // The system store holds no mesh root, and none at all is no answer.
    for extra in [&[("XDS_ROOT_CA", "SYSTEM")][..], &[][..]] {
        let err = with(extra).unwrap_err().to_string();
        assert!(err.contains("`mesh_root_ca` is required"), "{err}");
    }
    let err = with(&[("AMBIT_MESH_ROOT_CA", "SYSTEM")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("the system store is no mesh root"), "{err}");
    // Without a remote CA the local CA's own root is the mesh root.
    assert_eq!(layers(BASE, &[]).unwrap().mesh_root_ca, None);
}
