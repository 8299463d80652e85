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
            let asked = rt.block_on(ask_api(event, Path::new(run_dir)));
            let agent = format!(
                "agent socket {}: {e} — is the Ambit agent running?",
                sock.display()
            );
            return Err(match asked {
                Ok(must) => AgentError::Unreachable {
                    why: agent,
                    must_enroll: Some(must),
                },
                Err(api) => AgentError::Unreachable {
                    why: format!(
                        "{agent}; and the API server could not say whether the pod is in the mesh: {api}"
                    ),
                    must_enroll: None,
                },
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
/// enrolled, using the kubeconfig the agent left in its run dir; why not,
/// when it cannot be had (no kubeconfig, the API refuses or does not answer
/// within 3 s).
async fn ask_api(event: &AddEvent, run_dir: &Path) -> Result<bool, String> {
    use k8s_openapi::api::core::v1::{Namespace, Pod};
    let path = run_dir.join(plugin::PLUGIN_KUBECONFIG_FILE);
    if !path.exists() {
        return Err(format!(
            "no kubeconfig from the agent at {}",
            path.display()
        ));
    }
    let lookup = async {
        let kubeconfig = kube::config::Kubeconfig::read_from(&path)
            .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?;
        let client = kube::Client::try_from(config).map_err(|e| e.to_string())?;
        let pod = kube::Api::<Pod>::namespaced(client.clone(), &event.pod_namespace)
            .get(&event.pod_name)
            .await
            .map_err(|e| format!("pod {}/{}: {e}", event.pod_namespace, event.pod_name))?;
        let ns = kube::Api::<Namespace>::all(client)
            .get_opt(&event.pod_namespace)
            .await
            .map_err(|e| format!("namespace {}: {e}", event.pod_namespace))?;
        Ok(super::kube::should_enroll(&pod, ns.as_ref(), &[]))
    };
    tokio::time::timeout(Duration::from_secs(3), lookup)
        .await
        .unwrap_or_else(|_| Err("no answer within 3s".into()))
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
