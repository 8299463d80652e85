//! Files watched with inotify (through `notify`), not polled: the directory
//! that holds the file is watched, so a file replaced by a rename, or a
//! Kubernetes volume's `..data` symlink swapped, is seen as well as a write
//! in place. Only where the filesystem cannot notify (inotify refused: no
//! watches left, a filesystem without it) is the directory polled, every
//! [`POLL_FALLBACK`], with a warning that says so.

use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

/// How often a directory is polled where it cannot be watched.
pub const POLL_FALLBACK: Duration = Duration::from_secs(2);

/// Writes that come in a burst (an editor's, a volume's swap) are taken as
/// one change once this long has passed without another.
const SETTLE: Duration = Duration::from_millis(100);

/// A watch on one file. Changes to its directory wake [`FileWatch::changed`];
/// the owner reads the file again and decides whether anything changed.
pub struct FileWatch {
    path: PathBuf,
    events: tokio::sync::mpsc::Receiver<()>,
    _watcher: Box<dyn Watcher + Send>,
}

impl std::fmt::Debug for FileWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileWatch")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl FileWatch {
    /// Watches `path`'s directory (which must exist).
    pub fn new(path: &Path) -> std::io::Result<FileWatch> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        // One pending wake-up is enough: the owner rereads the file whole.
        let (tx, events) = tokio::sync::mpsc::channel(1);
        let name = path.file_name().map(|n| n.to_os_string());
        let wake = move |event: notify::Result<notify::Event>| {
            match &event {
                // Opening and closing change nothing, and the owner's own
                // reading of the file would wake it again.
                Ok(e) if matches!(e.kind, notify::EventKind::Access(_)) => return,
                // Other files of the directory (a log written beside the
                // file, say) are none of its business.
                Ok(e)
                    if !e.need_rescan()
                        && !e.paths.iter().any(|p| concerns(p, name.as_deref())) =>
                {
                    return
                }
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, "file watch error; the file is read again"),
            }
            let _ = tx.try_send(());
        };
        let inotify = notify::RecommendedWatcher::new(wake.clone(), notify::Config::default())
            .and_then(|mut w| w.watch(&dir, RecursiveMode::NonRecursive).map(|()| w));
        let watcher: Box<dyn Watcher + Send> = match inotify {
            Ok(w) => Box::new(w),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, every = ?POLL_FALLBACK, "cannot watch this directory with inotify; polling it");
                let mut w = notify::PollWatcher::new(
                    wake,
                    notify::Config::default().with_poll_interval(POLL_FALLBACK),
                )
                .map_err(std::io::Error::other)?;
                w.watch(&dir, RecursiveMode::NonRecursive)
                    .map_err(std::io::Error::other)?;
                Box::new(w)
            }
        };
        Ok(FileWatch {
            path: path.to_path_buf(),
            events,
            _watcher: watcher,
        })
    }

    /// Waits until the file changed and the burst settled (or went on for
    /// [`SETTLE_AT_MOST`]). `false` once the watch can tell nothing more.
    pub async fn changed(&mut self) -> bool {
        if self.events.recv().await.is_none() {
            return false;
        }
        let until = tokio::time::Instant::now() + SETTLE_AT_MOST;
        while tokio::time::Instant::now() < until {
            match tokio::time::timeout(SETTLE, self.events.recv()).await {
                Ok(Some(())) => continue,
                Ok(None) | Err(_) => break,
            }
        }
        true
    }
}

/// A burst of writes is waited out this long at most.
const SETTLE_AT_MOST: Duration = Duration::from_secs(1);

/// Whether an event on `changed` concerns the watched file `name`: the file
/// itself (written, created, renamed over), or a Kubernetes volume's
/// `..data` link and the `..<timestamp>` directory it points to.
fn concerns(changed: &Path, name: Option<&std::ffi::OsStr>) -> bool {
    use std::os::unix::ffi::OsStrExt;
    match changed.file_name() {
        Some(n) => Some(n) == name || n.as_bytes().starts_with(b".."),
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_write_a_rename_and_a_symlink_swap_are_each_seen() {
        let dir = std::env::temp_dir().join(format!("ambit-filewatch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("crl.pem");
        std::fs::write(&file, "one").unwrap();
        let mut watch = FileWatch::new(&file).unwrap();
        async fn seen(watch: &mut FileWatch) -> bool {
            tokio::time::timeout(Duration::from_secs(5), watch.changed()).await == Ok(true)
        }
        std::fs::write(&file, "two").unwrap();
        assert!(seen(&mut watch).await, "a write in place");
        std::fs::write(dir.join("crl.pem.new"), "three").unwrap();
        std::fs::rename(dir.join("crl.pem.new"), &file).unwrap();
        assert!(seen(&mut watch).await, "a rename over it");
        // A volume's swap: the file is a link through `..data`, which moves.
        std::fs::create_dir_all(dir.join("v1")).unwrap();
        std::os::unix::fs::symlink("v1", dir.join("..data_tmp")).unwrap();
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        assert!(seen(&mut watch).await, "a symlink swapped");
        // Quiet: no wake-up of its own, nor from the file being read, nor
        // from other files of the directory being written.
        std::fs::read(&file).unwrap();
        std::fs::write(dir.join("proxy.log"), "a line").unwrap();
        let quiet = tokio::time::timeout(Duration::from_millis(300), watch.changed()).await;
        assert!(quiet.is_err(), "woke with nothing changed");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
