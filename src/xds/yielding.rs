//! Where a response is applied: a small one on a thread that gives way to
//! the data path at once, a large one (or any, while that thread cannot
//! keep up) on the xDS thread.
//!
//! A one-workload update is tens of microseconds of work on cold memory
//! (the paths it copies in the state's maps, the old state it frees). At
//! nice 10 the xDS thread, once running, keeps a data-path thread that
//! wakes on its CPU waiting for the rest of its turn, and that shows in
//! the connections' p99 while the mesh changes. A thread at `SCHED_IDLE`
//! is set aside the moment any other thread wants its CPU, and the kernel
//! counts its CPU as free when it places a waking thread.
//!
//! `SCHED_IDLE` gets almost nothing of a CPU that stays busy, and a thread
//! cannot leave it without `CAP_SYS_NICE` (or an `RLIMIT_NICE` that allows
//! the nice value it had). So each response handed over is timed: one the
//! thread has not begun within [`STARVED`] is taken back and applied on
//! the xDS thread, and when one waited that long for a CPU (begun late, or
//! its time from hand-over to done less the CPU it used), the responses
//! of the next [`KEEP_UP`] are applied on the xDS thread itself, at its
//! nice 10: the stream never waits on a starved thread for long. A
//! response of [`MIN_RESOURCES`] or more (a first push, a reconnect's) is
//! always applied there: it would wait longest, and it converts ahead on a
//! helper at the xDS thread's priority. If the thread cannot start, or
//! ends, everything is applied on the xDS thread.

use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use super::ahead::MIN_RESOURCES;

/// A response that waited this long for a CPU means the node's CPUs stay
/// busy: the yielding thread would fall behind.
pub const STARVED: Duration = Duration::from_millis(10);
/// After a starved response, responses are applied on the xDS thread for
/// this long; twice as long each time the first one handed over after it
/// starves again, up to [`KEEP_UP_MOST`] (a node whose CPUs stay busy
/// meets a starved update ever more rarely).
pub const KEEP_UP: Duration = Duration::from_secs(10);
pub const KEEP_UP_MOST: Duration = Duration::from_secs(640);

type Job = Box<dyn FnOnce() + Send>;

/// The thread that applies small responses, and whether it keeps up.
pub struct Applier {
    jobs: Option<mpsc::Sender<Job>>,
    /// Until then, everything is applied on the caller's thread.
    here_until: Option<Instant>,
    /// A job not begun within this is taken back ([`STARVED`]).
    starved: Duration,
    /// The next window on the xDS thread, if one starves.
    keep_up: Duration,
}

/// The applying thread ended while it held a response (it panicked).
#[derive(Debug, thiserror::Error)]
#[error("the thread applying xDS responses ended while applying one")]
pub struct Lost;

