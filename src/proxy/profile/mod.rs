//! The admin port's profiles, in pprof's format and at ztunnel's paths, so
//! `go tool pprof http://127.0.0.1:15000/debug/pprof/profile` reads them:
//!
//! - `/debug/pprof/profile?seconds=&frequency=`: the CPU, sampled on
//!   SIGPROF for `seconds` (1–300, 10 by default) at `frequency` Hz
//!   (1–1000, 100 by default, Go's rate: a faster one under-reports, since
//!   SIGPROFs that fall together are delivered once). Nothing runs, and
//!   nothing is paid, while no profile is being taken.
//! - `/debug/pprof/heap/profiling?activate=true|false`: jemalloc's heap
//!   sampling (one sample per 512 KiB allocated on average) on or off, in
//!   a proxy started with `_RJEM_MALLOC_CONF=prof:true` (off from the
//!   start even then).
//! - `/debug/pprof/heap`: what is live of what was sampled while it was on.

use bytes::Bytes;
use http::StatusCode;

use crate::sideport::{Answer, Reply, PROTOBUF, TEXT};

mod cpu;

/// `seconds` and `frequency` when the request does not say.
const CPU_SECONDS: u64 = 10;
const CPU_HZ: u32 = 100;

/// The value of `key` in a path's query, undecoded.
pub(super) fn query<'a>(path: &'a str, key: &str) -> Option<&'a str> {
    let (_, q) = path.split_once('?')?;
    q.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == key).then_some(v)
    })
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Reply {
    (status, TEXT, body.into())
}

/// `key` from the query, within `range`, or `default` when absent.
fn bounded<T>(
    path: &str,
    key: &str,
    range: std::ops::RangeInclusive<T>,
    default: T,
) -> Result<T, Reply>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display,
{
    let Some(raw) = query(path, key) else {
        return Ok(default);
    };
    match raw.parse::<T>() {
        Ok(v) if range.contains(&v) => Ok(v),
        _ => Err(text(
            StatusCode::BAD_REQUEST,
            format!(
                "invalid {key} value; expected {}-{}\n",
                range.start(),
                range.end()
            ),
        )),
    }
}

/// `GET /debug/pprof/profile`: samples every thread for the asked time,
/// then answers the profile (gzipped protobuf, symbolized).
pub(super) fn cpu(path: &str) -> Answer {
    let seconds = match bounded(path, "seconds", 1..=300u64, CPU_SECONDS) {
        Ok(s) => s,
        Err(reply) => return reply.into(),
    };
    let hz = match bounded(path, "frequency", 1..=1000u32, CPU_HZ) {
        Ok(f) => f,
        Err(reply) => return reply.into(),
    };
    Answer::Later(Box::pin(async move {
        match cpu::take(seconds, hz).await {
            Ok(profile) => {
                tracing::info!(
                    bytes = profile.pprof.len(),
                    samples = profile.samples,
                    lost = profile.lost,
                    "CPU profile written"
                );
                (StatusCode::OK, PROTOBUF, profile.pprof.into())
            }
            Err(e @ cpu::Refused::Busy) => text(StatusCode::CONFLICT, format!("{e}\n")),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
        }
    }))
}

/// jemalloc's profiling handle, when the process was started with it
/// (`_RJEM_MALLOC_CONF=prof:true`; see `MALLOC_CONF` in main.rs for why
/// it is not armed by default).
fn heap_control(
) -> Result<&'static std::sync::Arc<tokio::sync::Mutex<jemalloc_pprof::JemallocProfCtl>>, Reply> {
    jemalloc_pprof::PROF_CTL.as_ref().ok_or_else(|| {
        text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "heap profiling is not armed in this process: start the proxy with _RJEM_MALLOC_CONF=prof:true to allow it (armed, it costs ~5% CPU per round trip)\n",
        )
    })
}

/// `GET /debug/pprof/heap`: the sampled live heap (gzipped protobuf).
pub(super) fn heap() -> Answer {
    let ctl = match heap_control() {
        Ok(c) => c.clone(),
        Err(reply) => return reply.into(),
    };
    Answer::Later(Box::pin(async move {
        let mut ctl = ctl.lock_owned().await;
        if !ctl.activated() {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                "heap profiling not active; activate with /debug/pprof/heap/profiling?activate=true\n",
            );
        }
        // jemalloc writes its dump to a file under $TMPDIR, which is then
        // read, parsed and symbolized: off the workers.
        let started = std::time::Instant::now();
        let dumped = tokio::task::spawn_blocking(move || {
            let dumped = ctl.dump_pprof();
            // The symbolizer caches what it parsed of the binary: let it go.
            backtrace::clear_symbol_cache();
            dumped
        });
        match dumped.await {
            Ok(Ok(body)) => {
                tracing::info!(bytes = body.len(), took = ?started.elapsed(), "heap profile written");
                (StatusCode::OK, PROTOBUF, body.into())
            }
            Ok(Err(e)) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the heap profile cannot be written: {e:#}\n"),
            ),
            Err(e) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the heap profile was lost: {e}\n"),
            ),
        }
    }))
}

/// `/debug/pprof/heap/profiling[?activate=true|false]`: turns sampling on
/// or off, and says which it is. Turning it off forgets what was sampled.
pub(super) fn heap_profiling(path: &str) -> Answer {
    let ctl = match heap_control() {
        Ok(c) => c.clone(),
        Err(reply) => return reply.into(),
    };
    let activate = match query(path, "activate") {
        None => None,
        Some("true") => Some(true),
        Some("false") => Some(false),
        Some(v) => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("invalid activate value {v:?}; expected true or false\n"),
            )
            .into()
        }
    };
    Answer::Later(Box::pin(async move {
        let mut ctl = ctl.lock().await;
        let changed = match activate {
            Some(true) => ctl.activate(),
            Some(false) => ctl.deactivate(),
            None => Ok(()),
        };
        match changed {
            Ok(()) => {
                if let Some(on) = activate {
                    tracing::info!(active = on, "heap profiling changed");
                }
                text(
                    StatusCode::OK,
                    format!("heap profiling active: {}\n", ctl.activated()),
                )
            }
            Err(e) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("heap profiling cannot be changed: {e}\n"),
            ),
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_found_by_key_and_bounds_refuse_what_is_outside() {
        let p = "/debug/pprof/profile?seconds=2&frequency=997";
        assert_eq!(query(p, "seconds"), Some("2"));
        assert_eq!(query(p, "frequency"), Some("997"));
        assert_eq!(query(p, "second"), None);
        assert_eq!(query("/debug/pprof/profile", "seconds"), None);
        assert_eq!(bounded(p, "seconds", 1..=300u64, 10).ok(), Some(2));
        assert_eq!(bounded("/x", "seconds", 1..=300u64, 10).ok(), Some(10));
        for bad in [
            "/x?seconds=0",
            "/x?seconds=301",
            "/x?seconds=-1",
            "/x?seconds=ten",
        ] {
            let (status, _, body) = bounded(bad, "seconds", 1..=300u64, 10).unwrap_err();
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(body, "invalid seconds value; expected 1-300\n", "{bad}");
        }
    }
}
