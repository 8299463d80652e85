//! HBONE on the wire (docs/wire.md §5): building the CONNECT request a client
//! sends, validating the one a server receives, and the HTTP/2 settings both
//! sides use. Pure code over `http` values; the sockets live elsewhere.

use std::net::{IpAddr, SocketAddr};

use http::{Method, Request, StatusCode};

use super::budget::STREAM_SEND_BUFFER;
use crate::constants::PROXY_OWN_PORTS;

/// HTTP/2 window and frame sizes, and how much of an HBONE connection's
/// output the kernel may hold unsent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct H2Settings {
    pub stream_window: u32,
    pub connection_window: u32,
    pub frame_size: u32,
    /// `TCP_NOTSENT_LOWAT` on the connection's socket; 0: the kernel's default.
    pub unsent_limit: u32,
}

impl H2Settings {
    pub fn client(&self) -> h2::client::Builder {
        let mut b = h2::client::Builder::new();
        b.initial_window_size(self.stream_window)
            .initial_connection_window_size(self.connection_window)
            .max_frame_size(self.frame_size)
            .max_header_list_size(16 * 1024)
            .max_send_buffer_size(STREAM_SEND_BUFFER)
            .enable_push(false);
        b
    }

    pub fn server(&self) -> h2::server::Builder {
        let mut b = h2::server::Builder::new();
        b.initial_window_size(self.stream_window)
            .initial_connection_window_size(self.connection_window)
            .max_frame_size(self.frame_size)
            .max_header_list_size(64 * 1024)
            .max_send_buffer_size(STREAM_SEND_BUFFER)
            .max_concurrent_streams(200);
        b
    }
}

/// What the source proxy says about the connection it tunnels.
#[derive(Debug, Clone)]
pub struct ConnectRequest {
    /// The destination pod address and port, or (through another
    /// network's gateway) the service's hostname and port (`:authority`).
    pub target: Authority,
    /// The original client address (`forwarded: for=`).
    pub source: SocketAddr,
    /// The service the client asked for, when the hop is to its waypoint
    /// (`forwarded: ...;host=`).
    pub host: Option<String>,
    /// The source workload's `baggage`, made once per pod ([`baggage`]).
    pub baggage: http::HeaderValue,
    /// The source's network, on the inner CONNECT through another
    /// network's gateway (`x-forwarded-network`, as ztunnel sends it).
    pub network: Option<String>,
}

/// What the `baggage` header says of a source workload, as ztunnel writes
/// it: entries in this order, each left out when its value is empty.
#[derive(Debug, Default)]
pub struct Baggage<'a> {
    pub cluster: &'a str,
    pub namespace: &'a str,
    /// `deployment`, `cronjob`, `pod` or `job`: the key is `k8s.<type>.name`.
    pub workload_type: &'a str,
    pub workload_name: &'a str,
    pub service: &'a str,
    pub revision: &'a str,
    pub region: &'a str,
    pub zone: &'a str,
}

impl Baggage<'_> {
    /// The header value; one that is not a valid header is left empty.
    pub fn header(&self) -> http::HeaderValue {
        let type_key = format!("k8s.{}.name", self.workload_type);
        let entries = [
            ("k8s.cluster.name", self.cluster),
            ("k8s.namespace.name", self.namespace),
            (type_key.as_str(), self.workload_name),
            ("service.name", self.service),
            ("service.version", self.revision),
            ("cloud.region", self.region),
            ("cloud.availability_zone", self.zone),
        ];
        let text = entries
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        http::HeaderValue::from_str(&text).unwrap_or(http::HeaderValue::from_static(""))
    }
}

const FORWARDED: http::HeaderName = http::header::FORWARDED;
const BAGGAGE: http::HeaderName = http::HeaderName::from_static("baggage");
const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");
/// The network a CONNECT through a gateway comes from.
pub const X_FORWARDED_NETWORK: http::HeaderName =
    http::HeaderName::from_static("x-forwarded-network");

impl ConnectRequest {
    fn forwarded(&self) -> String {
        match &self.host {
            Some(host) => format!("for=\"{}\";host={host}", self.source),
            None => format!("for=\"{}\"", self.source),
        }
    }

