//! The budget's rules, one at a time, on budgets of their own.

use super::windows::{IDLE_WINDOWS_AFTER, WINDOW_RETRY};
use super::*;
use crate::proxy::activity::OnConnection;

fn budget(limit: usize) -> &'static Budget {
    let b: &'static Budget = Box::leak(Box::default());
    b.set_limit(limit);
    b
}

const MIB: usize = 1 << 20;

fn configured() -> H2Settings {
    H2Settings {
        stream_window: 4 << 20,
        connection_window: 16 << 20,
        frame_size: 1 << 20,
        unsent_limit: 0,
    }
}

fn windows(h: H2Settings) -> (usize, usize) {
    (
        h.connection_window as usize / MIB,
        h.stream_window as usize * 4 / MIB,
    )
}

#[test]
fn connections_share_half_the_budget_in_power_of_two_windows_between_the_smallest_and_the_configured(
) {
    let gib = 1 << 30;
    let at = |n| windows(fair_windows(configured(), share_of(gib, Counted::busy(n))));
    // (connection MiB, stream in quarter MiB)
    assert_eq!(at(1), (16, 16));
    assert_eq!(at(32), (16, 16), "32 × 16 MiB is half of 1 GiB");
    assert_eq!(at(33), (8, 8));
    assert_eq!(at(64), (8, 8));
    assert_eq!(at(65), (4, 4));
    assert_eq!(at(512), (1, 1));
    let at_2048 = fair_windows(configured(), share_of(gib, Counted::busy(2048)));
    assert_eq!(
        (at_2048.connection_window, at_2048.stream_window),
        (256 << 10, 64 << 10)
    );
    assert_eq!(
        fair_windows(configured(), share_of(gib, Counted::busy(20_000))).connection_window,
        64 << 10,
        "never below 64 KiB / 16 KiB"
    );
    assert_eq!(
        fair_windows(configured(), 0).stream_window,
        16 << 10,
        "the smallest stream window"
    );
    assert_eq!(
        windows(fair_windows(configured(), share_of(0, Counted::busy(5000)))),
        (16, 16),
        "no budget"
    );
    // Configured below the floor: kept as configured.
    let small = H2Settings {
        stream_window: 8 << 10,
        connection_window: 32 << 10,
        ..configured()
    };
    assert_eq!(fair_windows(small, 0), small);
}

#[test]
fn a_connection_past_the_half_moves_every_connection_to_the_same_smaller_windows_and_back() {
    // Half of 128 MiB holds four 16 MiB windows; a connection's fair
    // windows may bring its peer to an eighth (16 MiB): one peer each.
    let b = budget(128 * MIB);
    let peer = |i: usize| Identity::new("td", "ns", &format!("p{i}"));
    let mut first: Vec<ConnectionWindows> = (0..4)
        .map(|i| {
            b.connection(configured(), &peer(i), Activity::new())
                .unwrap()
                .1
        })
        .collect();
    assert!(first.iter().all(|w| windows(w.granted()) == (16, 16)));
    assert_eq!(b.used(), 64 * MIB);
    assert!(
        first.iter().all(|w| !w.share.has_changed().unwrap()),
        "while all fit, others are not woken"
    );

    // A fifth: the fair share is 8 MiB, which the others hold until
    // they move, so it starts at the smallest and is behind.
    let (granted, mut fifth) = b
        .connection(configured(), &peer(4), Activity::new())
        .unwrap();
    assert_eq!(granted.connection_window, 64 << 10);
    assert!(fifth.behind());
    assert!(first.iter().all(|w| w.share.has_changed().unwrap()));
    for w in &mut first {
        assert_eq!(w.rebalance().map(windows), Some((8, 8)));
        assert!(!w.behind());
    }
    assert_eq!(b.used(), 4 * 8 * MIB + (64 << 10));
    assert_eq!(fifth.rebalance().map(windows), Some((8, 8)));
    assert!(!fifth.behind());
    assert_eq!(b.used(), 5 * 8 * MIB, "five equal windows");
    assert_eq!(fifth.rebalance(), None, "nothing moves twice");

    // It goes: the share rises only one connection below the step
    // (hysteresis), so the four keep 8 MiB until a second goes.
    drop(fifth);
    assert!(first.iter().all(|w| !w.share.has_changed().unwrap()));
    drop(first.remove(0));
    for w in &mut first {
        assert!(w.share.has_changed().unwrap());
        assert_eq!(w.rebalance().map(windows), Some((16, 16)));
    }
    assert_eq!(b.used(), 48 * MIB);
    drop(first);
    assert_eq!(b.used(), 0);
    assert_eq!(b.connections.lock().unwrap().all, 0);
    assert!(b.by_peer.lock().unwrap().is_empty());
}

