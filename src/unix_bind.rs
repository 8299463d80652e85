//! Binding a Unix socket whose file only its owner may open (mode 0600)
//! from the instant it exists: the kernel creates the file with that mode,
//! rather than a `chmod` narrowing it after `bind`, a window in which anyone
//! on the node could connect. Every Unix socket the agent listens on is
//! bound here (the ZDS socket, the plugin event socket). No listening, no
//! I/O on the socket: the caller does that with what `bind` returns.
//!
//! [`KeptPath`] watches such a socket's file, so that a file removed under
//! a running agent (a cleanup of the run directory, a host directory made
//! anew) is bound again rather than leaving nothing to connect to.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sched::CloneFlags;
use nix::sys::stat::Mode;

/// The umask under which the socket file is created: 0777 & !0177 = 0600.
const OWNER_ONLY_UMASK: libc::mode_t = 0o177;

/// Runs `bind`, which creates a Unix socket file at the path it is given,
/// with the socket file made mode 0600: `bind(2)` gives the file 0777
/// less the umask in force, and here that umask is 0177.
///
/// The umask is shared by every thread of the process, and changing it
/// around `bind` would race the other threads' file creations (a conflist
/// written 0644 at that moment would come out 0600). So `bind` runs on a
/// short-lived thread of its own, which first stops sharing its filesystem
/// attributes (`unshare(CLONE_FS)`: root, working directory and umask; no
/// privilege needed, though a container's default seccomp profile allows
/// `unshare` only with `CAP_SYS_ADMIN`, which the agent has for `setns`)
/// and only then sets its umask. The socket it returns belongs to the
/// process and works from any thread.
pub fn owner_only<T: Send + 'static>(
    path: &Path,
    bind: impl FnOnce(&Path) -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let path: PathBuf = path.to_path_buf();
    std::thread::Builder::new()
        .name("unix-bind".into())
        .spawn(move || -> io::Result<T> {
            nix::sched::unshare(CloneFlags::CLONE_FS).map_err(|e| {
                io::Error::new(
                    io::Error::from(e).kind(),
                    format!("unshare(CLONE_FS), for a umask of this thread alone: {e} (a container's default seccomp profile allows it with CAP_SYS_ADMIN, which the agent holds for setns)"),
                )
            })?;
            nix::sys::stat::umask(Mode::from_bits_truncate(OWNER_ONLY_UMASK));
            bind(path.as_path())
        })?
        .join()
        .map_err(|_| io::Error::other("the thread binding a Unix socket panicked"))?
}

/// How often the agent looks whether its sockets' files are still there.
pub const SOCKET_CHECK: Duration = Duration::from_secs(1);

/// What a socket path holds, against the file the agent bound there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SocketFile {
    /// The socket the agent bound.
    Ours,
    /// Nothing (removed, or its directory was): bind it again.
    Gone,
    /// Another file. Left alone: another agent may have bound it (a second
    /// one started by mistake, or beside this one), and two agents taking
    /// the path from each other every second would keep clients from
    /// staying with either.
    Other,
}

/// Device and inode of the file at `path`, not following a link.
fn file_id(path: &Path) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// The state of the socket path from what `stat` says now and the
/// (device, inode) the agent's bind left there.
fn socket_file(now: io::Result<(u64, u64)>, bound: Option<(u64, u64)>) -> SocketFile {
    match now {
        Err(e) if e.kind() == io::ErrorKind::NotFound => SocketFile::Gone,
        // Cannot tell (a permission problem on the way): nothing to act on.
        Err(_) => SocketFile::Ours,
        Ok(id) if bound.is_none_or(|b| b == id) => SocketFile::Ours,
        Ok(_) => SocketFile::Other,
    }
}

/// The file a listening socket was bound at, to be looked at every
/// [`SOCKET_CHECK`] with [`KeptPath::check`]: a removed file is bound
/// again; a file of someone else's at the path is left alone. Each state
/// is logged once.
pub struct KeptPath {
    path: PathBuf,
    /// What the socket is, for the logs ("ZDS socket").
    what: &'static str,
    bound: Option<(u64, u64)>,
    said: SocketFile,
}

