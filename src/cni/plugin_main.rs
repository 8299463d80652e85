//! The CNI plugin process (`ambit-cni`): reads the environment and stdin,
//! runs the pure logic of [`super::plugin`], delivers ADD events to the agent
//! over `<run dir>/pluginevent.sock` (HTTP/1.1 on a stream Unix socket, 5 s
//! budget), and prints the result — and nothing else — on stdout. Errors are
//! CNI error JSON on stdout with exit code 1; logs go to stderr.

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use super::agent::PLUGIN_SOCKET;
use super::plugin::{self, AddEvent, AgentError, CniError};

/// The whole budget for telling the agent.
pub const AGENT_TIMEOUT: Duration = Duration::from_secs(5);

/// POSTs the event to the agent; the error text says what went wrong and where.
fn post(event: &AddEvent, run_dir: &str) -> Result<(), AgentError> {
    let sock = Path::new(run_dir).join(PLUGIN_SOCKET);
    let body = serde_json::to_vec(event).map_err(|e| AgentError::Refused(e.to_string()))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| AgentError::Refused(e.to_string()))?;
    let stream = match rt.block_on(tokio::net::UnixStream::connect(&sock)) {
        Ok(s) => s,
        Err(e) => {
            let must_enroll = rt.block_on(ask_api(event, Path::new(run_dir)));
            return Err(AgentError::Unreachable {
                why: format!(
                    "agent socket {}: {e} — is the Ambit agent running?",
                    sock.display()
                ),
                must_enroll,
            });
        }
    };
    rt.block_on(async {
        let exchange = async {
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .map_err(|e| format!("agent socket {}: {e}", sock.display()))?;
            tokio::spawn(conn);
            let req = http::Request::post("http://ambit-agent/cmdadd")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| e.to_string())?;
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| format!("agent: {e}"))?;
            let status = resp.status();
            let text = resp
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            if status == http::StatusCode::OK {
                Ok(())
            } else {
                Err(format!(
                    "agent answered {status}: {}",
                    String::from_utf8_lossy(&text).trim()
                ))
            }
        };
        tokio::time::timeout(AGENT_TIMEOUT, exchange)
            .await
            .map_err(|_| format!("agent socket {}: no answer within 5s", sock.display()))?
    })
    .map_err(AgentError::Refused)
}

/// With no agent to ask: whether the API server says the pod must be
/// enrolled, using the kubeconfig the agent left in its run dir. `None` when
/// there is none or the API does not answer within 3 s.
async fn ask_api(event: &AddEvent, run_dir: &Path) -> Option<bool> {
    use k8s_openapi::api::core::v1::{Namespace, Pod};
    let path = run_dir.join(plugin::PLUGIN_KUBECONFIG_FILE);
    if !path.exists() {
        return None;
    }
    let lookup = async {
        let kubeconfig = kube::config::Kubeconfig::read_from(&path).ok()?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .ok()?;
        let client = kube::Client::try_from(config).ok()?;
        let pod = kube::Api::<Pod>::namespaced(client.clone(), &event.pod_namespace)
            .get(&event.pod_name)
            .await
            .ok()?;
        let ns = kube::Api::<Namespace>::all(client)
            .get_opt(&event.pod_namespace)
            .await
            .ok()?;
        Some(super::kube::should_enroll(&pod, ns.as_ref(), &[]))
    };
    tokio::time::timeout(Duration::from_secs(3), lookup)
        .await
        .ok()
        .flatten()
}

/// Runs the plugin and returns the process exit code.
pub fn main() -> i32 {
    let mut stdin = Vec::new();
    let stdout = std::io::stdout();
    let outcome = match plugin::env_from(|k| std::env::var(k).ok()) {
        Err(e) => Err(e),
        Ok(env) => match std::io::stdin().read_to_end(&mut stdin) {
            Err(e) => Err(CniError::decoding_failure(format!("reading stdin: {e}"))),
            Ok(_) => plugin::handle(&env, &stdin, &mut post),
        },
    };
    let mut out = stdout.lock();
    match outcome {
        Ok(text) => {
            let _ = out.write_all(text.as_bytes());
            0
        }
        Err(e) => {
            eprintln!("ambit-cni: {e}");
            let _ = out.write_all(e.to_json(&plugin::reply_version(&stdin)).as_bytes());
            1
        }
    }
}
