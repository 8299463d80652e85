//! The CNI plugin's whole input, the `CNI_*` environment and the network
//! config on stdin, through the calls `ambit-cni` makes: `env_from`,
//! `handle` (config, `CNI_ARGS`, the decision, the result conversion) and
//! `reply_version` for an error's label.
//!
//! Input: a knob byte choosing the agent's answer (0 took the pod, 1
//! refused, 2 and 3 unreachable with the API saying the pod must, or need
//! not, be enrolled), then `KEY=value` lines, a blank line, and stdin.
//!
//! Checked beyond "no panic": stdout is JSON (or empty); a named pod in
//! `CNI_ARGS` has a namespace; and the event the plugin would POST reads
//! back the same through the agent's parser.

#![no_main]

use ambit::cni::agent::parse_add_event;
use ambit::cni::plugin::{env_from, handle, parse_cni_args, reply_version, AddEvent, AgentError};
use ambit_fuzz::knob;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (agent, rest) = knob(data);
    let (env_text, stdin) = match rest.windows(2).position(|w| w == b"\n\n") {
        Some(i) => (&rest[..i], &rest[i + 2..]),
        None => (rest, &[][..]),
    };
    // As std::env::var: a variable that is not UTF-8 counts as unset.
    let vars: Vec<(&str, &str)> = env_text
        .split(|b| *b == b'\n')
        .filter_map(|line| std::str::from_utf8(line).ok()?.split_once('='))
        .collect();
    let get = |key: &str| {
        vars.iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_string())
    };
    let env = match env_from(get) {
        Ok(env) => env,
        Err(e) => return assert_json(&e.to_json(&reply_version(stdin))),
    };
    let pod = parse_cni_args(&env.args);
    assert!(
        pod.name.is_none() || pod.namespace.is_some(),
        "a named pod without a namespace: {pod:?}"
    );
    let mut post = |event: &AddEvent, _run_dir: &str| {
        let body = serde_json::to_vec(event).expect("an event serializes");
        let read = parse_add_event(&body).expect("the agent reads what the plugin sends");
        assert_eq!(&read, event);
        match agent % 4 {
            0 => Ok(()),
            1 => Err(AgentError::Refused("agent answered 500".into())),
            // Never `must_enroll: None`: that reads a file the config names.
            n => Err(AgentError::Unreachable {
                why: "no agent socket".into(),
                must_enroll: Some(n == 2),
            }),
        }
    };
    match handle(&env, stdin, &mut post) {
        Ok(out) if out.is_empty() => {}
        Ok(out) => assert_json(&out),
        Err(e) => assert_json(&e.to_json(&reply_version(stdin))),
    }
});

/// The spec's stdout is one JSON value, on success and on error.
fn assert_json(text: &str) {
    assert!(
        serde_json::from_str::<serde_json::Value>(text).is_ok(),
        "stdout is not JSON: {text}"
    );
}
