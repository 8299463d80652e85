//! An HBONE connection's receive windows for its life: its share of the
//! budget while it carries streams, the smallest once idle, moved as the
//! share or its streams move (docs/wire.md §10), and the retry of a
//! connection left behind its share.

use std::sync::Arc;

use tokio::sync::watch;

use super::super::activity::{Activity, Watch};
use super::super::hbone::H2Settings;
use super::{fair_windows, Budget, Reservation, ROOMY};

/// How long a connection carries no stream before it is idle: it keeps
/// the smallest windows and leaves the share to the busy ones. Long enough
/// that a client opening one connection after another through the same
/// pooled connection keeps it busy.
pub const IDLE_WINDOWS_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

/// An HBONE connection's receive windows and their reservation, for its
/// life: counted among the connections that share the budget until
/// dropped. A connection carrying streams (busy, and for
/// [`IDLE_WINDOWS_AFTER`] after its last) has its fair share; an idle one
/// the smallest windows. Whoever drives the connection moves it when the
/// share or its streams move ([`ConnectionWindows::moved`],
/// [`ConnectionWindows::apply`]), and retries ([`WindowRetry`]) while it
/// is [`ConnectionWindows::unsettled`].
#[derive(Debug)]
pub struct ConnectionWindows {
    pub(super) budget: &'static Budget,
    pub(super) configured: H2Settings,
    pub(super) granted: H2Settings,
    pub(super) reservation: Reservation,
    pub(super) share: watch::Receiver<usize>,
    /// The streams the connection carries.
    pub(super) streams: Arc<Activity>,
    /// Counted among the busy connections.
    pub(super) busy: bool,
    /// While busy and carrying no stream: when it will have carried none
    /// for [`IDLE_WINDOWS_AFTER`]. Dropped, not just left unpolled, once
    /// it carries one again: a timer left in tokio's wheel still wakes its
    /// task when it fires (the node bench saw each new connection woken
    /// 5 s after it opened). Through one pooled connection, a client
    /// opening connection after connection sets it at most once per 5 s:
    /// streams in between wake no one.
    pub(super) idle_check: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// Has carried a stream: a new connection's driver is woken by its
    /// first stream (it is awake for it anyway) rather than at the 5 s mark
    /// after it opened.
    pub(super) carried: bool,
}

impl ConnectionWindows {
    /// The windows granted now.
    #[cfg(test)]
    pub fn granted(&self) -> H2Settings {
        self.granted
    }

    /// Moves to the fair windows ([`ConnectionWindows::rebalance`]) and
    /// tells the peer what it has not been told ([`tell_windows`]);
    /// whether either moved.
    pub fn apply(&mut self, conn: &mut impl ReceiveWindows, told: &mut H2Settings) -> bool {
        let before = (self.granted, *told);
        self.follow_streams();
        self.rebalance();
        tell_windows(conn, told, self.granted);
        before != (self.granted, *told)
    }

    /// Whether another try is wanted: behind the fair windows, or the peer
    /// not yet told of the granted ones.
    pub fn unsettled(&self, told: H2Settings) -> bool {
        self.behind() || told != self.granted
    }

