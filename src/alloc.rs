//! The allocator's settings every role runs with (the binary exports
//! them; so do the benches that measure the proxy's memory, so their
//! figures are the proxy's).

/// jemalloc's settings: one arena (a node proxy
/// runs on a couple of worker threads, whose caches take most allocations
/// without the arena's lock; each more arena costs its own metadata and
/// pages), and freed pages handed back to the system two seconds after
/// they were last used (bulk flows keep their buffers between reads) and
/// then at once (`MADV_DONTNEED`, so resident memory shows it).
/// Each thread's cache keeps jemalloc's default 20 freed objects per size
/// class: what a thread caches is not given back while the thread idles
/// (up to ~0.5 MB per proxy after a bulk transfer), but 4 cost 3–4% of
/// HBONE throughput and CPU per byte (docs/perf-log.md, 2026-12-05).
/// jemalloc's heap profiler is built in but not armed: armed (`prof:true`,
/// as ztunnel runs), every free checks whether its object was sampled,
/// which cost 4–5% of the proxies' CPU per HBONE round trip and 6% of p50
/// even with sampling off (docs/perf-log.md, 2026-12-05). A proxy started
/// with `_RJEM_MALLOC_CONF=prof:true` has it, off until an operator turns
/// it on at the admin port; it then samples once per 512 KiB allocated on
/// average (`lg_prof_sample:19`, ztunnel's).
pub const SETTINGS: Settings = Settings(
    c"narenas:1,dirty_decay_ms:2000,muzzy_decay_ms:0,prof_active:false,lg_prof_sample:19".as_ptr(),
);

/// A C string pointer jemalloc reads once at start (as the exported
/// `_rjem_malloc_conf`); never written.
#[repr(transparent)]
pub struct Settings(*const std::ffi::c_char);

// SAFETY: the pointer is to a static, immutable C string literal.
unsafe impl Sync for Settings {}

/// Long-running roles give freed memory back on jemalloc's own thread, on
/// time, rather than only when they next allocate (an idle proxy does
/// not): it sleeps while there is nothing to give back.
pub fn purge_in_background() {
    if let Err(e) = tikv_jemalloc_ctl::background_thread::write(true) {
        eprintln!("ambit: jemalloc's background thread cannot start ({e}); freed memory goes back to the system only as the process allocates");
    }
}
