//! A future that waits for a rare event beside a busy one (a drain, a
//! budget change, a pod gone, beside a connection's I/O) in one `select!`.
//!
//! A `select!` polls every branch whenever its task wakes, so the rare
//! branch is polled on every chunk the busy one moves. Its poll is not
//! free: a `watch` or `Notify` takes the lock of a waiter list shared by
//! every connection of the pod (or the proxy), whose cache line then
//! moves between the worker threads on each chunk. Wrapped in [`Quiet`],
//! the rare future is polled only when its own waker has fired (and on
//! the first poll, so that it registers): an atomic swap and a waker
//! check on lines of this connection's own.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::AcqRel, Ordering::Release};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// The wake flag of one rare branch: made once (one small allocation) and
/// reused by the [`Quiet`] futures a loop makes on every turn.
#[derive(Debug)]
pub struct Gate {
    flag: Arc<Flag>,
    waker: Waker,
}

pin_project_lite::pin_project! {
    /// `fut`, polled only once it has woken (see the module's doc).
    pub struct Quiet<'g, F> {
        #[pin]
        fut: F,
        gate: &'g Gate,
    }
}

#[derive(Debug)]
struct Flag {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Release);
        self.task.wake();
    }
}

impl Gate {
    pub fn new() -> Self {
        let flag = Arc::new(Flag {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        Gate {
            waker: Waker::from(flag.clone()),
            flag,
        }
    }

    /// `fut`, polled on its first poll and then only after its own wakes.
    /// One gate serves one future at a time.
    pub fn quiet<F: Future>(&self, fut: F) -> Quiet<'_, F> {
        self.flag.woken.store(true, Release);
        Quiet { fut, gate: self }
    }
}

impl<F: Future> Future for Quiet<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let flag = &this.gate.flag;
        // Registered before the flag is read: a wake in between is seen
        // now or wakes the task again.
        flag.task.register(cx.waker());
        if !flag.woken.swap(false, AcqRel) {
            return Poll::Pending;
        }
        this.fut.poll(&mut Context::from_waker(&this.gate.waker))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    /// Counts its polls; ready once `open` is set, waking whoever last
    /// polled it when told to.
    struct Counted {
        polls: Arc<AtomicUsize>,
        open: Arc<AtomicBool>,
        waiter: Arc<std::sync::Mutex<Option<Waker>>>,
    }

    impl Future for Counted {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, SeqCst);
            if self.open.load(SeqCst) {
                return Poll::Ready(());
            }
            *self.waiter.lock().unwrap() = Some(cx.waker().clone());
            Poll::Pending
        }
    }

    #[derive(Default)]
    struct Woken(AtomicUsize);
    impl Wake for Woken {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, SeqCst);
        }
    }

    #[test]
    fn the_inner_future_is_polled_first_and_then_only_after_its_own_wake() {
        let polls = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(AtomicBool::new(false));
        let waiter = Arc::new(std::sync::Mutex::new(None));
        let gate = Gate::new();
        let mut quiet = Box::pin(gate.quiet(Counted {
            polls: polls.clone(),
            open: open.clone(),
            waiter: waiter.clone(),
        }));
        let task = Arc::new(Woken::default());
        let task_waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&task_waker);
        assert!(quiet.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polls.load(SeqCst), 1, "the first poll registers");
        // The task wakes for its busy branch, again and again: not polled.
        for _ in 0..5 {
            assert!(quiet.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(polls.load(SeqCst), 1);
        // Its own event: the task is woken, and the next poll reaches it.
        open.store(true, SeqCst);
        waiter.lock().unwrap().take().unwrap().wake();
        assert_eq!(
            task.0.load(SeqCst),
            1,
            "the task is woken by the inner wake"
        );
        assert!(quiet.as_mut().poll(&mut cx).is_ready());
        assert_eq!(polls.load(SeqCst), 2);
        // The gate again, for the loop's next turn: its first poll polls.
        drop(quiet);
        open.store(false, SeqCst);
        let mut again = Box::pin(gate.quiet(Counted {
            polls: polls.clone(),
            open,
            waiter,
        }));
        assert!(again.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polls.load(SeqCst), 3);
    }

    #[tokio::test]
    async fn a_watch_change_reaches_a_quiet_waiter() {
        let (tx, mut rx) = tokio::sync::watch::channel(0);
        let waiting = tokio::spawn(async move {
            let gate = Gate::new();
            let changed = gate.quiet(rx.changed());
            tokio::select! {
                r = changed => r.is_ok(),
                _ = tokio::time::sleep(std::time::Duration::from_secs(10)) => false,
            }
        });
        tokio::task::yield_now().await;
        tx.send(1).unwrap();
        assert!(
            waiting.await.unwrap(),
            "the change is seen before the timer"
        );
    }
}
