//! Inbound: HBONE on port 15008 (mutual TLS, HTTP/2 CONNECT, peer checked
//! against our trust domain) and plaintext on port 15006 (senders outside
//! the mesh). Both deliver to the application on the pod's own address.
//!
//! Fail closed, as ztunnel: a connection is authorized against the pod's
//! own workload, and while the state does not hold it (after a short wait
//! for it to arrive) nothing is allowed; plaintext aimed at an address that
//! is not the pod's is refused. The source is looked up on demand only for
//! a connection already allowed: a denied one is labelled from the state.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::server::SendResponse;
use http::{Request, Response, StatusCode};
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, TcpStream};

use super::activity::{Activity, OnConnection};
use super::budget::{Reservation, WindowRetry, BUDGET, STREAM_OPEN_COST};
use super::copy::{tcp_h2_bidirectional, Transferred};
use super::gate::Gate;
use super::hbone::{
    authority_of, canonical, forwarded_for, forwarded_host, validate_connect, Authority,
    ConnectRejection, H2Settings,
};
use super::metrics::{ConnectionLabels, Metrics, WorkloadLabels};
use super::open::Protocol;
use super::outbound::original_dst;
use super::pod::{end_unserved, is_own_address, Lifecycle, PodRef, TLS_SEND_BUFFER};
use super::proxy_protocol;
use super::reauth::{Authorized, Denied, Destination, Tracker};
use super::record::{ConnectionRecord, Direction};
use super::route::waypoint;
use super::splice::splice_bidirectional;
use super::tls_stream;
use super::together::{self, Streams};
use crate::constants::{HBONE_PORT, PROXY_OWN_PORTS};
use crate::identity::crl::{self, Side};
use crate::identity::{tls, Identity};
use crate::limits::{caps, ConnectionCap, LogThrottle};
use crate::xds::best_service;
use crate::xds::client::OnDemand;
use crate::xds::types::{GatewayAddress, Name, Ports, Service, TunnelToApp};
use crate::xds::{State, StateHandle};

/// How long a peer has to finish the TLS handshake, and then HTTP/2's.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection waits for the pod's own workload to reach the
/// state (a pod can be served before the control plane has sent it) before
/// it is denied: ztunnel's wait for its local workload.
const OWN_WORKLOAD_WAIT: Duration = Duration::from_secs(5);

/// The inbound side of one pod.
pub struct Inbound {
    pub pod: PodRef,
    pub state: StateHandle,
    /// Asks the control plane about sources the state lacks (on demand).
    pub demand: Option<OnDemand>,
    pub metrics: Arc<Metrics>,
    pub h2: H2Settings,
    pub tracker: Arc<Tracker>,
    /// This pod, as its connections' re-checks find it.
    pub destination: Arc<Destination>,
    /// Addresses of pods this proxy stopped serving: connections from them are dead.
    pub pods_gone: super::pods::PodsGone,
    /// An HBONE connection that carries no stream for this long is closed
    /// (the outbound pool's `pool_unused_release_timeout`, as ztunnel's).
    pub idle_timeout: Duration,
}

/// HBONE handshakes in progress in the whole proxy, a quarter per source:
/// what peers not yet authenticated make the proxy buffer is bounded by
/// this, not by the (much larger) connection caps.
static HANDSHAKES: std::sync::LazyLock<ConnectionCap> = std::sync::LazyLock::new(|| {
    ConnectionCap::new("hbone_handshake", caps::HBONE_HANDSHAKES).per_source()
});

/// Failed HBONE handshakes, which any peer can cause at will: ten lines
/// per ten seconds, then a count of the others.
static FAILED_HANDSHAKES: LogThrottle = LogThrottle::new(10);

/// How long an idle connection told to go (GOAWAY) has to close before it
/// is dropped: a peer that reads nothing never lets it close cleanly.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(5);

