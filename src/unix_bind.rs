//! Binding a Unix socket whose file only its owner may open (mode 0600)
//! from the instant it exists: the kernel creates the file with that mode,
//! rather than a `chmod` narrowing it after `bind`, a window in which anyone
//! on the node could connect. Every Unix socket the agent listens on is
//! bound here (the ZDS socket, the plugin event socket). No listening, no
//! I/O on the socket: the caller does that with what `bind` returns.

use std::io;
use std::path::{Path, PathBuf};

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

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
