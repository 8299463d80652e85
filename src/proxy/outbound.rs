//! Outbound (port 15001): connections the pod opens, captured by the in-pod
//! rules. The original destination decides the route: a meshed pod or a
//! service VIP goes over HBONE, a known TCP workload gets plain TCP, and
//! anything else passes through untouched.

mod drive;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use socket2::SockRef;
use tokio::net::{TcpListener, TcpStream};

use super::activity::Activity;
use super::budget::{Refusal, Reservation, BUDGET, STREAM_OPEN_COST};
use super::copy::tcp_h2_bidirectional;
use super::hbone::{Authority, ConnectRequest, H2Settings};
use super::hostname::HostnameResolver;
use super::metrics::{ConnectionLabels, Metrics, WorkloadLabels};
use super::open::{Listed, Protocol};
use super::pod::{end_unserved, limit_unsent, Own, PodRef, TLS_SEND_BUFFER};
use super::pool::{Lease, Lifeline, Pool, PoolKey, PooledConn};
use super::record::{ConnectionRecord, Direction};
use super::route::{route, to_workload, Client, Route};
use super::splice::splice_bidirectional;
use super::tls_stream;
use super::together;
use super::tunnel;
use crate::identity::crl::Side;
use crate::identity::{tls, Identity};
use crate::limits::{caps, CapSlot, ConnectionCap};
use crate::xds::client::OnDemand;
use crate::xds::types::{Service, Workload};
use crate::xds::StateHandle;
use drive::{drive, Ended, RELEASED_CLOSE_DEADLINE};

/// The original destination of a redirected connection.
pub fn original_dst(stream: &TcpStream) -> io::Result<SocketAddr> {
    use nix::sys::socket::{getsockopt, sockopt};
    if let Ok(v4) = getsockopt(stream, sockopt::OriginalDst) {
        let ip = std::net::Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
        return Ok(SocketAddr::new(ip.into(), u16::from_be(v4.sin_port)));
    }
    let v6 = getsockopt(stream, sockopt::Ip6tOriginalDst).map_err(io::Error::from)?;
    let ip = std::net::Ipv6Addr::from(v6.sin6_addr.s6_addr);
    Ok(SocketAddr::new(
        super::hbone::canonical(ip.into()),
        u16::from_be(v6.sin6_port),
    ))
}

/// Why an outbound connection could not be carried.
#[derive(Debug, thiserror::Error)]
pub enum OutboundError {
    #[error("connect {addr}: {source}")]
    Connect { addr: SocketAddr, source: io::Error },
    #[error("TLS to {addr}: {source}")]
    Tls { addr: SocketAddr, source: io::Error },
    #[error("peer {addr}: {source}")]
    PeerIdentity {
        addr: SocketAddr,
        source: tls::PeerIdentityError,
    },
    #[error("HTTP/2 to {addr}: {source}")]
    H2 { addr: SocketAddr, source: h2::Error },
    #[error("CONNECT {target} refused with status {status}")]
    Refused {
        target: Authority,
        status: http::StatusCode,
    },
    #[error("through the gateway {gateway}, the inner tunnel to {target}: {source}")]
    Inner {
        gateway: SocketAddr,
        target: Authority,
        source: io::Error,
    },
    #[error("{0}")]
    NoEndpoint(String),
    #[error(
        "the destination's resource {0} was refused ({1}); refused rather than passed through"
    )]
    RefusedResource(String, String),
    #[error("{0} is the proxy's own port: a self call, refused")]
    SelfCall(SocketAddr),
    #[error("{0}; refused rather than sent around the waypoint")]
    NoWaypoint(String),
    #[error("on-demand DNS: {0}")]
    Unresolved(String),
    #[error("{0}; refused rather than dialled across networks")]
    OtherNetwork(String),
    #[error("HBONE to {0}: not established within {HBONE_DEADLINE:?}")]
    Deadline(SocketAddr),
    #[error("refused: {}", .0.reason())]
    Budget(Refusal),
}