#[test]
fn a_connection_churning_at_a_step_wakes_no_one_and_the_share_rises_an_eighth_below_it() {
    // Half of 1 GiB holds 32 connections at 16 MiB.
    let b = budget(1 << 30);
    let peer = |i: usize| Identity::new("td", "ns", &format!("p{i}"));
    let mut held: Vec<ConnectionWindows> = (0..32)
        .map(|i| {
            b.connection(configured(), &peer(i), Activity::new())
                .unwrap()
                .1
        })
        .collect();
    assert!(held.iter().all(|w| windows(w.granted()) == (16, 16)));
    // The 33rd: every connection falls to 8 MiB at once.
    held.push(
        b.connection(configured(), &peer(32), Activity::new())
            .unwrap()
            .1,
    );
    for w in &mut held {
        w.rebalance();
    }
    assert!(held.iter().all(|w| windows(w.granted()) == (8, 8)));
    assert_eq!(b.used(), 33 * 8 * MIB);
    // It goes and comes back, over and over: no one else is woken,
    // and each newcomer gets the same 8 MiB at once.
    for i in 0..10 {
        drop(held.pop());
        assert!(held.iter().all(|w| !w.share.has_changed().unwrap()));
        let (granted, w) = b
            .connection(configured(), &peer(100 + i), Activity::new())
            .unwrap();
        assert_eq!(windows(granted), (8, 8));
        held.push(w);
        assert!(held.iter().all(|w| !w.share.has_changed().unwrap()));
    }
    // Down to 30 (16 MiB would fit): still no one woken.
    held.truncate(30);
    assert!(held.iter().all(|w| !w.share.has_changed().unwrap()));
    // 29, an eighth below the step: all rise to 16 MiB again.
    held.truncate(29);
    for w in &mut held {
        assert!(w.share.has_changed().unwrap());
        assert_eq!(w.rebalance().map(windows), Some((16, 16)));
    }
    assert_eq!(b.used(), 29 * 16 * MIB);
    drop(held);
    assert_eq!((b.used(), b.connections.lock().unwrap().all), (0, 0));
}

#[test]
fn a_connection_refused_even_the_smallest_windows_is_not_counted_among_them() {
    let b = budget(256 << 10);
    let p = Identity::new("td", "ns", "p");
    // Its peer may hold a quarter (64 KiB): one smallest window.
    let (granted, kept) = b.connection(configured(), &p, Activity::new()).unwrap();
    assert_eq!(granted.connection_window, 64 << 10);
    assert_eq!(
        b.connection(configured(), &p, Activity::new()).unwrap_err(),
        Refusal::Peer
    );
    assert_eq!(b.connections.lock().unwrap().all, 1);
    drop(kept);
    assert_eq!((b.used(), b.connections.lock().unwrap().all), (0, 0));
}

#[test]
fn one_peer_gets_a_quarter_one_pod_a_half_and_everything_comes_back() {
    let b = budget(400);
    let (mallory, alice) = (
        Identity::new("td", "ns", "mallory"),
        Identity::new("td", "ns", "alice"),
    );
    let (victim, other): (Arc<str>, Arc<str>) = ("ns/victim".into(), "ns/other".into());
    let m1 = b.reserve(60, Some(&mallory), Some(&victim)).unwrap();
    let _m2 = b.reserve(40, Some(&mallory), Some(&victim)).unwrap();
    assert_eq!(
        b.reserve(1, Some(&mallory), Some(&other)).unwrap_err(),
        Refusal::Peer
    );
    // Others still get in, to the same pod up to its half.
    let a1 = b.reserve(100, Some(&alice), Some(&victim)).unwrap();
    assert_eq!(
        b.reserve(1, Some(&Identity::new("td", "ns", "bob")), Some(&victim))
            .unwrap_err(),
        Refusal::Pod
    );
    assert_eq!(b.used(), 200);
    drop(m1);
    assert!(b.reserve(60, Some(&mallory), Some(&other)).is_ok());
    drop(a1);
    assert_eq!(b.used(), 40);
    assert!(b.by_pod.lock().unwrap().get(&victim) == Some(&40));
}

