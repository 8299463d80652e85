//! The DNS proxy (port 15053 in each pod, UDP and TCP): answers A/AAAA for
//! mesh service hostnames from the state — full names, wildcard hosts
//! (`*.example.com`) and Kubernetes short forms with the pod's search
//! domains; headless services answer with their endpoints, in the
//! service's families only — and forwards everything else (a ServiceEntry
//! host without a VIP included) to the node's resolvers, from
//! inside the pod's netns with the pod mark. Parsing and building messages is
//! hickory-proto's; a packet it cannot parse gets FORMERR (or is dropped when
//! not even the header is there).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::pod::{PodRef, SocketFactory};
use crate::limits::ConnectionCap;
use crate::xds::{best_service, State, StateHandle};

/// TTL of the answers the proxy makes itself.
pub const TTL: u32 = 30;
/// How long an upstream resolver has to answer.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);
/// Forwarded queries one pod may have in flight; past it, UDP queries are
/// dropped (the stub resolver retries) and a TCP connection is closed. Bounds
/// what a pod flooding names the upstreams do not answer can take from a
/// proxy that serves every pod of the node; mesh names, answered from the
/// state, do not count.
pub const MAX_IN_FLIGHT: usize = 256;
/// How long a TCP client has to send the next message, or the rest of one.
const TCP_IDLE: Duration = Duration::from_secs(10);
/// TCP connections one pod may hold open; more are closed at once.
pub const MAX_TCP_CONNECTIONS: usize = crate::limits::caps::DNS_TCP;

/// What to do with one query.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// Send these bytes back.
    Answer(Vec<u8>),
    /// Not a mesh name: pass the query to the upstream resolvers.
    Forward,
    /// Not even a DNS header: say nothing.
    Drop,
}

/// Where a query comes from: the pod's namespace and the cluster's DNS
/// domain give its search domains (`<ns>.svc.<cd>`, `svc.<cd>`, `<cd>`).
#[derive(Debug, Clone, Copy)]
pub struct Asker<'a> {
    pub namespace: &'a str,
    pub cluster_domain: &'a str,
}

/// Names a query may mean, in order: the name as asked; the name with one
/// of the pod's search domains taken off (a stub resolver appends them, so
/// `db.example.com.shop.svc.cluster.local` may be a ServiceEntry host); and
/// each of those completed with the search domains (Kubernetes short forms).
fn candidates(name: &str, asker: Asker<'_>) -> Vec<String> {
    let cd = asker.cluster_domain;
    let search = [
        format!("{}.svc.{cd}", asker.namespace),
        format!("svc.{cd}"),
        cd.to_string(),
    ];
    let mut bases = vec![name.to_string()];
    for s in &search {
        if let Some(stripped) = name
            .strip_suffix(s.as_str())
            .and_then(|n| n.strip_suffix('.'))
        {
            if !stripped.is_empty() {
                bases.push(stripped.to_string());
            }
        }
    }
    let mut out: Vec<String> = Vec::new();
    for b in bases {
        let mut forms = vec![b.clone()];
        if !b.ends_with(cd) {
            forms.push(format!("{b}.{}", search[0]));
            forms.push(format!("{b}.{}", search[1]));
        }
        for f in forms {
            if !out.contains(&f) {
                out.push(f);
            }
        }
    }
    out
}

/// `name` and the wildcards that cover it, most specific first:
/// `www.example.com`, `*.example.com`, `*.com` (as ztunnel tries them).
fn wildcards(name: &str) -> Vec<String> {
    let mut out = vec![name.to_string()];
    let mut rest = name;
    while let Some((_, parent)) = rest.split_once('.') {
        out.push(format!("*.{parent}"));
        rest = parent;
    }
    out
}

