//! ZDS on the wire (docs/wire.md §2): a `SOCK_SEQPACKET` Unix socket carrying one
//! protobuf message per packet (no length prefix, under 1024 bytes), with the
//! pod's netns fd passed as `SCM_RIGHTS` on Add. Both ends (the agent's server
//! and the proxy's client) use these async packet primitives.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::sys::socket::{
    accept4, bind, connect, listen, recvmsg, sendmsg, socket, AddressFamily, Backlog,
    ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Largest ZDS message either side accepts.
pub const MAX_PACKET: usize = 1024;

/// Registers an owned socket with the reactor.
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd keeps its descriptor open and unchanged until it is
    // dropped, which only happens when the AsyncFd is.
    unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}

fn seqpacket() -> io::Result<OwnedFd> {
    Ok(socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

/// One connected ZDS socket.
#[derive(Debug)]
pub struct SeqPacket {
    fd: AsyncFd<OwnedFd>,
}

impl SeqPacket {
    /// Connects to the agent's socket at `path`.
    pub fn connect(path: &Path) -> io::Result<Self> {
        let fd = seqpacket()?;
        let addr = UnixAddr::new(path)?;
        // Unix-socket connect completes at once (or fails): no EINPROGRESS.
        connect(fd.as_raw_fd(), &addr).map_err(|e| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!("ZDS socket {}: {e}", path.display()),
            )
        })?;
        Ok(SeqPacket { fd: register(fd)? })
    }

    /// Sends one packet, with `fd` attached as `SCM_RIGHTS` if given.
    pub async fn send(&self, bytes: &[u8], fd: Option<RawFd>) -> io::Result<()> {
        if bytes.len() > MAX_PACKET {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("ZDS message of {} bytes exceeds {MAX_PACKET}", bytes.len()),
            ));
        }
        let fds = fd.map(|f| [f]);
        loop {
            let mut guard = self.fd.ready(Interest::WRITABLE).await?;
            let res = guard.try_io(|inner| {
                let iov = [IoSlice::new(bytes)];
                let cmsg: Vec<ControlMessage> = fds
                    .as_ref()
                    .map(|f| ControlMessage::ScmRights(f))
                    .into_iter()
                    .collect();
                sendmsg::<()>(inner.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None)
                    .map_err(io::Error::from)
            });
            match res {
                Ok(r) => return r.map(|_| ()),
                Err(_would_block) => continue,
            }
        }
    }

    /// Receives one packet and the fd it carried, if any. EOF is an error.
    pub async fn recv(&self) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
        loop {
            let mut guard = self.fd.ready(Interest::READABLE).await?;
            let res = guard.try_io(|inner| {
                let mut buf = vec![0u8; MAX_PACKET];
                let mut cmsg_space = nix::cmsg_space!([RawFd; 2]);
                let (n, flags, fds) = {
                    let mut iov = [IoSliceMut::new(&mut buf)];
                    let msg = recvmsg::<()>(
                        inner.as_raw_fd(),
                        &mut iov,
                        Some(&mut cmsg_space),
                        MsgFlags::MSG_CMSG_CLOEXEC,
                    )
                    .map_err(io::Error::from)?;
                    let mut fds = Vec::new();
                    for c in msg.cmsgs().map_err(io::Error::from)? {
                        if let ControlMessageOwned::ScmRights(list) = c {
                            // SAFETY: the kernel just installed these fds in our table; we own them now.
                            fds.extend(
                                list.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }),
                            );
                        }
                    }
                    (msg.bytes, msg.flags, fds)
                };
                if flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC) {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "ZDS packet truncated",
                    ));
                }
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "ZDS peer closed the connection",
                    ));
                }
                if fds.len() > 1 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "ZDS packet carried more than one fd",
                    ));
                }
                buf.truncate(n);
                Ok((buf, fds.into_iter().next()))
            });
            match res {
                Ok(r) => return r,
                Err(_would_block) => continue,
            }
        }
    }
}

/// The agent's listening ZDS socket.
#[derive(Debug)]
pub struct SeqPacketListener {
    fd: AsyncFd<OwnedFd>,
}

impl SeqPacketListener {
    /// Binds `path` (replacing a stale socket file), mode 0600 from the
    /// start ([`crate::unix_bind`]).
    pub fn bind(path: &Path) -> io::Result<Self> {
        let _ = std::fs::remove_file(path);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let fd = crate::unix_bind::owner_only(path, |path| {
            let fd = seqpacket()?;
            bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
            Ok(fd)
        })?;
        listen(&fd, Backlog::new(16).map_err(io::Error::from)?)?;
        Ok(SeqPacketListener { fd: register(fd)? })
    }

    pub async fn accept(&self) -> io::Result<SeqPacket> {
        loop {
            let mut guard = self.fd.ready(Interest::READABLE).await?;
            match guard.try_io(|inner| {
                accept4(
                    inner.as_raw_fd(),
                    SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
                )
                .map_err(io::Error::from)
            }) {
                Ok(r) => {
                    // SAFETY: accept4 returned a new fd that nothing else owns.
                    let fd = unsafe { OwnedFd::from_raw_fd(r?) };
                    return Ok(SeqPacket { fd: register(fd)? });
                }
                Err(_would_block) => continue,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn packets_and_fds_cross_intact() {
        let dir = std::env::temp_dir().join(format!("ambit-zds-wire-{}", std::process::id()));
        let path = dir.join("zds.sock");
        let listener = SeqPacketListener::bind(&path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600,
            "only the agent's user may connect"
        );
        let client = SeqPacket::connect(&path).unwrap();
        let server = listener.accept().await.unwrap();
        client.send(b"hello", None).await.unwrap();
        let (msg, fd) = server.recv().await.unwrap();
        assert_eq!((msg.as_slice(), fd.is_none()), (&b"hello"[..], true));
        let netns = std::fs::File::open("/proc/self/ns/net").unwrap();
        server.send(b"add", Some(netns.as_raw_fd())).await.unwrap();
        let (msg, fd) = client.recv().await.unwrap();
        assert_eq!(msg, b"add");
        assert!(fd.is_some(), "fd must arrive with the packet");
        assert!(
            client.send(&[0u8; 2000], None).await.is_err(),
            "oversized message refused"
        );
        drop(server);
        assert_eq!(
            client.recv().await.unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
