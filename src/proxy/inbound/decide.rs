//! What inbound decides about a connection before it carries it: whether
//! this pod is what the peer asks for (a waypoint of the target, a pod
//! backing the hostname it names), whether the pod's policies allow it
//! (waiting a bounded time for the pod's own workload), and how its
//! metrics and logs label it.

use super::*;

impl Inbound {
    /// Whether this pod is the waypoint of the service or workload at `t`
    /// (one of the workloads its waypoint resolves to).
    pub(super) fn is_waypoint_of(&self, t: SocketAddr) -> bool {
        let st = self.state.load();
        let network = &self.pod.network;
        match st.service_by_vip(network, t.ip(), None) {
            Some(svc) => self.fronts_service(&st, svc),
            None => st
                .workload_by_addr(network, t.ip())
                .and_then(|w| w.waypoint.as_ref())
                .is_some_and(|gw| self.is(&st, gw)),
        }
    }

    /// Whether this pod is one of `svc`'s waypoints.
    pub(super) fn fronts_service(&self, st: &State, svc: &Service) -> bool {
        let mut gateways = svc
            .waypoint
            .iter()
            .cloned()
            .chain(svc.weighted_waypoints.iter().map(|w| w.gateway()));
        gateways.any(|gw| self.is(st, &gw))
    }

    /// Whether the gateway `gw` resolves to this pod.
    pub(super) fn is(&self, st: &State, gw: &GatewayAddress) -> bool {
        waypoint::resolve(st, gw).is_ok_and(|r| r.is_from(st, &self.pod.ips))
    }

    /// The port a CONNECT to service `host`:`port` is delivered to on this
    /// pod, as ztunnel's inbound finds it: the service is the one of that
    /// hostname this pod's namespace sees best; when this pod backs it, the
    /// target port its workload (else the service) maps `port` to; when
    /// this pod is its waypoint, `port` itself (as for a VIP). Only the
    /// pod's own services are looked up by key; the scan over every
    /// service of that name is left to a hostname the pod does not back.
    pub(super) fn backed_port(
        &self,
        st: &State,
        host: &str,
        port: u16,
    ) -> Result<u16, ConnectRejection> {
        let pod = &self.pod;
        let own = st
            .workload_by_name(&pod.namespace, &pod.name)
            .filter(|w| w.service_account == pod.service_account);
        let named = |key: &str| key.split_once('/').is_some_and(|(_, h)| h == host);
        let backed = own.and_then(|w| {
            let mut keys = w.services.iter().filter(|(k, _)| named(k));
            let first = keys.next()?;
            let ours = |(k, _): &(&Name, &Ports)| {
                k.split_once('/')
                    .is_some_and(|(ns, _)| *ns == *pod.namespace)
            };
            Some(if ours(&first) {
                first
            } else {
                keys.find(ours).unwrap_or(first)
            })
        });
        if let Some((key, ports)) = backed {
            let svc = st.service_by_host(key);
            let target = match (ports.get(&port), svc.and_then(|s| s.ports.get(&port))) {
                (Some(&t), _) if t != 0 => t,
                (_, Some(&t)) if t != 0 => t,
                (Some(_), _) | (_, Some(_)) => port,
                (None, None) => return Err(ConnectRejection::NoPort(host.to_string(), port)),
            };
            return Ok(target);
        }
        match best_service(st.services_named(host), Some(&pod.namespace)) {
            Some(svc) if self.fronts_service(st, svc) => Ok(port),
            _ => Err(ConnectRejection::NotBacked(host.to_string())),
        }
    }

    /// What this connection is authorized as (for the check and re-checks).
    pub(super) fn authorized(
        &self,
        peer: Option<&Identity>,
        src_ip: IpAddr,
        target: SocketAddr,
    ) -> Authorized {
        Authorized {
            destination: self.destination.clone(),
            peer: peer.cloned(),
            src_ip,
            target,
            since: self.tracker.rechecks(),
        }
    }

    /// Decides `auth` against the state. While the state lacks the pod's
    /// own workload, waits up to [`OWN_WORKLOAD_WAIT`] for it (a pod can
    /// be served before the control plane has sent it); still missing, the
    /// connection is denied.
    pub(super) async fn decide(&self, auth: &Authorized) -> Result<Option<String>, Denied> {
        auth.check(&*self.state_with_own().await)
    }

