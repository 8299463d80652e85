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
//! back on the same address, as a killed and restarted API server.

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
use select::Selector;

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

/// A TokenRequest for `namespace/account`: a new token, bound to the pod the
/// request names in `boundObjectRef` (if any), living what it asks (an
/// hour by default, as the API server's).
fn token_request(inner: &mut Inner, namespace: &str, account: &str, body: &[u8]) -> Response<Body> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestStatus};
    let Ok(mut request) = serde_json::from_slice::<TokenRequest>(body) else {
        return reply(
            StatusCode::BAD_REQUEST,
            &status(StatusCode::BAD_REQUEST, "BadRequest", "not a TokenRequest"),
        );
    };
    inner.requests.push(format!("TOKEN {namespace}/{account}"));
    let bound = request
        .spec
        .bound_object_ref
        .as_ref()
        .filter(|r| r.kind.as_deref() == Some("Pod"))
        .and_then(|r| r.name.clone())
        .map(|name| (namespace.to_string(), name));
    let token = format!("issued-{}", inner.tokens.len() + 1);
    inner.tokens.insert(token.clone(), bound);
    let life = request.spec.expiration_seconds.unwrap_or(3600);
    request.spec.expiration_seconds = Some(life);
    let expires =
        k8s_openapi::jiff::Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(life);
    request.status = Some(TokenRequestStatus {
        token,
        expiration_timestamp: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(expires),
    });
    request.metadata.name = Some(account.to_string());
    request.metadata.namespace = Some(namespace.to_string());
    reply(
        StatusCode::CREATED,
        &serde_json::to_value(&request).unwrap_or_default(),
    )
}

/// Every request refused with `code`, in kube-apiserver's words.
fn refusal(code: StatusCode, req: &Request<Incoming>) -> Response<Body> {
    let parts: Vec<&str> = req
        .uri()
        .path()
        .trim_start_matches('/')
        .split('/')
        .collect();
    // .../namespaces/<ns>/<resource>/<name>, or .../<resource>/<name>
    let (resource, name) = match parts.as_slice() {
        [.., "namespaces", _, resource, name] | [_, _, resource, name] => (*resource, *name),
        [.., resource] => (*resource, ""),
        [] => ("", ""),
    };
    let user = "system:serviceaccount:istio-system:ambit";
    let (reason, message) = match code.as_u16() {
        401 => ("Unauthorized", "Unauthorized".to_string()),
        403 => (
            "Forbidden",
            format!("{resource} \"{name}\" is forbidden: User \"{user}\" cannot get resource \"{resource}\" in API group \"\""),
        ),
        429 => ("TooManyRequests", "Too many requests, please try again later.".to_string()),
        503 => ("ServiceUnavailable", "service unavailable".to_string()),
        _ => ("InternalError", "Internal error occurred: etcdserver: request timed out".to_string()),
    };
    let mut resp = reply(code, &status(code, reason, &message));
    if code == StatusCode::TOO_MANY_REQUESTS {
        resp.headers_mut()
            .insert("retry-after", http::HeaderValue::from_static("1"));
    }
    resp
}

fn status(code: StatusCode, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code.as_u16()})
}

