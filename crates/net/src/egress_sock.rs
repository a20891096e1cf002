//! Upstream sockets of the egress proxy: made by one thread that joined the router namespace
//! once, instead of a new thread joining it for every connection (a socket stays in the
//! namespace it was made in, whichever thread connects it). Connects on the runtime.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use nix::sched::{setns, CloneFlags};
use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::oneshot;

use crate::{io_err, NetError, Result};

type Reply = oneshot::Sender<std::io::Result<OwnedFd>>;

/// The socket maker of one router namespace; its thread ends when this is dropped.
pub(crate) struct SocketMaker(mpsc::Sender<Reply>);

impl SocketMaker {
    pub(crate) async fn start(ns: &Path) -> Result<Self> {
        let file = std::fs::File::open(ns).map_err(io_err(format!("opening {}", ns.display())))?;
        let (tx, rx) = mpsc::channel::<Reply>();
        let (ready_tx, ready) = oneshot::channel();
        let what = format!("joining {}", ns.display());
        std::thread::Builder::new()
            .name("kiln-egress".into())
            .spawn(move || {
                if let Err(e) = setns(&file, CloneFlags::CLONE_NEWNET) {
                    let _ = ready_tx.send(Err(std::io::Error::from(e)));
                    return;
                }
                let _ = ready_tx.send(Ok(()));
                while let Ok(reply) = rx.recv() {
                    let s = socket(
                        AddressFamily::Inet,
                        SockType::Stream,
                        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
                        None,
                    );
                    let _ = reply.send(s.map_err(std::io::Error::from));
                }
            })
            .map_err(io_err("starting a thread"))?;
        ready
            .await
            .map_err(|_| NetError::Config("egress socket thread ended".into()))?
            .map_err(io_err(what))?;
        Ok(Self(tx))
    }

    /// A TCP connection to `to` from the namespace.
    pub(crate) async fn connect(
        &self,
        to: SocketAddr,
        timeout: Duration,
    ) -> std::io::Result<TcpStream> {
        let (tx, rx) = oneshot::channel();
        let gone = || std::io::Error::other("egress socket thread ended");
        self.0.send(tx).map_err(|_| gone())?;
        let fd = rx.await.map_err(|_| gone())??;
        let s = TcpSocket::from_std_stream(std::net::TcpStream::from(fd));
        let up = tokio::time::timeout(timeout, s.connect(to))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        up.set_nodelay(true)?;
        Ok(up)
    }
}
