//! The CPU sampler behind `/debug/pprof/profile`: the kernel's profiling
//! timer (`ITIMER_PROF`, which counts the CPU time of every thread) sends
//! SIGPROF to the thread that is running; its handler walks that thread's
//! stack into a buffer allocated for this profile alone. When the time is
//! up the stacks are counted, symbolized and written as pprof, and the
//! buffer and the symbolizer's caches are freed: a proxy that was profiled
//! holds no more memory than before (pprof-rs, which ztunnel uses, keeps
//! ~84 MB of sample tables for the rest of the process's life).
//!
//! The handler takes no lock and allocates nothing: it claims a slot with
//! one atomic add and writes instruction pointers into it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::time::Duration;

/// Frames kept per sample, from the innermost.
const DEPTH: usize = 64;
/// A slot: the number of frames, then the frames.
const SLOT: usize = DEPTH + 1;
/// At most this many samples per profile: 32,768 slots of 520 bytes are
/// 17 MB, held only while the profile runs. Two busy cores at 100 Hz fill
/// 200 a second.
const MAX_SAMPLES: usize = 32_768;

/// The buffer of the profile being taken; null when none is.
static SLOTS: AtomicPtr<usize> = AtomicPtr::new(std::ptr::null_mut());
static CAPACITY: AtomicUsize = AtomicUsize::new(0);
/// The next slot a signal claims (may run past `CAPACITY`: those are lost).
static NEXT: AtomicUsize = AtomicUsize::new(0);
/// Handlers running now: the buffer is read only once none is.
static IN_HANDLER: AtomicUsize = AtomicUsize::new(0);
/// One profile at a time: the timer and the handler are the process's.
static TAKING: AtomicBool = AtomicBool::new(false);

/// Why a profile cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("a CPU profile is already being taken; try again when it ends")]
    Busy,
    #[error("the CPU profiler cannot start: {0}")]
    Start(std::io::Error),
    #[error("the CPU profile was lost while it was written: {0}")]
    Lost(String),
}

/// What a profile found: pprof bytes (gzipped protobuf), and counts.
pub struct Profile {
    pub pprof: Vec<u8>,
    pub samples: usize,
    pub lost: usize,
}

/// Samples every thread's CPU for `seconds` at `hz`, then writes what was
/// seen. Returns at once with [`Refused::Busy`] while another is taken.
pub async fn take(seconds: u64, hz: u32) -> Result<Profile, Refused> {
    let running = Running::start(seconds, hz)?;
    tracing::info!(seconds, frequency = hz, "CPU profile started");
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    // Stopping waits (briefly) for handlers in flight; counting and
    // symbolizing read the binary: neither on a worker thread.
    let period_ns = 1_000_000_000 / u64::from(hz);
    let written = tokio::task::spawn_blocking(move || {
        let (stacks, lost) = running.stop();
        let samples = stacks.iter().map(|(_, n)| n).sum();
        let pprof = write(&stacks, period_ns);
        // The symbolizer caches what it parsed of the binary: let it go.
        backtrace::clear_symbol_cache();
        Profile {
            pprof,
            samples,
            lost,
        }
    })
    .await;
    written.map_err(|e| Refused::Lost(e.to_string()))
}

/// A profile being taken: the buffer, the handler and the timer. Dropped
/// without [`Running::stop`] (the request went away), it stops all three.
struct Running {
    slots: Vec<usize>,
    stopped: bool,
}

