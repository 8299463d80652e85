//! A small in-process stand-in for the Kubernetes API server, for tests: it
//! serves list and watch of pods and namespaces (with resourceVersions and a
//! replayable history), single GETs, and patches of pods and `pods/status`,
//! which it records. Where the agent's client depends on it, it answers as
//! kube-apiserver does: selectors it does not serve are 400 (`select`),
//! lists page with `limit`/`continue`, watches end at `timeoutSeconds`
//! (with a BOOKMARK first when asked for), an object that comes to match
//! a watch's selector is ADDED to it and one that stops is DELETED, a
//! DELETED event carries the deletion's resourceVersion, and a PATCH is
//! applied as its content type says (`patch`). [`FakeApi::expire_watches`] ends every open watch with
//! `410 Gone`, as an API server does when its watch cache has moved on;
//! [`FakeApi::kill`] and [`FakeApi::start_again`] take it down and bring it
//! back on the same address, as a killed and restarted API server. This
//! file holds the state and [`FakeApi`], the test's handle on it;
//! `serving` answers the requests.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::netns::Netns;

mod patch;
mod select;
mod serving;
use select::Selector;
use serving::{serve_on, status};

#[cfg(test)]
mod tests;

/// The kinds the fake serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Pod,
    Namespace,
    /// `apps/v1` DaemonSets: served by GET only.
    DaemonSet,
    /// Nodes: served by GET only.
    Node,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Namespace => "Namespace",
            Kind::DaemonSet => "DaemonSet",
            Kind::Node => "Node",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::DaemonSet => "apps/v1",
            _ => "v1",
        }
    }
}

type Key = (Kind, String, String);