/// An accepted HBONE connection's TLS handshake, within
/// [`HANDSHAKE_TIMEOUT`], holding its place among the handshakes in
/// progress (`handshaking`) until it ends; a failure is logged (ten lines
/// per ten seconds, then a count) and gives `None`.
async fn tls_handshake(
    server: Arc<rustls::ServerConfig>,
    tcp: TcpStream,
    peer: SocketAddr,
    handshaking: impl Sized,
) -> Option<(
    tls_stream::TlsStream,
    Vec<rustls::pki_types::CertificateDer<'static>>,
)> {
    let accepted = tokio::time::timeout(HANDSHAKE_TIMEOUT, tls_stream::accept(server, tcp)).await;
    drop(handshaking);
    match accepted {
        Ok(Ok((mut tls, certs))) => {
            tls.set_buffer_limit(TLS_SEND_BUFFER);
            Some((tls, certs))
        }
        Ok(Err(e)) => {
            match FAILED_HANDSHAKES.admit() {
                Some(unsaid) => {
                    tracing::warn!(src.addr = %peer, error = %e, unsaid, "HBONE TLS handshake refused (unsaid: failed handshakes not logged since the last line)")
                }
                None => {
                    tracing::debug!(src.addr = %peer, error = %e, "HBONE TLS handshake refused")
                }
            }
            None
        }
        Err(_) => {
            match FAILED_HANDSHAKES.admit() {
                Some(unsaid) => {
                    tracing::warn!(src.addr = %peer, unsaid, "HBONE TLS handshake timed out (unsaid: failed handshakes not logged since the last line)")
                }
                None => tracing::debug!(src.addr = %peer, "HBONE TLS handshake timed out"),
            }
            None
        }
    }
}

