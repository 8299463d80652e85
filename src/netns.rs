//! Network namespaces by file (`/var/run/netns/NAME`, `/proc/PID/ns/net`):
//! run a command inside one, or run a closure on a thread that entered one.
//!
//! Sockets keep the namespace they were created in, so a socket made on a
//! thread inside a pod's netns stays there after the thread leaves. Only the
//! thread that calls `setns` moves; the process never does.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// An open network namespace.
#[derive(Debug, Clone)]
pub struct Netns {
    path: PathBuf,
    file: Arc<File>,
}

impl Netns {
    /// Opens the network namespace at `path`. Non-blocking, so a path that
    /// names a FIFO cannot hang the caller; anything that is not a network
    /// namespace (a plain file, another kind of namespace) is refused.
    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = path.as_ref().to_path_buf();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("netns {}: {e}", path.display())))?;
        let ns = Netns {
            path,
            file: Arc::new(file),
        };
        if !ns.is_netns() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a network namespace", ns.path.display()),
            ));
        }
        Ok(ns)
    }

    /// Takes ownership of an already open namespace fd (e.g. one received over ZDS).
    pub fn from_fd(fd: std::os::fd::OwnedFd, label: &str) -> Self {
        Netns {
            path: PathBuf::from(label),
            file: Arc::new(File::from(fd)),
        }
    }

    /// Whether the fd really is a network namespace.
    pub fn is_netns(&self) -> bool {
        const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
        // SAFETY: NS_GET_NSTYPE is a read-only ioctl on an fd we own.
        let t = unsafe { libc::ioctl(self.file.as_raw_fd(), NS_GET_NSTYPE as _) };
        t == libc::CLONE_NEWNET
    }

    /// The namespace of a named netns (`ip netns add NAME`).
    pub fn named(name: &str) -> io::Result<Self> {
        Self::open(Path::new("/var/run/netns").join(name))
    }

    /// The open namespace fd (e.g. to pass over ZDS).
    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.file.as_fd()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A command that will run inside this namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new(program);
        let fd = self.file.as_raw_fd();
        // SAFETY: setns(2) is async-signal-safe and touches only the child; `fd`
        // stays open in the parent (held by `self.file`) until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd
    }

    /// Moves the calling thread into this namespace.
    pub fn enter(&self) -> io::Result<()> {
        nix::sched::setns(&*self.file, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(io::Error::from)
    }

    /// The calling thread's current namespace.
    pub fn current() -> io::Result<Self> {
        let tid = nix::unistd::gettid();
        Self::open(format!("/proc/self/task/{tid}/ns/net"))
    }

    /// Device and inode of the namespace: equal for two handles to the same netns.
    pub fn id(&self) -> io::Result<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let m = self.file.metadata()?;
        Ok((m.dev(), m.ino()))
    }

    /// Runs the synchronous `f` on the calling thread inside this namespace,
    /// then returns the thread to `home`. Sockets made by `f` stay in this
    /// namespace. No thread is created, so this is cheap enough per connection.
    pub fn with<T>(&self, home: &Netns, f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        self.enter()?;
        let result = f();
        if let Err(e) = home.enter() {
            // A worker thread left inside a pod's netns would carry other pods'
            // traffic there: that must never continue.
            eprintln!("fatal: cannot return thread to its network namespace: {e}");
            std::process::abort();
        }
        result
    }

    /// Runs `f` on a fresh thread inside this namespace and returns its result.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
        let ns = self.clone();
        std::thread::spawn(move || {
            ns.enter()?;
            Ok(f())
        })
        .join()
        .map_err(|_| io::Error::other("thread inside netns panicked"))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_network_namespace_opens_and_a_fifo_does_not_hang() {
        assert!(Netns::open("/proc/self/ns/net").is_ok());
        let dir = std::env::temp_dir().join(format!("ambit-netns-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plain = dir.join("plain");
        std::fs::write(&plain, "x").unwrap();
        let err = Netns::open(&plain).unwrap_err().to_string();
        assert!(err.contains("is not a network namespace"), "{err}");
        // Another kind of namespace is not a network namespace either.
        assert!(Netns::open("/proc/self/ns/uts").is_err());
        let fifo = dir.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let started = std::time::Instant::now();
        assert!(Netns::open(&fifo).is_err());
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "open blocked"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