/// How long an outbound HBONE stream has to be established: dial (TCP, TLS,
/// HTTP/2) or pooled connection, then the CONNECT answered.
pub const HBONE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// The outbound side of one pod.
pub struct Outbound {
    pub pod: PodRef,
    pub state: StateHandle,
    /// Asks the control plane about destinations the state lacks (on demand).
    pub demand: Option<OnDemand>,
    pub pool: Arc<Pool>,
    pub metrics: Arc<Metrics>,
    pub h2: H2Settings,
    pub trust_domain: String,
    /// Resolves workloads reached by hostname.
    pub hostnames: Arc<HostnameResolver>,
}

impl Outbound {
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        let life = self.pod.life.clone();
        let open = self.metrics.sockets_open("source");
        let cap = ConnectionCap::new("outbound", caps::OUTBOUND).counted_in(open);
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
                    life.spawn(self.clone().handle(stream, peer, slot));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "outbound accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// One accepted connection: routed, counted and its upstream opened
    /// here, then carried ([`carry`]; an HBONE stream in its connection's
    /// task, a socket in a task of its own), apart from this future, which holds only
    /// what carrying needs for as long as the connection lives: as one
    /// future, the connection kept its route, the routing closure and the
    /// establishing stage's locals to its end (2,216 bytes,
    /// `-Zprint-type-sizes`, dev profile); the carrying task's is 1,480.
    async fn handle(self: Arc<Self>, stream: TcpStream, peer: SocketAddr, slot: CapSlot) {
        // Read now: the TIME_WAIT this connection may leave keeps its cookie.
        let cookie = SockRef::from(&stream).cookie().ok();
        let accepted_from = peer;
        let peer = SocketAddr::new(super::hbone::canonical(peer.ip()), peer.port());
        let dst = match original_dst(&stream) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(src.addr = %peer, error = %e, "no original destination; closing");
                end_unserved(&stream).await;
                return;
            }
        };
        let (record, e) = match self.open(peer, dst).await {
            Ok((record, upstream)) => {
                let listed = match &upstream {
                    Upstream::Hbone { target, .. } => (*target, Protocol::Hbone),
                    Upstream::Plain { target, .. } => (*target, Protocol::Tcp),
                };
                let listed = self.pod.open.outbound(peer, dst, listed.0, listed.1);
                // An HBONE stream is carried in its connection's task.
                let streams = match &upstream {
                    Upstream::Hbone { lease, .. } => Some(lease.streams().clone()),
                    Upstream::Plain { .. } => None,
                };
                let carried = carry(Carried {
                    pod: self.pod.clone(),
                    stream,
                    upstream,
                    record,
                    accepted_from,
                    cookie,
                    slot,
                    listed,
                });
                match streams {
                    Some(streams) => streams.spawn(&self.pod.life, carried),
                    None => self.pod.life.spawn(carried),
                }
                return;
            }
            Err(failed) => failed,
        };
        record.failed("CONNECT", e);
        // Last, with any upstream side already let go.
        let proxy_closed_first = end_unserved(&stream).await;
        ending(
            &self.pod,
            &stream,
            accepted_from,
            cookie,
            proxy_closed_first,
        );
    }

    /// Routes the connection to `dst`, opens its record and its upstream:
    /// a socket, or a CONNECT stream answered 200. On failure, the record
    /// with the reason, not yet counted.
    async fn open(
        &self,
        peer: SocketAddr,
        dst: SocketAddr,
    ) -> Result<(ConnectionRecord, Upstream), (ConnectionRecord, OutboundError)> {
        let decide = || {
            let state = self.state.load();
            let client = Client {
                namespace: &self.pod.namespace,
                name: &self.pod.name,
                ips: &self.pod.ips,
            };
            route(&state, &self.pod.network, client, dst, &self.trust_domain)
        };
        let mut route = decide();
        // What this pod says of itself as the state has it now.
        let own = self.pod.own(&self.state.load());
        if let (Route::Passthrough { .. }, Some(demand)) = (&route, &self.demand) {
            // Unknown here; maybe not to the control plane. Ask once, then decide.
            if demand.fetch_address(&self.pod.network, dst.ip()).await {
                route = decide();
            }
        }
        if let Route::Hostname {
            workload,
            port,
            service,
        } = route
        {
            route = self.resolve(workload, port, service, dst, &own).await;
        }
        let labels = self.labels(&route, &own);
        let kind = match &route {
            Route::Hbone { waypoint: true, .. } => "waypoint",
            Route::Hbone { .. } => "hbone",
            Route::Gateway { waypoint: true, .. } => "gateway-waypoint",
            Route::Gateway { .. } => "gateway",
            Route::Tcp { .. } => "tcp",
            Route::Passthrough { .. } => "passthrough",
            Route::NoEndpoint { .. } => "no-endpoint",
            Route::NoWaypoint { .. } => "no-waypoint",
            Route::Refused { .. } => "refused",
            Route::SelfCall => "self-call",
            Route::Unresolved { .. } => "unresolved",
            Route::OtherNetwork { .. } => "other-network",
            Route::Hostname { .. } => "hostname",
        };
        let mut record = ConnectionRecord::open(
            self.metrics.clone(),
            (labels, &self.pod.key),
            Direction::Outbound,
            Some(peer),
            dst,
        );
        record.set_route(kind);
        match &route {
            Route::Hbone { proxy, target, .. } => record.set_hbone(*proxy, *target),
            Route::Gateway { gateway, .. } => record.set_hbone(*gateway, dst),
            _ => {}
        }
        let upstream = match route {
            Route::Hbone {
                proxy,
                target,
                identities,
                service,
                waypoint,
                ..
            } => {
                // A waypoint is told which service the client asked for.
                let host = service.filter(|_| waypoint).map(|s| s.hostname.clone());
                let baggage = own.baggage.clone();
                self.hbone(peer, proxy, target, identities, (host, baggage))
                    .await
            }
            Route::Gateway {
                gateway,
                gateway_identities,
                host,
                port,
                identities,
                ..
            } => {
                let through = (gateway, gateway_identities);
                self.through_gateway(peer, through, (host, port), identities, own.baggage.clone())
                    .await
            }
            Route::Tcp { target, .. } | Route::Passthrough { target } => self.plain(target).await,
            Route::NoEndpoint { reason, .. } => Err(OutboundError::NoEndpoint(reason)),
            Route::NoWaypoint { reason } => Err(OutboundError::NoWaypoint(reason)),
            Route::Refused { resource, reason } => {
                Err(OutboundError::RefusedResource(resource, reason))
            }
            Route::SelfCall => Err(OutboundError::SelfCall(dst)),
            Route::Unresolved { reason, .. } => Err(OutboundError::Unresolved(reason)),
            Route::OtherNetwork { reason, .. } => Err(OutboundError::OtherNetwork(reason)),
            Route::Hostname { workload, .. } => {
                Err(OutboundError::Unresolved(workload.hostname.to_string()))
            }
        };
        match upstream {
            Ok(u) => Ok((record, u)),
            Err(e) => Err((record, e)),
        }
    }

    async fn plain(&self, target: SocketAddr) -> Result<Upstream, OutboundError> {
        let socket =
            self.pod
                .sockets
                .connect(target)
                .await
                .map_err(|source| OutboundError::Connect {
                    addr: target,
                    source,
                })?;
        Ok(Upstream::Plain { socket, target })
    }

    /// A CONNECT stream to `target` through `proxy`, answered 200.
    async fn hbone(
        &self,
        src: SocketAddr,
        proxy: SocketAddr,
        target: SocketAddr,
        identities: Vec<Identity>,
        (host, baggage): (Option<String>, http::HeaderValue),
    ) -> Result<Upstream, OutboundError> {
        // The stream's read buffer, reserved before anything is sent for it;
        // its send buffer is added when it first sends.
        let reserved = BUDGET
            .reserve(STREAM_OPEN_COST, None, Some(&self.pod.key))
            .map_err(OutboundError::Budget)?;
        let req = ConnectRequest {
            target: target.into(),
            source: src,
            host,
            baggage,
            network: None,
        };
        // Everything before the first byte (a pooled connection or a dial:
        // TCP, TLS, HTTP/2; then the CONNECT and its answer) within one
        // deadline, so a peer that accepts and then stalls fails its callers
        // in time instead of holding them (and the pool's dial lock) forever.
        // On the heap while it runs: the dial (TCP, TLS and HTTP/2
        // handshakes) is the largest stage.
        let established = Box::pin(tokio::time::timeout(
            HBONE_DEADLINE,
            self.stream_to(proxy, identities, req),
        ))
        .await;
        let (lease, send, body) = match established {
            Ok(r) => r?,
            Err(_) => return Err(OutboundError::Deadline(proxy)),
        };
        Ok(Upstream::Hbone {
            lease,
            send,
            body,
            reserved,
            target,
        })
    }

    /// A CONNECT stream through `proxy` (a pooled connection, or one
    /// dialled and checked against `identities`), answered 200.
    async fn stream_to(
        &self,
        proxy: SocketAddr,
        identities: Vec<Identity>,
        req: ConnectRequest,
    ) -> Result<(Lease, h2::SendStream<Bytes>, h2::RecvStream), OutboundError> {
        let key = PoolKey {
            pod: self.pod.uid.clone(),
            src: self.pod.identity.clone(),
            dst: identities.clone(),
            addr: proxy,
        };
        let lease: Lease = self
            .pool
            .get(key, || self.dial(proxy, identities.clone()))
            .await?;
        let target = req.target.clone();
        let (send, resp) = send_connect(lease.sender(), req, proxy).await?;
        if resp.status() != http::StatusCode::OK {
            return Err(OutboundError::Refused {
                target,
                status: resp.status(),
            });
        }
        Ok((lease, send, resp.into_body()))
    }

    /// A stream to service `target` on another network, through its
    /// gateway, as ztunnel opens one: a CONNECT to `target` over HBONE to
    /// the gateway (pooled, checked against the gateway's identities);
    /// inside that stream, mutual TLS with this pod's certificate to the
    /// destination's proxy (checked against `identities`: the gateway
    /// sees only ciphertext), HTTP/2, and the CONNECT again, saying which
    /// network it comes from. The inner connection is this connection's
    /// alone and ends with it.
    async fn through_gateway(
        &self,
        src: SocketAddr,
        (gateway, gateway_ids): (SocketAddr, Vec<Identity>),
        (host, port): (String, u16),
        identities: Vec<Identity>,
        baggage: http::HeaderValue,
    ) -> Result<Upstream, OutboundError> {
        // The outer stream's read buffer, and the inner connection's
        // windows and buffers, for the connection's life.
        let reserved = BUDGET
            .reserve(STREAM_OPEN_COST + INNER_COST, None, Some(&self.pod.key))
            .map_err(OutboundError::Budget)?;
        // A gateway is asked for a service by its name.
        let target = Authority::Host(host.clone(), port);
        let req = |network| ConnectRequest {
            target: target.clone(),
            source: src,
            host: Some(host.clone()),
            baggage: baggage.clone(),
            network,
        };
        let inner_err = |source: io::Error| OutboundError::Inner {
            gateway,
            target: target.clone(),
            source,
        };
        let established = Box::pin(tokio::time::timeout(HBONE_DEADLINE, async {
            let (lease, send, body) = self.stream_to(gateway, gateway_ids, req(None)).await?;
            let io = tunnel::StreamIo::new(send, body);
            let client = self.pod.tls.load_full().client.clone();
            let tls = tokio_rustls::TlsConnector::from(client)
                .connect(tls::hbone_server_name(), io)
                .await
                .map_err(inner_err)?;
            tls::verify_peer_identity(tls.get_ref().1.peer_certificates(), &identities)
                .map_err(|e| inner_err(io::Error::other(e)))?;
            let (sender, conn) = inner_h2()
                .handshake::<_, Bytes>(tls)
                .await
                .map_err(|e| inner_err(io::Error::other(e)))?;
            // Ends once the stream and the sender are let go.
            tokio::spawn(conn);
            let network = Some(self.pod.network.to_string());
            let (send, resp) = send_connect(sender, req(network), gateway).await?;
            if resp.status() != http::StatusCode::OK {
                return Err(OutboundError::Refused {
                    target: target.clone(),
                    status: resp.status(),
                });
            }
            Ok((lease, send, resp.into_body()))
        }))
        .await;
        let (lease, send, body) = match established {
            Ok(r) => r?,
            Err(_) => return Err(OutboundError::Deadline(gateway)),
        };
        Ok(Upstream::Hbone {
            lease,
            send,
            body,
            reserved,
            target: gateway,
        })
    }

    async fn dial(
        &self,
        proxy: SocketAddr,
        identities: Vec<Identity>,
    ) -> Result<Arc<PooledConn>, OutboundError> {
        // A destination that holds its share is refused before any handshake.
        BUDGET
            .admits_connection(self.h2, &identities)
            .map_err(OutboundError::Budget)?;
        let tcp =
            self.pod
                .sockets
                .connect(proxy)
                .await
                .map_err(|source| OutboundError::Connect {
                    addr: proxy,
                    source,
                })?;
        let socket = std::os::fd::AsRawFd::as_raw_fd(&tcp);
        if let Err(e) = limit_unsent(&tcp, self.h2.unsent_limit) {
            tracing::debug!(error = %e, "cannot limit the HBONE connection's unsent data");
        }
        let identity = self.pod.tls.load_full();
        let crl_generation = identity.crl_generation();
        let client = identity.client.clone();
        let (mut tls, peer) = tls_stream::connect(client, tls::hbone_server_name(), tcp)
            .await
            .map_err(|source| OutboundError::Tls {
                addr: proxy,
                source,
            })?;
        tls.set_buffer_limit(TLS_SEND_BUFFER);
        let peer_id = tls::verify_peer_identity(Some(&peer), &identities).map_err(|source| {
            OutboundError::PeerIdentity {
                addr: proxy,
                source,
            }
        })?;
        // With revocation lists, a list loaded later that revokes the peer closes the connection.
        let revocation = identity.track(&peer, Side::Outbound, crl_generation);
        drop(identity);
        // The receive windows this connection grants the peer for its
        // answers, reserved for its life and moved with its share of the
        // budget, as an inbound connection's are: what a destination that
        // sends to applications that do not read can make this proxy hold.
        // The streams it carries, which its windows' share follows.
        let activity = Activity::new();
        let (h2, windows) = BUDGET.connection(self.h2, &peer_id, activity.clone()).map_err(|refusal| {
            tracing::warn!(dst.addr = %proxy, dst.principal = %peer_id, reason = refusal.reason(), "HBONE connection not opened");
            OutboundError::Budget(refusal)
        })?;
        let (sender, conn) =
            h2.client()
                .handshake(tls)
                .await
                .map_err(|source| OutboundError::H2 {
                    addr: proxy,
                    source,
                })?;
        let lifeline = Arc::new(Lifeline::new(activity));
        let driver = lifeline.clone();
        // The connection's task also carries its streams (`together`).
        let (streams, inbox) = together::channel();
        let driving = drive(conn, h2, windows, lifeline.clone(), socket, revocation);
        let main = futures_util::FutureExt::map(driving, move |ended| {
            match ended {
                Ok(Ended::Closed) => {}
                Ok(Ended::Revoked) => tracing::info!(
                    dst.addr = %proxy,
                    dst.principal = %peer_id,
                    "HBONE connection closed: a CRL now revokes the peer's certificate"
                ),
                Ok(Ended::Abandoned) => tracing::info!(
                    dst.addr = %proxy,
                    "HBONE connection reset: the destination took nothing for {}s after the last stream ended",
                    RELEASED_CLOSE_DEADLINE.as_secs()
                ),
                Err(e) => {
                    tracing::debug!(dst.addr = %proxy, error = %e, "HBONE connection ended")
                }
            }
            driver.close();
        });
        tokio::spawn(together::together(main, inbox));
        tracing::debug!(dst.addr = %proxy, "HBONE connection established");
        Ok(PooledConn::new(sender, lifeline, streams))
    }

    /// Resolves a hostname endpoint from the proxy's own netns (counted in
    /// `istio_on_demand_dns_total`) and routes to the address found.
    async fn resolve(
        &self,
        workload: Arc<Workload>,
        port: u16,
        service: Arc<Service>,
        dst: SocketAddr,
        own: &Own,
    ) -> Route {
        self.metrics
            .on_demand_dns(&self.source_labels(own), &workload.hostname);
        let found = self.hostnames.resolve(&workload.hostname, dst.ip()).await;
        match found {
            Ok(ip) => to_workload(
                workload,
                SocketAddr::new(ip, port),
                Some(service),
                &self.trust_domain,
            ),
            Err(reason) => Route::Unresolved { workload, reason },
        }
    }

    /// This pod as a source: its workload fields as it says them now, and
    /// its own identity.
    fn source_labels(&self, own: &Own) -> ConnectionLabels {
        let mut l = ConnectionLabels {
            reporter: "source",
            source_principal: self.pod.identity.to_string(),
            ..Default::default()
        };
        l.set_source(&own.labels);
        l
    }

    fn labels(&self, route: &Route, own: &Own) -> ConnectionLabels {
        let mut l = self.source_labels(own);
        let (workload, service) = match route {
            Route::Hbone {
                workload, service, ..
            } => {
                l.connection_security_policy = "mutual_tls";
                (Some(workload), service.as_ref())
            }
            Route::Gateway {
                workload, service, ..
            } => {
                l.connection_security_policy = "mutual_tls";
                (Some(workload), Some(service))
            }
            Route::Tcp {
                workload, service, ..
            } => (Some(workload), service.as_ref()),
            Route::NoEndpoint { service, .. } => (None, Some(service)),
            Route::Passthrough { .. }
            | Route::NoWaypoint { .. }
            | Route::Refused { .. }
            | Route::SelfCall => (None, None),
            Route::Hostname {
                workload, service, ..
            } => (Some(workload), Some(service)),
            Route::Unresolved { workload, .. } | Route::OtherNetwork { workload, .. } => {
                (Some(workload), None)
            }
        };
        if let Some(w) = workload {
            l.set_destination(&WorkloadLabels::of(w));
            match route {
                Route::Hbone { .. } => {
                    l.destination_principal = w.identity(&self.trust_domain).to_string()
                }
                // The identity the inner tunnel is checked against.
                Route::Gateway { identities, .. } => {
                    l.destination_principal = identities[0].to_string()
                }
                _ => {}
            }
        }
        if let Some(s) = service {
            l.destination_service = s.hostname.clone();
            l.destination_service_namespace = s.namespace.clone();
            l.destination_service_name = s.name.clone();
        }
        l
    }
}

