//! On-demand DNS for workloads reached by hostname (DNS `ServiceEntry`
//! endpoints): the hostname is resolved when a connection needs it, with
//! the node's resolvers, from the proxy's own netns, as ztunnel does. Never
//! from inside the asking pod: the answer is shared by every pod of the
//! node, and a pod can answer its own DNS (an address of the resolver's on
//! its loopback is enough), so it could send everyone else's connections
//! to itself. Answers are checked (the id, the question asked, the names
//! and types of the records) and kept for their TTL. Messages are
//! hickory-proto's; the cache is bounded.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RData, RecordType};

use super::dns::{datagram, UPSTREAM_TIMEOUT};
use super::pod::SocketFactory;
#[cfg(test)]
use super::pod::SocketOptions;

/// Hostnames kept at once; past it, expired ones go, then all.
const MAX_CACHED: usize = 4096;
/// An answer is kept no longer than this, whatever its TTL.
const MAX_TTL: Duration = Duration::from_secs(3600);
/// CNAMEs followed from the name asked, at most.
const MAX_CNAMES: usize = 8;
/// Datagrams read per query that are not its answer (a flood of forged
/// ones ends the wait for that resolver, not the proxy's patience).
const MAX_STRAY: usize = 16;

/// Resolves and caches the hostnames of hostname workloads.
#[derive(Debug)]
pub struct HostnameResolver {
    upstreams: Arc<Vec<SocketAddr>>,
    /// Sockets in the proxy's own netns, never a pod's.
    sockets: SocketFactory,
    cache: Mutex<HashMap<String, Cached>>,
}

#[derive(Debug, Clone)]
struct Cached {
    ips: Vec<IpAddr>,
    until: Instant,
}

impl HostnameResolver {
    /// Asks `upstreams` through `sockets`, which must be the proxy's own
    /// ([`SocketFactory::local`]).
    pub fn new(upstreams: Arc<Vec<SocketAddr>>, sockets: SocketFactory) -> Self {
        HostnameResolver {
            upstreams,
            sockets,
            cache: Mutex::default(),
        }
    }

