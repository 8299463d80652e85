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

/// Calls `apply` with each item of `items` and `convert` of it, in order;
/// `convert` runs on a helper thread (at `nice`) when there are at least
/// [`MIN_RESOURCES`] items.
pub fn convert_in_order<I, T, C, A>(items: &[I], nice: libc::c_int, convert: C, mut apply: A)
where
    I: Sync,
    T: Send,
    C: Fn(&I) -> T + Sync,
    A: FnMut(&I, T),
{
    if items.len() >= MIN_RESOURCES {
        match ahead(items, nice, &convert, &mut apply) {
            Ok(()) => return,
            Err(e) => {
                tracing::debug!(error = %e, "no thread to convert ahead; converting in one pass")
            }
        }
    }
    items.iter().for_each(|i| apply(i, convert(i)));
}

/// [`convert_in_order`] with the helper; an error (nothing applied) if
/// the helper cannot start.
fn ahead<I, T, C, A>(
    items: &[I],
    nice: libc::c_int,
    convert: &C,
    apply: &mut A,
) -> std::io::Result<()>
where
    I: Sync,
    T: Send,
    C: Fn(&I) -> T + Sync,
    A: FnMut(&I, T),
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
                for chunk in items.chunks(CHUNK) {
                    if tx.send(chunk.iter().map(convert).collect()).is_err() {
                        return; // the applier stopped
                    }
                }
            })?;
        for (chunk, converted) in items.chunks(CHUNK).zip(rx) {
            for (item, t) in chunk.iter().zip(converted) {
                apply(item, t);
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
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
            convert_in_order(
                &items,
                0,
                |i| (i * 3, std::thread::current().id()),
                |i, (t, on)| {
                    assert_eq!(t, i * 3);
                    threads.insert(on);
                    seen.push(*i);
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
