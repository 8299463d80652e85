//! The data path while the mesh changes: connection latency through two
//! real proxies (the `ambit` binary, dedicated, in lab pods) that hold a
//! mesh of N workloads from this bench's delta xDS server, idle and while
//! one-workload updates arrive at a steady rate.
//!
//! The server stands in for istiod: a full push of the mesh (the two lab
//! pods among N workloads shaped as in the rest of this bench) on each
//! stream, then every update to every stream, one response each. A
//! connection is the lab client's: connect to the server pod's echo port
//! (captured, carried over HBONE), send a byte, read it back, close; the
//! time is from `connect` to the echo. Idle and churn phases alternate, the
//! same number of connections each.
//!
//! With `open` > 0, that many more connections from the client to another
//! port of the server pod are opened through the proxies first and held,
//! idle, through both phases: open inbound connections the server's proxy
//! re-checks at every change of the mesh, as a node's would be.

use std::net::{Ipv4Addr, SocketAddr, TcpListener as StdListener, TcpStream};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ambit::lab::{http_get, write_ca, BusyLoops, EchoServer, Lab, LabPod, ProxySpec};
use ambit::proto::discovery::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use ambit::proto::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};
use ambit::proto::workload as pb;
use prost::Message;
use tonic::{Request, Response, Status, Streaming};

use super::{percentile, resource, response, workload, ADDRESS, AUTHORIZATION};

const TD: &str = "cluster.local";
const XDS_PORT: u16 = 15010;
const ECHO_PORT: u16 = 8080;
/// Where the connections held open go.
const HELD_PORT: u16 = 8081;

/// The bench's istiod: the full push on each stream, then the updates.
#[derive(Clone)]
pub(super) struct Source {
    pub push: Arc<DeltaDiscoveryResponse>,
    pub policies: Arc<DeltaDiscoveryResponse>,
    pub updates: tokio::sync::broadcast::Sender<Arc<DeltaDiscoveryResponse>>,
}

