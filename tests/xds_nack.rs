//! The xDS client against a scripted delta ADS server (tonic, in this test):
//! a response with one bad resource is NACKed naming it, the good ones are
//! applied; a reconnect sends `initial_resource_versions`; a huge response is
//! applied; on demand, the wire shape, resubscription and the cap.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ambit::proto::discovery::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use ambit::proto::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};
use ambit::proto::workload as pb;
use ambit::xds::client::{XdsClient, XdsConfig};
use ambit::xds::convert::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
use ambit::xds::StateHandle;
use prost::Message;
use tonic::{Request, Response, Status, Streaming};

fn workload(uid: &str, ip: Vec<u8>) -> Resource {
    let a = pb::Address {
        r#type: Some(pb::address::Type::Workload(pb::Workload {
            uid: uid.into(),
            name: uid.into(),
            namespace: "ns".into(),
            addresses: vec![ip],
            tunnel_protocol: 1,
            ..Default::default()
        })),
    };
    Resource {
        name: uid.into(),
        version: "v1".into(),
        resource: Some(prost_types::Any {
            type_url: ADDRESS_TYPE.into(),
            value: a.encode_to_vec(),
        }),
        aliases: vec![],
    }
}

/// What a scripted server does with one request.
enum Step {
    Answer(DeltaDiscoveryResponse),
    Quiet,
    HangUp,
}

type Script = Box<dyn FnMut(&DeltaDiscoveryRequest) -> Step + Send>;

/// A delta ADS server that records every request (`seen`) and runs a fresh
/// script on each stream, so a script can keep state for its stream.
#[derive(Clone)]
struct Scripted {
    seen: Arc<Mutex<Vec<DeltaDiscoveryRequest>>>,
    per_stream: Arc<dyn Fn() -> Script + Send + Sync>,
}

