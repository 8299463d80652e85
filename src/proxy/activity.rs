//! The streams an HBONE connection carries now, and since when it has
//! carried none: what closes an idle connection (the pool's and the
//! inbound's idle timeout) and what its share of the memory budget follows
//! (docs/wire.md §10). Whoever drives the connection is told when it
//! starts or stops carrying streams ([`Activity::moved`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
// tokio's clock (the system's, outside tests): the pool's timing tests
// run on a paused clock.
use tokio::time::Instant;

/// A connection's open streams, and since when it has had none.
#[derive(Debug)]
pub struct Activity {
    open: AtomicUsize,
    idle_since: Mutex<Instant>,
    /// Told when the connection starts or stops carrying streams.
    moved: Notify,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            open: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            moved: Notify::new(),
        })
    }

    /// A stream starts; returns the streams open before it.
    pub fn enter(&self) -> usize {
        let before = self.open.fetch_add(1, Ordering::AcqRel);
        if before == 0 {
            self.moved.notify_one();
        }
        before
    }

    /// A stream ends; returns the streams open before it ended.
    pub fn leave(&self) -> usize {
        let mut since = self.idle_since.lock().unwrap_or_else(|e| e.into_inner());
        let before = self.open.fetch_sub(1, Ordering::AcqRel);
        if before == 1 {
            *since = Instant::now();
            drop(since);
            self.moved.notify_one();
        }
        before
    }

    /// The streams open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Since when the connection has carried no stream; `None` while it
    /// carries one.
    pub fn idle_since(&self) -> Option<Instant> {
        if self.open() > 0 {
            return None;
        }
        Some(*self.idle_since.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// How long the connection has carried no stream; `None` while it
    /// carries one (so that a zero timeout never closes a busy connection).
    pub fn idle_for(&self) -> Option<Duration> {
        self.idle_since().map(|since| since.elapsed())
    }

    /// Resolves once the connection has started or stopped carrying
    /// streams since the last time it resolved (at once if it has).
    pub async fn moved(&self) {
        self.moved.notified().await
    }
}

/// One stream on a connection, for its [`Activity`]: counted while held.
#[derive(Debug)]
pub struct OnConnection(Arc<Activity>);

impl OnConnection {
    pub fn new(activity: &Arc<Activity>) -> OnConnection {
        activity.enter();
        OnConnection(activity.clone())
    }
}

impl Drop for OnConnection {
    fn drop(&mut self) {
        self.0.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_driver_is_told_when_the_first_stream_starts_and_the_last_ends() {
        let a = Activity::new();
        assert_eq!(a.open(), 0);
        assert!(a.idle_for().is_some());
        let first = OnConnection::new(&a);
        // Told once, though it was not waiting yet.
        tokio::time::timeout(Duration::from_secs(1), a.moved())
            .await
            .expect("told of the first stream");
        let second = OnConnection::new(&a);
        assert_eq!((a.open(), a.idle_for()), (2, None));
        drop(first);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), a.moved())
                .await
                .is_err(),
            "a second stream and the first's end change nothing the driver follows"
        );
        let before = Instant::now();
        drop(second);
        tokio::time::timeout(Duration::from_secs(1), a.moved())
            .await
            .expect("told of the last stream's end");
        assert!(a.idle_since().unwrap() >= before);
    }
}