struct Watch {
    kind: Kind,
    selector: Selector,
    tx: mpsc::UnboundedSender<Bytes>,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    /// Watches from before this resourceVersion get 410 Gone.
    oldest: u64,
    objects: BTreeMap<Key, Value>,
    /// Every change: its resourceVersion, kind, type, the object after it
    /// and the object before it (a watch's selector may match one and not
    /// the other).
    history: Vec<(u64, Kind, &'static str, Value, Option<Value>)>,
    /// No watch lasts longer (see [`FakeApi::cap_watches`]).
    watch_cap: Option<std::time::Duration>,
    watches: Vec<Watch>,
    patches: Vec<(String, Value)>,
    requests: Vec<String>,
    /// Every request gets this status (see [`FakeApi::refuse`]).
    refusing: Option<StatusCode>,
    /// Requests for one object are held unanswered (see [`FakeApi::stall`]).
    stalled: bool,
    /// Tokens issued by TokenRequest (`issued-<n>`), each with the pod it
    /// is bound to, if any; and the pod the kubeconfig's `fake-token` is
    /// bound to, as a pod's projected token is (see
    /// [`FakeApi::bind_kubeconfig_token`]).
    tokens: BTreeMap<String, Option<(String, String)>>,
    kubeconfig_token_pod: Option<(String, String)>,
}

impl Inner {
    /// Whether `token` authenticates: known, and its pod (if it is bound to
    /// one) still there, as kube-apiserver checks a bound token.
    fn authenticates(&self, token: &str) -> bool {
        let bound = match token {
            "fake-token" => self.kubeconfig_token_pod.clone(),
            t => match self.tokens.get(t) {
                Some(bound) => bound.clone(),
                None => return false,
            },
        };
        bound.is_none_or(|(ns, name)| self.objects.contains_key(&key(Kind::Pod, &ns, &name)))
    }
}

/// A running fake API server (plain HTTP on 127.0.0.1 inside a netns).
pub struct FakeApi {
    pub addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
    ns: Netns,
    /// The serving thread, while the server is up.
    server: Mutex<Option<Server>>,
    /// Served over TLS, as a real API server: its certificate for
    /// 127.0.0.1, and the CA bundle (PEM) that signed it.
    tls: Option<(Arc<rustls::ServerConfig>, String)>,
}

/// The thread serving one listener, and how to stop it.
struct Server {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

/// Where an object is stored: namespaces are cluster-scoped.
fn key(kind: Kind, namespace: &str, name: &str) -> Key {
    let ns = match kind {
        Kind::Namespace | Kind::Node => "",
        Kind::Pod | Kind::DaemonSet => namespace,
    };
    (kind, ns.to_string(), name.to_string())
}

fn key_of(kind: Kind, obj: &Value) -> Key {
    let m = &obj["metadata"];
    key(
        kind,
        m["namespace"].as_str().unwrap_or("default"),
        m["name"].as_str().unwrap_or_default(),
    )
}

/// The line a watch of `kind` with `selector` is sent for a change, if any:
/// an object that comes to match is ADDED, one that stops matching is
/// DELETED (as kube-apiserver's watch cache filters).
fn watch_line(
    kind: Kind,
    selector: &Selector,
    (k, typ, obj, before): (Kind, &str, &Value, Option<&Value>),
) -> Option<Bytes> {
    if k != kind {
        return None;
    }
    let now = selector.matches(obj);
    let was = before.is_some_and(|b| selector.matches(b));
    let typ = match (typ, was, now) {
        ("DELETED", _, true) => "DELETED",
        ("DELETED", _, false) => return None,
        (_, false, true) => "ADDED",
        (t, true, true) => t,
        (_, true, false) => "DELETED",
        (_, false, false) => return None,
    };
    Some(Bytes::from(
        json!({"type": typ, "object": obj}).to_string() + "\n",
    ))
}

impl Inner {
    /// Marks an object as being deleted (once; a second deletion changes
    /// nothing, as on a real server). Returns the object as stored.
    fn terminate(&mut self, key: &Key, grace_seconds: u64) -> Option<Value> {
        let mut obj = self.objects.get(key).cloned()?;
        if obj["metadata"].get("deletionTimestamp").is_none() {
            let at = k8s_openapi::jiff::Timestamp::now()
                + k8s_openapi::jiff::SignedDuration::from_secs(grace_seconds as i64);
            obj["metadata"]["deletionTimestamp"] =
                json!(at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string());
            obj["metadata"]["deletionGracePeriodSeconds"] = json!(grace_seconds);
            self.put(key.0, obj);
        }
        self.objects.get(key).cloned()
    }

    /// Removes an object; the DELETED event carries the deletion's
    /// resourceVersion, as the API server's: a watch resumed from it does
    /// not see it again.
    fn remove(&mut self, key: &Key) -> Option<Value> {
        let mut obj = self.objects.remove(key)?;
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let before = Some(obj.clone());
        self.event(key.0, "DELETED", obj.clone(), before);
        Some(obj)
    }

    fn event(&mut self, kind: Kind, typ: &'static str, obj: Value, before: Option<Value>) {
        let change = (kind, typ, &obj, before.as_ref());
        self.watches
            .retain(|w| match watch_line(w.kind, &w.selector, change) {
                Some(line) => w.tx.send(line).is_ok(),
                None => !w.tx.is_closed(),
            });
        self.history.push((self.rv, kind, typ, obj, before));
    }

    fn put(&mut self, kind: Kind, mut obj: Value) {
        self.rv += 1;
        obj["apiVersion"] = json!(kind.api_version());
        obj["kind"] = json!(kind.name());
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let key = key_of(kind, &obj);
        let before = self.objects.insert(key, obj.clone());
        let typ = if before.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        self.event(kind, typ, obj, before);
    }
}

impl FakeApi {
    /// Starts the server on 127.0.0.1 inside `ns` (where the agent runs),
    /// in plain HTTP.
    pub fn start(ns: &Netns) -> std::io::Result<FakeApi> {
        Self::start_with(ns, None)
    }