impl Running {
    fn start(seconds: u64, hz: u32) -> Result<Self, Refused> {
        if TAKING.swap(true, Ordering::AcqRel) {
            return Err(Refused::Busy);
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let wanted = (seconds as usize)
            .saturating_mul(hz as usize)
            .saturating_mul(cpus);
        let capacity = wanted.clamp(1, MAX_SAMPLES);
        let mut running = Running {
            slots: vec![0usize; capacity * SLOT],
            stopped: false,
        };
        NEXT.store(0, Ordering::SeqCst);
        CAPACITY.store(capacity, Ordering::SeqCst);
        SLOTS.store(running.slots.as_mut_ptr(), Ordering::SeqCst);
        if let Err(e) = install_handler().and_then(|()| set_timer(hz)) {
            running.halt();
            return Err(Refused::Start(e));
        }
        Ok(running)
    }

    /// Stops the timer, waits out handlers in flight, and leaves the
    /// buffer to this thread alone.
    fn halt(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let _ = set_timer(0);
        SLOTS.store(std::ptr::null_mut(), Ordering::SeqCst);
        // A handler counts itself in before it reads SLOTS: once none is
        // counted, none can still write (SeqCst orders the two).
        while IN_HANDLER.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        // A SIGPROF still pending finds SLOTS null and returns.
        TAKING.store(false, Ordering::Release);
    }

    /// The distinct stacks seen and how often, and how many samples did not
    /// fit.
    fn stop(mut self) -> (Vec<(Vec<usize>, usize)>, usize) {
        self.halt();
        let claimed = NEXT.load(Ordering::SeqCst);
        let capacity = self.slots.len() / SLOT;
        let mut counts: HashMap<&[usize], usize> = HashMap::new();
        for slot in self.slots.chunks_exact(SLOT).take(claimed.min(capacity)) {
            let n = slot[0].min(DEPTH);
            if n > 0 {
                *counts.entry(&slot[1..=n]).or_default() += 1;
            }
        }
        let stacks = counts.into_iter().map(|(s, n)| (s.to_vec(), n)).collect();
        (stacks, claimed.saturating_sub(capacity))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.halt();
    }
}

/// pprof's bytes for `stacks` (innermost frame first), each sample worth
/// `period_ns` of CPU, symbolized against this process's mappings.
fn write(stacks: &[(Vec<usize>, usize)], period_ns: u64) -> Vec<u8> {
    let mut profile = pprof_util::StackProfile::default();
    for mapping in mappings::MAPPINGS.iter().flatten() {
        profile.push_mapping(mapping.clone());
    }
    for (addrs, n) in stacks {
        let weight = (*n as f64) * (period_ns as f64);
        // The writer lists stacks outermost first and reads each address
        // as a return address (one past its call). The innermost is the
        // interrupted instruction itself: one is added to it to match.
        let mut addrs: Vec<usize> = addrs.iter().rev().copied().collect();
        if let Some(leaf) = addrs.last_mut() {
            *leaf += 1;
        }
        profile.push_stack(pprof_util::WeightedStack { addrs, weight }, None);
    }
    profile.to_pprof(("cpu", "nanoseconds"), ("cpu", "nanoseconds"), None)
}

/// ITIMER_PROF at `hz` (0 stops it).
fn set_timer(hz: u32) -> std::io::Result<()> {
    let interval = if hz == 0 {
        libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        }
    } else {
        libc::timeval {
            tv_sec: 0,
            tv_usec: (1_000_000 / hz.max(1)) as libc::suseconds_t,
        }
    };
    let timer = libc::itimerval {
        it_interval: interval,
        it_value: interval,
    };
    // SAFETY: a valid itimerval; the old value is not asked for.
    let rc = unsafe { libc::setitimer(libc::ITIMER_PROF, &timer, std::ptr::null_mut()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Installs [`on_sigprof`] (once; it stays, and returns at once while no
/// profile is taken). `SA_RESTART`: a blocking call it interrupts goes on.
fn install_handler() -> std::io::Result<()> {
    static INSTALLED: std::sync::OnceLock<Result<(), i32>> = std::sync::OnceLock::new();
    let installed = INSTALLED.get_or_init(|| {
        // SAFETY: zeroed sigaction is a valid start; the handler is an
        // `extern "C"` fn with the SA_SIGINFO signature.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigprof as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(libc::SIGPROF, &action, std::ptr::null_mut()) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
            }
        }
    });
    installed.map_err(std::io::Error::from_raw_os_error)
}

/// The instruction the signal interrupted, from the saved context.
///
/// # Safety
/// `ctx` is the `ucontext_t` the kernel passed to a SA_SIGINFO handler.
unsafe fn interrupted_at(ctx: *mut libc::c_void) -> Option<usize> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: per this function's contract.
    let uc = unsafe { &*(ctx as *const libc::ucontext_t) };
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    return Some(uc.uc_mcontext.gregs[libc::REG_RIP as usize] as usize);
    #[cfg(all(target_os = "linux", target_arch = "aarch64"))]
    return Some(uc.uc_mcontext.pc as usize);
    #[allow(unreachable_code)]
    {
        let _ = uc;
        None
    }
}

extern "C" fn on_sigprof(_: libc::c_int, _: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno is this thread's; read here and put back on return,
    // since the interrupted code may be about to read it.
    let errno = unsafe { *libc::__errno_location() };
    IN_HANDLER.fetch_add(1, Ordering::SeqCst);
    let base = SLOTS.load(Ordering::SeqCst);
    if !base.is_null() {
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        if i < CAPACITY.load(Ordering::Relaxed) {
            // SAFETY: slot `i` is inside the buffer (i < capacity), claimed
            // by this handler alone, and the buffer lives until no handler
            // is counted in IN_HANDLER.
            let slot = unsafe { std::slice::from_raw_parts_mut(base.add(i * SLOT), SLOT) };
            // SAFETY: the kernel's context for this signal.
            let pc = unsafe { interrupted_at(ctx) };
            slot[0] = record(&mut slot[1..], pc);
        }
    }
    IN_HANDLER.fetch_sub(1, Ordering::SeqCst);
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Walks this thread's stack into `frames` from the interrupted instruction
/// `pc` outwards (the handler's own frames are skipped); returns how many
/// it wrote. Without `pc`, or when the walk never reaches it, the sample
/// is what is known.
fn record(frames: &mut [usize], pc: Option<usize>) -> usize {
    let mut n = 0;
    let mut reached = pc.is_none();
    // SAFETY: the unsynchronized walk is the one usable in a signal
    // handler (the synchronized one takes a lock the interrupted code may
    // hold); it allocates nothing.
    unsafe {
        backtrace::trace_unsynchronized(|frame| {
            let ip = frame.ip() as usize;
            // The walk's end, as some unwinders mark it.
            if ip == 0 {
                return false;
            }
            if !reached {
                if Some(ip) != pc {
                    return true;
                }
                reached = true;
            }
            frames[n] = ip;
            n += 1;
            n < frames.len()
        });
    }
    match (reached, pc) {
        (true, _) => n,
        (false, Some(pc)) if pc != 0 => {
            frames[0] = pc;
            1
        }
        (false, _) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(until: std::time::Instant) -> u64 {
        let mut x = 0u64;
        while std::time::Instant::now() < until {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        x
    }

    /// A thread that burns CPU is seen, a second profile at once is
    /// refused, and the buffer is gone once the profile is written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_thread_is_sampled_and_a_second_profile_is_refused() {
        let burner =
            std::thread::spawn(|| spin(std::time::Instant::now() + Duration::from_millis(1500)));
        let first = tokio::spawn(take(1, 250));
        // The first claims the profiler before the second asks.
        while !TAKING.load(Ordering::Acquire) {
            tokio::task::yield_now().await;
        }
        assert!(matches!(take(1, 100).await, Err(Refused::Busy)));
        let profile = first.await.unwrap().unwrap();
        burner.join().unwrap();
        // One busy core for a second at 250 Hz: ~250 samples.
        assert!(
            profile.samples >= 100,
            "{} samples, {} lost",
            profile.samples,
            profile.lost
        );
        assert_eq!(profile.lost, 0);
        assert!(SLOTS.load(Ordering::SeqCst).is_null());
        assert!(!TAKING.load(Ordering::SeqCst));
        // gzip's magic: the bytes are what pprof reads.
        assert_eq!(&profile.pprof[..2], &[0x1f, 0x8b]);
    }
}