#[test]
fn a_stream_grows_by_its_send_buffer_under_its_shares_and_gives_it_back_when_quiet() {
    let b = budget(400);
    let mallory = Identity::new("td", "ns", "mallory");
    let pod: Arc<str> = "ns/victim".into();
    // Many idle streams of one peer fit where sending ones would not.
    let mut idle: Vec<Reservation> = (0..10)
        .map(|_| b.reserve(5, Some(&mallory), Some(&pod)).unwrap())
        .collect();
    idle[0].grow(40).unwrap();
    assert_eq!(idle[1].grow(40).unwrap_err(), Refusal::Peer);
    assert_eq!(b.used(), 90, "a refused growth leaves the stream as it was");
    idle[0].shrink(40);
    idle[1].grow(40).unwrap();
    assert_eq!(b.by_peer.lock().unwrap().get(&mallory), Some(&90));
    idle.clear();
    assert_eq!(b.used(), 0);
    assert!(b.by_peer.lock().unwrap().is_empty());
    assert!(b.by_pod.lock().unwrap().is_empty());
}

#[test]
fn an_empty_reservation_leaves_no_share_entry_and_drops_without_a_lock() {
    let b = budget(400);
    let mallory = Identity::new("td", "ns", "mallory");
    let pod: Arc<str> = "ns/victim".into();
    let empty = b.reserve(0, Some(&mallory), Some(&pod)).unwrap();
    assert!(b.by_peer.lock().unwrap().is_empty(), "no entry for 0 bytes");
    assert!(b.by_pod.lock().unwrap().is_empty());
    let mut emptied = b.reserve(40, Some(&mallory), Some(&pod)).unwrap();
    emptied.shrink(usize::MAX);
    assert!(b.by_pod.lock().unwrap().is_empty(), "given back by shrink");
    // Both drop on another thread while the share maps are held locked
    // here: a drop that took a lock would not finish.
    let (peers, pods) = (b.by_peer.lock().unwrap(), b.by_pod.lock().unwrap());
    let (done, dropped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop((empty, emptied));
        let _ = done.send(());
    });
    let finished = dropped.recv_timeout(std::time::Duration::from_secs(2));
    drop((peers, pods));
    assert!(
        finished.is_ok(),
        "an empty reservation's drop waited for a lock"
    );
    assert_eq!(b.used(), 0);
}

#[test]
fn past_the_budget_streams_are_refused_and_connections_get_smaller_windows() {
    let b = budget(128 << 20);
    let h2 = H2Settings {
        stream_window: 4 << 20,
        connection_window: 16 << 20,
        frame_size: 1 << 20,
        unsent_limit: 0,
    };
    let peers: Vec<Identity> = (0..8)
        .map(|i| Identity::new("td", "ns", &format!("sa{i}")))
        .collect();
    let mut conns = Vec::new();
    for p in &peers[..4] {
        let (granted, r) = b.connection(h2, p, Activity::new()).unwrap();
        assert_eq!(granted.connection_window, 16 << 20);
        conns.push(r);
    }
    // Half reserved: the next ones get the smallest windows.
    let (reduced, _r) = b.connection(h2, &peers[4], Activity::new()).unwrap();
    assert_eq!(
        (reduced.connection_window, reduced.stream_window),
        (64 << 10, 16 << 10)
    );
    // A peer holding half its share gets the smaller windows too.
    let (second, _r2) = b.connection(h2, &peers[0], Activity::new()).unwrap();
    assert_eq!(second.connection_window, 64 << 10);
    let mut held = Vec::new();
    let refused = loop {
        match b.reserve(STREAM_COST, Some(&peers[5 + held.len() % 3]), None) {
            Ok(r) => held.push(r),
            Err(e) => break e,
        }
    };
    assert_eq!(refused, Refusal::Budget);
    assert!(b.used() <= 128 << 20);
    // Less than a stream is left: connections take the smallest windows
    // until it is gone, then are refused.
    let mut small = Vec::new();
    let refused = loop {
        match b.connection(h2, &peers[5 + small.len() % 3], Activity::new()) {
            Ok((granted, r)) => {
                assert_eq!(granted.connection_window, 64 << 10);
                small.push(r);
            }
            Err(e) => break e,
        }
    };
    assert_eq!(refused, Refusal::Budget);
    assert!(small.len() < STREAM_COST / (64 << 10));
    assert!(b.used() <= 128 << 20);
    assert!(b.grow_read_buffer(STREAM_READ_START).is_none());
    assert_eq!(
        b.refused
            .get_or_create(&RefusedLabels { reason: "budget" })
            .get(),
        2
    );
    drop((held, small));
    assert_eq!(b.used(), (64 << 20) + (128 << 10));
}