    /// The state, once it holds the pod's own workload: waits up to
    /// [`OWN_WORKLOAD_WAIT`] for it, then gives the state as it is.
    pub(super) async fn state_with_own(&self) -> Arc<State> {
        let pod = &self.pod;
        let holds = |st: &State| {
            st.workload_by_name(&pod.namespace, &pod.name)
                .is_some_and(|w| w.service_account == pod.service_account)
        };
        // Subscribed before looking, so a change in between is not missed.
        let mut changes = self.state.subscribe();
        let mut state = self.state.load();
        if !holds(&state) {
            let arrived = async {
                while changes.changed().await.is_ok() {
                    state = self.state.load();
                    if holds(&state) {
                        return;
                    }
                }
                // The state can no longer change: wait out the deadline.
                std::future::pending::<()>().await
            };
            if tokio::time::timeout(OWN_WORKLOAD_WAIT, arrived)
                .await
                .is_err()
            {
                tracing::debug!(pod = %format!("{}/{}", pod.namespace, pod.name), "the pod's own workload is not in the state");
            }
        }
        state
    }

    /// The metric labels of a connection. Over HBONE, `sources` are the
    /// address the peer reported (`forwarded`) and then the peer's own
    /// address, and the first whose workload is who the certificate says
    /// the peer is names the source: a header never makes a peer pass for
    /// another workload (traffic through a waypoint is the waypoint's).
    /// With `fetch`, on demand, a source not held yet is asked for first.
    /// `to` is the destination port and the service the peer says the
    /// client asked for (`forwarded: host=`), which name the
    /// `destination_service` among the pod's own services.
    pub(super) async fn labels(
        &self,
        sources: &[IpAddr],
        peer: Option<&Identity>,
        to: (u16, Option<String>),
        fetch: bool,
    ) -> ConnectionLabels {
        let pod = &self.pod;
        let mut l = ConnectionLabels {
            reporter: "destination",
            destination_principal: pod.identity.to_string(),
            ..Default::default()
        };
        if let Some(id) = peer {
            l.source_principal = id.to_string();
        }
        let mut state = self.state.load();
        if let (Some(&ip), Some(demand), true) = (sources.first(), &self.demand, fetch) {
            // On demand, a source not known yet is asked for (once); with a
            // stream open the answer is awaited, so the connection is
            // labelled like the rest.
            if state.workload_by_addr(&pod.network, ip).is_none() {
                demand.fetch_address(&pod.network, ip).await;
                state = self.state.load();
            }
        }
        // This pod as it says it is now (its workload's fields follow the state).
        l.set_destination(&pod.own(&state).labels);
        let source = sources
            .iter()
            .filter_map(|ip| state.workload_by_addr(&pod.network, *ip))
            .find(|w| peer.is_none_or(|id| w.identity(&pod.identity.trust_domain) == *id));
        if let Some(w) = source {
            l.set_source(&WorkloadLabels::of(w));
        }
        if let Some(svc) =
            inbound_service(&state, (&pod.namespace, &pod.name), to.0, to.1.as_deref())
        {
            l.destination_service = svc.hostname.clone();
            l.destination_service_namespace = svc.namespace.clone();
            l.destination_service_name = svc.name.clone();
        }
        l
    }
}

/// The service an inbound connection was for, among the pod's own: the one
/// the client named (`forwarded: host=`), else the first whose target port
/// is the connection's port (as ztunnel guesses it).
pub(super) fn inbound_service<'a>(
    state: &'a State,
    (namespace, name): (&str, &str),
    port: u16,
    host: Option<&str>,
) -> Option<&'a Arc<Service>> {
    let w = state.workload_by_name(namespace, name)?;
    // In key order (BackedServices keeps them sorted).
    let named = host.and_then(|h| {
        w.services
            .keys()
            .filter_map(|k| state.service_by_host(k))
            .find(|s| s.hostname == h)
    });
    named.or_else(|| {
        w.services.iter().find_map(|(k, ports)| {
            let svc = state.service_by_host(k)?;
            let mut targets = ports.iter().map(|(sp, tp)| match (*tp, svc.ports.get(sp)) {
                (0, Some(&t)) if t != 0 => t,
                (0, _) => *sp,
                (t, _) => t,
            });
            targets.any(|t| t == port).then_some(svc)
        })
    })
}