    /// An address of `host`, of the family of `like` when it has one.
    pub async fn resolve(&self, host: &str, like: IpAddr) -> Result<IpAddr, String> {
        let now = Instant::now();
        let cached = self.cached(host, now);
        let ips = match cached {
            Some(ips) => ips,
            None => {
                let (ips, ttl) = self.ask(host).await?;
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
    async fn ask(&self, host: &str) -> Result<(Vec<IpAddr>, Duration), String> {
        let name = Name::from_ascii(format!("{}.", host.trim_end_matches('.')))
            .map_err(|e| format!("hostname {host:?} is not a DNS name: {e}"))?;
        let mut ips = Vec::new();
        let mut ttl: Option<u32> = None;
        let mut failure = None;
        for ty in [RecordType::A, RecordType::AAAA] {
            match self.query(&name, ty).await {
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

    /// One question to each resolver in turn until one answers it. A
    /// datagram that is not the answer to this question is dropped and the
    /// wait goes on (a connected socket hears only the resolver).
    async fn query(&self, name: &Name, ty: RecordType) -> Result<Answer, String> {
        let id = fastrand::u16(..);
        let mut q = Message::new();
        q.set_id(id)
            .set_recursion_desired(true)
            .add_query(Query::query(name.clone(), ty));
        let packet = q.to_vec().map_err(|e| e.to_string())?;
        for upstream in self.upstreams.iter() {
            let Ok(sock) = self.sockets.udp(*upstream, true) else {
                continue;
            };
            if sock.send(&packet).await.is_err() {
                continue;
            }
            let answer = async {
                for _ in 0..MAX_STRAY {
                    let Ok((reply, ())) =
                        datagram(&sock, |s, buf| s.try_recv(buf).map(|n| (n, ()))).await
                    else {
                        return None;
                    };
                    match parse_answer(&reply, id, name, ty) {
                        Err(Refused::NotOurs) => continue,
                        other => return Some(other),
                    }
                }
                None
            };
            match tokio::time::timeout(UPSTREAM_TIMEOUT, answer).await {
                Ok(Some(Ok(found))) => return Ok(found),
                Ok(Some(Err(Refused::Says(e)))) => return Err(e),
                _ => tracing::debug!(upstream = %upstream, "DNS resolver did not answer"),
            }
        }
        Err(format!("no resolver answered for {name}"))
    }
}

/// The addresses of an answer, and their least TTL.
pub type Answer = (Vec<IpAddr>, Option<u32>);

/// Why a datagram gives no addresses.
#[derive(Debug, PartialEq)]
pub enum Refused {
    /// Not the answer to the question asked (another id, another question,
    /// garbage): dropped, and the answer still awaited.
    NotOurs,
    /// The resolver's answer, and it has no address (no such name, a failure).
    Says(String),
}

/// The addresses in a DNS answer to query `id` for `name`'s `ty` records,
/// and their least TTL. Only records of `name`, or of the names its CNAMEs
/// lead to, and only of type `ty`, are taken: whatever else an answer
/// carries is not believed.
pub fn parse_answer(bytes: &[u8], id: u16, name: &Name, ty: RecordType) -> Result<Answer, Refused> {
    let m = Message::from_vec(bytes).map_err(|_| Refused::NotOurs)?;
    if m.id() != id || m.message_type() != MessageType::Response {
        return Err(Refused::NotOurs);
    }
    match m.queries() {
        [q] if q.name() == name => {
            if q.query_type() != ty || q.query_class() != DNSClass::IN {
                return Err(Refused::NotOurs);
            }
        }
        _ => return Err(Refused::NotOurs),
    }
    match m.response_code() {
        ResponseCode::NoError => {}
        ResponseCode::NXDomain => return Err(Refused::Says("no such name".into())),
        other => return Err(Refused::Says(format!("resolver answered {other}"))),
    }
    // The names that stand for `name`: itself and its CNAME chain.
    let mut names = vec![name.clone()];
    let mut ttl: Option<u32> = None;
    let mut least = |t: u32| ttl = Some(ttl.map_or(t, |old: u32| old.min(t)));
    while names.len() <= MAX_CNAMES {
        let last = names.last().expect("never empty");
        let next = m.answers().iter().find_map(|r| match r.data() {
            RData::CNAME(target) if r.name() == last => Some((target.0.clone(), r.ttl())),
            _ => None,
        });
        match next {
            Some((target, t)) if !names.contains(&target) => {
                least(t);
                names.push(target);
            }
            _ => break,
        }
    }
    let mut ips = Vec::new();
    for r in m.answers() {
        if r.record_type() != ty || !names.contains(r.name()) {
            continue;
        }
        let ip = match r.data() {
            RData::A(a) => IpAddr::V4(a.0),
            RData::AAAA(a) => IpAddr::V6(a.0),
            _ => continue,
        };
        ips.push(ip);
        least(r.ttl());
    }
    if ips.is_empty() {
        ttl = None;
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
    use hickory_proto::rr::rdata::{A, AAAA, CNAME};
    use hickory_proto::rr::Record;

    use super::*;

    fn name(n: &str) -> Name {
        Name::from_ascii(n).unwrap()
    }

    /// An answer to `id`, asking `asked` for A records, with `records`.
    fn answer(id: u16, asked: &str, code: ResponseCode, records: &[(&str, RData, u32)]) -> Vec<u8> {
        let mut m = Message::new();
        m.set_id(id)
            .set_message_type(MessageType::Response)
            .set_response_code(code)
            .add_query(Query::query(name(asked), RecordType::A));
        for (owner, data, ttl) in records {
            m.add_answer(Record::from_rdata(name(owner), *ttl, data.clone()));
        }
        m.to_vec().unwrap()
    }

    fn a(ip: &str) -> RData {
        RData::A(A(ip.parse().unwrap()))
    }

    const API: &str = "api.example.com.";

    #[test]
    fn answers_give_their_addresses_and_least_ttl_and_bad_ones_an_error() {
        let api = name(API);
        let v6 = RData::AAAA(AAAA("2001:db8::7".parse().unwrap()));
        let (ips, ttl) = parse_answer(
            &answer(
                7,
                API,
                ResponseCode::NoError,
                &[(API, a("192.0.2.7"), 60), (API, a("192.0.2.8"), 30)],
            ),
            7,
            &api,
            RecordType::A,
        )
        .unwrap();
        assert_eq!(ips.len(), 2);
        assert_eq!(ttl, Some(30));
        assert_eq!(
            parse_answer(
                &answer(7, API, ResponseCode::NXDomain, &[]),
                7,
                &api,
                RecordType::A
            ),
            Err(Refused::Says("no such name".into()))
        );
        // An AAAA record in an answer to an A question is not believed.
        let (ips, ttl) = parse_answer(
            &answer(7, API, ResponseCode::NoError, &[(API, v6, 60)]),
            7,
            &api,
            RecordType::A,
        )
        .unwrap();
        assert!(ips.is_empty() && ttl.is_none());
        assert_eq!(
            parse_answer(b"\x00\x07garbage", 7, &api, RecordType::A),
            Err(Refused::NotOurs),
            "garbage is dropped, not a panic"
        );
    }

    #[test]
    fn only_the_answer_to_the_question_asked_is_believed() {
        let api = name(API);
        let ok = [(API, a("192.0.2.7"), 60)];
        let not_ours = |bytes: Vec<u8>, why: &str| {
            assert_eq!(
                parse_answer(&bytes, 7, &api, RecordType::A),
                Err(Refused::NotOurs),
                "{why}"
            );
        };
        not_ours(answer(8, API, ResponseCode::NoError, &ok), "another id");
        not_ours(
            answer(7, "evil.example.com.", ResponseCode::NoError, &ok),
            "another question",
        );
        let mut aaaa = Message::from_vec(&answer(7, API, ResponseCode::NoError, &ok)).unwrap();
        aaaa.queries_mut()[0].set_query_type(RecordType::AAAA);
        not_ours(aaaa.to_vec().unwrap(), "another type asked");
        let mut query = Message::from_vec(&answer(7, API, ResponseCode::NoError, &ok)).unwrap();
        query.set_message_type(MessageType::Query);
        not_ours(query.to_vec().unwrap(), "a query, not an answer");
        // The name's case is the resolver's to change (0x20 encoding).
        let upper = answer(
            7,
            "API.Example.COM.",
            ResponseCode::NoError,
            &[("API.Example.COM.", a("192.0.2.7"), 60)],
        );
        assert_eq!(
            parse_answer(&upper, 7, &api, RecordType::A)
                .unwrap()
                .0
                .len(),
            1
        );
    }

    #[test]
    fn records_of_other_names_are_not_believed_but_a_cname_chain_is_followed() {
        let api = name(API);
        let cname = |to: &str| RData::CNAME(CNAME(name(to)));
        // A record for another name rides along: ignored.
        let (ips, _) = parse_answer(
            &answer(
                7,
                API,
                ResponseCode::NoError,
                &[
                    ("bank.example.org.", a("203.0.113.66"), 60),
                    (API, a("192.0.2.7"), 60),
                ],
            ),
            7,
            &api,
            RecordType::A,
        )
        .unwrap();
        assert_eq!(ips, ["192.0.2.7".parse::<IpAddr>().unwrap()]);
        // api -> edge -> host: the host's address, with the least TTL of the chain.
        let (ips, ttl) = parse_answer(
            &answer(
                7,
                API,
                ResponseCode::NoError,
                &[
                    ("edge.cdn.example.", cname("host.cdn.example."), 20),
                    (API, cname("edge.cdn.example."), 300),
                    ("host.cdn.example.", a("192.0.2.9"), 60),
                    ("other.cdn.example.", a("203.0.113.66"), 60),
                ],
            ),
            7,
            &api,
            RecordType::A,
        )
        .unwrap();
        assert_eq!(ips, ["192.0.2.9".parse::<IpAddr>().unwrap()]);
        assert_eq!(ttl, Some(20));
        // A CNAME loop ends.
        let (ips, _) = parse_answer(
            &answer(
                7,
                API,
                ResponseCode::NoError,
                &[
                    (API, cname("loop.example.com."), 60),
                    ("loop.example.com.", cname(API), 60),
                ],
            ),
            7,
            &api,
            RecordType::A,
        )
        .unwrap();
        assert!(ips.is_empty());
    }

    #[test]
    fn answers_are_kept_for_their_ttl_and_no_longer() {
        let r = HostnameResolver::new(
            Arc::default(),
            SocketFactory::local(SocketOptions::marked(0), "proxy".into()),
        );
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
