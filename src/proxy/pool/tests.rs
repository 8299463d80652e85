//! The pool's placement of streams, dials and their failures, and closing.

use super::*;
use tokio::io::duplex;

async fn h2_conn() -> Arc<PooledConn> {
    h2_conn_watched().await.0
}

/// Also reports, once the client side ends, whether its last frame was a
/// GOAWAY with NO_ERROR (a tap between client and server reads the frames).
async fn h2_conn_watched() -> (Arc<PooledConn>, tokio::sync::oneshot::Receiver<bool>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (a, mut tap_in) = duplex(1 << 16);
    let (mut tap_out, b) = duplex(1 << 16);
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let mut preface = [0u8; 24];
        let mut last = None;
        if tap_in.read_exact(&mut preface).await.is_ok()
            && tap_out.write_all(&preface).await.is_ok()
        {
            let mut head = [0u8; 9];
            while tap_in.read_exact(&mut head).await.is_ok() {
                let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                let mut payload = vec![0u8; len];
                if tap_in.read_exact(&mut payload).await.is_err() {
                    break;
                }
                last = Some((head[3], payload.get(4..8).map(|c| c.to_vec())));
                let _ = tap_out.write_all(&head).await;
                let _ = tap_out.write_all(&payload).await;
            }
        }
        let goaway = last == Some((7, Some(vec![0, 0, 0, 0])));
        let _ = tx.send(goaway);
    });
    tokio::spawn(async move {
        let mut srv = h2::server::handshake(b).await.unwrap();
        while let Some(Ok((_req, mut respond))) = srv.accept().await {
            let _ = respond.send_response(http::Response::new(()), false);
        }
    });
    let (sender, conn) = h2::client::handshake(a).await.unwrap();
    let lifeline = Arc::new(Lifeline::new(Activity::new()));
    let driver = lifeline.clone();
    let (streams, inbox) = super::super::together::channel();
    let main = async move {
        let _ = conn.await;
        driver.close();
    };
    tokio::spawn(super::super::together::together(main, inbox));
    (PooledConn::new(sender, lifeline, streams), rx)
}

// On a paused clock: a wait ends when every task is idle, so "nothing
// happened meanwhile" is exact, and no real time passes.
#[tokio::test(start_paused = true)]
async fn drain_closes_idle_connections_and_busy_ones_after_their_streams() {
    let pool = Pool::new(100, 1, Duration::from_secs(60));
    let (idle, idle_end) = h2_conn_watched().await;
    drop(pool.get(key(), given(idle)).await.unwrap());
    let mut other = key();
    other.addr = "10.0.0.4:15008".parse().unwrap();
    let (busy, mut busy_end) = h2_conn_watched().await;
    let lease = pool.get(other, given(busy)).await.unwrap();
    let req = http::Request::builder()
        .method("CONNECT")
        .uri("10.0.0.4:8080")
        .body(())
        .unwrap();
    let mut sender = lease.sender().ready().await.unwrap();
    let (_resp, _stream) = sender.send_request(req, false).unwrap();
    drop(sender);
    assert_eq!(pool.open(), 2);
    pool.drain();
    assert_eq!(pool.open(), 0);
    let clean = tokio::time::timeout(Duration::from_secs(2), idle_end).await;
    assert_eq!(
        clean.ok().and_then(Result::ok),
        Some(true),
        "idle connection ends with GOAWAY (NO_ERROR)"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        busy_end.try_recv().is_err(),
        "a connection with a stream in flight stays open"
    );
    drop((_resp, _stream, lease));
    let clean = tokio::time::timeout(Duration::from_secs(2), busy_end).await;
    assert_eq!(
        clean.ok().and_then(Result::ok),
        Some(true),
        "busy connection ends with GOAWAY after its stream"
    );
}

fn key() -> PoolKey {
    PoolKey {
        pod: "default/a".into(),
        src: Identity::new("td", "a", "a"),
        dst: vec![Identity::new("td", "b", "b")],
        addr: "10.0.0.3:15008".parse().unwrap(),
    }
}

#[tokio::test]
async fn burst_dials_once_and_reuses() {
    let pool = Pool::new(100, 1, Duration::from_secs(60));
    let _leases = burst(&pool, 50, 20).await;
    assert_eq!(pool.dials(), 1, "a burst must share one dial");
    assert_eq!(pool.open(), 1);
}