fn query(uri: &http::Uri) -> BTreeMap<String, String> {
    let decode = |s: &str| {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'%' if i + 2 < b.len() => {
                    let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                    match u8::from_str_radix(hex, 16) {
                        Ok(v) => {
                            out.push(v);
                            i += 3;
                            continue;
                        }
                        Err(_) => out.push(b'%'),
                    }
                }
                b'+' => out.push(b' '),
                c => out.push(c),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

type Body = BoxBody<Bytes, Infallible>;

/// A LIST: every object of `kind` the selector matches, in pages of
/// `limit` when asked for, each page but the last with a `continue` token
/// (this list's resourceVersion and where the next page starts). A token
/// from before the server's oldest resourceVersion is 410 Gone, as after a
/// compaction; one that does not read is 400.
fn list(
    inner: &Inner,
    kind: Kind,
    selector: &Selector,
    q: &BTreeMap<String, String>,
) -> Response<Body> {
    let (rv, start) = match q.get("continue").filter(|c| !c.is_empty()) {
        None => (inner.rv, 0),
        Some(token) => {
            let parsed = token
                .strip_prefix("rv-")
                .and_then(|t| t.split_once("-from-"))
                .and_then(|(rv, at)| Some((rv.parse::<u64>().ok()?, at.parse::<usize>().ok()?)));
            match parsed {
                Some((rv, _)) if rv < inner.oldest => {
                    return reply(
                        StatusCode::GONE,
                        &status(
                            StatusCode::GONE,
                            "Expired",
                            "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                        ),
                    )
                }
                Some(at) => at,
                None => {
                    return reply(
                        StatusCode::BAD_REQUEST,
                        &status(StatusCode::BAD_REQUEST, "BadRequest", "continue key is not valid"),
                    )
                }
            }
        }
    };
    let limit = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let matching: Vec<&Value> = inner
        .objects
        .iter()
        .filter(|((k, _, _), o)| *k == kind && selector.matches(o))
        .map(|(_, o)| o)
        .collect();
    let page: Vec<Value> = matching
        .iter()
        .skip(start)
        .take(limit)
        .map(|o| (*o).clone())
        .collect();
    let next = start.saturating_add(page.len());
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if next < matching.len() {
        metadata["continue"] = json!(format!("rv-{rv}-from-{next}"));
        metadata["remainingItemCount"] = json!(matching.len() - next);
    }
    let list = json!({"kind": format!("{}List", kind.name()), "apiVersion": kind.api_version(),
                      "metadata": metadata, "items": page});
    reply(StatusCode::OK, &list)
}

fn reply(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed())
        .unwrap_or_default()
}

/// Serves `listener` on a thread of its own until told to stop; stopping
/// drops the listener and every connection with the thread's runtime.
fn serve_on(
    listener: std::net::TcpListener,
    state: Arc<Mutex<Inner>>,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> std::io::Result<Server> {
    listener.set_nonblocking(true)?;
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            loop {
                let stream = tokio::select! {
                    _ = &mut stopped => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                let state = state.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(serve(state, req).await) }
                    });
                    let http = hyper::server::conn::http1::Builder::new();
                    match tls {
                        // A client that does not trust the CA never gets a request in.
                        Some(config) => {
                            if let Ok(stream) =
                                tokio_rustls::TlsAcceptor::from(config).accept(stream).await
                            {
                                let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                            }
                        }
                        None => {
                            let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                        }
                    }
                });
            }
        });
        // Dropping the runtime here drops every connection it served.
    });
    Ok(Server { stop, thread })
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

