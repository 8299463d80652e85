//! On-demand DNS for workloads reached by hostname (DNS `ServiceEntry`
//! endpoints): the hostname is resolved when a connection needs it, from
//! inside the asking pod's netns through the node's resolvers (as the DNS
//! proxy forwards), and the answer is kept for its TTL. Messages are
//! hickory-proto's; the cache is bounded.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};

use super::dns::exchange;
use super::pod::SocketFactory;

/// Hostnames kept at once; past it, expired ones go, then all.
const MAX_CACHED: usize = 4096;
/// An answer is kept no longer than this, whatever its TTL.
const MAX_TTL: Duration = Duration::from_secs(3600);

/// Resolves and caches the hostnames of hostname workloads.
#[derive(Debug)]
pub struct HostnameResolver {
    upstreams: Arc<Vec<SocketAddr>>,
    cache: Mutex<HashMap<String, Cached>>,
}

#[derive(Debug, Clone)]
struct Cached {
    ips: Vec<IpAddr>,
    until: Instant,
}

impl HostnameResolver {
    pub fn new(upstreams: Arc<Vec<SocketAddr>>) -> Self {
        HostnameResolver {
            upstreams,
            cache: Mutex::default(),
        }
    }

    /// An address of `host`, of the family of `like` when it has one.
    pub async fn resolve(
        &self,
        sockets: &SocketFactory,
        host: &str,
        like: IpAddr,
    ) -> Result<IpAddr, String> {
        let now = Instant::now();
        let cached = self.cached(host, now);
        let ips = match cached {
            Some(ips) => ips,
            None => {
                let (ips, ttl) = self.ask(sockets, host).await?;
                self.keep(host, &ips, ttl, now);
                ips
            }
        };
        pick(&ips, like).ok_or_else(|| format!("hostname {host} has no address"))
    }

    fn cached(&self, host: &str, now: Instant) -> Option<Vec<IpAddr>> {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .get(host)
            .filter(|c| c.until > now)
            .map(|c| c.ips.clone())
    }

    fn keep(&self, host: &str, ips: &[IpAddr], ttl: Duration, now: Instant) {
        if ttl.is_zero() {
            return;
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MAX_CACHED {
            cache.retain(|_, c| c.until > now);
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
        }
        let until = now + ttl.min(MAX_TTL);
        cache.insert(
            host.to_string(),
            Cached {
                ips: ips.to_vec(),
                until,
            },
        );
    }

    /// A and AAAA queries; the addresses of both, and the least TTL.
    async fn ask(
        &self,
        sockets: &SocketFactory,
        host: &str,
    ) -> Result<(Vec<IpAddr>, Duration), String> {
        let name = Name::from_ascii(format!("{}.", host.trim_end_matches('.')))
            .map_err(|e| format!("hostname {host:?} is not a DNS name: {e}"))?;
        let mut ips = Vec::new();
        let mut ttl: Option<u32> = None;
        let mut failure = None;
        for ty in [RecordType::A, RecordType::AAAA] {
            let id = fastrand::u16(..);
            let mut q = Message::new();
            q.set_id(id)
                .set_recursion_desired(true)
                .add_query(Query::query(name.clone(), ty));
            let packet = q.to_vec().map_err(|e| e.to_string())?;
            let Some(reply) = exchange(sockets, &self.upstreams, &packet).await else {
                failure = Some(format!("no resolver answered for {host}"));
                continue;
            };
            match parse_answer(&reply, id) {
                Ok((found, t)) => {
                    ips.extend(found);
                    if let Some(t) = t {
                        ttl = Some(ttl.map_or(t, |old| old.min(t)));
                    }
                }
                Err(e) => failure = Some(format!("{host}: {e}")),
            }
        }
        if ips.is_empty() {
            return Err(failure.unwrap_or_else(|| format!("hostname {host} has no address")));
        }
        Ok((ips, Duration::from_secs(u64::from(ttl.unwrap_or(0)))))
    }
}

/// The addresses in a DNS answer to query `id`, and their least TTL.
fn parse_answer(bytes: &[u8], id: u16) -> Result<(Vec<IpAddr>, Option<u32>), String> {
    let m = Message::from_vec(bytes).map_err(|e| format!("bad DNS answer: {e}"))?;
    if m.id() != id || m.message_type() != MessageType::Response {
        return Err("a DNS answer to another query".into());
    }
    match m.response_code() {
        ResponseCode::NoError => {}
        ResponseCode::NXDomain => return Err("no such name".into()),
        other => return Err(format!("resolver answered {other}")),
    }
    let mut ips = Vec::new();
    let mut ttl: Option<u32> = None;
    for r in m.answers() {
        let ip = match r.data() {
            RData::A(a) => IpAddr::V4(a.0),
            RData::AAAA(a) => IpAddr::V6(a.0),
            _ => continue,
        };
        ips.push(ip);
        ttl = Some(ttl.map_or(r.ttl(), |t| t.min(r.ttl())));
    }
    Ok((ips, ttl))
}

/// One of `ips` at random, of the family of `like` when there is one.
fn pick(ips: &[IpAddr], like: IpAddr) -> Option<IpAddr> {
    let same: Vec<&IpAddr> = ips
        .iter()
        .filter(|ip| ip.is_ipv4() == like.is_ipv4())
        .collect();
    let from: Vec<&IpAddr> = if same.is_empty() {
        ips.iter().collect()
    } else {
        same
    };
    (!from.is_empty()).then(|| *from[fastrand::usize(..from.len())])
}

#[cfg(test)]
mod tests {
    use hickory_proto::rr::rdata::{A, AAAA};
    use hickory_proto::rr::Record;

