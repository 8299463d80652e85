//! An HBONE connection and its streams' copies, served by one task.
//!
//! A stream's bytes pass through two futures: its copy (TCP ↔ h2 stream)
//! and the connection (HTTP/2 framing and TLS). As two tasks, each chunk
//! one of them hands on wakes the other, often on the other worker thread
//! (a futex, a context switch), and the two take h2's per-connection
//! stream lock from different threads. Here the streams are polled inside
//! the connection's task, and a wake one of them gives the other while
//! that task is being polled is served in the same poll, instead of
//! scheduling the task again (which would also wake the idle worker to
//! come and steal it).

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::task::AtomicWaker;

use super::pod::Lifecycle;

/// A stream's copy, ready to be polled by its connection's task.
pub type StreamTask = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How many times one poll goes round (streams, then the connection)
/// while they keep waking each other, before it lets the runtime run
/// other tasks.
const ROUNDS: usize = 16;

/// Hands stream copies to the task of the connection they use.
#[derive(Clone)]
pub struct Streams(Arc<Shared>);

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Streams")
    }
}

impl Streams {
    /// Runs `fut` (counted, and cut short if the pod is drained, as
    /// [`Lifecycle::spawn`]'s) in the connection's task, or in a task of
    /// its own if the connection's has ended. What waits to be taken in is
    /// at most the streams the connection admits, each once.
    pub fn spawn<F>(&self, life: &Lifecycle, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let task: StreamTask = Box::pin(life.tracked(fut));
        let mut inbox = lock(&self.0.inbox);
        match inbox.as_mut() {
            Some(waiting) => {
                waiting.push(task);
                drop(inbox);
                self.0.sent.store(true, SeqCst);
                self.0.wake_by_ref();
            }
            None => {
                drop(inbox);
                tokio::spawn(task);
            }
        }
    }
}

/// Where a connection's task takes its streams from ([`together`]).
pub struct Inbox(Arc<Shared>);

/// A connection's stream channel: the handle streams are sent through,
/// and the end its task takes them from.
pub fn channel() -> (Streams, Inbox) {
    let shared = Arc::new(Shared {
        woken: AtomicBool::new(false),
        polling: AtomicBool::new(false),
        sent: AtomicBool::new(false),
        task: AtomicWaker::new(),
        inbox: Mutex::new(Some(Vec::new())),
    });
    (Streams(shared.clone()), Inbox(shared))
}

/// Runs `main` (the connection) and every stream sent to `inbox`, in the
/// task that polls the returned future. It ends with `main`'s output once
/// `main` has ended and so has every stream sent before then; a stream
/// sent later runs in a task of its own.
pub fn together<F: Future>(main: F, inbox: Inbox) -> Together<F> {
    Together {
        waker: Waker::from(inbox.0.clone()),
        inside: Inside {
            main: Some(Box::pin(main)),
            output: None,
            streams: FuturesUnordered::new(),
            shared: inbox.0,
        },
    }
}

/// What [`together`] returns.
pub struct Together<F: Future> {
    inside: Inside<F>,
    /// `inside.shared` as the waker every future inside is polled with
    /// (apart, so a poll borrows it rather than cloning it).
    waker: Waker,
}

/// What a round polls and changes.
struct Inside<F: Future> {
    main: Option<Pin<Box<F>>>,
    output: Option<F::Output>,
    streams: FuturesUnordered<StreamTask>,
    shared: Arc<Shared>,
}

/// Nothing in a `Together` is pinned in place: `main` is on the heap and
/// the output is only ever moved.
impl<F: Future> Unpin for Together<F> {}

/// What a connection's task shares with its [`Streams`] handles, and the
/// waker the futures inside are polled with: a wake while the task is
/// being polled only marks another round; any other wakes the task.
struct Shared {
    woken: AtomicBool,
    polling: AtomicBool,
    /// A stream was sent since the inbox was last looked in: a round takes
    /// the inbox's lock only then, not at every message the task carries.
    sent: AtomicBool,
    task: AtomicWaker,
    /// Streams sent and not yet taken in; `None` once the task has ended.
    inbox: Mutex<Option<Vec<StreamTask>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Wake for Shared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, SeqCst);
        if !self.polling.load(SeqCst) {
            self.task.wake();
        }
    }
}

impl<F: Future> Inside<F> {
    /// One round: new streams taken in, every ready stream polled, then
    /// the connection. `Some` once everything has ended.
    fn round(&mut self, cx: &mut Context<'_>) -> Option<F::Output> {
        if self.shared.sent.swap(false, SeqCst) {
            let sent = lock(&self.shared.inbox).as_mut().map(std::mem::take);
            for stream in sent.into_iter().flatten() {
                self.streams.push(stream);
            }
        }
        // A stream that panics is dropped (as a task of its own would be),
        // not the connection with every other stream on it.
        loop {
            let polled = catch_unwind(AssertUnwindSafe(|| self.streams.poll_next_unpin(cx)));
            match polled {
                Ok(Poll::Ready(Some(()))) => {}
                Ok(_) => break,
                Err(_) => {
                    tracing::error!("an HBONE stream's copy panicked; that stream is dropped")
                }
            }
        }
        if let Some(main) = &mut self.main {
            if let Poll::Ready(out) = main.as_mut().poll(cx) {
                self.output = Some(out);
                self.main = None;
            }
        }
        if self.main.is_some() || !self.streams.is_empty() {
            return None;
        }
        // Closed in the same step, so a stream sent from now on runs in a
        // task of its own rather than waiting here for a poll that never comes.
        let last = lock(&self.shared.inbox).take().unwrap_or_default();
        if last.is_empty() {
            return self.output.take();
        }
        self.streams.extend(last);
        self.shared.woken.store(true, SeqCst);
        None
    }
}