// On a paused clock: a wait ends when every task is idle, so "nothing
// happened meanwhile" is exact, and no real time passes.
#[tokio::test(start_paused = true)]
async fn a_stalled_dial_holds_later_callers_only_for_the_join_wait() {
    let pool = Pool::new(100, 1, Duration::from_secs(60));
    let stalled = {
        let pool = pool.clone();
        tokio::spawn(async move {
            pool.get(key(), || async {
                std::future::pending::<()>().await;
                Ok::<_, &str>(h2_conn().await)
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let start = Instant::now();
    let lease = pool
        .get(key(), || async { Ok::<_, &str>(h2_conn().await) })
        .await
        .unwrap();
    let waited = start.elapsed();
    assert!(
        waited >= JOIN_WAIT && waited < JOIN_WAIT + Duration::from_millis(400),
        "waited {waited:?} behind a dial that never ends"
    );
    drop(lease);
    // A caller that comes now finds the connection, not the stall.
    let start = Instant::now();
    let _lease = pool
        .get(key(), || async { Ok::<_, &str>(h2_conn().await) })
        .await
        .unwrap();
    assert!(start.elapsed() < Duration::from_millis(100));
    assert_eq!(pool.dials(), 1);
    stalled.abort();
}

#[tokio::test]
async fn a_removed_pods_connections_are_let_go_and_close() {
    let pool = Pool::new(100, 1, Duration::from_secs(300));
    let (conn, ended) = h2_conn_watched().await;
    drop(pool.get(key(), given(conn)).await.unwrap());
    let mut other = key();
    other.pod = "default/b".into();
    drop(
        pool.get(other, || async { Ok::<_, &str>(h2_conn().await) })
            .await
            .unwrap(),
    );
    drop(PoolPodGuard {
        pool: pool.clone(),
        pod: "default/a".into(),
    });
    assert_eq!(pool.open(), 1, "only the other pod's connection is kept");
    let clean = tokio::time::timeout(Duration::from_secs(2), ended).await;
    assert_eq!(
        clean.ok().and_then(Result::ok),
        Some(true),
        "the removed pod's connection ends with GOAWAY, long before its idle timeout"
    );
}

/// How many of `leases` each connection carries, largest first.
fn shares(leases: &[Lease]) -> Vec<usize> {
    let mut by_conn: HashMap<*const PooledConn, usize> = HashMap::new();
    for l in leases {
        *by_conn.entry(Arc::as_ptr(&l.conn)).or_default() += 1;
    }
    let mut n: Vec<usize> = by_conn.into_values().collect();
    n.sort_unstable_by(|a, b| b.cmp(a));
    n
}

/// A dial that hands over `conn`.
fn given(
    conn: Arc<PooledConn>,
) -> impl Fn() -> std::future::Ready<Result<Arc<PooledConn>, &'static str>> {
    move || std::future::ready(Ok(conn.clone()))
}

/// `n` streams asked for at once, each dialing (when it must) with a dial
/// of `dial_ms` milliseconds; their leases once all have one.
async fn burst(pool: &Arc<Pool>, n: usize, dial_ms: u64) -> Vec<Lease> {
    let asks: Vec<_> = (0..n)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { pool.get(key(), || slow_conn(dial_ms)).await.unwrap() })
        })
        .collect();
    let mut leases = Vec::new();
    for ask in asks {
        leases.push(ask.await.unwrap());
    }
    leases
}

/// A dial that takes `ms` milliseconds, as a handshake does.
async fn slow_conn(ms: u64) -> Result<Arc<PooledConn>, &'static str> {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Ok(h2_conn().await)
}

#[tokio::test]
async fn streams_at_once_get_connections_of_their_own_up_to_the_spread_then_share_evenly() {
    let pool = Pool::new(100, 2, Duration::from_secs(60));
    // One at a time: one connection, however many streams.
    for _ in 0..5 {
        drop(pool.get(key(), || slow_conn(0)).await.unwrap());
    }
    assert_eq!(
        pool.dials(),
        1,
        "streams one after another share a connection"
    );
    // Two at once: a second connection; more share the two evenly.
    let mut leases = Vec::new();
    for _ in 0..6 {
        leases.push(pool.get(key(), || slow_conn(0)).await.unwrap());
    }
    assert_eq!(pool.dials(), 2);
    assert_eq!(shares(&leases), vec![3, 3]);
    // As streams end, new ones go where there is least.
    let first = leases[0].conn.clone();
    leases.retain(|l| !Arc::ptr_eq(&l.conn, &first));
    assert_eq!(shares(&leases), vec![3]);
    for _ in 0..3 {
        leases.push(pool.get(key(), || slow_conn(0)).await.unwrap());
    }
    assert_eq!(shares(&leases), vec![3, 3]);
    assert_eq!(pool.dials(), 2, "no dial past the spread");
}

#[tokio::test]
async fn a_burst_is_shared_evenly_among_the_dials_it_sets_off() {
    let pool = Pool::new(100, 2, Duration::from_secs(60));
    let start = Instant::now();
    let leases = burst(&pool, 8, 30).await;
    assert_eq!(pool.dials(), 2);
    assert_eq!(shares(&leases), vec![4, 4]);
    assert!(
        start.elapsed() < JOIN_WAIT,
        "took {:?}: those waiting were not woken by the dials they waited for",
        start.elapsed()
    );
}

