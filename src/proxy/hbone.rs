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
    /// The destination pod address and port (`:authority`).
    pub target: SocketAddr,
    /// The original client address (`forwarded: for=`).
    pub source: SocketAddr,
    /// The service the client asked for, when the hop is to its waypoint
    /// (`forwarded: ...;host=`).
    pub host: Option<String>,
    /// The source workload's `baggage`, made once per pod ([`baggage`]).
    pub baggage: http::HeaderValue,
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
        Request::builder()
            .method(Method::CONNECT)
            .uri(self.target.to_string())
            .header(FORWARDED, once(self.forwarded())?)
            .header(BAGGAGE, self.baggage.clone())
            .header(TRACEPARENT, once(traceparent)?)
            .body(())
    }
}

/// Why a CONNECT was refused, with the status it earns.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectRejection {
    #[error("method {0} is not CONNECT")]
    NotConnect(String),
    #[error("authority {0:?} is not ip:port")]
    BadAuthority(String),
    #[error("destination {0} is not this pod's address")]
    NotThisPod(IpAddr),
    #[error("destination port {0} belongs to the proxy")]
    ProxyPort(u16),
}

impl ConnectRejection {
    pub fn status(&self) -> StatusCode {
        StatusCode::BAD_REQUEST
    }
}

/// Checks a received CONNECT: method, `ip:port` authority, the IP is the one
/// the connection arrived on (the pod's own), and the port is not the proxy's.
/// Where a CONNECT is delivered: the authority, which must be this pod's
/// address; or, when this pod is the waypoint of the workload or service
/// the authority names (`fronts`), this pod's address with the authority's
/// port (the "sandwich": the pod's waypoint application takes it from there).
pub fn validate_connect<B>(
    req: &Request<B>,
    local_ip: IpAddr,
    fronts: impl FnOnce(SocketAddr) -> bool,
) -> Result<SocketAddr, ConnectRejection> {
    if req.method() != Method::CONNECT {
        return Err(ConnectRejection::NotConnect(req.method().to_string()));
    }
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str())
        .unwrap_or_default();
    let target: SocketAddr = authority
        .parse()
        .map_err(|_| ConnectRejection::BadAuthority(authority.to_string()))?;
    let target = if canonical(target.ip()) == canonical(local_ip) {
        target
    } else if fronts(target) {
        SocketAddr::new(local_ip, target.port())
    } else {
        return Err(ConnectRejection::NotThisPod(target.ip()));
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
            target: "10.0.0.3:8080".parse().unwrap(),
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
            target: "[fd00::3]:80".parse().unwrap(),
            ..req()
        }
        .to_http()
        .unwrap();
        assert_eq!(v6.uri().authority().unwrap().as_str(), "[fd00::3]:80");
    }

    #[test]
    fn validation_statuses() {
        let local: IpAddr = "10.0.0.3".parse().unwrap();
        let ok = req().to_http().unwrap();
        assert_eq!(
            validate_connect(&ok, local, |_| false),
            Ok("10.0.0.3:8080".parse().unwrap())
        );
        let mapped: IpAddr = "::ffff:10.0.0.3".parse().unwrap();
        assert!(validate_connect(&ok, mapped, |_| false).is_ok());
        let other = ConnectRequest {
            target: "10.0.0.9:8080".parse().unwrap(),
            ..req()
        }
        .to_http()
        .unwrap();
        assert_eq!(
            validate_connect(&other, local, |_| false),
            Err(ConnectRejection::NotThisPod("10.0.0.9".parse().unwrap()))
        );
        // The pod that is the target's waypoint takes it, on its own address.
        assert_eq!(
            validate_connect(&other, local, |t| t.ip().to_string() == "10.0.0.9"),
            Ok("10.0.0.3:8080".parse().unwrap())
        );
        let own = ConnectRequest {
            target: "10.0.0.3:15008".parse().unwrap(),
            ..req()
        }
        .to_http()
        .unwrap();
        assert_eq!(
            validate_connect(&own, local, |_| false),
            Err(ConnectRejection::ProxyPort(15008))
        );
        let get = Request::get("http://10.0.0.3:80/").body(()).unwrap();
        assert!(matches!(
            validate_connect(&get, local, |_| false),
            Err(ConnectRejection::NotConnect(_))
        ));
        let host = Request::builder()
            .method(Method::CONNECT)
            .uri("example.com:80")
            .body(())
            .unwrap();
        assert!(matches!(
            validate_connect(&host, local, |_| false),
            Err(ConnectRejection::BadAuthority(_))
        ));
        assert_eq!(
            ConnectRejection::ProxyPort(1).status(),
            StatusCode::BAD_REQUEST
        );
    }
}