impl<F: Future> Future for Together<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Together {
            inside: this,
            waker,
        } = self.get_mut();
        this.shared.task.register(cx.waker());
        let mut inner = Context::from_waker(waker);
        let mut rounds = 0;
        loop {
            this.shared.polling.store(true, SeqCst);
            loop {
                this.shared.woken.store(false, SeqCst);
                if let Some(out) = this.round(&mut inner) {
                    this.shared.polling.store(false, SeqCst);
                    return Poll::Ready(out);
                }
                if !this.shared.woken.load(SeqCst) {
                    break;
                }
                rounds += 1;
                // Out of rounds, or of the runtime's budget for this poll
                // (past it, tokio's resources answer `Pending` and wake):
                // the task goes to the back of the queue.
                if rounds == ROUNDS || !tokio::task::coop::has_budget_remaining() {
                    this.shared.polling.store(false, SeqCst);
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
            }
            this.shared.polling.store(false, SeqCst);
            // A wake that came after the last round and before `polling`
            // was cleared did not wake the task: go round again for it.
            if !this.shared.woken.load(SeqCst) {
                return Poll::Pending;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::pod::Drain;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    /// A pod's lifecycle, and the trigger that drains it.
    fn life() -> (Lifecycle, crate::proxy::pod::DrainTrigger) {
        let (trigger, drain) = Drain::new();
        let (_, stop_accepting) = Drain::new();
        let life = Lifecycle {
            drain,
            stop_accepting,
            active: Default::default(),
        };
        (life, trigger)
    }

    /// Polls `task` once, with a waker that does nothing.
    fn poll_once<F: Future + Unpin>(task: &mut F) -> Poll<F::Output> {
        Pin::new(task).poll(&mut Context::from_waker(Waker::noop()))
    }

    /// Streams sent in run in the connection's task, and the whole ends
    /// only once the connection and every stream have.
    #[tokio::test]
    async fn ends_after_main_and_every_stream() {
        let (life, _trigger) = life();
        let ran = Arc::new(AtomicUsize::new(0));
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let counted = ran.clone();
        let l = life.clone();
        let (streams, inbox) = channel();
        let main = async move {
            let c = counted.clone();
            streams.spawn(&l, async move {
                let _ = wait.await;
                c.fetch_add(1, SeqCst);
            });
            7
        };
        let mut task = together(main, inbox);
        // One poll: `main` ends in it, the stream waits.
        assert!(
            poll_once(&mut task).is_pending(),
            "ended before its stream did"
        );
        assert_eq!(life.active.count(), 1);
        go.send(()).unwrap();
        assert_eq!(task.await, 7);
        assert_eq!(ran.load(SeqCst), 1);
        assert_eq!(life.active.count(), 0);
    }

    /// A stream sent after everything ended still runs (in its own task).
    #[tokio::test]
    async fn a_stream_sent_late_runs_on_its_own() {
        let (life, _trigger) = life();
        let (streams, inbox) = channel();
        together(async {}, inbox).await;
        let (done, ran) = tokio::sync::oneshot::channel();
        streams.spawn(&life, async move {
            let _ = done.send(());
        });
        tokio::time::timeout(Duration::from_secs(5), ran)
            .await
            .expect("the late stream never ran")
            .unwrap();
    }

    /// Two streams that hand each other data through a channel (as a copy
    /// and the connection do through h2's buffers) finish in one poll of
    /// the task: their wakes of each other do not reschedule it.
    #[tokio::test]
    async fn wakes_inside_a_poll_are_served_in_it() {
        let (life, _trigger) = life();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(1);
        let polls = Arc::new(AtomicUsize::new(0));
        let l = life.clone();
        let (streams, inbox) = channel();
        let main = async move {
            streams.spawn(&l, async move {
                for i in 0..8 {
                    tx.send(i).await.unwrap();
                }
            });
            let mut sum = 0;
            while let Some(i) = rx.recv().await {
                sum += i;
            }
            sum
        };
        let task = together(main, inbox);
        let counted = polls.clone();
        let mut task = Box::pin(task);
        let sum = std::future::poll_fn(move |cx| {
            counted.fetch_add(1, SeqCst);
            task.as_mut().poll(cx)
        })
        .await;
        assert_eq!(sum, 28);
        assert_eq!(
            polls.load(SeqCst),
            1,
            "the task was polled again for its own wakes"
        );
    }

    /// A stream that panics is dropped alone: the connection and its
    /// other streams go on.
    #[tokio::test]
    async fn a_panicking_stream_is_dropped_alone() {
        let (life, _trigger) = life();
        let (done, finished) = tokio::sync::oneshot::channel();
        let (streams, inbox) = channel();
        let l = life.clone();
        let main = async move {
            streams.spawn(&l, async { panic!("a stream's bug") });
            streams.spawn(&l, async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                let _ = done.send(());
            });
            3
        };
        let out = tokio::spawn(together(main, inbox)).await;
        assert_eq!(out.expect("the connection's task died with the stream"), 3);
        finished.await.expect("the other stream was dropped too");
        assert_eq!(life.active.count(), 0);
    }

    /// Draining the pod cuts short the streams run inside, as it cuts
    /// short a spawned one.
    #[tokio::test]
    async fn drained_streams_end() {
        let (life, trigger) = life();
        let l = life.clone();
        let (streams, inbox) = channel();
        let main = async move {
            streams.spawn(&l, std::future::pending());
        };
        let mut task = together(main, inbox);
        assert!(poll_once(&mut task).is_pending());
        trigger.fire();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("a drained stream kept its connection's task");
    }
}