#[tokio::test]
async fn a_dial_to_spread_that_fails_or_stalls_leaves_its_stream_on_the_open_connection() {
    let tried = Arc::new(AtomicUsize::new(0));
    let counted = |tried: &Arc<AtomicUsize>| {
        let tried = tried.clone();
        move || {
            tried.fetch_add(1, Ordering::Relaxed);
            slow_conn(0)
        }
    };
    for stalls in [false, true] {
        let pool = Pool::new(100, 2, Duration::from_secs(60));
        let first = pool.get(key(), || slow_conn(0)).await.unwrap();
        let start = Instant::now();
        let second = if stalls {
            pool.get(key(), || async {
                std::future::pending::<()>().await;
                slow_conn(0).await
            })
            .await
        } else {
            pool.get(key(), || async { Err::<Arc<PooledConn>, _>("refused") })
                .await
        };
        let second = second.expect("the stream failed although a connection had room");
        let waited = start.elapsed();
        assert!(Arc::ptr_eq(&first.conn, &second.conn));
        let bound = if stalls {
            JOIN_WAIT + Duration::from_millis(400)
        } else {
            Duration::from_millis(100)
        };
        assert!(waited < bound, "stalls: {stalls}; waited {waited:?}");
        // Held for a while: the next streams share without trying again.
        let third = pool.get(key(), counted(&tried)).await.unwrap();
        assert!(Arc::ptr_eq(&first.conn, &third.conn));
        assert_eq!(tried.load(Ordering::Relaxed), 0, "stalls: {stalls}");
        assert_eq!(pool.dials(), 1);
    }
}

// On a paused clock: a wait ends when every task is idle, so "nothing
// happened meanwhile" is exact, and no real time passes.
#[tokio::test(start_paused = true)]
async fn callers_waiting_for_a_dial_that_fails_dial_on_their_own() {
    let pool = Pool::new(100, 1, Duration::from_secs(60));
    let failing = {
        let pool = pool.clone();
        tokio::spawn(async move {
            pool.get(key(), || async {
                tokio::time::sleep(Duration::from_millis(30)).await;
                Err::<Arc<PooledConn>, _>("refused")
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    let start = Instant::now();
    let lease = pool.get(key(), || slow_conn(0)).await;
    assert!(failing.await.unwrap().is_err());
    assert!(lease.is_ok(), "the waiting caller got no connection");
    assert!(
        start.elapsed() < JOIN_WAIT,
        "waited {:?}: the failure should end the wait at once",
        start.elapsed()
    );
    assert_eq!(pool.dials(), 1);
}

// On a paused clock: a wait ends when every task is idle, so "nothing
// happened meanwhile" is exact, and no real time passes.
#[tokio::test(start_paused = true)]
async fn full_connection_gets_a_sibling_and_idle_ones_are_evicted() {
    let pool = Pool::new(2, 1, Duration::from_millis(50));
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(
            pool.get(key(), || async { Ok::<_, &str>(h2_conn().await) })
                .await
                .unwrap(),
        );
    }
    assert_eq!(pool.dials(), 2, "third stream needs a second connection");
    drop(leases);
    tokio::time::sleep(Duration::from_millis(80)).await;
    pool.evict();
    assert_eq!(pool.open(), 0, "idle connections must be released");
}

#[tokio::test]
async fn callers_woken_by_one_dial_never_put_more_than_max_streams_on_it() {
    let pool = Pool::new(2, 1, Duration::from_secs(60));
    let leases = burst(&pool, 6, 30).await;
    assert_eq!(
        shares(&leases),
        vec![2, 2, 2],
        "six streams at once, two per connection at most"
    );
    assert_eq!(pool.dials(), 3);
}

// A zero release timeout turns pooling off: each stream after the last
// one ended dials (a TLS handshake between proxies), and the connection
// it used is let go (GOAWAY) at once, not at the next eviction sweep.
#[tokio::test(start_paused = true)]
async fn a_zero_release_timeout_dials_for_each_stream_and_closes_at_once() {
    let pool = Pool::new(100, 1, Duration::ZERO);
    let (first, first_end) = h2_conn_watched().await;
    let lease = pool.get(key(), given(first)).await.unwrap();
    assert_eq!(pool.open(), 1);
    // While it carries a stream, a second one may share it.
    let (unused, _) = h2_conn_watched().await;
    let shared = pool.get(key(), given(unused)).await.unwrap();
    assert_eq!(pool.dials(), 1, "a connection in use is shared");
    drop(lease);
    assert_eq!(pool.open(), 1, "still carrying a stream");
    drop(shared);
    assert_eq!(pool.open(), 0, "left the pool as its last stream ended");
    let clean = tokio::time::timeout(Duration::from_secs(2), first_end).await;
    assert_eq!(
        clean.ok().and_then(Result::ok),
        Some(true),
        "closed with GOAWAY (NO_ERROR) without an eviction sweep"
    );
    let (second, _) = h2_conn_watched().await;
    let _again = pool.get(key(), given(second)).await.unwrap();
    assert_eq!(pool.dials(), 2, "the next stream dials anew");

    // With a timeout, the same sequence reuses the connection.
    let pooled = Pool::new(100, 1, Duration::from_secs(60));
    let (one, _) = h2_conn_watched().await;
    drop(pooled.get(key(), given(one)).await.unwrap());
    let (two, _) = h2_conn_watched().await;
    let _reused = pooled.get(key(), given(two)).await.unwrap();
    assert_eq!(pooled.dials(), 1);
    assert_eq!(pooled.open(), 1);
}