/// Addresses of the mesh service `name` means, or `None` if it is not one.
/// A service without a VIP answers only if it is a Kubernetes headless
/// service (a hostname under `svc.<cluster domain>`, answered with its
/// endpoints); a ServiceEntry host without one is left to the upstream
/// resolvers, as ztunnel leaves it. Only the families the service has
/// are answered.
fn lookup(state: &State, name: &str, asker: Asker<'_>) -> Option<Vec<IpAddr>> {
    let namespace = asker.namespace;
    let kube_domain = format!(".svc.{}", asker.cluster_domain);
    for candidate in candidates(name, asker) {
        for host in wildcards(&candidate) {
            // Several namespaces may define the hostname: the client's own
            // first, else the canonical one, else the first (as ztunnel picks).
            let answerable = state
                .services_named(&host)
                .filter(|s| !s.vips.is_empty() || s.hostname.ends_with(&kube_domain));
            let Some(svc) = best_service(answerable, Some(namespace)) else {
                continue;
            };
            let mut ips: Vec<IpAddr> = if svc.vips.is_empty() {
                // Headless: the endpoints themselves.
                state
                    .healthy_endpoints(svc)
                    .flat_map(|e| e.workload.workload_ips.iter().copied())
                    .collect()
            } else {
                svc.vips.iter().map(|v| v.address).collect()
            };
            ips.retain(|ip| svc.ip_families.is_none_or(|f| f.admits(*ip)));
            ips.sort();
            ips.dedup();
            return Some(ips);
        }
    }
    None
}

/// Decides one query (pure: reads only `state`).
pub fn reply(packet: &[u8], state: &State, asker: Asker<'_>) -> Reply {
    let formerr = |id| {
        Message::error_msg(id, OpCode::Query, ResponseCode::FormErr)
            .to_vec()
            .map(Reply::Answer)
            .unwrap_or(Reply::Drop)
    };
    if packet.len() < 12 {
        return Reply::Drop;
    }
    let id = u16::from_be_bytes([packet[0], packet[1]]);
    let Ok(req) = Message::from_vec(packet) else {
        return formerr(id);
    };
    if req.message_type() != MessageType::Query
        || req.op_code() != OpCode::Query
        || req.queries().len() != 1
    {
        return formerr(id);
    }
    let q = &req.queries()[0];
    let name = q.name().to_lowercase().to_ascii();
    let name = name.trim_end_matches('.');
    let Some(ips) = lookup(state, name, asker) else {
        return Reply::Forward;
    };
    let mut resp = Message::new();
    resp.set_id(id)
        .set_message_type(MessageType::Response)
        .set_op_code(OpCode::Query)
        .set_authoritative(true)
        .set_recursion_desired(req.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(ResponseCode::NoError)
        .add_query(q.clone());
    for ip in ips {
        let rdata = match (q.query_type(), ip) {
            (RecordType::A, IpAddr::V4(v4)) => RData::A(A(v4)),
            (RecordType::AAAA, IpAddr::V6(v6)) => RData::AAAA(AAAA(v6)),
            _ => continue,
        };
        resp.add_answer(Record::from_rdata(q.name().clone(), TTL, rdata));
    }
    resp.to_vec()
        .map(Reply::Answer)
        .unwrap_or_else(|_| formerr(id))
}

/// The DNS proxy of one pod.
pub struct DnsProxy {
    pub pod: PodRef,
    pub state: StateHandle,
    pub upstreams: Arc<Vec<SocketAddr>>,
    pub metrics: Arc<super::metrics::Metrics>,
    /// The cluster's DNS domain (`cluster_domain`).
    cluster_domain: Arc<str>,
    /// [`MAX_IN_FLIGHT`] permits.
    in_flight: tokio::sync::Semaphore,
    /// [`MAX_TCP_CONNECTIONS`] permits.
    tcp_connections: ConnectionCap,
    /// Whether a limit has been hit and said.
    warned_full: std::sync::atomic::AtomicBool,
}

impl DnsProxy {
    pub fn new(
        pod: PodRef,
        state: StateHandle,
        upstreams: Arc<Vec<SocketAddr>>,
        metrics: Arc<super::metrics::Metrics>,
        cluster_domain: Arc<str>,
    ) -> Self {
        DnsProxy {
            pod,
            cluster_domain,
            state,
            upstreams,
            metrics,
            in_flight: tokio::sync::Semaphore::new(MAX_IN_FLIGHT),
            tcp_connections: ConnectionCap::new("dns_tcp", MAX_TCP_CONNECTIONS),
            warned_full: Default::default(),
        }
    }

    async fn resolve(&self, packet: Vec<u8>) -> Option<Vec<u8>> {
        let by = |who| super::metrics::DnsLabels { answered_by: who };
        let asker = Asker {
            namespace: &self.pod.namespace,
            cluster_domain: &self.cluster_domain,
        };
        match reply(&packet, &self.state.load(), asker) {
            Reply::Answer(bytes) => {
                self.metrics.dns_requests.get_or_create(&by("proxy")).inc();
                Some(bytes)
            }
            Reply::Drop => None,
            Reply::Forward => {
                // Only forwarded queries wait on the network, so only they
                // count: mesh names stay answered while upstreams are slow.
                let Ok(_permit) = self.in_flight.try_acquire() else {
                    self.warn_full("forwarded queries in flight", MAX_IN_FLIGHT);
                    return None;
                };
                self.metrics
                    .dns_requests
                    .get_or_create(&by("upstream"))
                    .inc();
                let answer = self.forward(&packet).await;
                if answer.is_none() {
                    self.metrics.dns_upstream_failures.inc();
                }
                answer
            }
        }
    }

    /// Asks each upstream in turn, from the pod's netns with the pod mark.
    async fn forward(&self, packet: &[u8]) -> Option<Vec<u8>> {
        exchange(&self.pod.sockets, &self.upstreams, packet).await
    }

    /// Says, once per pod, that a limit is hit and more is being dropped.
    fn warn_full(&self, what: &str, limit: usize) {
        if !self
            .warned_full
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(pod = %self.pod.uid, what, limit, "DNS proxy at a limit; dropping more (said once per pod)");
        }
    }

    /// Serves UDP on `sock` until the pod stops.
    pub async fn serve_udp(self: Arc<Self>, sock: tokio::net::UdpSocket) {
        let sock = Arc::new(sock);
        let life = self.pod.life.clone();
        loop {
            let got = tokio::select! {
                r = datagram(&sock, |s, buf| s.try_recv_from(buf)) => r,
                _ = life.stop_listening() => return,
            };
            let Ok((packet, from)) = got else { continue };
            let (this, sock) = (self.clone(), sock.clone());
            life.spawn(async move {
                if let Some(resp) = this.resolve(packet).await {
                    let _ = sock.send_to(&resp, from).await;
                }
            });
        }
    }

    /// Serves TCP (2-byte length prefix per message) on `listener` until the pod stops.
    pub async fn serve_tcp(self: Arc<Self>, listener: tokio::net::TcpListener) {
        let life = self.pod.life.clone();
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = life.stop_listening() => return,
            };
            let Ok((mut stream, peer)) = accepted else {
                continue;
            };
            let Some(held) = self.tcp_connections.admit(peer.ip()) else {
                continue; // dropped: closed
            };
            let this = self.clone();
            life.spawn(async move {
                let _held = held;
                loop {
                    let len = match tokio::time::timeout(TCP_IDLE, stream.read_u16()).await {
                        Ok(Ok(len)) => len as usize,
                        _ => return,
                    };
                    let mut packet = vec![0u8; len];
                    match tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut packet)).await {
                        Ok(Ok(_)) => {}
                        _ => return,
                    }
                    let Some(resp) = this.resolve(packet).await else {
                        return;
                    };
                    let Ok(len) = u16::try_from(resp.len()) else {
                        return;
                    };
                    if stream.write_u16(len).await.is_err()
                        || stream.write_all(&resp).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    }
}

