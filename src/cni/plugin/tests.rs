//! Unit tests of the CNI plugin's pure logic.

use super::*;

const PREV_V1: &str = r#"{"cniVersion":"1.0.0",
    "interfaces":[{"name":"eth0","mac":"0a:58:0a:f4:01:05","sandbox":"/var/run/netns/cni-1"}],
    "ips":[{"interface":0,"address":"10.244.1.5/24","gateway":"10.244.1.1"},
           {"interface":0,"address":"fd00::5/64"}],
    "routes":[{"dst":"0.0.0.0/0"}],"dns":{"nameservers":["10.96.0.10"]}}"#;

const POD: &str = concat!(
    "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-1;",
    "K8S_POD_UID=u-1;K8S_POD_INFRA_CONTAINER_ID=c0ffee"
);

fn config(version: &str, extra: &str) -> Vec<u8> {
    let head = format!(r#"{{"cniVersion":"{version}","name":"k8s","type":"ambit-cni""#);
    format!("{head}{extra}}}").into_bytes()
}

fn with_prev(version: &str, prev: &str) -> Vec<u8> {
    config(version, &format!(r#","prevResult":{prev}"#))
}

fn env(command: &str, args: &str) -> CniEnv {
    let netns = "/var/run/netns/cni-1".to_string();
    let (container_id, ifname) = ("c0ffee".to_string(), "eth0".to_string());
    CniEnv {
        command: command.into(),
        container_id,
        netns,
        ifname,
        args: args.into(),
        path: String::new(),
    }
}

/// An environment lookup over fixed pairs.
fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let pairs: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |key| pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

/// Runs `handle`, recording every event posted and answering each with `answer`.
fn run(
    env: &CniEnv,
    stdin: &[u8],
    answer: Result<(), String>,
) -> (Result<String, CniError>, Vec<(AddEvent, String)>) {
    run_with(env, stdin, answer.map_err(AgentError::Refused))
}

fn run_with(
    env: &CniEnv,
    stdin: &[u8],
    answer: Result<(), AgentError>,
) -> (Result<String, CniError>, Vec<(AddEvent, String)>) {
    let mut posted = Vec::new();
    let mut post = |ev: &AddEvent, dir: &str| {
        posted.push((ev.clone(), dir.to_string()));
        answer.clone()
    };
    let out = handle(env, stdin, &mut post);
    (out, posted)
}

fn json_of(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

fn code_of<T: fmt::Debug>(r: Result<T, CniError>) -> u32 {
    r.expect_err("expected a CNI error").code
}

#[test]
fn garbage_stdin_is_a_decoding_failure() {
    assert_eq!(code_of(parse_config(b"{not json")), 6);
    assert_eq!(code_of(parse_config(b"[\"1.0.0\"]")), 6);
    assert_eq!(code_of(parse_config(br#"{"cniVersion":1}"#)), 6);
    for cmd in ["ADD", "DEL", "CHECK"] {
        let (out, posted) = run(&env(cmd, POD), b"\x00garbage", Ok(()));
        assert_eq!(code_of(out), 6, "{cmd}");
        assert!(posted.is_empty());
    }
}

#[test]
fn missing_or_unsupported_version_is_rejected() {
    assert_eq!(
        code_of(parse_config(br#"{"name":"n","type":"ambit-cni"}"#)),
        7
    );
    let err = parse_config(&config("0.2.0", "")).expect_err("0.2.0 is not supported");
    assert_eq!(err.code, 1);
    for v in SUPPORTED_VERSIONS {
        assert!(err.details.contains(v), "{}", err.details);
        assert!(parse_config(&config(v, "")).is_ok(), "{v}");
    }
}

#[test]
fn config_defaults_legacy_and_unknown_keys() {
    let cfg = parse_config(&config(
        "1.0.0",
        r#","ipam":{"type":"host-local"},"mtu":1450"#,
    ))
    .expect("valid");
    assert_eq!(cfg.cni_agent_run_dir, "/var/run/ambit");
    assert_eq!(cfg.exclude_namespaces, vec!["kube-system".to_string()]);
    assert_eq!(cfg.enroll, Enrollment::All);
    assert!(cfg.prev_result.is_none());
    let legacy =
        r#","cni_event_address":"/var/run/istio-cni/pluginevent.sock","exclude_namespaces":[]"#;
    let cfg = parse_config(&config("0.3.1", legacy)).expect("valid");
    assert_eq!(cfg.cni_agent_run_dir, "/var/run/istio-cni");
    assert!(cfg.exclude_namespaces.is_empty());
}

#[test]
fn enrollment_config_is_validated() {
    let parse =
        |e: &str| parse_config(&config("1.0.0", &format!(r#","enroll":{e}"#))).map(|c| c.enroll);
    assert_eq!(parse(r#"{"mode":"none"}"#), Ok(Enrollment::None));
    assert_eq!(parse("{}"), Ok(Enrollment::All));
    let namespaces = Enrollment::Namespaces(vec!["a".into(), "b".into()]);
    assert_eq!(
        parse(r#"{"mode":"namespaces","namespaces":["a","b"]}"#),
        Ok(namespaces)
    );
    assert_eq!(
        parse(r#"{"mode":"pod_pattern","pod_pattern":"w*"}"#),
        Ok(Enrollment::PodPattern("w*".into()))
    );
    assert_eq!(code_of(parse(r#"{"mode":"pod_pattern"}"#)), 7);
    assert_eq!(code_of(parse(r#"{"mode":"some"}"#)), 7);
}

#[test]
fn env_requirements_per_command() {
    assert_eq!(code_of(env_from(vars(&[]))), 4);
    assert_eq!(code_of(env_from(vars(&[("CNI_COMMAND", "")]))), 4);
    let version =
        env_from(vars(&[("CNI_COMMAND", "VERSION")])).expect("VERSION needs nothing else");
    assert_eq!(
        version,
        CniEnv {
            command: "VERSION".into(),
            ..CniEnv::default()
        }
    );
    let full = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "c"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_NETNS", "/n"),
        ("CNI_ARGS", "K8S_POD_NAME=p"),
        ("CNI_PATH", "/opt/cni/bin"),
    ];
    let add = env_from(vars(&full)).expect("complete ADD env");
    assert_eq!(
        (add.netns.as_str(), add.args.as_str(), add.path.as_str()),
        ("/n", "K8S_POD_NAME=p", "/opt/cni/bin")
    );
    for missing in ["CNI_CONTAINERID", "CNI_IFNAME", "CNI_NETNS"] {
        let pairs: Vec<_> = full
            .iter()
            .copied()
            .filter(|(k, _)| *k != missing)
            .collect();
        let err = env_from(vars(&pairs)).expect_err("a required variable is missing");
        assert_eq!(err.code, 4);
        assert!(err.msg.contains(missing), "{}", err.msg);
    }
    let del = [
        ("CNI_COMMAND", "DEL"),
        ("CNI_CONTAINERID", "c"),
        ("CNI_IFNAME", "eth0"),
    ];
    assert_eq!(
        env_from(vars(&del)).map(|e| e.netns),
        Ok(String::new()),
        "DEL works without a netns"
    );
}

#[test]
fn cni_args_parsing() {
    let pod = parse_cni_args(POD);
    let some = |s: &str| Some(s.to_string());
    let expected = PodArgs {
        name: some("web-1"),
        namespace: some("shop"),
        uid: some("u-1"),
        infra_container_id: some("c0ffee"),
    };
    assert_eq!(pod, expected);
    let podman = parse_cni_args("IgnoreUnknown=1;K8S_POD_NAME=foo");
    assert_eq!(
        podman,
        PodArgs {
            name: some("foo"),
            namespace: some("default"),
            ..PodArgs::default()
        }
    );
    assert_eq!(parse_cni_args(""), PodArgs::default());
    assert_eq!(
        parse_cni_args("IgnoreUnknown=1;junk;K8S_POD_NAME=;=x;;"),
        PodArgs::default()
    );
}

#[test]
fn glob_matches_star_runs_only() {
    let matching = [
        ("web-*", "web-1"),
        ("*", ""),
        ("*", "abc"),
        ("a*c", "abbbc"),
        ("*-db-*", "shop-db-0"),
    ];
    for (p, t) in matching.into_iter().chain([
        ("a**b", "ab"),
        ("é*", "éa"),
        ("exact", "exact"),
        ("*ab", "aab"),
    ]) {
        assert!(glob_match(p, t), "{p} should match {t}");
    }
    let failing = [
        ("web-*", "api-1"),
        ("a*c", "abcd"),
        ("exact", "exactly"),
        ("", "a"),
        ("a?c", "abc"),
    ];
    for (p, t) in failing.into_iter().chain([("*x*", "abc")]) {
        assert!(!glob_match(p, t), "{p} should not match {t}");
    }
}

#[test]
fn enrollment_rules_select_pods() {
    let mut cfg = parse_config(&config("1.0.0", "")).expect("valid");
    let (e, pod) = (env("ADD", ""), parse_cni_args(POD));
    let cases = [
        (Enrollment::All, true),
        (Enrollment::None, false),
        (Enrollment::Namespaces(vec!["shop".into()]), true),
        (Enrollment::Namespaces(vec!["other".into()]), false),
        (Enrollment::PodPattern("web-*".into()), true),
        (Enrollment::PodPattern("api-*".into()), false),
    ];
    for (rule, enrolled) in cases {
        cfg.enroll = rule.clone();
        match decide(&cfg, &e, &pod) {
            Decision::Enroll(_) => assert!(enrolled, "{rule:?}"),
            Decision::PassThrough(reason) => {
                assert!(!enrolled, "{rule:?}");
                assert_eq!(reason, "not selected by the enrollment rule");
            }
        }
    }
    assert_eq!(
        decide(&cfg, &e, &PodArgs::default()),
        Decision::PassThrough("no Kubernetes pod args")
    );
}

#[test]
fn kubernetes_mode_asks_the_agent_except_for_its_own_pods() {
    let stdin = config(
        "1.0.0",
        &format!(
            r#","enroll":{{"mode":"kubernetes","agent_namespace":"istio-system","agent_pod_prefix":"ambit-"}},"prevResult":{PREV_V1}"#
        ),
    );
    let cfg = parse_config(&stdin).expect("valid");
    let (e, pod) = (env("ADD", ""), parse_cni_args(POD));
    assert!(matches!(decide(&cfg, &e, &pod), Decision::Enroll(_)));
    let own = parse_cni_args("K8S_POD_NAMESPACE=istio-system;K8S_POD_NAME=ambit-x7k2p");
    assert_eq!(
        decide(&cfg, &e, &own),
        Decision::PassThrough("the agent's own pod")
    );
    let (out, posted) = run(
        &env(
            "ADD",
            "K8S_POD_NAMESPACE=istio-system;K8S_POD_NAME=ambit-x7k2p",
        ),
        &stdin,
        Err("must not be called".into()),
    );
    assert!(
        out.is_ok() && posted.is_empty(),
        "no call for the agent's own pod"
    );
    let other = parse_cni_args("K8S_POD_NAMESPACE=istio-system;K8S_POD_NAME=istiod-1");
    assert!(matches!(decide(&cfg, &e, &other), Decision::Enroll(_)));
}

#[test]
fn without_an_agent_a_pod_starts_only_when_the_api_server_says_it_is_not_in_the_mesh() {
    let dir = std::env::temp_dir().join(format!("ambit-plugin-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let stdin = |mode: &str| {
        config(
            "1.0.0",
            &format!(
                r#","cni_agent_run_dir":"{}","enroll":{{"mode":"{mode}"}},"prevResult":{PREV_V1}"#,
                dir.display()
            ),
        )
    };
    let api = |must: Option<bool>| {
        Err(AgentError::Unreachable {
            why: "no socket".into(),
            must_enroll: must,
        })
    };
    let add = |ns: &str| env("ADD", &format!("K8S_POD_NAMESPACE={ns};K8S_POD_NAME=web-1"));
    // The API server could not be asked: every pod fails closed, even with
    // an older agent's list saying its namespace is not ambient (the pod
    // may opt in by its own label).
    std::fs::write(dir.join(AMBIENT_NAMESPACES_FILE), r#"["mesh"]"#).unwrap();
    let (out, posted) = run_with(&add("shop"), &stdin("kubernetes"), api(None));
    assert_eq!(posted.len(), 1, "the agent was tried first");
    assert_eq!(code_of(out), 100, "no answer is no permission");
    // When the API server answered, its verdict decides.
    let (out, _) = run_with(&add("shop"), &stdin("kubernetes"), api(Some(true)));
    assert_eq!(code_of(out), 100, "a pod labelled ambient fails closed");
    let (out, _) = run_with(&add("mesh"), &stdin("kubernetes"), api(Some(false)));
    assert_eq!(
        json_of(&out.expect("a pod the API says is not enrolled starts")),
        json_of(PREV_V1)
    );
    // An agent that answers with an error is never bypassed, nor is another mode.
    let refused = Err(AgentError::Refused("agent answered 500".into()));
    let (out, _) = run_with(&add("shop"), &stdin("kubernetes"), refused);
    assert_eq!(code_of(out), 100);
    let (out, _) = run_with(&add("shop"), &stdin("all"), api(Some(false)));
    assert_eq!(code_of(out), 100, "only Kubernetes mode asks the API");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn excluded_namespace_passes_through_without_posting() {
    let stdin = config(
        "1.0.0",
        &format!(r#","exclude_namespaces":["shop"],"prevResult":{PREV_V1}"#),
    );
    let (out, posted) = run(&env("ADD", POD), &stdin, Err("must not be called".into()));
    assert!(posted.is_empty());
    assert_eq!(
        json_of(&out.expect("pass-through succeeds")),
        json_of(PREV_V1)
    );
    let cfg = parse_config(&stdin).expect("valid");
    assert_eq!(
        decide(&cfg, &env("ADD", POD), &parse_cni_args(POD)),
        Decision::PassThrough("namespace excluded")
    );
    let coredns = env("ADD", "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns");
    let (out, posted) = run(&coredns, &config("1.0.0", ""), Ok(()));
    assert!(
        out.is_ok() && posted.is_empty(),
        "kube-system is excluded by default"
    );
}

#[test]
fn add_for_enrolled_pod_posts_once_with_prev_result_ips() {
    let stdin = config(
        "1.0.0",
        &format!(r#","cni_agent_run_dir":"/run/ambit","prevResult":{PREV_V1}"#),
    );
    let (out, posted) = run(&env("ADD", POD), &stdin, Ok(()));
    assert_eq!(posted.len(), 1);
    let (event, dir) = &posted[0];
    assert_eq!(dir, "/run/ambit");
    let body = serde_json::to_value(event).expect("serializable");
    let expected = json!({
        "Netns": "/var/run/netns/cni-1", "PodName": "web-1", "PodNamespace": "shop",
        "PodUID": "u-1", "ContainerID": "c0ffee",
        "IPs": [
            {"Interface": 0, "Address": "10.244.1.5/24", "Gateway": "10.244.1.1"},
            {"Interface": 0, "Address": "fd00::5/64", "Gateway": null},
        ],
    });
    assert_eq!(body, expected, "the agent sees Istio's keys");
    assert_eq!(
        json_of(&out.expect("ADD succeeds")),
        json_of(PREV_V1),
        "same version: printed back as is"
    );
    let istio: AddEvent =
        serde_json::from_str(r#"{"Netns":"/n","PodName":"p","PodNamespace":"ns","IPs":[]}"#)
            .expect("an event without PodUID/ContainerID decodes");
    assert_eq!(
        (istio.pod_uid.as_str(), istio.container_id.as_str()),
        ("", "")
    );
}

#[test]
fn agent_failure_fails_the_add_closed() {
    let stdin = with_prev("0.4.0", PREV_V1);
    let (out, posted) = run(&env("ADD", POD), &stdin, Err("connection refused".into()));
    assert_eq!(posted.len(), 1);
    let err = out.expect_err("ADD must fail");
    let msg =
        "pod shop/web-1 must be enrolled in the mesh but the Ambit agent refused or is unreachable";
    assert_eq!(
        (err.code, err.msg.as_str(), err.details.as_str()),
        (100, msg, "connection refused")
    );
    let v = json_of(&err.to_json(&reply_version(&stdin)));
    assert_eq!(
        v,
        json!({"cniVersion": "0.4.0", "code": 100, "msg": msg, "details": "connection refused"})
    );
    assert!(err.to_string().contains("connection refused"));
}

#[test]
fn an_add_with_a_broken_prev_result_fails_before_the_agent_is_asked() {
    // The pod would be enrolled, but the plugin cannot answer the runtime:
    // the agent must not have put the pod under redirection for nothing.
    for prev in [r#"{"ips":{}}"#, r#"{"ips":[{"address":"nonsense"}]}"#] {
        let (out, posted) = run(&env("ADD", POD), &with_prev("0.4.0", prev), Ok(()));
        assert_eq!(code_of(out), 7, "{prev}");
        assert!(posted.is_empty(), "{prev}: the agent was asked: {posted:?}");
    }
}

#[test]
fn result_conversion_between_versions() {
    let cfg = parse_config(&with_prev("0.4.0", PREV_V1)).expect("valid");
    let (out, prev) = (
        json_of(&result_for(&cfg).expect("converts down")),
        json_of(PREV_V1),
    );
    assert_eq!(out["cniVersion"], "0.4.0");
    assert_eq!(
        (&out["ips"][0]["version"], &out["ips"][1]["version"]),
        (&json!("4"), &json!("6"))
    );
    for key in ["interfaces", "routes", "dns"] {
        assert_eq!(out[key], prev[key], "{key} kept as is");
    }
    let old =
        r#"{"cniVersion":"0.3.1","ips":[{"version":"4","interface":0,"address":"10.1.0.2/16"}]}"#;
    let cfg = parse_config(&with_prev("1.0.0", old)).expect("valid");
    let out = json_of(&result_for(&cfg).expect("converts up"));
    assert_eq!(
        out,
        json!({"cniVersion": "1.0.0", "ips": [{"interface": 0, "address": "10.1.0.2/16"}]})
    );
    let cfg = parse_config(&with_prev(
        "0.3.0",
        r#"{"ips":[{"address":"10.1.0.2/16"}]}"#,
    ))
    .expect("valid");
    assert_eq!(
        json_of(&result_for(&cfg).expect("no prevResult version"))["ips"][0]["version"],
        "4"
    );
}

#[test]
fn result_without_or_with_broken_prev_result() {
    let cfg = parse_config(&config("1.1.0", "")).expect("valid");
    let empty = json!({"cniVersion": "1.1.0", "interfaces": [], "ips": []});
    assert_eq!(json_of(&result_for(&cfg).expect("empty result")), empty);
    let code =
        |prev: &str| parse_config(&with_prev("0.3.1", prev)).map(|c| code_of(result_for(&c)));
    assert_eq!(code(r#"{"ips":[{"address":"nonsense"}]}"#), Ok(7));
    assert_eq!(code(r#"{"ips":{}}"#), Ok(7));
    assert_eq!(code(r#"{"cniVersion":"0.2.0","ip4":{}}"#), Ok(1));
}

#[test]
fn version_lists_supported_versions() {
    let (out, _) = run(&env("VERSION", ""), br#"{"cniVersion":"0.4.0"}"#, Ok(()));
    let all = json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]);
    assert_eq!(
        json_of(&out.expect("VERSION succeeds")),
        json!({"cniVersion": "0.4.0", "supportedVersions": all})
    );
    let (out, _) = run(&env("VERSION", ""), b"", Ok(()));
    assert_eq!(
        json_of(&out.expect("VERSION succeeds"))["cniVersion"],
        "1.1.0"
    );
}

#[test]
fn del_check_gc_status_have_no_side_effects_and_unknown_is_rejected() {
    let stdin = with_prev("1.0.0", PREV_V1);
    for cmd in ["DEL", "CHECK", "GC", "STATUS"] {
        let (out, posted) = run(&env(cmd, POD), &stdin, Err("must not be called".into()));
        assert_eq!(out, Ok(String::new()), "{cmd}");
        assert!(posted.is_empty(), "{cmd}");
    }
    assert_eq!(code_of(run(&env("FROB", POD), &stdin, Ok(())).0), 4);
}

#[test]
fn error_constructors_carry_spec_codes() {
    let codes = [
        CniError::incompatible_version("9").code,
        CniError::invalid_env("e").code,
        CniError::decoding_failure("d").code,
        CniError::invalid_config("c").code,
        CniError::enrollment_failed("f", "").code,
    ];
    assert_eq!(codes, [1, 4, 6, 7, 100]);
    assert_eq!(
        CniError::invalid_config("no cniVersion").to_string(),
        "CNI error 7: no cniVersion"
    );
}