    use super::*;

    fn answer(id: u16, code: ResponseCode, records: &[(RData, u32)]) -> Vec<u8> {
        let mut m = Message::new();
        m.set_id(id)
            .set_message_type(MessageType::Response)
            .set_response_code(code);
        let name = Name::from_ascii("api.example.com.").unwrap();
        for (data, ttl) in records {
            m.add_answer(Record::from_rdata(name.clone(), *ttl, data.clone()));
        }
        m.to_vec().unwrap()
    }

    #[test]
    fn answers_give_their_addresses_and_least_ttl_and_bad_ones_an_error() {
        let v4 = RData::A(A("192.0.2.7".parse().unwrap()));
        let v6 = RData::AAAA(AAAA("2001:db8::7".parse().unwrap()));
        let (ips, ttl) = parse_answer(
            &answer(7, ResponseCode::NoError, &[(v4.clone(), 60), (v6, 30)]),
            7,
        )
        .unwrap();
        assert_eq!(ips.len(), 2);
        assert_eq!(ttl, Some(30));
        assert!(
            parse_answer(&answer(8, ResponseCode::NoError, &[(v4.clone(), 60)]), 7)
                .unwrap_err()
                .contains("another query")
        );
        assert_eq!(
            parse_answer(&answer(7, ResponseCode::NXDomain, &[]), 7).unwrap_err(),
            "no such name"
        );
        assert!(
            parse_answer(b"\x00\x07garbage", 7).is_err(),
            "garbage is an error, not a panic"
        );
    }

    #[test]
    fn answers_are_kept_for_their_ttl_and_no_longer() {
        let r = HostnameResolver::new(Arc::default());
        let now = Instant::now();
        let ips: Vec<IpAddr> = vec!["192.0.2.7".parse().unwrap()];
        r.keep("api.example.com", &ips, Duration::from_secs(30), now);
        assert_eq!(
            r.cached("api.example.com", now + Duration::from_secs(29)),
            Some(ips.clone())
        );
        assert_eq!(
            r.cached("api.example.com", now + Duration::from_secs(30)),
            None,
            "expired"
        );
        r.keep("zero.example.com", &ips, Duration::ZERO, now);
        assert_eq!(r.cached("zero.example.com", now), None, "TTL 0 is not kept");
        // Bounded: a flood of names does not grow the cache past its cap.
        for i in 0..(MAX_CACHED + 10) {
            r.keep(
                &format!("h{i}.example.com"),
                &ips,
                Duration::from_secs(30),
                now,
            );
        }
        assert!(r.cache.lock().unwrap().len() <= MAX_CACHED);
    }

    #[test]
    fn the_address_family_of_the_destination_is_preferred() {
        let ips: Vec<IpAddr> = vec!["192.0.2.7".parse().unwrap(), "2001:db8::7".parse().unwrap()];
        assert_eq!(pick(&ips, "10.96.0.1".parse().unwrap()), Some(ips[0]));
        assert_eq!(pick(&ips, "fd00::1".parse().unwrap()), Some(ips[1]));
        assert_eq!(
            pick(&ips[..1], "fd00::1".parse().unwrap()),
            Some(ips[0]),
            "else any"
        );
        assert_eq!(pick(&[], "10.0.0.1".parse().unwrap()), None);
    }
}
