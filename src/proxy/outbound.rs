//! Outbound (port 15001): connections the pod opens, captured by the in-pod
//! rules. The original destination decides the route: a meshed pod or a
//! service VIP goes over HBONE, a known TCP workload gets plain TCP, and
//! anything else passes through untouched.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use socket2::SockRef;
use tokio::net::{TcpListener, TcpStream};

use super::copy::{splice_bidirectional, tcp_h2_bidirectional, Transferred};
use super::hbone::{ConnectRequest, H2Settings};
use super::metrics::{ConnectionLabels, Metrics};
use super::pod::{end_unserved, limit_unsent, PodRef, TLS_SEND_BUFFER};
use super::pool::{Lease, Pool, PoolKey, PooledConn};
use super::record::{ConnectionRecord, Direction};
use crate::constants::HBONE_PORT;
use crate::identity::{tls, Identity};
use crate::xds::client::OnDemand;
use crate::xds::types::{Protocol, Service, Workload};
use crate::xds::{State, StateHandle};

/// Where an outbound connection goes.
#[derive(Debug, Clone)]
pub enum Route {
    /// Mutual TLS + CONNECT to the destination pod's proxy.
    Hbone {
        proxy: SocketAddr,
        target: SocketAddr,
        identities: Vec<Identity>,
        workload: Arc<Workload>,
        service: Option<Arc<Service>>,
    },
    /// Plain TCP to a known workload that is not meshed.
    Tcp {
        target: SocketAddr,
        workload: Arc<Workload>,
        service: Option<Arc<Service>>,
    },
    /// Not in the mesh: straight to the original destination.
    Passthrough { target: SocketAddr },
    /// A service with no healthy endpoint for that port.
    NoEndpoint { service: Arc<Service> },
}

/// Decides the route of a connection to `dst` (pure: reads only `state`).
pub fn route(state: &State, network: &str, dst: SocketAddr, trust_domain: &str) -> Route {
    if let Some(svc) = state.service_by_vip(network, dst.ip()) {
        let Some(&svc_target) = svc.ports.get(&dst.port()) else {
            return Route::NoEndpoint {
                service: svc.clone(),
            };
        };
        let endpoints: Vec<_> = state
            .healthy_endpoints(svc)
            .filter(|e| !e.workload.workload_ips.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Route::NoEndpoint {
                service: svc.clone(),
            };
        }
        let ep = endpoints[fastrand::usize(..endpoints.len())];
        let port = match ep.ports.get(&dst.port()).copied().unwrap_or(svc_target) {
            0 => dst.port(),
            p => p,
        };
        let target = SocketAddr::new(ep.workload.workload_ips[0], port);
        return to_workload(ep.workload.clone(), target, Some(svc.clone()), trust_domain);
    }
    match state.workload_by_addr(network, dst.ip()) {
        Some(w) => to_workload(w.clone(), dst, None, trust_domain),
        None => Route::Passthrough { target: dst },
    }
}

fn to_workload(
    workload: Arc<Workload>,
    target: SocketAddr,
    service: Option<Arc<Service>>,
    td: &str,
) -> Route {
    match workload.protocol {
        Protocol::Hbone => {
            let mut identities = vec![workload.identity(td)];
            for san in service.iter().flat_map(|s| &s.subject_alt_names) {
                if let Ok(id) = san.parse::<Identity>() {
                    identities.push(id);
                }
            }
            Route::Hbone {
                proxy: SocketAddr::new(target.ip(), HBONE_PORT),
                target,
                identities,
                workload,
                service,
            }
        }
        Protocol::Tcp => Route::Tcp {
            target,
            workload,
            service,
        },
    }
}

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
        target: SocketAddr,
        status: http::StatusCode,
    },
    #[error("service {0} has no healthy endpoint for this port")]
    NoEndpoint(String),
}

/// The outbound side of one pod.
pub struct Outbound {
    pub pod: PodRef,
    pub state: StateHandle,
    /// Asks the control plane about destinations the state lacks (on demand).
    pub demand: Option<OnDemand>,
    pub pool: Arc<Pool>,
    pub metrics: Arc<Metrics>,
    pub h2: H2Settings,
    pub cluster: String,
    pub trust_domain: String,
}

