//! How a pod's listeners and connections are told to stop: the pod's
//! drain, the proxy's exit, and the count of connections in flight.

use std::sync::Arc;

/// Tells a pod's listeners and connections to stop; cheap to clone.
#[derive(Debug, Clone)]
pub struct Drain(tokio::sync::watch::Receiver<bool>);

/// The sending side of a [`Drain`].
#[derive(Debug)]
pub struct DrainTrigger(tokio::sync::watch::Sender<bool>);

impl Drain {
    pub fn new() -> (DrainTrigger, Drain) {
        let (tx, rx) = tokio::sync::watch::channel(false);
        (DrainTrigger(tx), Drain(rx))
    }

    /// Resolves once the pod is drained (never, if the trigger is kept and not fired).
    pub async fn signalled(&self) {
        let mut rx = self.0.clone();
        let _ = rx.wait_for(|d| *d).await;
    }

    /// Runs `fut` unless the pod is drained first. `fut` is a pointer (a
    /// boxed or pinned future): a large future passed by value would be
    /// stored twice in this one.
    ///
    /// The drain's watch is polled only when it may have fired (its
    /// version moved, one atomic load) or the task's waker changed, not
    /// with every poll of `fut`: a pending watch takes a lock on each poll,
    /// and this runs around every connection, polled at every message.
    /// No allocation: a [`Gate`] here cost ~0.3 kB per idle connection.
    ///
    /// [`Gate`]: super::gate::Gate
    pub async fn run<F: std::future::Future<Output = ()> + Unpin>(&self, mut fut: F) {
        // Drained already (a connection denied as it was tracked): `fut`
        // is never polled, so not a byte of it moves.
        if self.0.has_changed().unwrap_or(true) {
            return;
        }
        // Outside the task's budget: out of it, tokio's watch answers
        // `Pending` without registering the waker (and wakes the task
        // instead), and the version check below would then never poll it
        // again: a drain nobody is told of.
        let mut signalled = std::pin::pin!(tokio::task::unconstrained(self.signalled()));
        // The waker the watch last registered: polled again for another.
        let mut watching: Option<std::task::Waker> = None;
        std::future::poll_fn(|cx| {
            if std::future::Future::poll(std::pin::Pin::new(&mut fut), cx).is_ready() {
                return std::task::Poll::Ready(());
            }
            // `self.0` never marks a version seen, so it has changed once
            // the trigger fired (or is gone, which `signalled` ends on too).
            let again = match &watching {
                Some(w) => !w.will_wake(cx.waker()) || self.0.has_changed().unwrap_or(true),
                None => true,
            };
            if again {
                if std::future::Future::poll(signalled.as_mut(), cx).is_ready() {
                    return std::task::Poll::Ready(());
                }
                watching = Some(cx.waker().clone());
            }
            std::task::Poll::Pending
        })
        .await
    }
}

impl DrainTrigger {
    /// Closes the pod's listeners and every connection it carries, now.
    pub fn fire(&self) {
        let _ = self.0.send(true);
    }
}

/// Connections in flight across the proxy, for a graceful exit.
#[derive(Debug, Default)]
pub struct ActiveConnections(std::sync::atomic::AtomicUsize);

/// Counts one connection while it lives.
#[derive(Debug)]
pub struct ConnectionGuard(Arc<ActiveConnections>);

impl ActiveConnections {
    pub fn track(self: &Arc<Self>) -> ConnectionGuard {
        self.0.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        ConnectionGuard(self.clone())
    }

    pub fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// How a pod's listeners and connections are told to stop.
#[derive(Debug, Clone)]
pub struct Lifecycle {
    /// This pod is gone: close its listeners and connections now.
    pub drain: Drain,
    /// The proxy is exiting: stop accepting (a successor may be listening
    /// beside us) and let connections in flight finish.
    pub stop_accepting: Drain,
    pub active: Arc<ActiveConnections>,
}

impl Lifecycle {
    /// Resolves when the pod's listener should close.
    pub async fn stop_listening(&self) {
        tokio::select! {
            _ = self.drain.signalled() => {}
            _ = self.stop_accepting.signalled() => {}
        }
    }