impl Applier {
    /// Starts the yielding thread; without it, everything is applied on
    /// the caller's thread.
    pub fn start() -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let started = std::thread::Builder::new()
            .name("ambit-xds-apply".into())
            .spawn(move || {
                yield_to_all();
                rx.into_iter().for_each(|job| job());
            });
        match started {
            Ok(_) => Applier {
                jobs: Some(tx),
                ..Applier::here()
            },
            Err(e) => {
                tracing::warn!(error = %e, "no thread to apply xDS updates on; applying them on the xDS thread");
                Applier::here()
            }
        }
    }

    /// Everything applied on the caller's thread.
    pub fn here() -> Self {
        Applier {
            jobs: None,
            here_until: None,
            starved: STARVED,
            keep_up: KEEP_UP,
        }
    }

    /// Whether a response of `resources` resources is handed to the
    /// yielding thread at `now`.
    fn hands_over(&self, resources: usize, now: Instant) -> bool {
        self.jobs.is_some()
            && resources < MIN_RESOURCES
            && self.here_until.is_none_or(|until| now >= until)
    }

    /// Notes that a response handed over at `now` waited `waited` for a CPU.
    fn waited(&mut self, waited: Duration, now: Instant) {
        if waited < self.starved {
            // It kept up: a window after the next starved one is the first.
            self.here_until = None;
            self.keep_up = KEEP_UP;
            return;
        }
        if self.here_until.is_some_and(|until| now < until) {
            return; // applied here already
        }
        tracing::info!(
            waited_ms = waited.as_millis() as u64,
            "an xDS update waited for a busy CPU; applying updates at the xDS thread's priority for {} s",
            self.keep_up.as_secs()
        );
        self.here_until = Some(now + self.keep_up);
        self.keep_up = (self.keep_up * 2).min(KEEP_UP_MOST);
    }

    /// `apply` (of a response of `resources` resources), on the yielding
    /// thread or here; its result.
    pub async fn apply<T: Send + 'static, F: FnOnce() -> T + Send + 'static>(
        &mut self,
        resources: usize,
        apply: F,
    ) -> Result<T, Lost> {
        let handed = Instant::now();
        if !self.hands_over(resources, handed) {
            return Ok(apply());
        }
        // The job is taken from here by whichever thread runs it: the
        // yielding one, or this one if that has not begun it in time.
        let slot = Arc::new(Mutex::new(Some(apply)));
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let job: Job = {
            let slot = slot.clone();
            Box::new(move || {
                let Some(apply) = take(&slot) else {
                    return; // taken back
                };
                let cpu = thread_cpu();
                let out = apply();
                let used = thread_cpu().saturating_sub(cpu);
                let _ = tx.send((out, handed.elapsed().saturating_sub(used)));
            })
        };
        if let Some(Err(mpsc::SendError(job))) = self.jobs.as_ref().map(|jobs| jobs.send(job)) {
            // The thread is gone: from now on, here.
            self.jobs = None;
            job();
        }
        let done = match tokio::time::timeout(self.starved, &mut rx).await {
            Ok(done) => done,
            Err(_) => match take(&slot) {
                // Not begun: the thread is starved of CPU. Here, now.
                Some(apply) => {
                    self.waited(self.starved, Instant::now());
                    return Ok(apply());
                }
                // Begun: it ends soon.
                None => rx.await,
            },
        };
        match done {
            Ok((out, waited)) => {
                self.waited(waited, Instant::now());
                Ok(out)
            }
            Err(_) => {
                self.jobs = None;
                Err(Lost)
            }
        }
    }
}

/// The job in `slot`, if no thread has taken it.
fn take<F>(slot: &Mutex<Option<F>>) -> Option<F> {
    slot.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// Puts the calling thread at `SCHED_IDLE`; a failure leaves it as it was.
fn yield_to_all() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sets the calling thread's own policy (pid 0); `param` lives
    // across the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "SCHED_IDLE refused; xDS updates applied at the xDS thread's priority");
    }
}