impl Outbound {
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        let life = self.pod.life.clone();
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = life.stop_listening() => return,
            };
            match accepted {
                Ok((stream, peer)) => {
                    let this = self.clone();
                    life.spawn(async move { this.handle(stream, peer).await });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "outbound accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn handle(&self, mut stream: TcpStream, peer: SocketAddr) {
        // Read now: the TIME_WAIT this connection may leave keeps its cookie.
        let cookie = SockRef::from(&stream).cookie();
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
        let mut route = route(
            &self.state.load(),
            &self.pod.network,
            dst,
            &self.trust_domain,
        );
        if let (Route::Passthrough { .. }, Some(demand)) = (&route, &self.demand) {
            // Unknown here; maybe not to the control plane. Ask once, then decide.
            if demand.fetch_address(&self.pod.network, dst.ip()).await {
                route = self::route(
                    &self.state.load(),
                    &self.pod.network,
                    dst,
                    &self.trust_domain,
                );
            }
        }
        let labels = self.labels(&route);
        let kind = match &route {
            Route::Hbone { .. } => "hbone",
            Route::Tcp { .. } => "tcp",
            Route::Passthrough { .. } => "passthrough",
            Route::NoEndpoint { .. } => "no-endpoint",
        };
        let mut record = ConnectionRecord::open(
            self.metrics.clone(),
            labels,
            Direction::Outbound,
            Some(peer),
            dst,
        );
        record.set_route(kind);
        let result = match route {
            Route::Hbone {
                proxy,
                target,
                identities,
                ..
            } => {
                self.hbone(&mut stream, peer, proxy, target, identities)
                    .await
            }
            Route::Tcp { target, .. } | Route::Passthrough { target } => {
                self.plain(&stream, target).await
            }
            Route::NoEndpoint { service } => Err(OutboundError::NoEndpoint(service.key())),
        };
        // Cut short: nothing carried, or a copy ended by the other side's failure.
        let (t, cut_short) = match result {
            Ok(carried) => {
                record.closed(carried.0, None);
                carried
            }
            Err(e) => {
                record.failed("CONNECT", e);
                (Transferred::default(), true)
            }
        };
        // Last, with the upstream side and any pooled stream already let go.
        let proxy_closed_first = if cut_short {
            end_unserved(&stream).await
        } else {
            t.proxy_closed_first
        };
        if let (true, Ok(cookie)) = (proxy_closed_first, cookie) {
            self.pod
                .sockets
                .forget_time_wait(&stream, accepted_from, cookie);
        }
    }

    async fn plain(
        &self,
        stream: &TcpStream,
        target: SocketAddr,
    ) -> Result<(Transferred, bool), OutboundError> {
        let upstream =
            self.pod
                .sockets
                .connect(target)
                .await
                .map_err(|source| OutboundError::Connect {
                    addr: target,
                    source,
                })?;
        let (t, res) = splice_bidirectional(stream, &upstream).await;
        if let Err(e) = &res {
            tracing::debug!(dst.addr = %target, error = %e, "passthrough copy ended with an error");
        }
        Ok((t, res.is_err()))
    }

    async fn hbone(
        &self,
        stream: &mut TcpStream,
        src: SocketAddr,
        proxy: SocketAddr,
        target: SocketAddr,
        identities: Vec<Identity>,
    ) -> Result<(Transferred, bool), OutboundError> {
        let key = PoolKey {
            pod: self.pod.uid.clone(),
            src: self.pod.identity.clone(),
            dst: identities.clone(),
            addr: proxy,
        };
        let lease: Lease = self.pool.get(key, || self.dial(proxy, identities)).await?;
        let mut sender = lease.sender();
        let req = ConnectRequest {
            target,
            source: src,
            cluster: self.cluster.clone(),
            namespace: self.pod.namespace.clone(),
            workload: self.pod.name.clone(),
            service: self.pod.canonical_service.clone(),
            revision: self.pod.canonical_revision.clone(),
        }
        .to_http()
        .map_err(|e| OutboundError::Connect {
            addr: target,
            source: io::Error::other(e),
        })?;
        let h2err = |source| OutboundError::H2 {
            addr: proxy,
            source,
        };
        sender = sender.ready().await.map_err(h2err)?;
        let (resp, send) = sender.send_request(req, false).map_err(h2err)?;
        let resp = resp.await.map_err(h2err)?;
        if resp.status() != http::StatusCode::OK {
            return Err(OutboundError::Refused {
                target,
                status: resp.status(),
            });
        }
        let (t, res) = tcp_h2_bidirectional(stream, send, resp.into_body()).await;
        if let Err(e) = &res {
            tracing::debug!(dst.addr = %target, error = %e, "HBONE copy ended with an error");
        }
        drop(lease);
        Ok((t, res.is_err()))
    }

    async fn dial(
        &self,
        proxy: SocketAddr,
        identities: Vec<Identity>,
    ) -> Result<Arc<PooledConn>, OutboundError> {
        let tcp =
            self.pod
                .sockets
                .connect(proxy)
                .await
                .map_err(|source| OutboundError::Connect {
                    addr: proxy,
                    source,
                })?;
        if let Err(e) = limit_unsent(&tcp, self.h2.unsent_limit) {
            tracing::debug!(error = %e, "cannot limit the HBONE connection's unsent data");
        }
        let connector = tokio_rustls::TlsConnector::from(self.pod.tls.load().client.clone());
        let mut tls = connector
            .connect(tls::hbone_server_name(), tcp)
            .await
            .map_err(|source| OutboundError::Tls {
                addr: proxy,
                source,
            })?;
        tls.get_mut().1.set_buffer_limit(Some(TLS_SEND_BUFFER));
        tls::verify_peer_identity(tls.get_ref().1.peer_certificates(), &identities).map_err(
            |source| OutboundError::PeerIdentity {
                addr: proxy,
                source,
            },
        )?;
        let (sender, conn) =
            self.h2
                .client()
                .handshake(tls)
                .await
                .map_err(|source| OutboundError::H2 {
                    addr: proxy,
                    source,
                })?;
        let closed = Arc::new(AtomicBool::new(false));
        let flag = closed.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(dst.addr = %proxy, error = %e, "HBONE connection ended");
            }
            flag.store(true, Ordering::Release);
        });
        tracing::debug!(dst.addr = %proxy, "HBONE connection established");
        Ok(PooledConn::new(sender, closed))
    }

    fn labels(&self, route: &Route) -> ConnectionLabels {
        let pod = &self.pod;
        let mut l = ConnectionLabels {
            reporter: "source",
            source_workload: pod.name.clone(),
            source_canonical_service: pod.canonical_service.clone(),
            source_canonical_revision: pod.canonical_revision.clone(),
            source_workload_namespace: pod.namespace.clone(),
            source_principal: pod.identity.to_string(),
            ..Default::default()
        };
        let (workload, service) = match route {
            Route::Hbone {
                workload, service, ..
            } => {
                l.connection_security_policy = "mutual_tls";
                (Some(workload), service.as_ref())
            }
            Route::Tcp {
                workload, service, ..
            } => (Some(workload), service.as_ref()),
            Route::NoEndpoint { service } => (None, Some(service)),
            Route::Passthrough { .. } => (None, None),
        };
        if let Some(w) = workload {
            l.destination_workload = w.name.clone();
            l.destination_workload_namespace = w.namespace.clone();
            l.destination_canonical_service = w.canonical_service().to_string();
            l.destination_canonical_revision = if w.canonical_revision.is_empty() {
                "latest".into()
            } else {
                w.canonical_revision.clone()
            };
            if matches!(route, Route::Hbone { .. }) {
                l.destination_principal = w.identity(&self.trust_domain).to_string();
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn state() -> State {
        crate::xds::local::parse(
            Path::new("t.yaml"),
            r#"
workloads:
- {name: server, namespace: default, serviceAccount: srv, workloadIps: [10.0.0.3], protocol: HBONE,
   services: {"default/echo.default.svc.cluster.local": {80: 8080}}}
- {name: legacy, namespace: default, workloadIps: [10.0.0.4], protocol: TCP}
- {name: sick, namespace: default, workloadIps: [10.0.0.5], protocol: HBONE, status: Unhealthy,
   services: {"default/lonely.default.svc.cluster.local": {80: 80}}}
services:
- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: ["/10.96.0.10"], ports: {80: 9090},
   subjectAltNames: ["spiffe://cluster.local/ns/default/sa/alt"]}
- {name: lonely, namespace: default, hostname: lonely.default.svc.cluster.local, vips: ["/10.96.0.11"], ports: {80: 80}}
"#,
        )
        .unwrap()
    }

    fn r(dst: &str) -> Route {
        route(&state(), "", dst.parse().unwrap(), "cluster.local")
    }

    #[test]
    fn meshed_pod_goes_over_hbone_to_15008() {
        match r("10.0.0.3:8080") {
            Route::Hbone {
                proxy,
                target,
                identities,
                ..
            } => {
                assert_eq!(proxy, "10.0.0.3:15008".parse().unwrap());
                assert_eq!(target, "10.0.0.3:8080".parse().unwrap());
                assert_eq!(
                    identities,
                    vec![Identity::new("cluster.local", "default", "srv")]
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn vip_maps_to_endpoint_target_port_with_service_sans() {
        match r("10.96.0.10:80") {
            Route::Hbone {
                target,
                identities,
                service,
                ..
            } => {
                assert_eq!(
                    target,
                    "10.0.0.3:8080".parse().unwrap(),
                    "workload port override wins"
                );
                assert_eq!(identities.len(), 2);
                assert_eq!(service.unwrap().name, "echo");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(r("10.96.0.10:81"), Route::NoEndpoint { .. }),
            "port not in service"
        );
        assert!(
            matches!(r("10.96.0.11:80"), Route::NoEndpoint { .. }),
            "only endpoint is unhealthy"
        );
    }

    #[test]
    fn tcp_workload_and_unknown_destinations() {
        assert!(matches!(r("10.0.0.4:80"), Route::Tcp { .. }));
        assert!(matches!(r("192.0.2.1:443"), Route::Passthrough { .. }));
    }
}
