//! The CONNECT a proxy receives on 15008, as h2 hands it over, through
//! `validate_connect`, `forwarded_for` and `forwarded_host` as the inbound
//! listener calls them.
//!
//! Input: a knob byte (bits 0-1: this pod's address, 10.0.0.3,
//! ::ffff:10.0.0.3, fd00::3 or the authority's own; bit 2: this pod is the
//! target's waypoint), then a `METHOD URI` line and `name: value` lines.
//!
//! Checked beyond "no panic": an accepted target is this pod's address
//! (v4-mapped counted as v4) on a port that is not the proxy's own; and
//! what was accepted, sent on with `ConnectRequest::to_http` as a proxy
//! sends it, reads back the same.

#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ambit::constants::PROXY_OWN_PORTS;
use ambit::proxy::{
    forwarded_for, forwarded_host, validate_connect, Baggage, ConnectRejection, ConnectRequest,
};
use ambit_fuzz::knob;
use http::{HeaderName, HeaderValue, Method, Request, Uri};
use libfuzzer_sys::fuzz_target;

const POD: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 3);

fuzz_target!(|data: &[u8]| {
    let (flags, text) = knob(data);
    let Some(req) = request(text) else {
        return;
    };
    let local = match flags & 3 {
        0 => IpAddr::V4(POD),
        1 => IpAddr::V6(POD.to_ipv6_mapped()),
        2 => IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 3)),
        _ => authority_ip(&req).unwrap_or(IpAddr::V4(POD)),
    };
    let fronts = flags & 4 != 0;
    let source = forwarded_for(&req);
    let host = forwarded_host(&req);
    // A hostname authority: one this pod backs (on port 8080 behind any
    // port) with the next flag, else none.
    let backs_any = flags & 8 != 0;
    let backs = |host: &str, _port: u16| match backs_any {
        true => Ok(8080),
        false => Err(ConnectRejection::NotBacked(host.to_string())),
    };
    let target = match validate_connect(&req, local, |_| fronts, backs) {
        Ok(target) => target,
        Err(rejection) => {
            let _ = (rejection.to_string(), rejection.status());
            return;
        }
    };
    assert_eq!(
        v4_first(target.ip()),
        v4_first(local),
        "accepted {target}, not this pod's address {local}"
    );
    assert!(
        !PROXY_OWN_PORTS.contains(&target.port()),
        "accepted the proxy's own port: {target}"
    );
    send_on(target, source, host);
});

/// `METHOD URI`, then headers; a header line h2 would refuse is left out.
fn request(text: &[u8]) -> Option<Request<()>> {
    let mut lines = text.split(|b| *b == b'\n');
    let first = lines.next()?;
    let (method, uri) = match first.iter().position(|b| *b == b' ') {
        Some(i) => (&first[..i], &first[i + 1..]),
        None => (first, &[][..]),
    };
    let mut req = Request::new(());
    *req.method_mut() = Method::from_bytes(method).ok()?;
    *req.uri_mut() = Uri::try_from(uri).ok()?;
    for line in lines {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let name = HeaderName::from_bytes(&line[..colon]);
        let value = HeaderValue::from_bytes(line[colon + 1..].trim_ascii_start());
        if let (Ok(name), Ok(value)) = (name, value) {
            req.headers_mut().append(name, value);
        }
    }
    Some(req)
}

fn authority_ip(req: &Request<()>) -> Option<IpAddr> {
    let authority = req.uri().authority()?.as_str();
    authority.parse::<SocketAddr>().ok().map(|a| a.ip())
}

/// `::ffff:a.b.c.d` as `a.b.c.d`: a dual-stack listener sees either form.
fn v4_first(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Sends the accepted connection on as a proxy does (to a waypoint, or to
/// the application behind it) and reads the request back.
fn send_on(target: SocketAddr, source: Option<SocketAddr>, host: Option<String>) {
    // Text forms carry no v6 flow info or scope id: compare without them.
    let target = SocketAddr::new(target.ip(), target.port());
    let source = source.map_or(SocketAddr::from(([10, 0, 0, 2], 40000)), |s| {
        SocketAddr::new(s.ip(), s.port())
    });
    let baggage = Baggage {
        namespace: host.as_deref().unwrap_or_default(),
        workload_type: "pod",
        ..Default::default()
    }
    .header();
    let sent = ConnectRequest {
        target: target.into(),
        source,
        host: host.clone(),
        baggage,
        network: None,
    }
    .to_http()
    .expect("a request rebuilt from an accepted one is valid");
    let no_host = |h: &str, _| Err(ConnectRejection::NotBacked(h.to_string()));
    assert_eq!(
        validate_connect(&sent, target.ip(), |_| false, no_host),
        Ok(target)
    );
    assert_eq!(forwarded_for(&sent), Some(source));
    // `host=` goes out unquoted: only a hostname-like value reads back whole.
    let hostname_like = |h: &str| {
        h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
    };
    if host.as_deref().is_some_and(hostname_like) {
        assert_eq!(forwarded_host(&sent), host);
    }
}
