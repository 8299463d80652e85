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
    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("netns {}: {e}", path.display())))?;
        Ok(Netns {
            path,
            file: Arc::new(file),
        })
    }

    /// The namespace of a named netns (`ip netns add NAME`).
    pub fn named(name: &str) -> io::Result<Self> {
        Self::open(Path::new("/var/run/netns").join(name))
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