impl Scripted {
    fn new<F>(per_stream: impl Fn() -> F + Send + Sync + 'static) -> Self
    where
        F: FnMut(&DeltaDiscoveryRequest) -> Step + Send + 'static,
    {
        Scripted {
            seen: Arc::default(),
            per_stream: Arc::new(move || Box::new(per_stream()) as Script),
        }
    }

    fn server(&self) -> AggregatedDiscoveryServiceServer<Scripted> {
        AggregatedDiscoveryServiceServer::new(self.clone())
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Scripted {
    type DeltaAggregatedResourcesStream =
        Pin<Box<dyn futures_util::Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

    async fn delta_aggregated_resources(
        &self,
        req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let mut inbound = req.into_inner();
        let (seen, mut script) = (self.seen.clone(), (self.per_stream)());
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        tokio::spawn(async move {
            while let Ok(Some(r)) = inbound.message().await {
                seen.lock().unwrap().push(r.clone());
                match script(&r) {
                    Step::Answer(resp) => {
                        if tx.send(Ok(resp)).await.is_err() {
                            break;
                        }
                    }
                    Step::Quiet => {}
                    Step::HangUp => break,
                }
            }
        });
        let out =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        Ok(Response::new(Box::pin(out)))
    }
}

/// Answers an on-demand stream: each named subscription (not `*`) gets one
/// response, with the resources `found` gives and the other names removed.
fn answer_names(
    r: &DeltaDiscoveryRequest,
    nonce: &mut u64,
    found: impl Fn(&str) -> Option<Resource>,
) -> DeltaDiscoveryResponse {
    let (mut resources, mut removed_resources) = (Vec::new(), Vec::new());
    for name in r.resource_names_subscribe.iter().filter(|n| *n != "*") {
        match found(name) {
            Some(res) => resources.push(res),
            None => removed_resources.push(name.clone()),
        }
    }
    *nonce += 1;
    DeltaDiscoveryResponse {
        type_url: r.type_url.clone(),
        nonce: nonce.to_string(),
        resources,
        removed_resources,
        ..Default::default()
    }
}

/// Waits until `client` has a stream open and `server` has its first request.
async fn until_connected(client: &XdsClient, server: &Scripted) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !client.connected() || server.seen.lock().unwrap().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "no stream");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 20 s) for a request after the first one that matches
/// `wanted`: a NACK, or a reconnect's opening request.
async fn later_request(
    server: &Scripted,
    wanted: impl Fn(&DeltaDiscoveryRequest) -> bool,
) -> DeltaDiscoveryRequest {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let found = server
            .seen
            .lock()
            .unwrap()
            .iter()
            .skip(1)
            .find(|r| wanted(r))
            .cloned();
        if let Some(r) = found {
            return r;
        }
        assert!(tokio::time::Instant::now() < deadline, "no such request");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Serves `svc` on a fresh loopback port and starts an xDS client against it;
/// returns the client's state and its task.
async fn serve_and_connect<S>(
    svc: AggregatedDiscoveryServiceServer<S>,
) -> (StateHandle, tokio::task::JoinHandle<()>)
where
    S: AggregatedDiscoveryService,
{
    let (state, _, task) = serve_and_connect_with(svc, false).await;
    (state, task)
}

/// Like [`serve_and_connect`], also returning the client; `on_demand` as `XDS_ON_DEMAND`.
async fn serve_and_connect_with<S>(
    svc: AggregatedDiscoveryServiceServer<S>,
    on_demand: bool,
) -> (StateHandle, Arc<XdsClient>, tokio::task::JoinHandle<()>)
where
    S: AggregatedDiscoveryService,
{
    let cfg = XdsConfig {
        on_demand,
        ..serve(svc).await
    };
    let state = StateHandle::default();
    let client = XdsClient::new(cfg, state.clone());
    let task = tokio::spawn(client.clone().run());
    (state, client, task)
}

/// Serves `svc` on a fresh loopback port; a client config for it.
async fn serve<S>(svc: AggregatedDiscoveryServiceServer<S>) -> XdsConfig
where
    S: AggregatedDiscoveryService,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = futures_util::stream::unfold(listener, |l| async move {
        Some((l.accept().await.map(|(s, _)| s), l))
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(incoming),
    );
    XdsConfig {
        address: format!("http://{addr}"),
        root_ca: None,
        token: None,
        cluster_id: "Kubernetes".into(),
        node_id: "ztunnel~10.0.0.9~ambit.istio-system~istio-system.svc.cluster.local".into(),
        metadata: vec![],
        mark: 1337,
        on_demand: false,
        on_demand_wait: Duration::from_secs(2),
        max_message_size: 256 << 20,
    }
}

/// One response with a good and a broken workload; hangs up after the NACK,
/// and at once on a later subscription of the same stream.
fn nack_script() -> Scripted {
    Scripted::new(|| {
        let mut sent = false;
        move |r: &DeltaDiscoveryRequest| {
            let first_address_sub = r.type_url == ADDRESS_TYPE && r.response_nonce.is_empty();
            if r.response_nonce == "n1" {
                // End this stream after the NACK: the client must reconnect.
                return Step::HangUp;
            }
            match (first_address_sub, sent) {
                (true, false) => {
                    sent = true;
                    Step::Answer(DeltaDiscoveryResponse {
                        type_url: ADDRESS_TYPE.into(),
                        nonce: "n1".into(),
                        resources: vec![
                            workload("good", vec![10, 0, 0, 1]),
                            workload("broken", vec![10, 0]),
                        ],
                        ..Default::default()
                    })
                }
                (true, true) => Step::HangUp,
                _ => Step::Quiet,
            }
        }
    })
}

#[tokio::test]
async fn bad_resource_is_nacked_by_name_and_the_rest_applied_and_reconnect_sends_versions() {
    let script = nack_script();
    let (state, task) = serve_and_connect(script.server()).await;

    // The first request never answers a nonce: a later one is the NACK.
    let nack = later_request(&script, |r| r.response_nonce == "n1").await;
    let err = nack.error_detail.expect("a NACK");
    assert!(
        err.message.contains("broken") && !err.message.contains("good"),
        "{}",
        err.message
    );
    assert!(
        state
            .load()
            .workload_by_addr("", "10.0.0.1".parse().unwrap())
            .is_some(),
        "the good resource is applied"
    );
    let first = script.seen.lock().unwrap()[0].clone();
    assert!(
        first.node.unwrap().id.starts_with("ztunnel~"),
        "Istio's node id"
    );

    // The server ended the stream after the NACK; the client reconnects and says what it holds.
    let r = later_request(&script, |r| {
        r.type_url == ADDRESS_TYPE && r.response_nonce.is_empty()
    })
    .await;
    assert_eq!(
        r.initial_resource_versions.get("good").map(String::as_str),
        Some("v1"),
        "{:?}",
        r.initial_resource_versions
    );
    assert!(
        !r.initial_resource_versions.contains_key("broken"),
        "rejected resources are not claimed"
    );
    assert!(
        state
            .load()
            .workload_by_addr("", "10.0.0.1".parse().unwrap())
            .is_some(),
        "last good state kept across the outage"
    );
    task.abort();
}

/// First an Address response with a resource that cannot be read and one
/// whose uid another already claims, then an empty Authorization push and
/// an Address push that carry neither.
fn later_pushes_script() -> Scripted {
    Scripted::new(|| {
        let mut sent = false;
        move |r: &DeltaDiscoveryRequest| {
            if r.type_url == ADDRESS_TYPE && r.response_nonce.is_empty() && !sent {
                sent = true;
                return Step::Answer(DeltaDiscoveryResponse {
                    type_url: ADDRESS_TYPE.into(),
                    nonce: "n1".into(),
                    resources: vec![
                        workload("good", vec![10, 0, 0, 1]),
                        workload("broken", vec![10, 0]),
                        Resource {
                            name: "again".into(),
                            ..workload("good", vec![10, 0, 0, 2])
                        },
                    ],
                    ..Default::default()
                });
            }
            match r.response_nonce.as_str() {
                "n1" => Step::Answer(DeltaDiscoveryResponse {
                    type_url: AUTHORIZATION_TYPE.into(),
                    nonce: "n2".into(),
                    ..Default::default()
                }),
                "n2" => Step::Answer(DeltaDiscoveryResponse {
                    type_url: ADDRESS_TYPE.into(),
                    nonce: "n3".into(),
                    resources: vec![workload("later", vec![10, 0, 0, 3])],
                    ..Default::default()
                }),
                _ => Step::Quiet,
            }
        }
    })
}

#[tokio::test]
async fn a_push_after_a_refusal_is_acked_while_the_refusal_is_held() {
    let script = later_pushes_script();
    let (state, task) = serve_and_connect(script.server()).await;
    let nack = later_request(&script, |r| r.response_nonce == "n1").await;
    let err = nack
        .error_detail
        .expect("the response with refusals is NACKed");
    assert!(
        err.message.contains("broken:") && err.message.contains("again:"),
        "{}",
        err.message
    );
    // istiod reads a NACK as this proxy's view being stale: pushes that
    // carry nothing refused must be ACKed.
    for nonce in ["n2", "n3"] {
        let reply = later_request(&script, |r| r.response_nonce == nonce).await;
        assert_eq!(reply.error_detail, None, "the push {nonce} is ACKed");
    }
    let st = state.load();
    assert!(st
        .workload_by_addr("", "10.0.0.3".parse().unwrap())
        .is_some());
    assert!(
        st.workload_by_addr("", "10.0.0.2".parse().unwrap())
            .is_none(),
        "the refused resource stays out"
    );
    task.abort();
}

/// `n` workloads, each with a long uid.
fn big_script_resources(n: usize) -> Vec<Resource> {
    (0..n)
        .map(|i| {
            let ip = (0x0a00_0000u32 + i as u32).to_be_bytes().to_vec();
            let mut res = workload(&format!("w{i}-{}", "x".repeat(300)), ip);
            res.name = format!("w{i}");
            res
        })
        .collect()
}

/// Serves one response of `n` workloads, each with a long name.
fn big_script(n: usize) -> Scripted {
    Scripted::new(move || {
        move |r: &DeltaDiscoveryRequest| {
            if r.type_url != ADDRESS_TYPE || !r.response_nonce.is_empty() {
                return Step::Quiet;
            }
            let resources = big_script_resources(n);
            Step::Answer(DeltaDiscoveryResponse {
                type_url: ADDRESS_TYPE.into(),
                nonce: "big".into(),
                resources,
                ..Default::default()
            })
        }
    })
}

#[tokio::test]
async fn a_response_of_tens_of_megabytes_is_applied() {
    let n = 50_000;
    let (state, task) =
        serve_and_connect(big_script(n).server().max_encoding_message_size(256 << 20)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while state.load().workloads().count() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "large response not applied"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let size = workload(&format!("w0-{}", "x".repeat(300)), vec![10, 0, 0, 0]).encoded_len() * n;
    assert!(size > 15 << 20, "the response is tens of MB ({size} bytes)");
    task.abort();
}

/// On its first stream: one workload, then (once that is ACKed) a response
/// of `big` workloads; on every later stream, one more workload.
fn oversize_script(big: usize) -> Scripted {
    let streams = Arc::new(Mutex::new(0));
    Scripted::new(move || {
        let stream = {
            let mut n = streams.lock().unwrap();
            *n += 1;
            *n
        };
        move |r: &DeltaDiscoveryRequest| {
            if r.type_url != ADDRESS_TYPE {
                return Step::Quiet;
            }
            let resources = match (stream, r.response_nonce.as_str()) {
                (1, "") => vec![workload("good", vec![10, 0, 0, 1])],
                (1, "n1") => big_script_resources(big),
                (_, "") => vec![workload("later", vec![10, 0, 0, 2])],
                _ => return Step::Quiet,
            };
            let nonce = if resources.len() > 1 { "big" } else { "n1" };
            Step::Answer(DeltaDiscoveryResponse {
                type_url: ADDRESS_TYPE.into(),
                nonce: nonce.into(),
                resources,
                ..Default::default()
            })
        }
    })
}

#[tokio::test]
async fn a_response_over_the_size_limit_ends_the_stream_and_the_last_state_keeps_serving() {
    let script = oversize_script(20_000);
    let cfg = XdsConfig {
        max_message_size: 4 << 20,
        ..serve(script.server().max_encoding_message_size(256 << 20)).await
    };
    let state = StateHandle::default();
    let client = XdsClient::new(cfg, state.clone());
    client.clone().spawn_on_own_thread().unwrap();
    // The reconnect says what this proxy holds: the first workload, and
    // nothing of the response it could not take.
    let again = later_request(&script, |r| {
        r.type_url == ADDRESS_TYPE && !r.initial_resource_versions.is_empty()
    })
    .await;
    let held: Vec<&String> = again.initial_resource_versions.keys().collect();
    assert_eq!(held, ["good"], "the reconnect's versions");
    assert!(
        !script
            .seen
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.response_nonce == "big"),
        "the oversized response is neither ACKed nor NACKed"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let st = state.load();
        if st
            .workload_by_addr("", "10.0.0.2".parse().unwrap())
            .is_some()
        {
            assert!(st
                .workload_by_addr("", "10.0.0.1".parse().unwrap())
                .is_some());
            assert_eq!(st.workloads().count(), 2, "nothing of the big response");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no later push applied"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut text = String::new();
    let mut registry = prometheus_client::registry::Registry::default();
    client.metrics.register(&mut registry);
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains(r#"istio_xds_connection_terminations_total{reason="Error"} 1"#),
        "{text}"
    );
}

/// The proxy's runtime keeps its pace while a push of tens of megabytes is
/// decoded and applied: the client does that on a thread of its own. This
/// test's runtime has one thread, as a worker would be held.
#[tokio::test]
async fn a_large_push_is_taken_off_the_proxy_s_runtime() {
    let n = 50_000;
    // The server (encoding tens of megabytes) runs on a runtime of its own.
    let server = tokio::runtime::Runtime::new().unwrap();
    let svc = big_script(n).server().max_encoding_message_size(256 << 20);
    let cfg = server.spawn(serve(svc)).await.unwrap();
    let state = StateHandle::default();
    let client = XdsClient::new(cfg, state.clone());
    client.clone().spawn_on_own_thread().unwrap();
    let started = tokio::time::Instant::now();
    let mut last = std::time::Instant::now();
    let mut longest = Duration::ZERO;
    while state.load().workloads().count() < n {
        assert!(started.elapsed() < Duration::from_secs(120), "not applied");
        tokio::time::sleep(Duration::from_millis(1)).await;
        longest = longest.max(last.elapsed());
        last = std::time::Instant::now();
    }
    let took = started.elapsed();
    // The test means something only if the push took far longer than the
    // gap allowed.
    assert!(took > Duration::from_millis(500), "the push took {took:?}");
    assert!(
        longest < Duration::from_millis(100),
        "this runtime stalled {longest:?} while the push of {took:?} was taken"
    );
    server.shutdown_background();
}

/// Answers on-demand names: `/10.0.0.1` with a workload (by alias), any
/// other as removed; ends the stream after its first answer is ACKed so the
/// client must reconnect.
fn on_demand_script() -> Scripted {
    Scripted::new(|| {
        let mut nonce = 0;
        move |r: &DeltaDiscoveryRequest| {
            if !r.response_nonce.is_empty() && r.resource_names_subscribe.is_empty() {
                if r.type_url == ADDRESS_TYPE && r.response_nonce != "1" {
                    return Step::HangUp; // an answer was ACKed
                }
                return Step::Quiet;
            }
            Step::Answer(answer_names(r, &mut nonce, |name| {
                (name == "/10.0.0.1").then(|| {
                    let mut w = workload("w1", vec![10, 0, 0, 1]);
                    w.aliases = vec![name.to_string()];
                    w
                })
            }))
        }
    })
}

#[tokio::test]
async fn on_demand_opts_out_of_the_wildcard_fetches_by_name_and_resubscribes_after_reconnect() {
    let script = on_demand_script();
    let (state, client, task) = serve_and_connect_with(script.server(), true).await;
    until_connected(&client, &script).await;
    let first = script.seen.lock().unwrap()[0].clone();
    assert_eq!(first.type_url, ADDRESS_TYPE);
    // istiod reads an empty subscribe list as the wildcard: `*` in both lists opts out.
    assert_eq!(first.resource_names_subscribe, ["*"], "no names yet");
    assert_eq!(first.resource_names_unsubscribe, ["*"], "not the wildcard");

    assert!(
        client
            .fetch("/10.0.0.1".into(), Duration::from_secs(5))
            .await,
        "answered"
    );
    assert!(
        state
            .load()
            .workload_by_addr("", "10.0.0.1".parse().unwrap())
            .is_some(),
        "the answer is in the state when fetch returns"
    );
    assert!(
        client
            .fetch("/10.0.0.1".into(), Duration::from_secs(5))
            .await
    );
    let asked = script
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|r| {
            r.resource_names_subscribe
                .contains(&"/10.0.0.1".to_string())
        })
        .count();
    assert_eq!(asked, 1, "a fresh answer is not asked for again");

    // The server hung up after that answer: the next stream asks again for
    // what was subscribed, and an unknown name is answered as such.
    assert!(
        client
            .fetch("/10.0.0.7".into(), Duration::from_secs(20))
            .await,
        "an unknown name is answered, on the new stream if need be"
    );
    let r = later_request(&script, |r| r.type_url == ADDRESS_TYPE && r.node.is_some()).await;
    assert!(
        r.resource_names_subscribe
            .contains(&"/10.0.0.1".to_string()),
        "{:?}",
        r.resource_names_subscribe
    );
    assert_eq!(r.resource_names_unsubscribe, ["*"]);
    task.abort();
}

/// Answers every subscribed name as unknown (removed), and keeps the stream.
fn all_unknown_script() -> Scripted {
    Scripted::new(|| {
        let mut nonce = 0;
        move |r: &DeltaDiscoveryRequest| {
            let named = r.resource_names_subscribe.iter().any(|n| n != "*");
            if !r.response_nonce.is_empty() && !named {
                return Step::Quiet; // an ACK
            }
            Step::Answer(answer_names(r, &mut nonce, |_| None))
        }
    })
}

#[tokio::test]
async fn at_the_cap_on_demand_unsubscribes_the_oldest_unknown_names_in_one_batch() {
    use ambit::xds::client::MAX_DEMANDED;
    let script = all_unknown_script();
    let (_state, client, task) = serve_and_connect_with(script.server(), true).await;
    until_connected(&client, &script).await;
    // Fill the cap with external addresses, all answered "unknown".
    let name = |i: usize| format!("/10.1.{}.{}", i / 256, i % 256);
    for i in 0..MAX_DEMANDED {
        client.fetch(name(i), Duration::ZERO).await;
    }
    assert!(
        client
            .fetch(name(MAX_DEMANDED - 1), Duration::from_secs(20))
            .await,
        "the last (and so every) name answered"
    );
    // One more address makes room: the oldest unknown names go, in one request.
    assert!(
        client
            .fetch("/10.2.0.1".into(), Duration::from_secs(20))
            .await,
        "a new address is still asked about at the cap"
    );
    let seen = script.seen.lock().unwrap();
    let evicting = seen
        .iter()
        .find(|r| r.resource_names_unsubscribe.len() > 1)
        .expect("an unsubscribe request");
    assert_eq!(evicting.resource_names_unsubscribe.len(), MAX_DEMANDED / 16);
    assert_eq!(
        evicting.resource_names_unsubscribe[0],
        name(0),
        "oldest first"
    );
    assert!(evicting
        .resource_names_subscribe
        .contains(&"/10.2.0.1".to_string()));
    task.abort();
}
