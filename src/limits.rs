//! Process limits the long-lived roles set at start: the open-file limit
//! raised to its hard limit, since a node proxy holds two descriptors per
//! proxied connection for every pod of its node, and the agent one per pod.

use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// Raises `RLIMIT_NOFILE`'s soft limit to the hard limit; returns the limit
/// in force. A failure is logged and the old limit kept.
pub fn raise_open_files() -> u64 {
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit; keeping it");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-file limit");
            0
        }
    }
}
