//! Converting a large response's resources on a second thread while the
//! xDS thread applies the ones converted before them.
//!
//! A full push of a large mesh is a million resources, each decoded and
//! converted (its texts interned, its objects allocated), then applied to
//! the state's maps. The two halves share nothing but the resource passed
//! along, so a second thread does the first half a few chunks ahead of the
//! second. Results come back in the response's order: the state's
//! first-come rules see what they would see done in one pass.
//!
//! It applies to large responses only (a one-workload update is converted
//! where it is applied), so the data path's threads never wait on it; the
//! helper runs at the xDS thread's lowered priority and ends with the
//! response. If it cannot start, the response is converted in one pass.

use std::sync::mpsc::sync_channel;

/// Responses with fewer resources are converted in one pass.
pub const MIN_RESOURCES: usize = 1024;
/// Resources converted per hand-over.
const CHUNK: usize = 256;
/// Chunks converted ahead of the one being applied, at most: bounds the
/// converted resources held waiting (not the response).
const CHUNKS_AHEAD: usize = 4;

/// Calls `apply` with `convert` of each item of `items`, in order;
/// `convert` runs on a helper thread (at `nice`) when there are at least
/// [`MIN_RESOURCES`] items. Each item is dropped once converted, so what a
/// response carried goes as its resources are held (the converted ones
/// reuse its memory) rather than all at the end.
pub fn convert_in_order<L, T, C, A>(items: L, nice: libc::c_int, convert: C, mut apply: A)
where
    L: IntoIterator<IntoIter: ExactSizeIterator + Send>,
    T: Send,
    C: Fn(L::Item) -> T + Sync,
    A: FnMut(T),
{
    let mut items = items.into_iter();
    if items.len() >= MIN_RESOURCES {
        match ahead(&mut items, nice, &convert, &mut apply) {
            Ok(()) => return,
            Err(e) => {
                tracing::debug!(error = %e, "no thread to convert ahead; converting in one pass")
            }
        }
    }
    items.for_each(|i| apply(convert(i)));
}

/// [`convert_in_order`] with the helper; an error (nothing taken from
/// `items`: the helper never ran) if it cannot start.
fn ahead<It, T, C, A>(
    items: &mut It,
    nice: libc::c_int,
    convert: &C,
    apply: &mut A,
) -> std::io::Result<()>
where
    It: Iterator + Send,
    T: Send,
    C: Fn(It::Item) -> T + Sync,
    A: FnMut(T),
{
    std::thread::scope(|scope| {
        let (tx, rx) = sync_channel::<Vec<T>>(CHUNKS_AHEAD);
        std::thread::Builder::new()
            .name("ambit-xds-convert".into())
            .spawn_scoped(scope, move || {
                // SAFETY: setpriority on this thread's own id; no memory
                // is passed. A failure leaves the default priority.
                unsafe {
                    libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice)
                };
                loop {
                    let chunk: Vec<T> = items.by_ref().take(CHUNK).map(convert).collect();
                    if chunk.is_empty() || tx.send(chunk).is_err() {
                        return; // all sent, or the applier stopped
                    }
                }
            })?;
        rx.into_iter().flatten().for_each(apply);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn every_item_is_applied_once_in_order_whether_converted_ahead_or_not() {
        for n in [
            0,
            1,
            MIN_RESOURCES - 1,
            MIN_RESOURCES,
            5 * CHUNK + 7,
            20_000,
        ] {
            let items: Vec<u64> = (0..n as u64).collect();
            let mut seen = Vec::with_capacity(n);
            let mut threads = std::collections::HashSet::new();
            let converted = AtomicUsize::new(0);
            convert_in_order(
                items.clone(),
                0,
                |i| {
                    converted.fetch_add(1, Ordering::SeqCst);
                    (i, i * 3, std::thread::current().id())
                },
                |(i, t, on)| {
                    assert_eq!(t, i * 3);
                    threads.insert(on);
                    seen.push(i);
                    // What waits converted (each item dropped as it was)
                    // is a few chunks, never the rest of the response.
                    let ahead = converted.load(Ordering::SeqCst) - seen.len();
                    assert!(
                        ahead <= (CHUNKS_AHEAD + 2) * CHUNK,
                        "{ahead} converted ahead"
                    );
                },
            );
            assert_eq!(seen, items, "{n} items");
            if n == 0 {
                continue;
            }
            let ahead = !threads.contains(&std::thread::current().id());
            assert_eq!(
                ahead,
                n >= MIN_RESOURCES,
                "{n} items converted ahead: {ahead}"
            );
        }
    }
}
