//! What every served pod shares ([`ProxyShared`]: state, certificates, pool,
//! metrics, settings) and how one pod is built and started: its identity and
//! addresses, then its listeners (15001, 15006, 15008, 15053) as tasks.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use anyhow::Context;

use super::hbone::H2Settings;
use super::hostname::HostnameResolver;
use super::pod::{self, Drain, Own, Pod, PodRef, SocketFactory};
use super::{dns, inbound, metrics, outbound, pool, reauth};
use crate::constants::{DNS_PORT, HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};
use crate::identity::{CertManager, Identity};
use crate::netns::Netns;
use crate::xds::{self, StateHandle};

/// What every served pod shares: state, certificates, pool, metrics, settings.
pub struct ProxyShared {
    pub state: StateHandle,
    pub certs: Arc<CertManager>,
    pub pool: Arc<pool::Pool>,
    pub metrics: Arc<metrics::Metrics>,
    pub h2: H2Settings,
    pub cluster: String,
    pub trust_domain: String,
    /// The cluster's DNS domain, for the DNS proxy's names.
    pub cluster_domain: Arc<str>,
    pub network: String,
    /// Mark and congestion control of every pod socket.
    pub sockets: pod::SocketOptions,
    pub ipv6: bool,
    /// Fired when the proxy exits: every pod stops accepting.
    pub stop_accepting: Drain,
    pub active: Arc<pod::ActiveConnections>,
    pub tracker: Arc<reauth::Tracker>,
    /// Resolvers for non-mesh names; `None`: no DNS proxy.
    pub dns_upstreams: Option<Arc<Vec<SocketAddr>>>,
    /// Resolves workloads reached by hostname (on demand, cached by TTL).
    pub hostnames: Arc<HostnameResolver>,
    /// Fetches addresses the state lacks (`XDS_ON_DEMAND` with a control plane).
    pub demand: Option<xds::client::OnDemand>,
    /// Told the addresses of each pod this proxy stops serving.
    pub pods_gone: PodsGone,
}

/// Where the proxy says which pod addresses went away. An inbound HBONE
/// connection from such an address is dead: the pod's side went with its
/// netns, usually with no FIN getting out (the veth goes first), so it is
/// closed now rather than when TCP keepalive notices minutes later.
#[derive(Debug, Clone)]
pub struct PodsGone(tokio::sync::broadcast::Sender<Arc<[IpAddr]>>);

impl Default for PodsGone {
    fn default() -> Self {
        PodsGone(tokio::sync::broadcast::channel(256).0)
    }
}

impl PodsGone {
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Arc<[IpAddr]>> {
        self.0.subscribe()
    }
}

/// Says a served pod's addresses are gone when dropped (with the pod).
pub struct PodGoneGuard {
    pub gone: PodsGone,
    pub ips: Arc<[IpAddr]>,
}

impl Drop for PodGoneGuard {
    fn drop(&mut self) {
        let _ = self.gone.0.send(self.ips.clone());
    }
}

/// A pod's identity as the agent (or `PROXY_WORKLOAD_INFO`) gives it.
#[derive(Debug, Clone)]
pub struct PodInfo {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub service_account: String,
}

impl ProxyShared {
    /// Builds a pod: identity and certificate, addresses from the state (or
    /// from the pod's interfaces when the state does not list it).
    pub async fn pod(
        &self,
        info: &PodInfo,
        sockets: SocketFactory,
        drain: Drain,
        netns: Option<&Netns>,
    ) -> anyhow::Result<PodRef> {
        let identity = Identity::new(&self.trust_domain, &info.namespace, &info.service_account);
        let mut snapshot = self.state.load();
        let interfaces = || -> anyhow::Result<Vec<IpAddr>> {
            Ok(match netns {
                None => interface_ips(),
                Some(ns) => {
                    let home = Netns::current()?;
                    ns.with(&home, || Ok(interface_ips()))?
                }
            })
        };
        if snapshot
            .workload_by_name(&info.namespace, &info.name)
            .is_none()
        {
            if let Some(demand) = &self.demand {
                // On demand, the pod's own workload comes by its addresses.
                // With no stream open, subscribe but do not hold up the pod:
                // its addresses come from its interfaces meanwhile.
                let asks = interfaces()?
                    .into_iter()
                    .map(|ip| demand.fetch_address(&self.network, ip));
                futures_util::future::join_all(asks).await;
                snapshot = self.state.load();
            }
        }
        let workload = snapshot.workload_by_name(&info.namespace, &info.name);
        let ips = match workload {
            Some(w) => w.workload_ips.to_vec(),
            None => interfaces()?,
        };
        // What the pod says of itself follows its workload (`Pod::own`);
        // until the state lists it, it is named as a pod.
        let unlisted = Arc::new(Own::unlisted(&info.namespace, &info.name, &self.cluster));
        let said = arc_swap::ArcSwap::new(match workload {
            Some(w) => Arc::new(Own::of(w)),
            None => unlisted.clone(),
        });
        Ok(Arc::new(Pod {
            uid: info.uid.clone(),
            key: info.uid.as_str().into(),
            name: info.name.clone(),
            namespace: info.namespace.clone(),
            service_account: info.service_account.clone(),
            network: workload
                .map(|w| w.network.to_string())
                .unwrap_or_else(|| self.network.clone()),
            unlisted,
            said,
            open: Arc::default(),
            tls: self.certs.get(&identity).await?,
            lease: self.certs.lease(),
            identity,
            ips,
            sockets,
            life: pod::Lifecycle {
                drain,
                stop_accepting: self.stop_accepting.clone(),
                active: self.active.clone(),
            },
        }))
    }