    /// `forwarded` (it names the source port) and `traceparent` are new in
    /// every request, so they are sent never-indexed (RFC 7541 §6.2.3): a
    /// value that can never be referred to again would only push
    /// `baggage` out of both ends' HPACK tables, and each end would keep a
    /// copy of it there for the next few dozen streams, long after this one
    /// ended, scattered between other connections' memory (heaptrack: that
    /// was most of what a burst of 1,000 streams left alive on each side).
    pub fn to_http(&self) -> Result<Request<()>, http::Error> {
        let traceparent = format!(
            "00-{:032x}-{:016x}-00",
            fastrand::u128(1..),
            fastrand::u64(1..)
        );
        let once = |v: String| {
            http::HeaderValue::try_from(v).map(|mut v| {
                v.set_sensitive(true);
                v
            })
        };
        let mut req = Request::builder()
            .method(Method::CONNECT)
            .uri(self.target.to_string())
            .header(FORWARDED, once(self.forwarded())?)
            .header(BAGGAGE, self.baggage.clone())
            .header(TRACEPARENT, once(traceparent)?);
        if let Some(network) = &self.network {
            req = req.header(X_FORWARDED_NETWORK, network.as_str());
        }
        req.body(())
    }
}

/// Why a CONNECT was refused, with the status it earns.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectRejection {
    #[error("method {0} is not CONNECT")]
    NotConnect(String),
    #[error("authority {0:?} is not ip:port or hostname:port")]
    BadAuthority(String),
    #[error("destination {0} is not this pod's address")]
    NotThisPod(IpAddr),
    #[error("destination port {0} belongs to the proxy")]
    ProxyPort(u16),
    /// A `hostname:port` authority naming no service this pod backs (or
    /// is the waypoint of).
    #[error("no service {0} that this pod backs")]
    NotBacked(String),
    /// A service this pod backs, without the port asked for.
    #[error("service {0} that this pod backs has no port {1}")]
    NoPort(String, u16),
}

impl ConnectRejection {
    /// 400 for a request no pod could take; 503 for a hostname this pod
    /// does not serve (as ztunnel answers a hostname it cannot resolve).
    pub fn status(&self) -> StatusCode {
        match self {
            ConnectRejection::NotBacked(_) | ConnectRejection::NoPort(..) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

/// What a CONNECT's authority names: an address, or a service's hostname
/// and port (what arrives through another network's gateway).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authority {
    Addr(SocketAddr),
    Host(String, u16),
}

impl std::fmt::Display for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Authority::Addr(a) => a.fmt(f),
            Authority::Host(host, port) => write!(f, "{host}:{port}"),
        }
    }
}

impl From<SocketAddr> for Authority {
    fn from(a: SocketAddr) -> Authority {
        Authority::Addr(a)
    }
}

/// The method checked and the authority read: `ip:port`, or
/// `hostname:port` with a DNS name for the host.
pub fn authority_of<B>(req: &Request<B>) -> Result<Authority, ConnectRejection> {
    if req.method() != Method::CONNECT {
        return Err(ConnectRejection::NotConnect(req.method().to_string()));
    }
    let authority = req.uri().authority();
    let text = authority.map(|a| a.as_str()).unwrap_or_default();
    if let Ok(addr) = text.parse() {
        return Ok(Authority::Addr(addr));
    }
    let bad = || ConnectRejection::BadAuthority(text.to_string());
    let authority = authority.filter(|_| !text.contains('@')).ok_or_else(bad)?;
    let host = authority.host();
    let is_name = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
        && host.parse::<IpAddr>().is_err();
    match (is_name, authority.port_u16()) {
        (true, Some(port)) => Ok(Authority::Host(host.to_ascii_lowercase(), port)),
        _ => Err(bad()),
    }
}

/// Checks a received CONNECT: method, authority, the IP is the one the
/// connection arrived on (the pod's own), and the port is not the
/// proxy's. Where a CONNECT is delivered: the authority, which must be
/// this pod's address; or, when this pod is the waypoint of the workload
/// or service the authority names (`fronts`), this pod's address with the
/// authority's port (the "sandwich": the pod's waypoint application takes
/// it from there); or, for a `hostname:port` authority, this pod's
/// address with the port `backs` finds for that service on this pod.
pub fn validate_connect<B>(
    req: &Request<B>,
    local_ip: IpAddr,
    fronts: impl FnOnce(SocketAddr) -> bool,
    backs: impl FnOnce(&str, u16) -> Result<u16, ConnectRejection>,
) -> Result<SocketAddr, ConnectRejection> {
    let target = match authority_of(req)? {
        Authority::Addr(target) if canonical(target.ip()) == canonical(local_ip) => target,
        Authority::Addr(target) if fronts(target) => SocketAddr::new(local_ip, target.port()),
        Authority::Addr(target) => return Err(ConnectRejection::NotThisPod(target.ip())),
        Authority::Host(host, port) => SocketAddr::new(local_ip, backs(&host, port)?),
    };
    if PROXY_OWN_PORTS.contains(&target.port()) {
        return Err(ConnectRejection::ProxyPort(target.port()));
    }
    Ok(target)
}