/// Accepts on `listener` under a cap of `max` (`what` names it), counting
/// the connections held open in `open`.
async fn accept_loop<F, Fut>(
    listener: TcpListener,
    (what, max, open): (&'static str, usize, Gauge),
    life: Lifecycle,
    handle: F,
) where
    F: Fn(TcpStream, SocketAddr) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let cap = ConnectionCap::new(what, max).per_source().counted_in(open);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = life.stop_listening() => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                let Some(slot) = cap.admit(peer.ip()) else {
                    continue;
                };
                let peer = SocketAddr::new(canonical(peer.ip()), peer.port());
                let conn = handle(stream, peer);
                life.spawn(async move {
                    conn.await;
                    drop(slot);
                });
            }
            Err(e) => {
                tracing::warn!(listener = what, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

impl Inbound {
    /// Serves HBONE on `listener` (15008).
    pub async fn serve_hbone(self: Arc<Self>, listener: TcpListener) {
        let open = self.metrics.sockets_open("destination");
        accept_loop(
            listener,
            ("hbone", caps::HBONE, open),
            self.pod.life.clone(),
            |s, p| {
                // The connection's task also carries its streams.
                let (streams, inbox) = together::channel();
                together::together(self.clone().hbone_conn(s, p, streams), inbox)
            },
        )
        .await
    }

    /// Serves plaintext on `listener` (15006).
    pub async fn serve_plaintext(self: Arc<Self>, listener: TcpListener) {
        let life = self.pod.life.clone();
        let open = self.metrics.sockets_open("destination");
        accept_loop(
            listener,
            ("inbound_plaintext", caps::INBOUND_PLAINTEXT, open),
            life,
            |s, p| self.clone().plaintext_conn(s, p),
        )
        .await
    }

    /// One HBONE connection; its streams, once opened, are carried
    /// through `streams` in the connection's task.
    async fn hbone_conn(self: Arc<Self>, tcp: TcpStream, peer: SocketAddr, streams: Streams) {
        let local_ip = match tcp.local_addr() {
            Ok(a) => a.ip(),
            Err(_) => return,
        };
        // A place among the handshakes in progress, held until the peer is
        // authenticated; none left (for this source, or at all): closed.
        let Some(handshaking) = HANDSHAKES.admit(peer.ip()) else {
            return;
        };
        let identity = self.pod.tls.load_full();
        let crl_generation = identity.crl_generation();
        // Its result is a temporary: as a local it would keep its room
        // (912 bytes) in this future for the connection's life.
        let Some((tls, peer_certs)) =
            tls_handshake(identity.server.clone(), tcp, peer, handshaking).await
        else {
            return;
        };
        let Some(peer_id) = peer_certs.first().and_then(tls::identity_of) else {
            return; // unreachable: the verifier requires a SPIFFE identity
        };
        // With revocation lists, a list loaded later that revokes the peer closes the connection.
        let mut revocation = identity.track(&peer_certs, Side::Inbound, crl_generation);
        drop(identity);
        // The receive windows this connection is granted, reserved for its
        // life and moved with its share of the budget.
        // The streams it carries: its windows' share and its idle timeout follow them.
        let activity = Activity::new();
        let (h2, mut windows) = match BUDGET.connection(self.h2, &peer_id, activity.clone()) {
            Ok(granted) => granted,
            Err(refusal) => {
                tracing::warn!(src.addr = %peer, src.principal = %peer_id, reason = refusal.reason(), "HBONE connection refused");
                return;
            }
        };
        let handshake = h2.server().handshake::<_, Bytes>(tls);
        let mut conn = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                tracing::warn!(src.addr = %peer, error = %e, "HBONE HTTP/2 handshake failed");
                return;
            }
            Err(_) => {
                tracing::warn!(src.addr = %peer, "HBONE HTTP/2 handshake timed out");
                return;
            }
        };
        // On proxy exit: GOAWAY (no new streams), but streams in flight go on.
        let mut goaway_sent = false;
        // Refused streams are counted each; said once per connection.
        let mut refused_said = false;
        let mut gone = self.pods_gone.subscribe();
        let mut gone_open = true;
        // The windows the peer was told of; a stream window waits while an
        // earlier SETTINGS is unacknowledged, and is tried again.
        let mut told = h2;
        let mut retry = WindowRetry::default();
        // Asks to be woken by what moves its windows first.
        windows.apply(&mut conn, &mut told);
        // Idle connections are let go, so a peer cannot park connections
        // (and the windows they hold in the budget) for ever.
        let idle_check = (self.idle_timeout / 4).max(Duration::from_millis(100));
        let mut idle_tick =
            tokio::time::interval_at(tokio::time::Instant::now() + idle_check, idle_check);
        idle_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut let_go: Option<tokio::time::Instant> = None;
        // What the connection waits on besides its frames is polled only
        // when it wakes, not with every frame ([`Gate`]).
        let gate = Gate::new();
        loop {
            let side = async {
                tokio::select! {
                    _ = idle_tick.tick(), if let_go.is_none() => Waited::IdleCheck,
                    _ = tokio::time::sleep_until(let_go.unwrap_or_else(tokio::time::Instant::now)), if let_go.is_some() => Waited::LetGo,
                    () = crl::revoked(&mut revocation) => Waited::Revoked,
                    _ = windows.moved() => Waited::Windows,
                    _ = retry.due(), if windows.unsettled(told) => Waited::Retry,
                    _ = self.pod.life.stop_accepting.signalled(), if !goaway_sent => Waited::StopAccepting,
                    ips = gone.recv(), if gone_open => Waited::Gone(ips),
                }
            };
            // The side first: unwoken it costs one atomic swap, and a
            // connection whose peer keeps opening streams (`accept` ready
            // at every poll, until the budget is spent) still hears its
            // revocation, its pod gone, the proxy's exit.
            let side = tokio::select! {
                biased;
                side = gate.guard(side) => Err(side),
                n = conn.accept() => Ok(n),
            };
            let next = match side {
                Ok(next) => next,
                Err(Waited::IdleCheck) => {
                    if activity
                        .idle_for()
                        .is_some_and(|idle| idle >= self.idle_timeout)
                    {
                        tracing::debug!(src.addr = %peer, idle = ?self.idle_timeout, "idle HBONE connection closed");
                        conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                        let_go = Some(tokio::time::Instant::now() + IDLE_CLOSE_GRACE);
                    }
                    continue;
                }
                Err(Waited::LetGo) => break,
                Err(Waited::Revoked) => {
                    tracing::info!(src.addr = %peer, src.principal = %peer_id, "HBONE connection closed: a CRL now revokes the peer's certificate");
                    break;
                }
                Err(Waited::Windows) => {
                    windows.apply(&mut conn, &mut told);
                    retry.reset();
                    continue;
                }
                Err(Waited::Retry) => {
                    retry.tried(windows.apply(&mut conn, &mut told));
                    continue;
                }
                Err(Waited::StopAccepting) => {
                    conn.graceful_shutdown();
                    goaway_sent = true;
                    continue;
                }
                Err(Waited::Gone(ips)) => {
                    match ips {
                        Ok(ips) if ips.iter().any(|ip| canonical(*ip) == peer.ip()) => {
                            tracing::debug!(src.addr = %peer, "HBONE connection from a pod no longer served closed");
                            break;
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => gone_open = false,
                        _ => {}
                    }
                    continue;
                }
            };
            let Some(next) = next else { break };
            match next {
                Ok(accepted) => {
                    let reserved = match BUDGET.reserve(
                        STREAM_OPEN_COST,
                        Some(&peer_id),
                        Some(&self.pod.key),
                    ) {
                        Ok(r) => r,
                        Err(refusal) => {
                            if !refused_said {
                                refused_said = true;
                                tracing::warn!(src.addr = %peer, src.principal = %peer_id, reason = refusal.reason(), "HBONE streams refused (REFUSED_STREAM)");
                            }
                            let (_, mut respond) = accepted;
                            respond.send_reset(h2::Reason::REFUSED_STREAM);
                            continue;
                        }
                    };
                    let stream = self.clone().hbone_stream(
                        accepted,
                        peer_id.clone(),
                        peer,
                        local_ip,
                        (reserved, OnConnection::new(&activity)),
                        streams.clone(),
                    );
                    self.pod.life.spawn(stream);
                }
                Err(e) => {
                    tracing::debug!(src.addr = %peer, error = %e, "HBONE connection ended");
                    break;
                }
            }
        }
    }

    /// One CONNECT stream: checked, answered and connected here, then
    /// carried ([`carry`]) in the connection's task, apart from this
    /// future, holding only what carrying needs for as long as the stream
    /// lives. As one future, the
    /// stream kept the request, every argument twice and every local once
    /// borrowed to its end, 2,856 bytes (`-Zprint-type-sizes`), and a
    /// future chained after this one would still be sized for this one
    /// (2,328); the carrying task's is 1,696.
    async fn hbone_stream(
        self: Arc<Self>,
        accepted: (Request<h2::RecvStream>, SendResponse<Bytes>),
        peer_id: Identity,
        peer: SocketAddr,
        local_ip: IpAddr,
        (reserved, on_connection): (Reservation, OnConnection),
        streams: Streams,
    ) {
        let (req, mut respond) = accepted;
        let Some(opened) = self
            .open_stream(&req, &mut respond, &peer_id, peer, local_ip)
            .await
        else {
            return;
        };
        let (record, upstream, auth) = opened;
        let Ok(send) = respond.send_response(Response::new(()), false) else {
            return;
        };
        let listed = self
            .pod
            .open
            .inbound(peer, None, auth.target, Protocol::Hbone);
        let tracked = self.tracker.track(auth);
        streams.spawn(
            &self.pod.life,
            carry(Opened {
                record,
                upstream,
                send,
                body: req.into_body(),
                reserved,
                tracked,
                on_connection,
                listed,
            }),
        );
    }

    /// Everything before the bytes move: the CONNECT checked, policy
    /// applied, the application dialed. `None` when the stream ended there
    /// (answered with an error, counted and logged).
    async fn open_stream(
        &self,
        req: &Request<h2::RecvStream>,
        respond: &mut SendResponse<Bytes>,
        peer_id: &Identity,
        peer: SocketAddr,
        local_ip: IpAddr,
    ) -> Option<(ConnectionRecord, TcpStream, Authorized)> {
        // Only a candidate for the source's labels (below), checked against
        // the peer's certificate: never the address logged or authorized.
        let src_ip = forwarded_for(req).map(|s| s.ip());
        let fronts = |t: SocketAddr| self.is_waypoint_of(t);
        // A service's hostname is looked up in the pod's own workload:
        // give the control plane the time it has for a policy check.
        let authority = authority_of(req).ok();
        let named = match &authority {
            Some(Authority::Host(host, _)) => Some(host.clone()),
            _ => None,
        };
        let state = match named {
            Some(_) => self.state_with_own().await,
            None => self.state.load(),
        };
        // The service the client asked for: as its proxy says, else as the
        // authority names it.
        let asked = forwarded_host(req).or(named);
        let backs = |host: &str, port: u16| self.backed_port(&state, host, port);
        let target = match validate_connect(req, local_ip, fronts, backs) {
            Ok(t) => t,
            Err(rej) => {
                tracing::warn!(src.principal = %peer_id, error = %rej, "HBONE CONNECT rejected");
                reply(respond, rej.status());
                return None;
            }
        };
        let auth = self.authorized(Some(peer_id), peer.ip(), target);
        let allowed_by = match self.decide(&auth).await {
            Ok(p) => p.unwrap_or_else(|| "-".into()),
            Err(denied) => {
                // As ztunnel: 503 while the pod's own workload is unknown,
                // 401 for a policy's denial.
                let status = match denied {
                    Denied::UnknownDestination => StatusCode::SERVICE_UNAVAILABLE,
                    Denied::Policy(_) => StatusCode::UNAUTHORIZED,
                };
                reply(respond, status);
                // Labelled from what the state holds: no address a denied
                // peer names is looked up on demand.
                let sources: Vec<IpAddr> = src_ip.into_iter().chain([peer.ip()]).collect();
                let to = (target.port(), asked.clone());
                let mut labels = self.labels(&sources, Some(peer_id), to, false).await;
                labels.connection_security_policy = "mutual_tls";
                let hbone = SocketAddr::new(local_ip, HBONE_PORT);
                ConnectionRecord::denied(
                    self.metrics.clone(),
                    (labels, &self.pod.key),
                    Direction::InboundHbone,
                    (Some(peer), target, Some(hbone)),
                    denied,
                );
                return None;
            }
        };
        // Allowed: only now may a source the state lacks be asked for.
        let sources: Vec<IpAddr> = src_ip.into_iter().chain([peer.ip()]).collect();
        let to = (target.port(), asked);
        let mut labels = self.labels(&sources, Some(peer_id), to, true).await;
        labels.connection_security_policy = "mutual_tls";
        // The authenticated peer's address, the one policy was applied to.
        let mut record = self.record(labels, Direction::InboundHbone, Some(peer), target);
        record.set_hbone(SocketAddr::new(local_ip, HBONE_PORT), target);
        record.set_allowed_by(allowed_by);
        let authority = authority.unwrap_or(Authority::Addr(target));
        let (to, header) = match self.delivery(&authority, target, peer, peer_id) {
            Ok(d) => d,
            Err(reason) => {
                reply(respond, StatusCode::SERVICE_UNAVAILABLE);
                record.failed("CONNECT", reason);
                return None;
            }
        };
        let dialed = match &header {
            // The header says who called: the application is dialled from
            // the pod's loopback, as ztunnel dials it.
            Some(_) => self.pod.sockets.connect(to).await,
            None => self.pod.sockets.connect_as(to, peer.ip()).await,
        };
        let mut upstream = match dialed {
            Ok(s) => s,
            Err(e) => {
                reply(respond, StatusCode::SERVICE_UNAVAILABLE);
                record.failed("CONNECT", format_args!("application not reachable: {e}"));
                return None;
            }
        };
        if let Some(header) = header {
            use tokio::io::AsyncWriteExt;
            if let Err(e) = upstream.write_all(&header).await {
                reply(respond, StatusCode::SERVICE_UNAVAILABLE);
                record.failed("CONNECT", format_args!("PROXY header not taken: {e}"));
                return None;
            }
        }
        Some((record, upstream, auth))
    }

    /// Where the application takes a stream delivered to `target`, and
    /// what it is told first: as the pod's workload asks by its
    /// application tunnel, its port instead of the target's (NONE and
    /// PROXY alike) and, for PROXY, on the pod's loopback, a PROXY v2
    /// header naming the peer (`peer`, `peer_id`) and the destination the
    /// peer asked for (the authority; for a service's hostname, the
    /// service's address on this network).
    fn delivery(
        &self,
        authority: &Authority,
        target: SocketAddr,
        peer: SocketAddr,
        peer_id: &Identity,
    ) -> Result<(SocketAddr, Option<Vec<u8>>), String> {
        let st = self.state.load();
        let pod = &self.pod;
        let tunnel = st
            .workload_by_name(&pod.namespace, &pod.name)
            .filter(|w| w.service_account == pod.service_account)
            .and_then(|w| w.application_tunnel());
        let Some(tunnel) = tunnel else {
            return Ok((target, None));
        };
        let port = tunnel.port.unwrap_or(target.port());
        if PROXY_OWN_PORTS.contains(&port) {
            return Err(format!(
                "the application tunnel's port {port} is the proxy's own"
            ));
        }
        match tunnel.protocol {
            TunnelToApp::None => Ok((SocketAddr::new(target.ip(), port), None)),
            TunnelToApp::Proxy => {
                let dst = match authority {
                    Authority::Addr(a) => *a,
                    Authority::Host(host, asked) => {
                        let svc = best_service(st.services_named(host), Some(&pod.namespace));
                        let vip = svc.and_then(|s| {
                            let here = s.vips.iter().filter(|v| v.network == *pod.network);
                            here.map(|v| v.address).max_by_key(|ip| ip.is_ipv4())
                        });
                        let Some(vip) = vip else {
                            return Err(format!(
                                "service {host} has no address on this network for the PROXY header"
                            ));
                        };
                        SocketAddr::new(vip, *asked)
                    }
                };
                let loopback: IpAddr = match canonical(target.ip()) {
                    IpAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    IpAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                };
                let header = proxy_protocol::header(peer, dst, Some(peer_id));
                Ok((SocketAddr::new(loopback, port), Some(header)))
            }
        }
    }

    async fn plaintext_conn(self: Arc<Self>, stream: TcpStream, peer: SocketAddr) {
        let target = match original_dst(&stream) {
            Ok(t) if PROXY_OWN_PORTS.contains(&t.port()) => {
                tracing::warn!(src.addr = %peer, dst.addr = %t, "plaintext connection to a proxy port refused");
                end_unserved(&stream).await;
                return;
            }
            // Only the pod's own addresses: anything else routed to the pod
            // would make the proxy dial it from inside the pod, with the
            // sender's address and the proxy's mark (a relay).
            Ok(t) if !is_own_address(&self.pod.ips, t.ip()) => {
                tracing::warn!(src.addr = %peer, dst.addr = %t, pod.ips = ?self.pod.ips, "plaintext connection to an address that is not this pod's refused");
                end_unserved(&stream).await;
                return;
            }
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(src.addr = %peer, error = %e, "no original destination; closing");
                end_unserved(&stream).await;
                return;
            }
        };
        let auth = self.authorized(None, peer.ip(), target);
        // Authorized first: a source the state lacks is asked for on demand
        // only for a connection that is allowed.
        let allowed = self.decide(&auth).await;
        let to = (target.port(), None);
        let mut labels = self.labels(&[peer.ip()], None, to, allowed.is_ok()).await;
        labels.connection_security_policy = "unknown";
        let allowed_by = match allowed {
            Ok(p) => p.unwrap_or_else(|| "-".into()),
            Err(denied) => {
                let (metrics, ends) = (self.metrics.clone(), (Some(peer), target, None));
                ConnectionRecord::denied(
                    metrics,
                    (labels, &self.pod.key),
                    Direction::InboundPlaintext,
                    ends,
                    denied,
                );
                end_unserved(&stream).await;
                return;
            }
        };
        let mut record = self.record(labels, Direction::InboundPlaintext, Some(peer), target);
        record.set_allowed_by(allowed_by);
        let upstream = match self.pod.sockets.connect_as(target, peer.ip()).await {
            Ok(s) => s,
            Err(e) => {
                record.failed("CONNECT", format_args!("application not reachable: {e}"));
                end_unserved(&stream).await;
                return;
            }
        };
        let listed = self.pod.open.inbound(peer, None, target, Protocol::Tcp);
        let tracked = self.tracker.track(auth);
        let mut result = None;
        {
            let copy = std::pin::pin!(async {
                result = Some(splice_bidirectional(&stream, &upstream).await)
            });
            tracked.revoked.run(copy).await;
        }
        // Cut short by a failure (not by policy, which closes at once): what
        // the sender still sends would go unread (see end_unserved).
        let copy_failed = matches!(result, Some((_, Err(_))));
        drop((upstream, tracked, listed));
        let (t, res) = result.unwrap_or_else(|| {
            (
                Transferred::default(),
                Err(std::io::Error::other("closed: no longer allowed by policy")),
            )
        });
        record.closed(t, res.err().map(|e| e.to_string()));
        if copy_failed {
            end_unserved(&stream).await;
        }
    }

    /// Counts a connection opened; its close is counted and logged by the record.
    fn record(
        &self,
        labels: ConnectionLabels,
        direction: Direction,
        src: Option<SocketAddr>,
        dst: SocketAddr,
    ) -> ConnectionRecord {
        let owner = &self.pod.key;
        ConnectionRecord::open(self.metrics.clone(), (labels, owner), direction, src, dst)
    }
}