    /// Binds the pod's three listeners (inside its netns) and serves them
    /// until its drain fires. Tasks only: no thread per pod.
    pub fn start(self: &Arc<Self>, pod: PodRef) -> anyhow::Result<()> {
        let any = |port| -> SocketAddr {
            if self.ipv6 {
                (Ipv6Addr::UNSPECIFIED, port).into()
            } else {
                (Ipv4Addr::UNSPECIFIED, port).into()
            }
        };
        let listen = |port| {
            pod.sockets
                .listen(any(port))
                .with_context(|| format!("pod {}: listening on port {port}", pod.uid))
        };
        let (out_l, plain_l, hbone_l) = (
            listen(OUTBOUND_PORT)?,
            listen(INBOUND_PLAINTEXT_PORT)?,
            listen(HBONE_PORT)?,
        );
        // Once here, not per connection: accepted sockets inherit the cap.
        if let Err(e) = pod::limit_unsent(&hbone_l, self.h2.unsent_limit) {
            tracing::debug!(pod = %pod.uid, error = %e, "cannot limit HBONE connections' unsent data");
        }
        let outbound = Arc::new(outbound::Outbound {
            pod: pod.clone(),
            state: self.state.clone(),
            demand: self.demand.clone(),
            pool: self.pool.clone(),
            metrics: self.metrics.clone(),
            h2: self.h2,
            trust_domain: self.trust_domain.clone(),
            hostnames: self.hostnames.clone(),
        });
        let inbound = Arc::new(inbound::Inbound {
            pod: pod.clone(),
            state: self.state.clone(),
            demand: self.demand.clone(),
            metrics: self.metrics.clone(),
            h2: self.h2,
            tracker: self.tracker.clone(),
            destination: Arc::new(reauth::Destination {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                service_account: pod.service_account.clone(),
            }),
            pods_gone: self.pods_gone.clone(),
            idle_timeout: self.pool.idle_timeout(),
        });
        tokio::spawn(outbound.serve(out_l));
        tokio::spawn(inbound.clone().serve_hbone(hbone_l));
        tokio::spawn(inbound.serve_plaintext(plain_l));
        if let Some(upstreams) = &self.dns_upstreams {
            let dns = Arc::new(dns::DnsProxy::new(
                pod.clone(),
                self.state.clone(),
                upstreams.clone(),
                self.metrics.clone(),
                self.cluster_domain.clone(),
            ));
            let mut addrs: Vec<SocketAddr> = vec![(Ipv4Addr::LOCALHOST, DNS_PORT).into()];
            if self.ipv6 {
                addrs.push((Ipv6Addr::LOCALHOST, DNS_PORT).into());
            }
            for (i, addr) in addrs.into_iter().enumerate() {
                // The IPv4 pair is required; [::1] only where the pod has IPv6 loopback.
                let bound = pod
                    .sockets
                    .udp(addr, false)
                    .and_then(|u| Ok((u, pod.sockets.listen(addr)?)));
                match bound {
                    Ok((udp, tcp)) => {
                        tokio::spawn(dns.clone().serve_udp(udp));
                        tokio::spawn(dns.clone().serve_tcp(tcp));
                    }
                    Err(e) if i == 0 => {
                        return Err(e).with_context(|| format!("pod {}: DNS on {addr}", pod.uid))
                    }
                    Err(e) => tracing::debug!(pod = %pod.uid, error = %e, "no DNS on [::1]"),
                }
            }
        }
        Ok(())
    }
}

fn interface_ips() -> Vec<IpAddr> {
    nix::ifaddrs::getifaddrs()
        .map(|addrs| {
            addrs
                .filter_map(|a| a.address)
                .filter_map(|s| {
                    s.as_sockaddr_in()
                        .map(|v4| IpAddr::V4(v4.ip()))
                        .or_else(|| s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
                })
                .filter(|ip| !ip.is_loopback())
                .collect()
        })
        .unwrap_or_default()
}