/// `::ffff:a.b.c.d` → `a.b.c.d`, so dual-stack listeners compare equal.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The service a peer says the client asked for: `forwarded: ...;host=`.
pub fn forwarded_host<B>(req: &Request<B>) -> Option<String> {
    let v = req.headers().get("forwarded")?.to_str().ok()?;
    v.split(';')
        .find_map(|part| part.trim().strip_prefix("host="))
        .map(|h| h.trim_matches('"').to_string())
}

/// The source address a peer reported in `forwarded: for="ip:port"`.
pub fn forwarded_for<B>(req: &Request<B>) -> Option<SocketAddr> {
    let v = req.headers().get("forwarded")?.to_str().ok()?;
    v.split(';')
        .find_map(|part| part.trim().strip_prefix("for="))
        .and_then(|s| s.trim_matches('"').parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> ConnectRequest {
        ConnectRequest {
            target: "10.0.0.3:8080".parse::<SocketAddr>().unwrap().into(),
            source: "10.0.0.2:40000".parse().unwrap(),
            host: None,
            baggage: Baggage {
                cluster: "Kubernetes",
                namespace: "default",
                workload_type: "deployment",
                workload_name: "client",
                service: "client",
                revision: "latest",
                ..Default::default()
            }
            .header(),
            network: None,
        }
    }

    #[test]
    fn baggage_names_the_workload_by_its_type_and_leaves_out_what_is_empty() {
        let b = Baggage {
            cluster: "east",
            namespace: "shop",
            workload_type: "cronjob",
            workload_name: "nightly",
            service: "nightly",
            revision: "v2",
            region: "eu-west",
            zone: "eu-west-1a",
        };
        assert_eq!(
            b.header(),
            "k8s.cluster.name=east,k8s.namespace.name=shop,k8s.cronjob.name=nightly,\
             service.name=nightly,service.version=v2,cloud.region=eu-west,cloud.availability_zone=eu-west-1a"
        );
        let sparse = Baggage {
            namespace: "shop",
            workload_type: "deployment",
            ..Default::default()
        };
        assert_eq!(sparse.header(), "k8s.namespace.name=shop");
        // A value that cannot go in a header yields an empty one, not a panic.
        let bad = Baggage {
            namespace: "a\nb",
            ..Default::default()
        };
        assert_eq!(bad.header(), "");
    }

    #[test]
    fn connect_request_carries_authority_and_headers() {
        let r = req().to_http().unwrap();
        assert_eq!(r.method(), Method::CONNECT);
        assert_eq!(r.uri().authority().unwrap().as_str(), "10.0.0.3:8080");
        assert_eq!(forwarded_for(&r), Some("10.0.0.2:40000".parse().unwrap()));
        assert!(r.headers()["baggage"]
            .to_str()
            .unwrap()
            .contains("k8s.namespace.name=default"));
        let tp = r.headers()["traceparent"].to_str().unwrap();
        assert_eq!(tp.len(), 55, "{tp}");
        // What is new in every request stays out of the HPACK tables; what
        // repeats for a source goes in.
        assert!(r.headers()["forwarded"].is_sensitive());
        assert!(r.headers()["traceparent"].is_sensitive());
        assert!(!r.headers()["baggage"].is_sensitive());
        let v6 = ConnectRequest {
            target: "[fd00::3]:80".parse::<SocketAddr>().unwrap().into(),
            ..req()
        }
        .to_http()
        .unwrap();
        assert_eq!(v6.uri().authority().unwrap().as_str(), "[fd00::3]:80");
    }

    #[test]
    fn the_inner_connect_through_a_gateway_names_the_service_and_the_source_network() {
        let inner = ConnectRequest {
            target: Authority::Host("api.default.svc.cluster.local".into(), 80),
            host: Some("api.default.svc.cluster.local".into()),
            network: Some("net1".into()),
            ..req()
        }
        .to_http()
        .unwrap();
        assert_eq!(
            inner.uri().authority().unwrap().as_str(),
            "api.default.svc.cluster.local:80"
        );
        assert_eq!(inner.headers()["x-forwarded-network"], "net1");
        assert_eq!(
            inner.headers()["forwarded"],
            "for=\"10.0.0.2:40000\";host=api.default.svc.cluster.local"
        );
        // What the destination's inbound reads back.
        assert_eq!(
            authority_of(&inner),
            Ok(Authority::Host("api.default.svc.cluster.local".into(), 80))
        );
        let direct = req().to_http().unwrap();
        assert!(!direct.headers().contains_key("x-forwarded-network"));
    }

    fn no_host(_: &str, _: u16) -> Result<u16, ConnectRejection> {
        unreachable!("an address authority is never looked up by name")
    }

    #[test]
    fn validation_statuses() {
        let local: IpAddr = "10.0.0.3".parse().unwrap();
        let ok = req().to_http().unwrap();
        assert_eq!(
            validate_connect(&ok, local, |_| false, no_host),
            Ok("10.0.0.3:8080".parse().unwrap())
        );
        let mapped: IpAddr = "::ffff:10.0.0.3".parse().unwrap();
        assert!(validate_connect(&ok, mapped, |_| false, no_host).is_ok());
        let other = ConnectRequest {
            target: "10.0.0.9:8080".parse::<SocketAddr>().unwrap().into(),
            ..req()
        }
        .to_http()
        .unwrap();
        assert_eq!(
            validate_connect(&other, local, |_| false, no_host),
            Err(ConnectRejection::NotThisPod("10.0.0.9".parse().unwrap()))
        );
        // The pod that is the target's waypoint takes it, on its own address.
        assert_eq!(
            validate_connect(&other, local, |t| t.ip().to_string() == "10.0.0.9", no_host),
            Ok("10.0.0.3:8080".parse().unwrap())
        );
        let own = ConnectRequest {
            target: "10.0.0.3:15008".parse::<SocketAddr>().unwrap().into(),
            ..req()
        }
        .to_http()
        .unwrap();
        assert_eq!(
            validate_connect(&own, local, |_| false, no_host),
            Err(ConnectRejection::ProxyPort(15008))
        );
        let get = Request::get("http://10.0.0.3:80/").body(()).unwrap();
        assert!(matches!(
            validate_connect(&get, local, |_| false, no_host),
            Err(ConnectRejection::NotConnect(_))
        ));
        let connect = |authority: &str| {
            Request::builder()
                .method(Method::CONNECT)
                .uri(authority)
                .body(())
                .unwrap()
        };
        // A service's hostname: delivered to this pod at the port the pod
        // backs it on; the service found is the one `backs` was asked for.
        let backs = |host: &str, port: u16| match (host, port) {
            ("echo.ns.svc.cluster.local", 80) => Ok(8080),
            ("echo.ns.svc.cluster.local", 15008) => Ok(15008),
            (h, 80) => Err(ConnectRejection::NotBacked(h.to_string())),
            (h, p) => Err(ConnectRejection::NoPort(h.to_string(), p)),
        };
        assert_eq!(
            validate_connect(
                &connect("Echo.ns.svc.cluster.local:80"),
                local,
                |_| false,
                backs
            ),
            Ok("10.0.0.3:8080".parse().unwrap())
        );
        assert_eq!(
            validate_connect(
                &connect("other.ns.svc.cluster.local:80"),
                local,
                |_| false,
                backs
            ),
            Err(ConnectRejection::NotBacked(
                "other.ns.svc.cluster.local".into()
            ))
        );
        assert_eq!(
            validate_connect(
                &connect("echo.ns.svc.cluster.local:81"),
                local,
                |_| false,
                backs
            ),
            Err(ConnectRejection::NoPort(
                "echo.ns.svc.cluster.local".into(),
                81
            ))
        );
        // A port that maps onto the proxy's own is still refused.
        assert_eq!(
            validate_connect(
                &connect("echo.ns.svc.cluster.local:15008"),
                local,
                |_| false,
                backs
            ),
            Err(ConnectRejection::ProxyPort(15008))
        );
        // No port, an IP without a port, a name with bytes no DNS name has,
        // or a user part: not an authority a peer may send.
        for bad in [
            "example.com",
            "10.0.0.3",
            "a_b.example:80",
            "u@example.com:80",
            "[::1]",
        ] {
            assert!(
                matches!(
                    validate_connect(&connect(bad), local, |_| false, |_: &str, _| Ok(80)),
                    Err(ConnectRejection::BadAuthority(_))
                ),
                "{bad}"
            );
        }
        assert_eq!(
            ConnectRejection::NotBacked("x".into()).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            ConnectRejection::ProxyPort(1).status(),
            StatusCode::BAD_REQUEST
        );
    }
}