#[test]
fn a_dial_is_refused_before_its_handshake_once_the_destination_holds_its_quarter() {
    // A quarter of 256 KiB: one smallest window (64 KiB).
    let b = budget(256 << 10);
    let (mallory, alice) = (
        Identity::new("td", "ns", "mallory"),
        Identity::new("td", "ns", "alice"),
    );
    assert!(b
        .admits_connection(configured(), std::slice::from_ref(&mallory))
        .is_ok());
    let (_, held) = b
        .connection(configured(), &mallory, Activity::new())
        .unwrap();
    assert_eq!(
        b.admits_connection(configured(), std::slice::from_ref(&mallory)),
        Err(Refusal::Peer)
    );
    assert!(
        b.admits_connection(configured(), &[mallory.clone(), alice.clone()])
            .is_ok(),
        "one of the identities a destination may have still has room"
    );
    assert_eq!(b.used(), 64 << 10, "a check reserves nothing");
    drop(held);
    assert!(b.admits_connection(configured(), &[mallory]).is_ok());
    assert!(budget(0).admits_connection(configured(), &[alice]).is_ok());
}

#[test]
fn no_budget_refuses_nothing() {
    let b = budget(0);
    let p = Identity::new("td", "ns", "p");
    let held: Vec<_> = (0..100)
        .map(|_| b.reserve(1 << 30, Some(&p), None).unwrap())
        .collect();
    assert_eq!(held.len(), 100);
}

