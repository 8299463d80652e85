//! The stand-in's HTTP side: each request answered from the shared
//! state as kube-apiserver answers it (lists, watches, single objects,
//! patches, deletions, TokenRequest, refusals), and the thread serving a
//! listener, in plain HTTP or TLS.

use super::*;

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

pub(super) fn status(code: StatusCode, reason: &str, message: &str) -> Value {
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

pub(super) type Body = BoxBody<Bytes, Infallible>;

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
pub(super) fn serve_on(
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
