//! The README's main job: `ambit demo --once` builds a node through the real
//! CNI path, sends traffic (meshed, service, passthrough, denied) and prints
//! what the proxy did.

#[test]
fn demo_shows_meshed_service_and_passthrough_traffic() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ambit"))
        .args(["demo", "--once"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no row {prefix}:\n{text}"))
            .to_string()
    };
    for prefix in ["client -> server (pod IP)", "client -> echo service VIP"] {
        let r = row(prefix);
        assert!(
            r.contains("HBONE mTLS")
                && r.contains("sa/client-sa")
                && r.contains("sa/server-sa")
                && r.contains("allowed, echoed"),
            "{r}"
        );
    }
    let r = row("client -> outsider");
    assert!(
        r.contains("passthrough") && r.contains("allowed, echoed"),
        "{r}"
    );
    let r = row("client -> server admin port");
    assert!(
        r.contains("DENIED by default/deny-admin-port (401)") && r.contains("sa/client-sa"),
        "{r}"
    );
    assert!(
        text.contains("not enrolled (namespace 'outside')"),
        "{text}"
    );
}
