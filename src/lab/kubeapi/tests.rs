//! The stand-in answers as kube-apiserver does where the agent's client
//! depends on it, read over HTTP as a client reads it.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{FakeApi, Kind};
use crate::netns::Netns;

/// One request with the kubeconfig's token: the status and the body's
/// JSON documents (one for a plain answer, one per event for a watch,
/// which is read to its end).
fn call(
    api: &FakeApi,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
) -> (u16, Vec<Value>) {
    let mut s = std::net::TcpStream::connect(api.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: k\r\nauthorization: Bearer fake-token\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    let status = text[9..12].parse().unwrap();
    let (_, body) = text.split_once("\r\n\r\n").unwrap();
    // Chunk sizes sit on lines of their own; each JSON document is one line.
    let docs = body
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (status, docs)
}

fn get(api: &FakeApi, path: &str) -> (u16, Vec<Value>) {
    call(api, "GET", path, "application/json", b"")
}

fn pod(name: &str, node: Option<&str>, app: &str) -> Value {
    let mut p = json!({"metadata": {"name": name, "namespace": "default", "labels": {"app": app}},
                       "spec": {}, "status": {"phase": "Running"}});
    if let Some(n) = node {
        p["spec"]["nodeName"] = json!(n);
    }
    p
}

fn names(list: &Value) -> Vec<&str> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap())
        .collect()
}

fn api() -> FakeApi {
    FakeApi::start(&Netns::current().unwrap()).unwrap()
}

#[test]
fn selectors_it_does_not_serve_are_400_and_the_others_select() {
    let api = api();
    api.put(Kind::Pod, pod("a", Some("n1"), "web"));
    api.put(Kind::Pod, pod("b", Some("n2"), "api"));
    let (code, docs) = get(&api, "/api/v1/pods?labelSelector=app%3Dweb");
    assert_eq!((code, names(&docs[0])), (200, vec!["a"]));
    let (code, docs) = get(&api, "/api/v1/pods?fieldSelector=spec.nodeName%3Dn2");
    assert_eq!((code, names(&docs[0])), (200, vec!["b"]));
    let (code, docs) = get(&api, "/api/v1/pods?fieldSelector=status.phase%3DRunning");
    assert_eq!(code, 400);
    assert_eq!(docs[0]["reason"], "BadRequest");
    assert_eq!(
        docs[0]["message"],
        "field label not supported: status.phase"
    );
    assert_eq!(
        get(&api, "/api/v1/pods?labelSelector=app+in+%28web%29").0,
        400
    );
    assert_eq!(
        get(&api, "/api/v1/pods?watch=true&fieldSelector=spec.x%3D1").0,
        400
    );
}

#[test]
fn lists_page_with_limit_and_continue_and_an_old_token_is_gone() {
    let api = api();
    for n in ["a", "b", "c"] {
        api.put(Kind::Pod, pod(n, Some("n1"), "web"));
    }
    let (_, first) = get(&api, "/api/v1/pods?limit=2");
    assert_eq!(names(&first[0]), vec!["a", "b"]);
    assert_eq!(first[0]["metadata"]["remainingItemCount"], 1);
    let token = first[0]["metadata"]["continue"]
        .as_str()
        .unwrap()
        .to_string();
    let (_, rest) = get(&api, &format!("/api/v1/pods?limit=2&continue={token}"));
    assert_eq!(names(&rest[0]), vec!["c"]);
    assert!(
        rest[0]["metadata"].get("continue").is_none(),
        "the last page"
    );
    assert_eq!(
        rest[0]["metadata"]["resourceVersion"],
        first[0]["metadata"]["resourceVersion"]
    );
    assert_eq!(get(&api, "/api/v1/pods?limit=2&continue=garbage").0, 400);
    api.put(Kind::Pod, pod("d", Some("n1"), "web"));
    api.expire_watches();
    let (code, docs) = get(&api, &format!("/api/v1/pods?limit=2&continue={token}"));
    assert_eq!((code, docs[0]["reason"].as_str()), (410, Some("Expired")));
}

/// A watch ends at its `timeoutSeconds` with a BOOKMARK of where it got
/// to; an object that comes to match its selector is ADDED, one that
/// stops is DELETED; a deletion carries its own resourceVersion.
#[test]
fn watches_end_on_time_with_a_bookmark_and_follow_the_selector() {
    let api = std::sync::Arc::new(api());
    api.put(Kind::Pod, pod("early", None, "web"));
    let rv = get(&api, "/api/v1/pods").1[0]["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let started = Instant::now();
    let watch = {
        let api = api.clone();
        std::thread::spawn(move || {
            get(&api, &format!(
                "/api/v1/pods?watch=true&resourceVersion={rv}&fieldSelector=spec.nodeName%3Dn1&timeoutSeconds=2&allowWatchBookmarks=true"
            ))
        })
    };
    // The watch is open once it is in the request log.
    while !api.requests().iter().any(|r| r.starts_with("WATCH")) {
        std::thread::sleep(Duration::from_millis(10));
    }
    api.update(Kind::Pod, "default", "early", |p| {
        p["spec"]["nodeName"] = json!("n1")
    });
    api.update(Kind::Pod, "default", "early", |p| {
        p["metadata"]["labels"]["v"] = json!("2")
    });
    api.update(Kind::Pod, "default", "early", |p| {
        p["spec"]["nodeName"] = json!("n2")
    });
    api.put(Kind::Pod, pod("late", Some("n1"), "web"));
    api.delete(Kind::Pod, "default", "late");
    let (code, events) = watch.join().unwrap();
    let took = started.elapsed();
    assert_eq!(code, 200);
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(6),
        "{took:?}"
    );
    let seen: Vec<(&str, &str)> = events
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap(),
                e["object"]["metadata"]["name"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            ("ADDED", "early"),
            ("MODIFIED", "early"),
            ("DELETED", "early"),
            ("ADDED", "late"),
            ("DELETED", "late"),
            ("BOOKMARK", ""),
        ],
        "{events:#?}"
    );
    let rv_of = |i: usize| {
        events[i]["object"]["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    assert!(
        rv_of(4) > rv_of(3),
        "a deletion has its own resourceVersion"
    );
    assert_eq!(rv_of(5), rv_of(4), "the bookmark is where the watch got to");
}

