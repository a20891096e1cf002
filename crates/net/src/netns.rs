//! Sockets inside a network namespace: a short-lived thread joins the namespace (`setns` only
//! affects the calling thread), makes the socket there and hands it back. The socket stays in
//! that namespace for its whole life, whatever thread uses it afterwards.

use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sched::{setns, CloneFlags};

use crate::{io_err, NetError, Result};

/// Runs `f` on a new thread that has joined the network namespace at `ns_path`.
pub async fn in_netns<T, F>(ns_path: &Path, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> std::io::Result<T> + Send + 'static,
{
    let path: PathBuf = ns_path.to_path_buf();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("kiln-netns".into())
        .spawn(move || {
            let r = (|| {
                let file = std::fs::File::open(&path)
                    .map_err(io_err(format!("opening {}", path.display())))?;
                setns(&file, CloneFlags::CLONE_NEWNET).map_err(|e| NetError::Io {
                    what: format!("joining {}", path.display()),
                    source: std::io::Error::from(e),
                })?;
                f().map_err(io_err("in the sandbox network namespace"))
            })();
            let _ = tx.send(r);
        })
        .map_err(io_err("starting a thread"))?;
    rx.await
        .map_err(|_| NetError::Config("network namespace thread panicked".into()))?
}

/// A TCP connection made from inside a namespace.
pub async fn connect_tcp(ns_path: &Path, to: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let s = in_netns(ns_path, move || TcpStream::connect_timeout(&to, timeout)).await?;
    s.set_nodelay(true).map_err(io_err("setting TCP_NODELAY"))?;
    Ok(s)
}

/// A UDP socket bound inside a namespace.
pub async fn bind_udp(ns_path: &Path, at: SocketAddr) -> Result<UdpSocket> {
    in_netns(ns_path, move || UdpSocket::bind(at)).await
}