async fn serve(state: Arc<Mutex<Inner>>, req: Request<Incoming>) -> Response<Body> {
    let lock = || state.lock().unwrap_or_else(|e| e.into_inner());
    let refusing = lock().refusing;
    if let Some(code) = refusing {
        lock()
            .requests
            .push(format!("REFUSED {} {}", code.as_u16(), req.uri().path()));
        return refusal(code, &req);
    }
    let bearer = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
        .to_string();
    if !lock().authenticates(&bearer) {
        lock()
            .requests
            .push(format!("UNAUTHORIZED {}", req.uri().path()));
        return refusal(StatusCode::UNAUTHORIZED, &req);
    }
    let path = req.uri().path().to_string();
    let q = query(req.uri());
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    if let (["api", "v1", "namespaces", ns, "serviceaccounts", account, "token"], &Method::POST) =
        (parts.as_slice(), req.method())
    {
        let (ns, account) = (ns.to_string(), account.to_string());
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        return token_request(&mut lock(), &ns, &account, &body);
    }
    let watch = q.get("watch").is_some_and(|v| v == "true" || v == "1");
    let kind = match parts.as_slice() {
        ["api", "v1", "pods"] => Some(Kind::Pod),
        ["api", "v1", "namespaces"] => Some(Kind::Namespace),
        _ => None,
    };
    if let (Some(kind), &Method::GET) = (kind, req.method()) {
        let selector = match Selector::parse(
            kind,
            q.get("fieldSelector").map(String::as_str),
            q.get("labelSelector").map(String::as_str),
        ) {
            Ok(s) => s,
            Err(message) => {
                lock().requests.push(format!("BAD {path}: {message}"));
                return reply(
                    StatusCode::BAD_REQUEST,
                    &status(StatusCode::BAD_REQUEST, "BadRequest", &message),
                );
            }
        };
        let mut inner = lock();
        let verb = if watch { "WATCH" } else { "LIST" };
        // The node a request is scoped to is part of what it asked for.
        let scope = selector
            .node()
            .map(|n| format!(" node={n}"))
            .unwrap_or_default();
        inner.requests.push(format!("{verb} {path}{scope}"));
        if !watch {
            return list(&inner, kind, &selector, &q);
        }
        let from: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let (tx, rx) = mpsc::unbounded_channel();
        if from < inner.oldest {
            let gone = status(StatusCode::GONE, "Expired", "too old resource version");
            let _ = tx.send(Bytes::from(
                json!({"type": "ERROR", "object": gone}).to_string() + "\n",
            ));
        } else {
            for (rv, k, typ, obj, before) in &inner.history {
                if *rv > from {
                    if let Some(line) = watch_line(kind, &selector, (*k, typ, obj, before.as_ref()))
                    {
                        let _ = tx.send(line);
                    }
                }
            }
            inner.watches.push(Watch { kind, selector, tx });
        }
        // It ends at `timeoutSeconds` (or the server's cap), first with a
        // BOOKMARK of where it got to when bookmarks were asked for.
        let asked = q
            .get("timeoutSeconds")
            .and_then(|t| t.parse::<u64>().ok())
            .map(std::time::Duration::from_secs);
        let ends = match (asked, inner.watch_cap) {
            (Some(a), Some(c)) => Some(a.min(c)),
            (a, c) => a.or(c),
        }
        .map(|d| tokio::time::Instant::now() + d);
        let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
        let bookmark = bookmarks.then(|| (state.clone(), kind));
        drop(inner);
        let stream = futures_util::stream::unfold(Some((rx, ends, bookmark)), |open| async move {
            let (mut rx, ends, bookmark) = open?;
            let next = match ends {
                Some(at) => tokio::time::timeout_at(at, rx.recv()).await.ok(),
                None => Some(rx.recv().await),
            };
            match next {
                Some(Some(line)) => Some((
                    Ok::<_, Infallible>(Frame::data(line)),
                    Some((rx, ends, bookmark)),
                )),
                Some(None) => None,
                None => {
                    let (state, kind) = bookmark?;
                    let rv = state.lock().unwrap_or_else(|e| e.into_inner()).rv;
                    let line = json!({"type": "BOOKMARK", "object": {
                        "kind": kind.name(), "apiVersion": kind.api_version(),
                        "metadata": {"resourceVersion": rv.to_string()}}});
                    Some((Ok(Frame::data(Bytes::from(line.to_string() + "\n"))), None))
                }
            }
        });
        return Response::builder()
            .header("content-type", "application/json")
            .body(BodyExt::boxed(StreamBody::new(stream)))
            .unwrap_or_default();
    }
    let key = match parts.as_slice() {
        ["api", "v1", "namespaces", ns] => Some((Kind::Namespace, String::new(), ns.to_string())),
        ["api", "v1", "nodes", name] => Some((Kind::Node, String::new(), name.to_string())),
        ["api", "v1", "namespaces", ns, "pods", name]
        | ["api", "v1", "namespaces", ns, "pods", name, "status"] => {
            Some((Kind::Pod, ns.to_string(), name.to_string()))
        }
        ["apis", "apps", "v1", "namespaces", ns, "daemonsets", name] => {
            Some((Kind::DaemonSet, ns.to_string(), name.to_string()))
        }
        _ => None,
    };
    let Some(key) = key else {
        return reply(
            StatusCode::NOT_FOUND,
            &status(StatusCode::NOT_FOUND, "NotFound", "no such path"),
        );
    };
    let method = req.method().clone();
    let content_type = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let stalled = {
        let mut inner = lock();
        inner.requests.push(format!("{method} {path}"));
        inner.stalled
    };
    if stalled {
        // Held open, never answered, until the client gives up.
        return std::future::pending().await;
    }
    let mut inner = lock();
    let Some(obj) = inner.objects.get(&key).cloned() else {
        return reply(
            StatusCode::NOT_FOUND,
            &status(StatusCode::NOT_FOUND, "NotFound", "not found"),
        );
    };
    match method {
        Method::GET => reply(StatusCode::OK, &obj),
        // A pod is deleted gracefully (30 s unless the request's
        // DeleteOptions say otherwise): it stays, terminating, until the
        // kubelet (the test: FakeApi::delete) removes it. Grace 0 removes
        // it at once.
        Method::DELETE if key.0 == Kind::Pod && !path.ends_with("/status") => {
            let grace = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|o| o["gracePeriodSeconds"].as_u64())
                .or_else(|| q.get("gracePeriodSeconds").and_then(|g| g.parse().ok()))
                .unwrap_or(30);
            if grace == 0 {
                let gone = inner.remove(&key).unwrap_or(obj);
                return reply(StatusCode::OK, &gone);
            }
            let terminating = inner.terminate(&key, grace).unwrap_or(obj);
            reply(StatusCode::OK, &terminating)
        }
        Method::PATCH if key.0 == Kind::Pod => {
            let content_type = content_type.unwrap_or_default();
            let subresource = path.ends_with("/status");
            match patch::apply(&obj, &content_type, &body, subresource) {
                Ok(updated) => {
                    let recorded = serde_json::from_slice::<Value>(&body).unwrap_or_default();
                    inner
                        .patches
                        .push((format!("{}/{}", key.1, key.2), recorded));
                    inner.put(Kind::Pod, updated.clone());
                    let stored = inner.objects.get(&key).cloned().unwrap_or(updated);
                    reply(StatusCode::OK, &stored)
                }
                Err((code, reason, message)) => reply(code, &status(code, reason, &message)),
            }
        }
        _ => reply(
            StatusCode::METHOD_NOT_ALLOWED,
            &status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "not served",
            ),
        ),
    }
}