impl KeptPath {
    /// Right after the listener was bound at `path`.
    pub fn new(path: &Path, what: &'static str) -> KeptPath {
        KeptPath {
            path: path.to_path_buf(),
            what,
            bound: file_id(path).ok(),
            said: SocketFile::Ours,
        }
    }

    /// Looks at the path: if its file was removed, binds it again with
    /// `bind` and returns the new listener, which takes the old one's
    /// place (connections accepted by the old one stay).
    pub fn check<L>(&mut self, bind: impl FnOnce(&Path) -> io::Result<L>) -> Option<L> {
        let (path, what) = (self.path.display(), self.what);
        match socket_file(file_id(&self.path), self.bound) {
            SocketFile::Ours => self.said = SocketFile::Ours,
            SocketFile::Gone => match bind(&self.path) {
                Ok(fresh) => {
                    self.bound = file_id(&self.path).ok();
                    self.said = SocketFile::Ours;
                    tracing::warn!(%path, "the {what} file was removed; bound it again (connections made before stay, new ones come through the new file)");
                    return Some(fresh);
                }
                Err(e) => {
                    if self.said != SocketFile::Gone {
                        tracing::error!(%path, error = %e, "the {what} file was removed and cannot be bound again; nothing new can connect until it is (trying every second)");
                    }
                    self.said = SocketFile::Gone;
                }
            },
            SocketFile::Other => {
                if self.said != SocketFile::Other {
                    tracing::error!(%path, "the {what} path now names a file this agent did not bind (another agent?); left alone, so new clients connect to that one");
                }
                self.said = SocketFile::Other;
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_a_removed_socket_file_is_bound_again() {
        let gone = || -> io::Result<(u64, u64)> { Err(io::Error::from(io::ErrorKind::NotFound)) };
        assert_eq!(socket_file(gone(), Some((1, 2))), SocketFile::Gone);
        assert_eq!(socket_file(Ok((1, 2)), Some((1, 2))), SocketFile::Ours);
        assert_eq!(
            socket_file(Ok((1, 3)), Some((1, 2))),
            SocketFile::Other,
            "another file at the path is not taken over"
        );
        let denied: io::Result<(u64, u64)> = Err(io::Error::from(io::ErrorKind::PermissionDenied));
        assert_eq!(socket_file(denied, Some((1, 2))), SocketFile::Ours);
    }

    #[test]
    fn a_kept_path_binds_a_removed_file_again_and_leaves_another_files_alone() {
        let dir = std::env::temp_dir().join(format!("ambit-kept-path-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        let bind = |p: &Path| std::os::unix::net::UnixListener::bind(p);
        let _first = bind(&path).unwrap();
        let mut kept = KeptPath::new(&path, "test socket");
        assert!(kept.check(bind).is_none(), "its own file is left as it is");
        std::fs::remove_file(&path).unwrap();
        let fresh = kept.check(bind).expect("bound again");
        let _client = std::os::unix::net::UnixStream::connect(&path).unwrap();
        assert!(fresh.accept().is_ok(), "the new listener takes connections");
        // Someone else's socket at the path now: not taken over.
        std::fs::remove_file(&path).unwrap();
        let _other = bind(&path).unwrap();
        assert!(kept.check(bind).is_none());
        assert!(kept.check(bind).is_none());
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The process umask, read without changing it (Linux 4.7+).
    fn process_umask() -> String {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find(|l| l.starts_with("Umask:"))
            .unwrap_or_default()
            .to_string()
    }

    #[test]
    fn the_socket_file_is_owner_only_the_moment_bind_returns() {
        let dir = std::env::temp_dir().join(format!("ambit-unix-bind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        let before = process_umask();
        // The mode is read inside `bind`, right after bind(2): no later
        // chmod can have been at work yet.
        let (listener, mode) = owner_only(&path, |p| {
            let l = std::os::unix::net::UnixListener::bind(p)?;
            let mode = std::fs::metadata(p)?.permissions().mode();
            Ok((l, mode))
        })
        .unwrap();
        assert_eq!(mode & 0o777, 0o600, "mode {:o} at creation", mode & 0o777);
        assert_eq!(process_umask(), before, "the process umask is untouched");
        // Still a working socket, from this thread.
        let _client = std::os::unix::net::UnixStream::connect(&path).unwrap();
        assert!(listener.accept().is_ok());
        std::fs::remove_dir_all(&dir).ok();
    }
}