    /// Spawns a connection task: counted, and cut short if the pod is drained.
    pub fn spawn<F: std::future::Future<Output = ()> + Send + 'static>(&self, fut: F) {
        tokio::spawn(self.tracked(fut));
    }

    /// `fut` counted while it lives, and cut short if the pod is drained:
    /// a connection task, to spawn or to run inside its HBONE connection's
    /// ([`super::together`]).
    pub fn tracked<F: std::future::Future<Output = ()> + Send + 'static>(
        &self,
        fut: F,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let guard = self.active.track();
        let drain = self.drain.clone();
        // On the heap once: held by value, `fut` would be stored three times
        // over in the task (rustc keeps a slot for the captured future, for
        // `run`'s argument and for the select inside it), which tripled
        // every connection's task (an idle outbound connection's from 6.5
        // to 19.7 kB, an inbound stream's from 9 to 27 kB).
        let fut = Box::pin(fut);
        async move {
            drain.run(fut).await;
            drop(guard);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A run cut short by the drain, whatever waker it was last polled
    /// with: the watch is polled again when the task's waker changes, so
    /// the wake goes to the task that holds the run now.
    #[test]
    fn a_drain_ends_a_run_that_moved_to_another_waker() {
        use std::future::Future;
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        use std::task::{Context, Wake, Waker};
        #[derive(Default)]
        struct Counted(AtomicUsize);
        impl Wake for Counted {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, SeqCst);
            }
        }
        let (trigger, drain) = Drain::new();
        let mut run = Box::pin(drain.run(std::future::pending::<()>()));
        let (first, second) = (Arc::new(Counted::default()), Arc::new(Counted::default()));
        let (w1, w2) = (Waker::from(first.clone()), Waker::from(second.clone()));
        for _ in 0..3 {
            assert!(run
                .as_mut()
                .poll(&mut Context::from_waker(&w1))
                .is_pending());
        }
        assert!(run
            .as_mut()
            .poll(&mut Context::from_waker(&w2))
            .is_pending());
        trigger.fire();
        assert_eq!(
            second.0.load(SeqCst),
            1,
            "the task holding the run was not woken"
        );
        assert!(run.as_mut().poll(&mut Context::from_waker(&w2)).is_ready());
        // Dropped, not fired: the run ends too (as `signalled` does).
        let (trigger, drain) = Drain::new();
        let mut run = Box::pin(drain.run(std::future::pending::<()>()));
        assert!(run
            .as_mut()
            .poll(&mut Context::from_waker(&w1))
            .is_pending());
        drop(trigger);
        assert!(run.as_mut().poll(&mut Context::from_waker(&w1)).is_ready());
    }

    /// A run whose drain fired before it began (a connection denied as it
    /// was tracked) never polls what it runs.
    #[test]
    fn a_run_drained_before_it_begins_never_polls_its_future() {
        use std::future::Future;
        use std::task::{Context, Waker};
        let (trigger, drain) = Drain::new();
        trigger.fire();
        let mut polled = false;
        let fut = std::future::poll_fn(|_| {
            polled = true;
            std::task::Poll::<()>::Pending
        });
        let mut run = Box::pin(drain.run(Box::pin(fut)));
        assert!(run
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_ready());
        drop(run);
        assert!(!polled, "a drained run moved its connection's bytes");
    }

    /// A run first polled when its task's budget is spent (a stream taken
    /// into its connection's task after busy ones) still hears the drain.
    #[tokio::test]
    async fn a_run_first_polled_out_of_budget_still_hears_the_drain() {
        use std::future::Future;
        let (trigger, drain) = Drain::new();
        let task = tokio::spawn(async move {
            let mut run = std::pin::pin!(drain.run(std::future::pending::<()>()));
            std::future::poll_fn(|cx| {
                // Spend the task's budget, then poll the run in the same poll.
                while std::pin::pin!(tokio::task::consume_budget())
                    .poll(cx)
                    .is_ready()
                {}
                assert!(run.as_mut().poll(cx).is_pending());
                std::task::Poll::Ready(())
            })
            .await;
            run.await
        });
        // Let the task poll the run and go to sleep on it.
        tokio::time::sleep(Duration::from_millis(50)).await;
        trigger.fire();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the drain was missed")
            .unwrap();
    }
}