/// Where an opened outbound connection's bytes go.
enum Upstream {
    /// A CONNECT stream, on a pooled connection held by its lease.
    Hbone {
        lease: Lease,
        send: h2::SendStream<Bytes>,
        body: h2::RecvStream,
        reserved: Reservation,
        target: SocketAddr,
    },
    /// A plain socket (a TCP workload, or passthrough).
    Plain {
        socket: TcpStream,
        target: SocketAddr,
    },
}

/// What carrying an opened connection holds for its life.
struct Carried {
    pod: PodRef,
    stream: TcpStream,
    upstream: Upstream,
    record: ConnectionRecord,
    accepted_from: SocketAddr,
    cookie: Option<u64>,
    /// The connection's place under the listener's cap, freed at its end.
    slot: CapSlot,
    /// Listed among the pod's open connections while it lives.
    listed: Listed,
}

/// Carries an opened connection until both directions end, then counts and
/// logs it. Not an async fn, which would store its argument twice (the
/// argument, then a local). The upstream's handles (a few words each) are
/// moved out for the copy so that each is let go as soon as it ends; the
/// stream's reservation (104 bytes) is used in place and emptied.
#[allow(clippy::manual_async_fn)]
fn carry(mut c: Carried) -> impl std::future::Future<Output = ()> + Send {
    async move {
        // Each upstream let go before the client's side is ended (below).
        let (t, res) = match c.upstream {
            Upstream::Hbone {
                lease,
                send,
                body,
                ref mut reserved,
                target,
            } => {
                let carried = tcp_h2_bidirectional(&mut c.stream, send, body, Some(reserved)).await;
                if let Err(e) = &carried.1 {
                    tracing::debug!(dst.addr = %target, error = %e, "HBONE copy ended with an error");
                }
                drop(lease);
                reserved.shrink(usize::MAX);
                carried
            }
            Upstream::Plain { socket, target } => {
                let carried = splice_bidirectional(&c.stream, &socket).await;
                if let Err(e) = &carried.1 {
                    tracing::debug!(dst.addr = %target, error = %e, "passthrough copy ended with an error");
                }
                drop(socket);
                carried
            }
        };
        c.record.closed(t, None);
        // Cut short (a copy ended by the other side's failure): ended here.
        let proxy_closed_first = if res.is_err() {
            end_unserved(&c.stream).await
        } else {
            t.proxy_closed_first
        };
        ending(
            &c.pod,
            &c.stream,
            c.accepted_from,
            c.cookie,
            proxy_closed_first,
        );
        // Named, so the block holds it to here: an async block captures only
        // the fields it names, and the rest of `c` is dropped when `carry`
        // returns (the cap's place was freed as carrying began, and the
        // listener's cap held only connections still being opened).
        drop((c.slot, c.listed));
    }
}