    /// Starts it over TLS, as a real API server serves: a certificate for
    /// 127.0.0.1 from a CA of its own, whose bundle the kubeconfig carries
    /// (`certificate-authority-data`).
    pub fn start_tls(ns: &Netns) -> std::io::Result<FakeApi> {
        let ca = crate::identity::LocalCa::generate_serving().map_err(std::io::Error::other)?;
        let cert = ca
            .issue_server(
                &["127.0.0.1".to_string()],
                std::time::Duration::from_secs(86400),
            )
            .map_err(std::io::Error::other)?;
        let mut config =
            rustls::ServerConfig::builder_with_provider(crate::identity::tls::provider())
                .with_safe_default_protocol_versions()
                .map_err(std::io::Error::other)?
                .with_no_client_auth()
                .with_single_cert(cert.chain.clone(), cert.private_key())
                .map_err(std::io::Error::other)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Self::start_with(ns, Some((Arc::new(config), ca.root_pem().to_string())))
    }

    fn start_with(
        ns: &Netns,
        tls: Option<(Arc<rustls::ServerConfig>, String)>,
    ) -> std::io::Result<FakeApi> {
        let listener = ns.run(|| std::net::TcpListener::bind("127.0.0.1:0"))??;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Mutex::new(Inner::default()));
        let server = serve_on(listener, inner.clone(), tls.as_ref().map(|t| t.0.clone()))?;
        Ok(FakeApi {
            addr,
            inner,
            ns: ns.clone(),
            server: Mutex::new(Some(server)),
            tls,
        })
    }

    /// The server dies, as a killed API server process does: its listener
    /// closes (new connections are refused) and every open connection,
    /// watches included, is cut without a last chunk. The objects stay, as
    /// they would in etcd. Does nothing if it is already down.
    pub fn kill(&self) {
        let server = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(server) = server {
            let _ = server.stop.send(());
            let _ = server.thread.join();
        }
        self.lock().watches.clear();
    }

    /// The server comes back on the same address. Like a restarted API
    /// server, whose watch cache starts from what etcd holds now, it
    /// refuses watches from any resourceVersion before now (410 Gone), so
    /// clients list again.
    pub fn start_again(&self) -> std::io::Result<()> {
        let mut server = self.server.lock().unwrap_or_else(|e| e.into_inner());
        if server.is_some() {
            return Ok(());
        }
        let addr = self.addr;
        let listener = self.ns.run(move || std::net::TcpListener::bind(addr))??;
        {
            let mut inner = self.lock();
            inner.oldest = inner.rv;
        }
        let tls = self.tls.as_ref().map(|t| t.0.clone());
        *server = Some(serve_on(listener, self.inner.clone(), tls)?);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A kubeconfig pointing at this server (with a token, as in a cluster,
    /// and over TLS the CA bundle, as `certificate-authority-data`).
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        use base64::Engine;
        let cluster = match &self.tls {
            Some((_, ca)) => format!(
                "server: https://{}\n    certificate-authority-data: {}",
                self.addr,
                base64::engine::general_purpose::STANDARD.encode(ca)
            ),
            None => format!("server: http://{}", self.addr),
        };
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    {cluster}\nusers:\n- name: agent\n  user:\n    token: fake-token\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: agent\ncurrent-context: fake\n"
        );
        std::fs::write(path, text)
    }

    /// The files a pod's service account mount holds (`token`, `ca.crt`,
    /// `namespace`), for a client of this server that finds it in-cluster:
    /// the token is the one [`FakeApi::write_kubeconfig`] writes. Over TLS
    /// only, as a cluster's API server is.
    pub fn write_service_account(&self, dir: &Path, namespace: &str) -> std::io::Result<()> {
        let Some((_, ca)) = &self.tls else {
            return Err(std::io::Error::other(
                "an in-cluster client needs the server over TLS (FakeApi::start_tls)",
            ));
        };
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("token"), "fake-token")?;
        std::fs::write(dir.join("ca.crt"), ca)?;
        std::fs::write(dir.join("namespace"), namespace)
    }