    /// Waits until something the windows follow moves: the share
    /// ([`Budget::publish`]) while busy, the first stream of an idle
    /// connection, the last stream's end on a busy one, or the time it has
    /// carried none reaching [`IDLE_WINDOWS_AFTER`]. An idle connection is
    /// not woken by the share: it keeps the smallest windows whatever the
    /// share is.
    pub async fn moved(&mut self) {
        let check = async {
            match &mut self.idle_check {
                Some(sleep) => sleep.as_mut().await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            Ok(()) = self.share.changed(), if self.busy => {}
            () = self.streams.moved() => {}
            () = check => {}
        }
    }

    /// Whether the connection is counted busy: it carries streams, or
    /// carried one less than [`IDLE_WINDOWS_AFTER`] ago.
    #[cfg(test)]
    pub fn busy(&self) -> bool {
        self.busy
    }

    /// Counts the connection busy while it carries streams, idle once it
    /// has carried none for [`IDLE_WINDOWS_AFTER`], and asks to be woken
    /// ([`ConnectionWindows::moved`]) by what can change that next: an idle
    /// connection by its first stream; a busy one carrying streams by the
    /// last one's end, then, carrying none, by the time it will have
    /// carried none long enough (and a new one, which has carried none yet,
    /// by its first stream too, so that it is not woken 5 s after it
    /// opened). Streams coming and going in between wake no one. Each step asks, then looks again, so a stream that comes or
    /// goes meanwhile is seen by the one or the other.
    fn follow_streams(&mut self) {
        loop {
            match (self.busy, self.streams.idle_since()) {
                (false, None) => self.set_busy(true),
                (false, Some(_)) => {
                    self.streams.watch(Watch::First);
                    if self.streams.open() == 0 {
                        return;
                    }
                }
                (true, None) => {
                    self.idle_check = None;
                    self.carried = true;
                    self.streams.watch(Watch::Last);
                    if self.streams.open() > 0 {
                        return;
                    }
                }
                (true, Some(since)) => {
                    let at = since + IDLE_WINDOWS_AFTER;
                    if tokio::time::Instant::now() >= at {
                        self.idle_check = None;
                        self.set_busy(false);
                        continue;
                    }
                    self.streams.watch(if self.carried {
                        Watch::Nothing
                    } else {
                        Watch::First
                    });
                    if !self.carried && self.streams.open() > 0 {
                        continue;
                    }
                    match &mut self.idle_check {
                        Some(sleep) => sleep.as_mut().reset(at),
                        None => self.idle_check = Some(Box::pin(tokio::time::sleep_until(at))),
                    }
                    return;
                }
            }
        }
    }

    fn set_busy(&mut self, busy: bool) {
        self.busy = busy;
        self.budget.count(0, if busy { 1 } else { -1 });
    }

    /// Whether the granted windows are below the fair ones (growing did not
    /// fit yet: other connections had not given theirs back, or the peer
    /// is past half its share).
    pub fn behind(&self) -> bool {
        self.granted.connection_window < self.fair().connection_window
    }

    fn fair(&self) -> H2Settings {
        let share = if self.busy { *self.share.borrow() } else { 0 };
        fair_windows(self.configured, share)
    }

    /// Moves to the fair windows: at once when they are smaller (the
    /// reservation shrinks), when they fit when larger. Returns the new
    /// windows when they changed.
    pub fn rebalance(&mut self) -> Option<H2Settings> {
        self.share.mark_unchanged();
        let fair = self.fair();
        let (have, want) = (
            self.granted.connection_window as usize,
            fair.connection_window as usize,
        );
        if want < have {
            self.reservation.shrink(have - want);
        } else if want == have || self.reservation.try_grow(want - have, ROOMY).is_err() {
            return None;
        }
        self.granted = fair;
        Some(fair)
    }
}

/// How soon a connection left behind its fair windows, or whose peer was
/// not yet told of them, tries again ([`WindowRetry`]).
pub const WINDOW_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// The longest a connection that stays behind waits between tries.
const WINDOW_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(32);

/// When a connection behind its fair windows tries again: [`WINDOW_RETRY`]
/// after it fell behind, then twice as long after each try that changed
/// nothing, up to [`WINDOW_RETRY_MAX`]; [`WINDOW_RETRY`] again once the
/// share moves or a try moves the windows. A connection its peer's share
/// keeps at the smallest windows stays behind for its whole life: on a
/// node of 1,000 pods, 2,000 such connections retrying every second woke
/// the proxy about 400 times a second with nothing flowing.
#[derive(Debug)]
pub struct WindowRetry {
    gap: std::time::Duration,
    next: tokio::time::Instant,
}

impl Default for WindowRetry {
    fn default() -> Self {
        WindowRetry {
            gap: WINDOW_RETRY,
            next: tokio::time::Instant::now() + WINDOW_RETRY,
        }
    }
}

impl WindowRetry {
    /// Waits until the next try is due.
    pub async fn due(&self) {
        tokio::time::sleep_until(self.next).await
    }

    /// A try was made; `moved`: it changed the windows or what the peer was told.
    pub fn tried(&mut self, moved: bool) {
        self.gap = if moved {
            WINDOW_RETRY
        } else {
            (self.gap * 2).min(WINDOW_RETRY_MAX)
        };
        self.next = tokio::time::Instant::now() + self.gap;
    }

    /// The share moved: the next try comes soon again.
    pub fn reset(&mut self) {
        self.gap = WINDOW_RETRY;
        self.next = tokio::time::Instant::now() + WINDOW_RETRY;
    }

    /// The wait before the next try.
    #[cfg(test)]
    pub fn gap(&self) -> std::time::Duration {
        self.gap
    }
}

/// An HTTP/2 connection (either end) whose receive windows can be changed
/// while it runs.
pub trait ReceiveWindows {
    /// The connection window, at once (a smaller one takes effect as data
    /// in flight is read).
    fn set_connection_window(&mut self, size: u32);
    /// Every stream's window, by SETTINGS; refused while an earlier
    /// SETTINGS is unacknowledged.
    fn set_stream_window(&mut self, size: u32) -> Result<(), h2::Error>;
}

impl<T, B> ReceiveWindows for h2::server::Connection<T, B>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    B: bytes::Buf,
{
    fn set_connection_window(&mut self, size: u32) {
        self.set_target_window_size(size);
    }
    fn set_stream_window(&mut self, size: u32) -> Result<(), h2::Error> {
        self.set_initial_window_size(size)
    }
}

impl<T, B> ReceiveWindows for h2::client::Connection<T, B>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    B: bytes::Buf,
{
    fn set_connection_window(&mut self, size: u32) {
        self.set_target_window_size(size);
    }
    fn set_stream_window(&mut self, size: u32) -> Result<(), h2::Error> {
        self.set_initial_window_size(size)
    }
}

/// Tells the peer of `granted` windows where they differ from `told`: the
/// connection window at once, the stream window unless a SETTINGS is
/// still unacknowledged (then `told` keeps the old one, for the next try).
fn tell_windows(conn: &mut impl ReceiveWindows, told: &mut H2Settings, granted: H2Settings) {
    if told.connection_window != granted.connection_window {
        conn.set_connection_window(granted.connection_window);
        told.connection_window = granted.connection_window;
    }
    if told.stream_window != granted.stream_window
        && conn.set_stream_window(granted.stream_window).is_ok()
    {
        told.stream_window = granted.stream_window;
    }
}

impl Drop for ConnectionWindows {
    fn drop(&mut self) {
        // Given back first, so that connections woken by a rising share
        // find the room.
        self.reservation.shrink(usize::MAX);
        self.budget.count(-1, if self.busy { -1 } else { 0 });
    }
}