/// The inner connection's windows through a gateway: one stream, so the
/// stream's and the connection's are one.
const INNER_WINDOW: u32 = 256 * 1024;

/// What an inner connection through a gateway is reserved in the budget
/// beyond its outer stream: its receive window, and its TLS session's and
/// HTTP/2 codec's buffers.
const INNER_COST: usize = INNER_WINDOW as usize + 64 * 1024;

fn inner_h2() -> h2::client::Builder {
    let mut b = h2::client::Builder::new();
    b.initial_window_size(INNER_WINDOW)
        .initial_connection_window_size(INNER_WINDOW)
        .max_header_list_size(16 * 1024)
        .max_concurrent_streams(1)
        .max_send_buffer_size(super::budget::STREAM_SEND_BUFFER)
        .enable_push(false);
    b
}

/// Sends the CONNECT `req` on `sender` (to `proxy`) and waits for its answer.
async fn send_connect(
    sender: h2::client::SendRequest<Bytes>,
    req: ConnectRequest,
    proxy: SocketAddr,
) -> Result<(h2::SendStream<Bytes>, http::Response<h2::RecvStream>), OutboundError> {
    let target = req.target.to_string();
    let req = req.to_http().map_err(|e| OutboundError::Connect {
        addr: proxy,
        source: io::Error::other(format!("CONNECT {target}: {e}")),
    })?;
    let h2err = |source| OutboundError::H2 {
        addr: proxy,
        source,
    };
    let mut sender = sender.ready().await.map_err(h2err)?;
    let (resp, send) = sender.send_request(req, false).map_err(h2err)?;
    let resp = resp.await.map_err(h2err)?;
    Ok((send, resp))
}

/// A connection the proxy closed first leaves its TIME_WAIT in the pod's
/// netns: forgotten at once, by its cookie.
fn ending(
    pod: &PodRef,
    stream: &TcpStream,
    accepted_from: SocketAddr,
    cookie: Option<u64>,
    proxy_closed_first: bool,
) {
    if let (true, Some(cookie)) = (proxy_closed_first, cookie) {
        pod.sockets.forget_time_wait(stream, accepted_from, cookie);
    }
}