type Out = Pin<Box<dyn futures_util::Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Source {
    type DeltaAggregatedResourcesStream = Out;

    async fn delta_aggregated_resources(
        &self,
        req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Out>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        let (push, policies) = (self.push.clone(), self.policies.clone());
        let mut updates = self.updates.subscribe();
        tokio::spawn(async move {
            loop {
                let out = tokio::select! {
                    r = inbound.message() => match r {
                        // A subscription (not an ACK): what it asks for.
                        Ok(Some(r)) if r.response_nonce.is_empty() => match r.type_url.as_str() {
                            ADDRESS => (*push).clone(),
                            _ => (*policies).clone(),
                        },
                        Ok(Some(_)) => continue,
                        _ => return,
                    },
                    u = updates.recv() => match u {
                        Ok(u) => (*u).clone(),
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(_) => return,
                    },
                };
                if tx.send(Ok(out)).await.is_err() {
                    return;
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

/// Serves `source` as the xDS server at 10.77.0.1:15010 in the lab's node
/// netns, where the pods reach it, on a runtime of its own.
pub(super) fn serve(lab: &Lab, source: Source) -> tokio::runtime::Runtime {
    // The server listens in the node's netns, where the pods reach it.
    let listener = lab
        .node
        .run(|| StdListener::bind((Ipv4Addr::new(10, 77, 0, 1), XDS_PORT)))
        .unwrap()
        .expect("bind the xDS server in the node netns");
    listener.set_nonblocking(true).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let incoming = futures_util::stream::unfold(listener, |l| async move {
            Some((l.accept().await.map(|(s, _)| s), l))
        });
        tonic::transport::Server::builder()
            .add_service(
                AggregatedDiscoveryServiceServer::new(source).max_encoding_message_size(1 << 30),
            )
            .serve_with_incoming(incoming)
            .await
    });
    runtime
}

/// A dedicated proxy for `pod` that takes its mesh from [`serve`].
pub(super) fn proxy_spec(lab: &Lab, pod: &LabPod, ca: &(PathBuf, PathBuf)) -> ProxySpec {
    let config = lab.dir.join("empty.yaml");
    std::fs::write(&config, "workloads: []\n").unwrap();
    ProxySpec {
        config,
        ca_cert: ca.0.clone(),
        ca_key: ca.1.clone(),
        workload_info: format!("default/{0}/{0}", pod.name),
        trust_domain: TD.into(),
        extra_env: vec![
            ("XDS_ADDRESS".into(), format!("http://10.77.0.1:{XDS_PORT}")),
            ("AMBIT_INSECURE_CONTROL_PLANE".into(), "true".into()),
        ],
    }
}

/// A lab pod's own workload, as istiod would send it.
pub(super) fn lab_workload(pod: &LabPod) -> Resource {
    let uid = format!("Kubernetes//Pod/default/{}", pod.name);
    let body = pb::Address {
        r#type: Some(pb::address::Type::Workload(pb::Workload {
            uid: uid.clone(),
            name: pod.name.clone(),
            namespace: "default".into(),
            addresses: vec![pod.ip.octets().to_vec()],
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            trust_domain: TD.into(),
            service_account: pod.name.clone(),
            workload_type: pb::WorkloadType::Pod as i32,
            cluster_id: "Kubernetes".into(),
            ..Default::default()
        })),
    };
    resource(ADDRESS, uid, body.encode_to_vec())
}

/// Connections from `pod` to `dst`, one after another: the time of each
/// from `connect` to its echoed byte.
fn connections(pod: &LabPod, dst: SocketAddr, n: usize) -> Vec<Duration> {
    pod.ns
        .run(move || {
            use std::io::{Read, Write};
            (0..n)
                .map(|_| {
                    let t = Instant::now();
                    let mut s = TcpStream::connect_timeout(&dst, Duration::from_secs(5))
                        .expect("connect through the proxies");
                    s.set_nodelay(true).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    s.write_all(b"x").unwrap();
                    let mut b = [0u8; 1];
                    s.read_exact(&mut b).expect("the echo");
                    t.elapsed()
                })
                .collect()
        })
        .expect("the client pod's netns")
}

/// Lets `pod`'s kernel reuse a closed connection's port once it is safe
/// (`tcp_tw_reuse`): the client app opens tens of thousands of short
/// connections a minute to one address, more than the ephemeral range
/// holds in TIME_WAIT. (Ambit's own connects to the app choose their port
/// per 4-tuple and need it as much.)
fn reuse_ports(pod: &LabPod) {
    pod.ns
        .run(|| std::fs::write("/proc/sys/net/ipv4/tcp_tw_reuse", "1"))
        .unwrap()
        .expect("tcp_tw_reuse in the pod's netns");
}

/// `istio_xds_message_total` for addresses, from `pod`'s proxy.
fn address_messages(pod: &LabPod) -> u64 {
    let (_, body) = http_get(pod, "127.0.0.1:15020", "/metrics").expect("the proxy's metrics");
    body.lines()
        .find(|l| l.starts_with("istio_xds_message_total") && l.contains("istio.workload.Address"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// `n` connections from `client` to `server`'s [`HELD_PORT`] through the
/// proxies, both ends held (nothing sent): returned once the server's
/// application has accepted every one (the server's proxy tracks each).
fn hold_open(client: &LabPod, server: &LabPod, n: usize) -> Vec<TcpStream> {
    if n == 0 {
        return Vec::new();
    }
    let listener = server
        .ns
        .run(|| StdListener::bind((Ipv4Addr::UNSPECIFIED, HELD_PORT)))
        .expect("the server pod's netns")
        .expect("the held connections' port");
    // Accepted as they come (the listen queue holds 128).
    let accepting = std::thread::spawn(move || {
        listener.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut accepted = Vec::with_capacity(n);
        while accepted.len() < n {
            match listener.accept() {
                Ok((s, _)) => accepted.push(s),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(
                        Instant::now() < deadline,
                        "{} of {n} held connections reached the server in 120 s",
                        accepted.len()
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("accepting a held connection: {e}"),
            }
        }
        accepted
    });
    let dst = SocketAddr::new(server.ip.into(), HELD_PORT);
    let mut held = client
        .ns
        .run(move || {
            (0..n)
                .map(|_| {
                    TcpStream::connect_timeout(&dst, Duration::from_secs(5))
                        .expect("connect a connection to hold")
                })
                .collect::<Vec<_>>()
        })
        .expect("the client pod's netns");
    held.extend(accepting.join().expect("the held connections' acceptor"));
    held
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The churn bench at `workloads` workloads, `rate` updates a second,
/// `open` connections held open, `load` busy loops at nice 19 through
/// both phases, `per_phase` connections in each of `rounds` idle and
/// churn phases.
pub fn latency_under_updates(
    workloads: usize,
    rate: u32,
    open: usize,
    load: usize,
    per_phase: usize,
    rounds: usize,
) {
    let services = (workloads / 10).max(1);
    println!(
        "\n== connection latency through two proxies holding {workloads} workloads, \
         idle and during {rate} updates/s =="
    );
    let binary = std::env::var("AMBIT_INGEST_BINARY")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_ambit").to_string());
    println!("proxies: {binary}");
    let mut lab = Lab::new("ingest", binary).expect("lab (run as root)");
    let ca = write_ca(&lab.dir, "ca", TD).unwrap();
    let client = lab.add_pod("client").unwrap();
    let server = lab.add_pod("server").unwrap();
    let _echo = EchoServer::start(&server, ECHO_PORT).unwrap();

    // The mesh: the two lab pods among `workloads` others.
    let mut resources: Vec<Resource> = (0..workloads)
        .map(|i| workload(i, services, "v1"))
        .map(|(name, body)| resource(ADDRESS, name, body))
        .collect();
    resources.push(lab_workload(&client));
    resources.push(lab_workload(&server));
    let (updates, _) = tokio::sync::broadcast::channel(1024);
    let source = Source {
        push: Arc::new(response(ADDRESS, resources)),
        policies: Arc::new(response(AUTHORIZATION, vec![])),
        updates: updates.clone(),
    };
    let runtime = serve(&lab, source);

    for pod in [&client, &server] {
        reuse_ports(pod);
        lab.redirect(pod).unwrap();
        let t = Instant::now();
        lab.start_proxy(pod, &proxy_spec(&lab, pod, &ca))
            .expect("proxy ready");
        println!(
            "{}'s proxy ready (full push taken) in {:.1} s",
            pod.name,
            t.elapsed().as_secs_f64()
        );
    }

    // The updater: one workload's new revision per response, at `rate`.
    let churning = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let updater = {
        let (churning, sent, stop) = (churning.clone(), sent.clone(), stop.clone());
        std::thread::spawn(move || {
            let every = Duration::from_secs(1) / rate;
            let mut next = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if churning.load(Ordering::Relaxed) {
                    let n = sent.fetch_add(1, Ordering::Relaxed) as usize;
                    let (name, body) = workload(n * 7919 % workloads, services, &format!("u{n}"));
                    let mut resp = response(ADDRESS, vec![resource(ADDRESS, name, body)]);
                    resp.nonce = format!("u{n}");
                    let _ = updates.send(Arc::new(resp));
                }
                next += every;
                match next.checked_duration_since(Instant::now()) {
                    Some(wait) => std::thread::sleep(wait),
                    None => next = Instant::now(),
                }
            }
        })
    };

    let t = Instant::now();
    let _held = hold_open(&client, &server, open);
    if open > 0 {
        println!(
            "{open} connections held open through the proxies (in {:.1} s)",
            t.elapsed().as_secs_f64()
        );
    }
    let dst = SocketAddr::new(server.ip.into(), ECHO_PORT);
    // Warm up: certificates, the pooled HBONE connection.
    connections(&client, dst, 200);
    if load > 0 {
        println!("background load: {load} busy loop(s) at nice 19 through both phases");
    }
    let busy = BusyLoops::start(load);
    let (mut idle, mut churn) = (Vec::new(), Vec::new());
    let before = (address_messages(&client), address_messages(&server));
    let mut churn_time = Duration::ZERO;
    for _ in 0..rounds {
        let quiet = connections(&client, dst, per_phase);
        let mut q = quiet.clone();
        q.sort();
        println!(
            "idle phase: p50 {:?}, p99 {:?}",
            percentile(&q, 50),
            percentile(&q, 99)
        );
        idle.extend(quiet);
        churning.store(true, Ordering::Relaxed);
        let t = Instant::now();
        churn.extend(connections(&client, dst, per_phase));
        churn_time += t.elapsed();
        churning.store(false, Ordering::Relaxed);
    }
    drop(busy);
    stop.store(true, Ordering::Relaxed);
    updater.join().unwrap();
    let sent = sent.load(Ordering::Relaxed);
    // Every update reaches both proxies (the client's is read first).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = (0, 0);
    while Instant::now() < deadline {
        got = (
            address_messages(&client) - before.0,
            address_messages(&server) - before.1,
        );
        if got.0 >= sent && got.1 >= sent {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    runtime.shutdown_background();
    idle.sort();
    churn.sort();
    let (i50, i99) = (percentile(&idle, 50), percentile(&idle, 99));
    let (c50, c99) = (percentile(&churn, 50), percentile(&churn, 99));
    println!(
        "idle: p50 {:.0} µs, p99 {:.0} µs ({} connections)",
        us(i50),
        us(i99),
        idle.len()
    );
    println!(
        "during updates: p50 {:.0} µs, p99 {:.0} µs ({} connections; {sent} updates in {:.1} s, \
         {:.0}/s; taken by the client's proxy {}, the server's {})",
        us(c50),
        us(c99),
        churn.len(),
        churn_time.as_secs_f64(),
        sent as f64 / churn_time.as_secs_f64(),
        got.0,
        got.1
    );
    // How often each proxy found its yielding thread starved and applied
    // updates at the xDS thread's priority instead (src/xds/yielding.rs).
    let starved = |pod: &LabPod| {
        std::fs::read_to_string(lab.log_path(&format!("proxy-{}", pod.name)))
            .unwrap_or_default()
            .matches("waited for a busy CPU")
            .count()
    };
    println!(
        "updates that waited for a busy CPU (each sends the next ones to the xDS thread for a while): \
         client's proxy {}, server's {}",
        starved(&client),
        starved(&server)
    );
    println!(
        "ingest: latency workloads={workloads} updates_per_s={:.0} open={open} load={load} idle_p50_us={:.0} \
         idle_p99_us={:.0} churn_p50_us={:.0} churn_p99_us={:.0} p99_ratio={:.2}",
        sent as f64 / churn_time.as_secs_f64(),
        us(i50),
        us(i99),
        us(c50),
        us(c99),
        c99.as_secs_f64() / i99.as_secs_f64()
    );
}