    /// Creates or replaces an object; watchers see ADDED or MODIFIED.
    pub fn put(&self, kind: Kind, obj: Value) {
        self.lock().put(kind, obj);
    }

    /// Changes a stored object in place (e.g. a label or the pod IP).
    pub fn update(&self, kind: Kind, namespace: &str, name: &str, f: impl FnOnce(&mut Value)) {
        let mut inner = self.lock();
        let Some(mut obj) = inner.objects.get(&key(kind, namespace, name)).cloned() else {
            panic!("no {kind:?} {namespace}/{name}");
        };
        f(&mut obj);
        inner.put(kind, obj);
    }

    /// Starts a graceful deletion, as `kubectl delete pod` does: the object
    /// stays, with `deletionTimestamp` and `deletionGracePeriodSeconds`
    /// set (watchers see MODIFIED), until [`FakeApi::delete`] removes it,
    /// as the kubelet does once the pod's containers have stopped.
    pub fn delete_gracefully(&self, kind: Kind, namespace: &str, name: &str, grace_seconds: u64) {
        self.lock()
            .terminate(&key(kind, namespace, name), grace_seconds);
    }

    /// Deletes an object; watchers see DELETED.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) {
        self.lock().remove(&key(kind, namespace, name));
    }

    /// The stored object.
    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        self.lock()
            .objects
            .get(&key(kind, namespace, name))
            .cloned()
    }

    /// Every `pods/status` patch so far: (`namespace/name`, body).
    pub fn patches(&self) -> Vec<(String, Value)> {
        self.lock().patches.clone()
    }

    /// Every request so far, as `VERB path` (LIST, WATCH, GET, PATCH).
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    /// From now on every request gets 401 Unauthorized, as when the
    /// client's ServiceAccount has been deleted.
    pub fn revoke(&self) {
        self.refuse(StatusCode::UNAUTHORIZED);
    }

    /// From now on every request gets `code`, worded as kube-apiserver
    /// words it: 401 (the account is gone), 403 (the account is there, its
    /// rights are not: a ClusterRole edited, or an uninstall's bindings
    /// deleted before its account), 429 (with `Retry-After`), 5xx.
    pub fn refuse(&self, code: StatusCode) {
        self.lock().refusing = Some(code);
    }

    /// Answers requests again.
    pub fn serve_again(&self) {
        self.lock().refusing = None;
    }

    /// Binds the kubeconfig's token to pod `namespace/name`, as a pod's
    /// projected ServiceAccount token is: once that pod is deleted, the
    /// token gets 401.
    pub fn bind_kubeconfig_token(&self, namespace: &str, name: &str) {
        self.lock().kubeconfig_token_pod = Some((namespace.to_string(), name.to_string()));
    }

    /// Tokens issued by TokenRequest so far.
    pub fn issued_tokens(&self) -> usize {
        self.lock().tokens.len()
    }

    /// From now on no watch lasts longer than `cap`, whatever its
    /// `timeoutSeconds` (a real server ends watches after its
    /// `--min-request-timeout`, 30 to 60 minutes): clients must watch again.
    pub fn cap_watches(&self, cap: std::time::Duration) {
        self.lock().watch_cap = Some(cap);
    }

    /// From now on every request for one object (GET, PATCH) is read,
    /// recorded and never answered, as from a wedged API server; lists and
    /// watches, open or new, still serve, so the client sees changes and
    /// then waits on its requests.
    pub fn stall(&self) {
        self.lock().stalled = true;
    }

    /// Ends every open watch with 410 Gone, and refuses watches from any
    /// resourceVersion before now, so clients must list again.
    pub fn expire_watches(&self) {
        let mut inner = self.lock();
        inner.oldest = inner.rv;
        let gone = Bytes::from(
            json!({"type": "ERROR", "object": status(StatusCode::GONE, "Expired", "too old resource version")})
                .to_string()
                + "\n",
        );
        for w in inner.watches.drain(..) {
            let _ = w.tx.send(gone.clone());
        }
    }
}
