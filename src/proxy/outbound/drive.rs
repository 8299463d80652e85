//! The driver of a dialed HBONE connection: it moves the connection's
//! receive windows with its share of the memory budget, and resets a
//! connection the pool let go of that does not close in time.

use bytes::Bytes;
use socket2::SockRef;

use super::super::budget::{ConnectionWindows, WindowRetry};
use super::super::gate::Gate;
use super::super::hbone::H2Settings;
use super::super::pool::Lifeline;
use crate::identity::crl;
use std::sync::Arc;

/// How long a connection no stream will use again (the pool let go of it:
/// idle past its timeout, its pod gone, or the proxy draining) may take to
/// close. One whose destination has stopped reading can never flush its
/// last frames, and would keep its windows' reservation and its buffers for
/// as long as the destination likes: it is reset instead.
pub const RELEASED_CLOSE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// How a driven connection ended, when it ended without an h2 error.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Ended {
    /// Closed by either side.
    Closed,
    /// Let go by the pool and not closed within [`RELEASED_CLOSE_DEADLINE`].
    Abandoned,
    /// Closed because a revocation list loaded since revokes the peer.
    Revoked,
}

/// What a driven connection waits on besides its frames, and came.
enum Waited {
    /// A revocation list loaded since revokes the peer.
    Revoked,
    /// The pool let go of the connection.
    Released,
    /// Released, and not closed in time.
    Deadline,
    /// What its receive windows follow moved.
    Windows,
    /// Time to try its windows again.
    Retry,
}

/// Drives a dialed HBONE connection to its end, moving the receive windows
/// it grants (`told`, as its handshake said) with its share of the budget,
/// and closes it if a revocation list loaded since revokes the peer
/// (`revocation`). Once released, it has [`RELEASED_CLOSE_DEADLINE`] to
/// close; past it the connection's `socket` (owned by `conn`) is reset as
/// `conn` is dropped.
///
/// Not an `async fn`: an `async fn` moves its arguments into locals as it
/// starts, and its future keeps room for both, so the connection (2,136
/// bytes) was held twice; the block here uses them where they were
/// captured. The connection's task, this and its caller's logging, was
/// 8,056 bytes, a jemalloc size class of 8 KiB per dialed connection
/// (`-Zprint-type-sizes`; the node bench's heap profile saw it).
#[allow(clippy::manual_async_fn)] // on purpose: see above
pub(super) fn drive<T>(
    mut conn: h2::client::Connection<T, Bytes>,
    mut told: H2Settings,
    mut windows: ConnectionWindows,
    lifeline: Arc<Lifeline>,
    socket: std::os::fd::RawFd,
    mut revocation: Option<crl::Tracked>,
) -> impl std::future::Future<Output = Result<Ended, h2::Error>>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    async move {
        let mut retry = WindowRetry::default();
        // Asks to be woken by what moves its windows first.
        windows.apply(&mut conn, &mut told);
        let released = lifeline.released();
        tokio::pin!(released);
        let mut deadline = None;
        // What the connection waits on besides its frames is polled only
        // when it wakes, not with every frame ([`Gate`]).
        let gate = Gate::new();
        loop {
            let side = async {
                tokio::select! {
                    () = crl::revoked(&mut revocation) => Waited::Revoked,
                    _ = &mut released, if deadline.is_none() => Waited::Released,
                    _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)), if deadline.is_some() => Waited::Deadline,
                    _ = windows.moved() => Waited::Windows,
                    _ = retry.due(), if windows.unsettled(told) => Waited::Retry,
                }
            };
            let waited = tokio::select! {
                biased;
                ended = &mut conn => return ended.map(|()| Ended::Closed),
                waited = gate.guard(side) => waited,
            };
            match waited {
                Waited::Revoked => return Ok(Ended::Revoked),
                Waited::Released => {
                    deadline = Some(tokio::time::Instant::now() + RELEASED_CLOSE_DEADLINE);
                }
                Waited::Deadline => {
                    // SAFETY: `conn` owns the socket and is alive until this returns.
                    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(socket) };
                    // A reset frees the unsent data the kernel would otherwise
                    // keep probing a closed window with.
                    let _ = SockRef::from(&fd).set_linger(Some(std::time::Duration::ZERO));
                    return Ok(Ended::Abandoned);
                }
                Waited::Windows => {
                    windows.apply(&mut conn, &mut told);
                    retry.reset();
                }
                Waited::Retry => retry.tried(windows.apply(&mut conn, &mut told)),
            }
        }
    }
}