#[test]
fn a_patch_is_applied_as_its_content_type_says_and_status_keeps_the_spec() {
    let api = api();
    api.put(Kind::Pod, pod("a", Some("n1"), "web"));
    let path = "/api/v1/namespaces/default/pods/a/status";
    let merge = br#"{"metadata": {"annotations": {"x": "1"}}, "spec": {"nodeName": "n9"}}"#;
    let (code, docs) = call(&api, "PATCH", path, "application/merge-patch+json", merge);
    assert_eq!(code, 200);
    assert_eq!(docs[0]["metadata"]["annotations"]["x"], "1");
    assert_eq!(
        docs[0]["spec"]["nodeName"], "n1",
        "pods/status ignores the spec"
    );
    let ops = br#"[{"op": "replace", "path": "/metadata/annotations/x", "value": "2"}]"#;
    assert_eq!(
        call(&api, "PATCH", path, "application/json-patch+json", ops).0,
        200
    );
    assert_eq!(
        api.get(Kind::Pod, "default", "a").unwrap()["metadata"]["annotations"]["x"],
        "2"
    );
    let failing = br#"[{"op": "remove", "path": "/metadata/annotations/none"}]"#;
    assert_eq!(
        call(&api, "PATCH", path, "application/json-patch+json", failing).0,
        422
    );
    assert_eq!(
        call(
            &api,
            "PATCH",
            path,
            "application/merge-patch+json",
            b"{oops"
        )
        .0,
        400
    );
    let (code, docs) = call(&api, "PATCH", path, "application/json", merge);
    assert_eq!(
        (code, docs[0]["reason"].as_str()),
        (415, Some("UnsupportedMediaType"))
    );
}

/// `DELETE` of a pod is graceful: it stays, terminating, with its
/// deletion time set, until it is removed; grace 0 removes it at once.
#[test]
fn a_pod_is_deleted_gracefully_first() {
    let api = api();
    api.put(Kind::Pod, pod("a", Some("n1"), "web"));
    api.put(Kind::Pod, pod("b", Some("n1"), "web"));
    let (code, docs) = call(
        &api,
        "DELETE",
        "/api/v1/namespaces/default/pods/a",
        "application/json",
        b"",
    );
    assert_eq!(code, 200);
    assert_eq!(docs[0]["metadata"]["deletionGracePeriodSeconds"], 30);
    let stored = api
        .get(Kind::Pod, "default", "a")
        .expect("still there, terminating");
    assert!(
        stored["metadata"]["deletionTimestamp"].is_string(),
        "{stored}"
    );
    let (code, _) = call(
        &api,
        "DELETE",
        "/api/v1/namespaces/default/pods/b",
        "application/json",
        br#"{"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}"#,
    );
    assert_eq!(code, 200);
    assert!(api.get(Kind::Pod, "default", "b").is_none());
    // A watch from before sees the terminating pod MODIFIED, then DELETED
    // once it is removed.
    api.delete(Kind::Pod, "default", "a");
    let (_, events) = get(
        &api,
        "/api/v1/pods?watch=true&resourceVersion=2&timeoutSeconds=1",
    );
    let seen: Vec<(&str, &str)> = events
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap(),
                e["object"]["metadata"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![("MODIFIED", "a"), ("DELETED", "b"), ("DELETED", "a")]
    );
}

/// Over TLS, a client with the kubeconfig's CA bundle is served; one
/// without it, or in plain HTTP, is not.
#[tokio::test]
async fn over_tls_only_a_client_with_the_ca_bundle_is_served() {
    use k8s_openapi::api::core::v1::Namespace;
    let api = FakeApi::start_tls(&Netns::current().unwrap()).unwrap();
    api.put(Kind::Namespace, json!({"metadata": {"name": "mesh"}}));
    let dir = std::env::temp_dir().join(format!("ambit-kubeapi-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kubeconfig");
    api.write_kubeconfig(&path).unwrap();
    let client = |path: std::path::PathBuf| async move {
        let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        kube::Api::<Namespace>::all(kube::Client::try_from(config).unwrap())
    };
    let ns = client(path.clone()).await.get("mesh").await.unwrap();
    assert_eq!(ns.metadata.name.as_deref(), Some("mesh"));
    let text = std::fs::read_to_string(&path).unwrap();
    let without_ca: String = text
        .lines()
        .filter(|l| !l.contains("certificate-authority-data"))
        .map(|l| format!("{l}\n"))
        .collect();
    let untrusting = dir.join("kubeconfig-without-ca");
    std::fs::write(&untrusting, without_ca).unwrap();
    let refused = client(untrusting).await.get("mesh").await;
    assert!(refused.is_err(), "a client without the CA was served");
    std::fs::remove_dir_all(&dir).unwrap();
    // Plain HTTP gets no answer from a TLS server.
    let mut s = std::net::TcpStream::connect(api.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /api/v1/namespaces HTTP/1.1\r\nhost: k\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(!String::from_utf8_lossy(&out).contains("HTTP/1.1 200"));
}