#[test]
fn the_pod_every_pod_of_a_full_node_talks_to_is_not_refused() {
    // 1,000 pods on a node all talk to one of them: the pool keeps a
    // connection each way per pair, so 2,000 connections count in that
    // pod's identity's quarter of a 1 GiB budget. At the old smallest
    // windows (256 KiB) the 521st was refused (`cargo bench --bench node`).
    let b = budget(1 << 30);
    let popular = Identity::new("td", "ns", "popular");
    let held: Vec<ConnectionWindows> = (0..2000)
        .map(|i| {
            b.connection(configured(), &popular, Activity::new())
                .unwrap_or_else(|e| panic!("connection {i} refused: {}", e.reason()))
                .1
        })
        .collect();
    assert!(b.used() <= (1 << 30) / 4, "within the identity's quarter");
    // Another identity still gets its fair windows' worth.
    let (other, _o) = b
        .connection(
            configured(),
            &Identity::new("td", "ns", "other"),
            Activity::new(),
        )
        .unwrap();
    assert!(other.connection_window >= 256 << 10);
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn a_connection_that_stays_behind_tries_again_less_and_less_often() {
    let mut retry = WindowRetry::default();
    let start = tokio::time::Instant::now();
    retry.due().await;
    assert_eq!(
        start.elapsed(),
        WINDOW_RETRY,
        "the first try after a second"
    );
    // Tries that change nothing: 2, 4, 8, 16, 32, 32 s apart.
    let mut gaps = Vec::new();
    for _ in 0..6 {
        retry.tried(false);
        gaps.push(retry.gap().as_secs());
    }
    assert_eq!(gaps, [2, 4, 8, 16, 32, 32]);
    // A try that moves the windows, or the share moving: soon again.
    retry.tried(true);
    assert_eq!(retry.gap(), WINDOW_RETRY);
    retry.tried(false);
    retry.reset();
    let t = tokio::time::Instant::now();
    retry.due().await;
    assert_eq!(t.elapsed(), WINDOW_RETRY);
}

/// What a connection's peer was told, as an h2 connection would send it.
#[derive(Debug, Default)]
struct Told {
    connection: u32,
    stream: u32,
}

impl ReceiveWindows for Told {
    fn set_connection_window(&mut self, size: u32) {
        self.connection = size;
    }
    fn set_stream_window(&mut self, size: u32) -> Result<(), h2::Error> {
        self.stream = size;
        Ok(())
    }
}

/// One HBONE connection as its driver sees it: its windows, its streams,
/// and what its peer was told.
struct Driven {
    windows: ConnectionWindows,
    streams: Arc<Activity>,
    told: H2Settings,
    peer: Told,
}

impl Driven {
    fn open(b: &'static Budget, i: usize) -> Driven {
        let streams = Activity::new();
        let peer = Identity::new("td", "ns", &format!("p{i}"));
        let (told, windows) = b.connection(configured(), &peer, streams.clone()).unwrap();
        Driven {
            windows,
            streams,
            told,
            peer: Told::default(),
        }
    }

    /// What the driver does when woken ([`ConnectionWindows::moved`]).
    fn drive(&mut self) {
        self.windows.apply(&mut self.peer, &mut self.told);
    }

    fn granted(&self) -> (usize, usize) {
        windows(self.windows.granted())
    }
}

#[tokio::test(start_paused = true)]
async fn connections_that_carry_no_stream_leave_the_share_to_those_that_do() {
    // A node of 1,000 pods: 4,000 pooled connections in one proxy, 50 of
    // them carrying a bulk flow each. Counted all alike, each would get
    // 128 KiB: a flow's rate follows its window.
    let b = budget(1 << 30);
    let mut conns: Vec<Driven> = (0..4000).map(|i| Driven::open(b, i)).collect();
    for c in &mut conns {
        c.drive();
    }
    assert_eq!(conns[0].windows.granted().connection_window, 128 << 10);
    let flows: Vec<OnConnection> = conns[..50]
        .iter()
        .map(|c| OnConnection::new(&c.streams))
        .collect();
    // A new connection's driver is woken by its first stream.
    for c in &mut conns[..50] {
        tokio::time::timeout(std::time::Duration::from_millis(1), c.windows.moved())
            .await
            .expect("woken by its first stream");
        c.drive();
    }

    // The rest carry nothing; a driver is woken as their time is up.
    let t = tokio::time::Instant::now();
    conns[50].windows.moved().await;
    assert_eq!(
        t.elapsed(),
        IDLE_WINDOWS_AFTER,
        "woken once idle long enough"
    );
    for c in &mut conns[50..] {
        c.drive();
    }
    assert!(conns[50..].iter().all(|c| !c.windows.busy()
        && c.windows.granted().connection_window == 64 << 10
        && c.peer.connection == 64 << 10
        && c.peer.stream == 16 << 10));
    // The 50 share what the idle ones leave of the half: (512 MiB −
    // 3,950 × 64 KiB) / 50, 5.3 MiB, rounded down to 4 MiB.
    for c in &mut conns[..50] {
        assert!(c.windows.busy());
        c.drive();
        assert_eq!(c.granted(), (4, 4), "4 MiB / 1 MiB");
        assert_eq!(c.peer.connection, 4 << 20);
    }
    // A second stream on a busy connection, and its end, wake no one.
    drop(OnConnection::new(&conns[0].streams));
    let woken = tokio::time::timeout(std::time::Duration::from_secs(60), conns[0].windows.moved());
    assert!(woken.await.is_err());
    assert!(b.used() <= (1 << 30) / 2);

    // An idle connection gets a stream: its driver is woken at once, and
    // it takes the same share.
    let stream = OnConnection::new(&conns[60].streams);
    tokio::time::timeout(
        std::time::Duration::from_millis(1),
        conns[60].windows.moved(),
    )
    .await
    .expect("woken by its first stream");
    conns[60].drive();
    assert_eq!(conns[60].granted(), (4, 4));
    // Its last stream ends: it stays busy for a while (a client that opens
    // one connection after another keeps its windows), then is idle again.
    drop(stream);
    conns[60].windows.moved().await;
    conns[60].drive();
    assert!(
        conns[60].windows.busy(),
        "the end of a stream is not idle yet"
    );
    // Streams coming and going meanwhile (a client opening connection
    // after connection) wake no one: the driver looks again when it said.
    for _ in 0..100 {
        drop(OnConnection::new(&conns[60].streams));
    }
    let t = tokio::time::Instant::now();
    conns[60].windows.moved().await;
    assert_eq!(t.elapsed(), IDLE_WINDOWS_AFTER);
    conns[60].drive();
    assert_eq!(conns[60].windows.granted().connection_window, 64 << 10);

    drop(flows);
    drop(conns);
    assert_eq!(b.used(), 0);
    assert_eq!(*b.connections.lock().unwrap(), Counted::default());
}