/// What an HBONE connection's task waits on besides its frames, and came.
enum Waited {
    /// Time to look at how long the connection has carried no stream.
    IdleCheck,
    /// The idle connection's grace to close is over.
    LetGo,
    /// A revocation list loaded since revokes the peer.
    Revoked,
    /// What its receive windows follow moved.
    Windows,
    /// Time to try its windows again.
    Retry,
    /// The proxy is exiting.
    StopAccepting,
    /// Pods the proxy no longer serves.
    Gone(Result<Arc<[IpAddr]>, tokio::sync::broadcast::error::RecvError>),
}

/// An allowed, connected HBONE stream: what carrying it needs, and no more.
struct Opened {
    record: ConnectionRecord,
    upstream: TcpStream,
    send: h2::SendStream<Bytes>,
    body: h2::RecvStream,
    reserved: Reservation,
    /// Ends the copy when a policy change denies the stream.
    tracked: super::reauth::Tracked,
    /// Keeps the connection from counting as idle while the stream lives.
    on_connection: OnConnection,
    /// Listed among the pod's open connections while it lives.
    listed: super::open::Listed,
}

/// Carries an opened stream until both directions end or policy revokes
/// it, then counts and logs it. Fields are used in place: moved out into
/// locals, they would be stored twice for the stream's life; and an
/// async fn stores its argument twice (the argument, then a local).
#[allow(clippy::manual_async_fn)]
fn carry(mut s: Opened) -> impl std::future::Future<Output = ()> + Send {
    async move {
        let mut result = None;
        // Pinned here and passed by pointer: by value, `run` would hold a
        // second copy of it.
        {
            let copy = std::pin::pin!(async {
                result = Some(
                    tcp_h2_bidirectional(&mut s.upstream, s.send, s.body, Some(&mut s.reserved))
                        .await,
                )
            });
            s.tracked.revoked.run(copy).await;
        }
        let (t, res) = result.unwrap_or_else(|| {
            (
                Transferred::default(),
                Err(std::io::Error::other("closed: no longer allowed by policy")),
            )
        });
        // Towards the application is "sent" from the source's point of view.
        let t = Transferred {
            sent: t.received,
            received: t.sent,
            proxy_closed_first: false, // outbound's notion; not used inbound
        };
        s.record.closed(t, res.err().map(|e| e.to_string()));
        // Named, so the block holds it to here: an async block captures only
        // the fields it names, and the rest of `s` is dropped when `carry`
        // returns (the connection counted as idle while its streams were
        // carried, and was let go after the idle timeout mid-stream).
        drop((s.on_connection, s.listed));
    }
}

fn reply(respond: &mut SendResponse<Bytes>, status: StatusCode) {
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    let _ = respond.send_response(resp, true);
}

mod decide;

#[cfg(test)]
mod tests;
