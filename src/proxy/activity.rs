//! The streams an HBONE connection carries now, and since when it has
//! carried none: what closes an idle connection (the pool's and the
//! inbound's idle timeout) and what its share of the memory budget follows
//! (docs/wire.md §10). Whoever drives the connection may ask to be told
//! when it next starts or stops carrying streams ([`Activity::watch`],
//! [`Activity::moved`]); unasked, a stream that comes or goes wakes no one,
//! so a client opening connection after connection through one pooled
//! connection costs its driver nothing.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::task::AtomicWaker;
// tokio's clock (the system's, outside tests): the pool's timing tests
// run on a paused clock.
use tokio::time::Instant;

/// A connection's open streams, and since when it has had none.
#[derive(Debug)]
pub struct Activity {
    open: AtomicUsize,
    idle_since: Mutex<Instant>,
    /// What the driver asked to be told of ([`Watch`]).
    watch: AtomicU8,
    /// Told and not yet seen by [`Activity::moved`].
    told: AtomicBool,
    /// The driver's task, woken when told: an atomic swap to register,
    /// where a `Notify` took a lock at every poll of the connection's task
    /// (every chunk a stream moves).
    driver: AtomicWaker,
}

/// What a connection's driver asks to be told of ([`Activity::watch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Watch {
    Nothing = 0,
    /// The first stream after none.
    First = 1,
    /// The last stream's end.
    Last = 2,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            open: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            watch: AtomicU8::new(Watch::Nothing as u8),
            told: AtomicBool::new(false),
            driver: AtomicWaker::new(),
        })
    }

    /// A stream starts; returns the streams open before it.
    pub fn enter(&self) -> usize {
        // Sequentially consistent with `watch`: either the driver sees the
        // stream, or this sees what the driver asked for.
        let before = self.open.fetch_add(1, Ordering::SeqCst);
        if before == 0 && self.watch.load(Ordering::SeqCst) == Watch::First as u8 {
            self.tell();
        }
        before
    }

    /// A stream ends; returns the streams open before it ended.
    pub fn leave(&self) -> usize {
        let mut since = self.idle_since.lock().unwrap_or_else(|e| e.into_inner());
        let before = self.open.fetch_sub(1, Ordering::SeqCst);
        if before == 1 {
            *since = Instant::now();
            drop(since);
            if self.watch.load(Ordering::SeqCst) == Watch::Last as u8 {
                self.tell();
            }
        }
        before
    }

    /// The streams open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Asks to be told ([`Activity::moved`]) of `what` from now on; the
    /// caller reads [`Activity::open`] after asking, so that a stream that
    /// came or went just before is not missed.
    pub fn watch(&self, what: Watch) {
        self.watch.store(what as u8, Ordering::SeqCst);
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

    /// Resolves once what was asked for ([`Activity::watch`]) has happened
    /// since the last time it resolved (at once if it has).
    pub async fn moved(&self) {
        std::future::poll_fn(|cx| {
            if self.told.swap(false, Ordering::SeqCst) {
                return std::task::Poll::Ready(());
            }
            self.driver.register(cx.waker());
            // Told between the look and the registration: seen now.
            if self.told.swap(false, Ordering::SeqCst) {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await
    }

    fn tell(&self) {
        self.told.store(true, Ordering::SeqCst);
        self.driver.wake();
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

    async fn told(a: &Activity) -> bool {
        tokio::time::timeout(Duration::from_millis(50), a.moved())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn the_driver_is_told_of_the_first_stream_or_the_last_ones_end_as_it_asked() {
        let a = Activity::new();
        assert_eq!(a.open(), 0);
        assert!(a.idle_for().is_some());
        // Unasked: a stream coming and going wakes no one.
        drop(OnConnection::new(&a));
        assert!(!told(&a).await);

        a.watch(Watch::First);
        let first = OnConnection::new(&a);
        assert!(told(&a).await, "told of the first stream");
        let second = OnConnection::new(&a);
        assert_eq!((a.open(), a.idle_for()), (2, None));
        drop(first);
        assert!(
            !told(&a).await,
            "a second stream, the first's end: nothing asked for"
        );

        a.watch(Watch::Last);
        let before = Instant::now();
        drop(second);
        assert!(told(&a).await, "told of the last stream's end");
        assert!(a.idle_since().unwrap() >= before);
        drop(OnConnection::new(&a));
        assert!(told(&a).await, "and again, while it still asks");
    }
}