/// The calling thread's CPU time.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes the calling thread's CPU clock into `ts`, which lives
    // across the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;

    /// The calling thread's scheduling policy and id.
    fn where_run() -> (libc::c_int, std::thread::ThreadId) {
        // SAFETY: reads the calling thread's own policy.
        let policy = unsafe { libc::sched_getscheduler(0) };
        (policy, std::thread::current().id())
    }

    /// An applier that waits for its thread however busy the machine
    /// (the tests beside this one keep the CPUs busy).
    fn patient() -> Applier {
        Applier {
            starved: Duration::from_secs(60),
            ..Applier::start()
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_small_response_is_applied_at_sched_idle_and_a_large_one_here() {
        let mut applier = patient();
        let here = std::thread::current().id();
        let (policy, on) = applier.apply(1, where_run).await.unwrap();
        assert_eq!(policy, libc::SCHED_IDLE);
        assert_ne!(on, here);
        let (_, on) = applier.apply(MIN_RESOURCES, where_run).await.unwrap();
        assert_eq!(on, here, "a first push's size is applied on the xDS thread");
        // In order, each with its own result.
        for i in 0..20u32 {
            assert_eq!(applier.apply(1, move || i * 2).await.unwrap(), i * 2);
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_update_that_waited_behind_a_busy_thread_sends_the_next_to_the_xds_thread() {
        let mut applier = patient();
        let here = std::thread::current().id();
        // The yielding thread and a busy thread at the usual priority on
        // one CPU: the busy one takes nearly all of it.
        let cpu = a_cpu_to_run_on();
        let pinned = applier
            .apply(1, move || {
                pin_to(cpu);
                std::thread::current().id()
            })
            .await
            .unwrap();
        assert_ne!(pinned, here);
        applier.starved = STARVED;
        let (busy, spinning) = (
            Arc::new(AtomicBool::new(true)),
            Arc::new(AtomicBool::new(false)),
        );
        let spinner = {
            let (busy, spinning) = (busy.clone(), spinning.clone());
            std::thread::spawn(move || {
                pin_to(cpu);
                // SAFETY: no arguments; reads the calling thread's CPU.
                while unsafe { libc::sched_getcpu() } != cpu as libc::c_int {
                    std::thread::yield_now();
                }
                spinning.store(true, Ordering::SeqCst);
                while busy.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        while !spinning.load(Ordering::SeqCst) {
            tokio::task::yield_now().await;
        }
        let t = Instant::now();
        let (_, on) = applier
            .apply(1, || {
                let t = thread_cpu();
                while thread_cpu() - t < Duration::from_millis(2) {}
                where_run()
            })
            .await
            .unwrap();
        let took = t.elapsed();
        busy.store(false, Ordering::Relaxed);
        spinner.join().unwrap();
        let _ = on; // begun there (then starved), or taken back
        assert!(took < Duration::from_secs(5), "the update took {took:?}");
        // The next are applied here too, for a while.
        let (_, on) = applier.apply(1, where_run).await.unwrap();
        assert_eq!(on, here, "after a starved update, the xDS thread applies");
        assert!(!applier.hands_over(1, Instant::now()));
        assert!(applier.hands_over(1, Instant::now() + KEEP_UP));
    }

    #[test]
    fn each_window_after_a_starved_update_is_twice_the_last_until_one_keeps_up() {
        let mut applier = Applier::here();
        applier.jobs = Some(mpsc::channel().0);
        let mut now = Instant::now();
        applier.waited(STARVED - Duration::from_micros(1), now);
        assert!(applier.hands_over(1, now), "it kept up");
        // Starved: 10 s on the xDS thread; starved again right after: 20 s...
        for window in [10, 20, 40, 80, 160, 320, 640, 640] {
            applier.waited(STARVED, now);
            let window = Duration::from_secs(window);
            assert!(!applier.hands_over(1, now + window - Duration::from_millis(1)));
            assert!(applier.hands_over(1, now + window));
            now += window;
        }
        // ...until one handed over keeps up: the next window is 10 s again.
        applier.waited(Duration::ZERO, now);
        assert!(applier.hands_over(1, now));
        applier.waited(STARVED, now);
        assert!(applier.hands_over(1, now + KEEP_UP));
        // A large response is never handed over.
        assert!(!applier.hands_over(MIN_RESOURCES, now + KEEP_UP));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_update_the_yielding_thread_has_not_begun_in_time_is_applied_here() {
        let mut applier = Applier::start();
        let here = std::thread::current().id();
        // The thread is held by a job of its own (as a thread the CPUs
        // never get to would be).
        let (release, held) = mpsc::channel::<()>();
        let blocker: Job = Box::new(move || {
            let _ = held.recv();
        });
        applier.jobs.as_ref().unwrap().send(blocker).unwrap();
        let t = Instant::now();
        let (_, on) = tokio::time::timeout(Duration::from_secs(5), applier.apply(1, where_run))
            .await
            .expect("an update left waiting on a thread that could not begin it")
            .unwrap();
        assert_eq!(
            on, here,
            "an update waited on a thread that could not run it"
        );
        assert!(t.elapsed() >= STARVED);
        // The next ones too, for a while; then the thread again.
        assert_eq!(applier.apply(1, where_run).await.unwrap().1, here);
        release.send(()).unwrap();
        applier.here_until = None;
        applier.starved = Duration::from_secs(60);
        assert_ne!(applier.apply(1, where_run).await.unwrap().1, here);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_thread_that_ended_leaves_the_updates_to_the_xds_thread() {
        let mut applier = patient();
        let lost = applier
            .apply(1, || -> u32 { panic!("a bug in applying") })
            .await;
        assert!(lost.is_err());
        let here = std::thread::current().id();
        assert_eq!(applier.apply(1, where_run).await.unwrap().1, here);
    }

    /// A CPU the calling thread may run on.
    fn a_cpu_to_run_on() -> usize {
        // SAFETY: a zeroed cpu_set_t is an empty set; the calling thread's
        // affinity is written into it, `size` its size; CPU_ISSET reads
        // it at indices below CPU_SETSIZE.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            let size = std::mem::size_of::<libc::cpu_set_t>();
            assert_eq!(libc::sched_getaffinity(0, size, &mut set), 0);
            (0..libc::CPU_SETSIZE as usize)
                .find(|&c| libc::CPU_ISSET(c, &set))
                .expect("a CPU to run on")
        }
    }

    fn pin_to(cpu: usize) {
        // SAFETY: a zeroed cpu_set_t is an empty set; `cpu` is below
        // CPU_SETSIZE; sets the calling thread's own affinity.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            assert_eq!(
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
                0
            );
        }
    }
}