/// The largest a UDP datagram can be.
const MAX_DATAGRAM: usize = 65_535;

thread_local! {
    /// Where a datagram lands before it is copied out at its own size: no
    /// await comes between, so one buffer per thread serves every socket.
    static DATAGRAM: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0; MAX_DATAGRAM].into_boxed_slice());
}

/// Waits for a datagram on `sock` and returns a copy of it at its own size,
/// with what `recv` says besides (the sender). It is read into this
/// thread's buffer, so a socket waiting for one holds none: each pod's DNS
/// listeners held 64 KiB each for the pod's life before (2026-12-01).
pub(super) async fn datagram<T>(
    sock: &tokio::net::UdpSocket,
    recv: impl Fn(&tokio::net::UdpSocket, &mut [u8]) -> std::io::Result<(usize, T)>,
) -> std::io::Result<(Vec<u8>, T)> {
    loop {
        sock.readable().await?;
        let got =
            DATAGRAM.with_borrow_mut(|buf| recv(sock, buf).map(|(n, t)| (buf[..n].to_vec(), t)));
        match got {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

/// Sends `packet` to each upstream resolver in turn, from inside the pod's
/// netns with the pod mark, and returns the first answer (within
/// [`UPSTREAM_TIMEOUT`] each). Shared by the DNS proxy and on-demand DNS.
pub(super) async fn exchange(
    sockets: &SocketFactory,
    upstreams: &[SocketAddr],
    packet: &[u8],
) -> Option<Vec<u8>> {
    for upstream in upstreams {
        let Ok(sock) = sockets.udp(*upstream, true) else {
            continue;
        };
        if sock.send(packet).await.is_err() {
            continue;
        }
        // A query waiting on a slow upstream holds no buffer.
        let reply = async {
            datagram(&sock, |s, buf| s.try_recv(buf).map(|n| (n, ())))
                .await
                .map(|(reply, ())| reply)
        };
        if let Ok(Ok(buf)) = tokio::time::timeout(UPSTREAM_TIMEOUT, reply).await {
            return Some(buf);
        }
        tracing::debug!(upstream = %upstream, "DNS upstream did not answer");
    }
    None
}

/// The node's resolvers from a resolv.conf text.
pub fn resolv_conf_servers(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|ip| ip.trim().parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::Name;
    use std::path::Path;

    fn state() -> State {
        crate::xds::local::parse(
            Path::new("t.yaml"),
            r#"
workloads:
- {name: db-0, namespace: data, workloadIps: [10.0.0.7], protocol: HBONE, services: {"data/db.data.svc.cluster.local": {5432: 5432}}}
services:
- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: ["/10.96.0.10", "/fd00::10"], ports: {80: 8080}}
- {name: db, namespace: data, hostname: db.data.svc.cluster.local, ports: {5432: 5432}}
"#,
        )
        .unwrap()
    }

    fn at(namespace: &str) -> Asker<'_> {
        Asker {
            namespace,
            cluster_domain: "cluster.local",
        }
    }

    fn query(name: &str, ty: RecordType) -> Vec<u8> {
        let mut m = Message::new();
        m.set_id(4242)
            .set_recursion_desired(true)
            .add_query(Query::query(Name::from_ascii(name).unwrap(), ty));
        m.to_vec().unwrap()
    }

    fn answers(r: Reply) -> Vec<String> {
        match r {
            Reply::Answer(b) => {
                let m = Message::from_vec(&b).unwrap();
                assert_eq!(m.id(), 4242);
                m.answers().iter().map(|a| a.data().to_string()).collect()
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn full_and_short_names_of_mesh_services() {
        let st = state();
        assert_eq!(
            answers(reply(
                &query("echo.default.svc.cluster.local.", RecordType::A),
                &st,
                at("default")
            )),
            ["10.96.0.10"]
        );
        assert_eq!(
            answers(reply(&query("echo.", RecordType::A), &st, at("default"))),
            ["10.96.0.10"],
            "short name in the pod's namespace"
        );
        assert_eq!(
            answers(reply(
                &query("echo.default.", RecordType::AAAA),
                &st,
                at("other")
            )),
            ["fd00::10"]
        );
        assert_eq!(
            answers(reply(
                &query("ECHO.default.svc.cluster.local.", RecordType::A),
                &st,
                at("x")
            )),
            ["10.96.0.10"],
            "case-insensitive"
        );
        assert_eq!(
            answers(reply(
                &query("db.data.svc.cluster.local.", RecordType::A),
                &st,
                at("x")
            )),
            ["10.0.0.7"],
            "headless: endpoints"
        );
        assert!(
            answers(reply(
                &query("db.data.svc.cluster.local.", RecordType::AAAA),
                &st,
                at("x")
            ))
            .is_empty(),
            "NODATA, not forwarded"
        );
    }

    #[test]
    fn search_expanded_names_and_another_cluster_domain() {
        let st = crate::xds::local::parse(
            Path::new("se.yaml"),
            r#"
services:
- {name: db, namespace: shop, hostname: db.example.com, vips: ["/10.96.0.70"], ports: {5432: 5432}}
- {name: web, namespace: shop, hostname: web.shop.svc.corp.internal, vips: ["/10.96.0.71"], ports: {80: 80}}
"#,
        )
        .unwrap();
        // A stub resolver appends the pod's search domains to a ServiceEntry host.
        for expanded in [
            "db.example.com.shop.svc.cluster.local.",
            "db.example.com.svc.cluster.local.",
            "db.example.com.cluster.local.",
        ] {
            assert_eq!(
                answers(reply(&query(expanded, RecordType::A), &st, at("shop"))),
                ["10.96.0.70"],
                "{expanded}"
            );
        }
        // A name that is not the mesh's, expanded or not, is forwarded.
        let other = query("www.example.org.shop.svc.cluster.local.", RecordType::A);
        assert_eq!(reply(&other, &st, at("shop")), Reply::Forward);
        // The cluster domain is the cluster's, not always cluster.local.
        let corp = Asker {
            namespace: "shop",
            cluster_domain: "corp.internal",
        };
        assert_eq!(
            answers(reply(&query("web.", RecordType::A), &st, corp)),
            ["10.96.0.71"]
        );
        assert_eq!(
            reply(&query("web.", RecordType::A), &st, at("shop")),
            Reply::Forward
        );
    }

    #[test]
    fn wildcard_hosts_families_and_service_entries_without_a_vip() {
        let st = crate::xds::local::parse(
            Path::new("wild.yaml"),
            r#"
workloads:
- {name: ds-0, namespace: data, workloadIps: [10.0.0.8, "fd00::8"], protocol: HBONE,
   services: {"data/ds4.data.svc.cluster.local": {80: 80}}}
services:
- {name: wild, namespace: shop, hostname: "*.example.com", vips: ["/10.96.0.80"], ports: {443: 443}}
- {name: exact, namespace: shop, hostname: api.example.com, vips: ["/10.96.0.81"], ports: {443: 443}}
- {name: novip, namespace: shop, hostname: legacy.example.net, ports: {80: 80}}
- {name: ds4, namespace: data, hostname: ds4.data.svc.cluster.local, ports: {80: 80}, ipFamilies: IPv4}
- {name: v6only, namespace: data, hostname: v6.data.svc.cluster.local, vips: ["/10.96.0.82", "/fd00::82"],
   ports: {80: 80}, ipFamilies: IPv6}
"#,
        )
        .unwrap();
        let ask = |name: &str, ty| reply(&query(name, ty), &st, at("shop"));
        assert_eq!(
            answers(ask("www.example.com.", RecordType::A)),
            ["10.96.0.80"]
        );
        assert_eq!(
            answers(ask("a.b.example.com.", RecordType::A)),
            ["10.96.0.80"]
        );
        assert_eq!(
            answers(ask("api.example.com.", RecordType::A)),
            ["10.96.0.81"],
            "the exact host before the wildcard"
        );
        assert_eq!(ask("example.com.", RecordType::A), Reply::Forward);
        // A ServiceEntry host with no VIP: the upstream resolvers answer.
        assert_eq!(ask("legacy.example.net.", RecordType::A), Reply::Forward);
        // A headless IPv4-only service: its dual-stack endpoints answer A only.
        assert_eq!(
            answers(ask("ds4.data.svc.cluster.local.", RecordType::A)),
            ["10.0.0.8"]
        );
        assert!(answers(ask("ds4.data.svc.cluster.local.", RecordType::AAAA)).is_empty());
        assert!(answers(ask("v6.data.svc.cluster.local.", RecordType::A)).is_empty());
        assert_eq!(
            answers(ask("v6.data.svc.cluster.local.", RecordType::AAAA)),
            ["fd00::82"]
        );
    }

    #[test]
    fn other_names_are_forwarded_and_garbage_is_refused() {
        let st = state();
        assert_eq!(
            reply(&query("example.com.", RecordType::A), &st, at("default")),
            Reply::Forward
        );
        assert_eq!(reply(b"short", &st, at("default")), Reply::Drop);
        let mut junk = query("echo.", RecordType::A);
        junk.truncate(junk.len() - 3);
        match reply(&junk, &st, at("default")) {
            Reply::Answer(b) => assert_eq!(
                Message::from_vec(&b).unwrap().response_code(),
                ResponseCode::FormErr
            ),
            other => panic!("{other:?}"),
        }
        for seed in 0..2000u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let len = rng.usize(0..300);
            let bytes: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            let _ = reply(&bytes, &st, at("default")); // never panics
        }
    }

    #[test]
    fn resolv_conf() {
        let servers = resolv_conf_servers(
            "# x\nsearch a b\nnameserver 10.0.0.53\nnameserver fd00::53\nnameserver bogus\n",
        );
        assert_eq!(
            servers,
            vec![
                "10.0.0.53:53".parse().unwrap(),
                "[fd00::53]:53".parse().unwrap()
            ]
        );
    }
}
