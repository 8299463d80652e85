//! Futures polled only when they asked to be.
//!
//! A connection's task is polled for every message it carries, and each
//! poll used to poll every future it also waits on: the pod's drain, a
//! policy's revocation, the budget's share, the revocation lists, the
//! idle timer. Each is pending almost always, and a pending tokio `watch`
//! or `broadcast` takes a lock on every poll to look at its waker again.
//! Behind a [`Gate`], such a future is polled on its first poll and after
//! a wake it asked for, and otherwise answers `Pending` from one atomic
//! flag: the message's pass through the proxy pays for its I/O only.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// One task's gate: the waker the gated future registers, and the flag
/// its wakes raise. One live [`Gated`] at a time: two pending at once would
/// share one flag, and the first polled would take the other's wake. A
/// loop makes a new `Gated` each turn from the same gate.
pub struct Gate {
    flag: Arc<Flag>,
    /// `flag` as a waker, made once.
    waker: Waker,
}

struct Flag {
    woken: AtomicBool,
    /// The task that polls the gated future.
    task: AtomicWaker,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, SeqCst);
        self.task.wake();
    }
}

impl Default for Gate {
    fn default() -> Self {
        Gate::new()
    }
}

impl Gate {
    pub fn new() -> Gate {
        let flag = Arc::new(Flag {
            woken: AtomicBool::new(false),
            task: AtomicWaker::new(),
        });
        Gate {
            waker: Waker::from(flag.clone()),
            flag,
        }
    }

    /// `fut`, polled on its first poll and then only after it was woken.
    /// A future that finishes without a wake (one polled for progress
    /// alone) must not be guarded: it would never be polled again.
    pub fn guard<F: Future>(&self, fut: F) -> Gated<'_, F> {
        Gated {
            gate: self,
            fresh: true,
            fut,
        }
    }
}

pin_project_lite::pin_project! {
    /// What [`Gate::guard`] returns.
    pub struct Gated<'a, F> {
        gate: &'a Gate,
        fresh: bool,
        #[pin]
        fut: F,
    }
}

impl<F: Future> Future for Gated<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let flag = &this.gate.flag;
        // Registered before the flag is read: a wake from now on either
        // raises the flag read below or wakes the task to poll again.
        flag.task.register(cx.waker());
        let woken = flag.woken.swap(false, SeqCst);
        if !woken && !*this.fresh {
            return Poll::Pending;
        }
        *this.fresh = false;
        this.fut.poll(&mut Context::from_waker(&this.gate.waker))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts its polls; always pending, and wakes no one.
    struct Counted<'a> {
        polls: &'a AtomicUsize,
    }

    impl Future for Counted<'_> {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, SeqCst);
            Poll::Pending
        }
    }

    /// A gated future is polled once, then not again until it is woken,
    /// however often its task is polled; its wake wakes the task.
    #[test]
    fn a_gated_future_is_polled_first_and_after_its_wakes_only() {
        let gate = Gate::new();
        let polls = AtomicUsize::new(0);
        let mut gated = std::pin::pin!(gate.guard(Counted { polls: &polls }));
        let task = Arc::new(Woken::default());
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);
        for _ in 0..10 {
            assert!(gated.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(polls.load(SeqCst), 1, "polled without a wake");
        assert_eq!(task.0.load(SeqCst), 0);
        gate.waker.wake_by_ref();
        assert_eq!(task.0.load(SeqCst), 1, "the task was not woken");
        for _ in 0..10 {
            assert!(gated.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(polls.load(SeqCst), 2, "a wake should bring one poll");
    }

    /// A real wake source: a gated `watch` change resolves once the value
    /// is sent, and not before.
    #[tokio::test]
    async fn a_gated_watch_resolves_when_sent() {
        let (tx, mut rx) = tokio::sync::watch::channel(false);
        let gate = Gate::new();
        let mut gated = Box::pin(gate.guard(rx.wait_for(|v| *v)));
        let polled = std::future::poll_fn(|cx| Poll::Ready(gated.as_mut().poll(cx))).await;
        assert!(polled.is_pending());
        tx.send(true).unwrap();
        let done = tokio::time::timeout(std::time::Duration::from_secs(5), gated).await;
        assert!(matches!(done, Ok(Ok(_))), "the sent value was not seen");
    }

    #[derive(Default)]
    struct Woken(AtomicUsize);

    impl Wake for Woken {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, SeqCst);
        }
    }
}
