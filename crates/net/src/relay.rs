//! Relaying a proxied TCP connection both ways while counting its bytes: with `splice(2)`
//! through a pipe per direction (the bytes never enter user space), or, where splice is
//! unavailable (it fails with `EINVAL`/`ENOSYS` on the first call), a copy loop through a
//! buffer. Both wait on the sockets' readiness through tokio and move data with non-blocking
//! calls, so one relay costs no thread.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use nix::libc;
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Most bytes one splice (or one read of the copy loop) moves.
const CHUNK: usize = 1024 * 1024;
/// Pipe size asked for (the kernel's default is 64 KiB; larger means fewer calls per byte).
const PIPE_SIZE: libc::c_int = 1024 * 1024;

static SPLICE: AtomicBool = AtomicBool::new(true);

/// Whether relays started from now on try `splice(2)` (default on; off: the copy loop, e.g.
/// to measure what splice saves).
pub fn set_splice(on: bool) {
    SPLICE.store(on, Ordering::Relaxed);
}

/// How a relay moved its bytes (for tests and benches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Splice,
    Copy,
}

/// Relays both ways until both sides are done (each end's EOF is passed on as a shutdown of
/// the other's write side), or until either way fails; counts the bytes delivered each way,
/// also when one fails. Returns how the `a` to `b` way moved its bytes.
pub async fn relay(
    a: &TcpStream,
    b: &TcpStream,
    a_to_b: &AtomicU64,
    b_to_a: &AtomicU64,
) -> io::Result<Mode> {
    let one = one_way(a, b, a_to_b);
    let other = one_way(b, a, b_to_a);
    tokio::pin!(one, other);
    let (mut mode, mut one_done, mut other_done) = (Mode::Copy, false, false);
    while !(one_done && other_done) {
        tokio::select! {
            r = &mut one, if !one_done => { one_done = true; mode = r?; }
            r = &mut other, if !other_done => { other_done = true; r?; }
        }
    }
    Ok(mode)
}

/// One direction, `from` to `to`: spliced when it can be, copied otherwise.
async fn one_way(from: &TcpStream, to: &TcpStream, n: &AtomicU64) -> io::Result<Mode> {
    if SPLICE.load(Ordering::Relaxed) {
        if let Ok(pipe) = Pipe::new() {
            match splice_way(from, to, n, &pipe).await {
                Err(Unsupported) => {}
                Ok(r) => return r.map(|_| Mode::Splice),
            }
        }
    }
    copy_way(from, to, n).await.map(|_| Mode::Copy)
}

/// The first splice failed in a way that says splice does not work on these descriptors
/// (nothing was moved yet).
struct Unsupported;

async fn splice_way(
    from: &TcpStream,
    to: &TcpStream,
    n: &AtomicU64,
    pipe: &Pipe,
) -> Result<io::Result<()>, Unsupported> {
    let mut first = true;
    loop {
        // Socket to pipe (the pipe is empty here, so a would-block is the socket's).
        let got = loop {
            if let Err(e) = from.readable().await {
                return Ok(Err(e));
            }
            match from.try_io(Interest::READABLE, || {
                splice(from.as_raw_fd(), pipe.w.as_raw_fd(), CHUNK)
            }) {
                Ok(k) => break k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) if first && unsupported(&e) => return Err(Unsupported),
                Err(e) => return Ok(Err(e)),
            }
        };
        first = false;
        if got == 0 {
            end_of(to);
            return Ok(Ok(()));
        }
        // Pipe to socket, all of it.
        let mut left = got;
        while left > 0 {
            if let Err(e) = to.writable().await {
                return Ok(Err(e));
            }
            match to.try_io(Interest::WRITABLE, || {
                splice(pipe.r.as_raw_fd(), to.as_raw_fd(), left)
            }) {
                Ok(k) => {
                    left -= k;
                    n.fetch_add(k as u64, Ordering::Relaxed);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Ok(Err(e)),
            }
        }
    }
}

async fn copy_way(from: &TcpStream, to: &TcpStream, n: &AtomicU64) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK];
    loop {
        from.readable().await?;
        let got = match from.try_read(&mut buf) {
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        if got == 0 {
            end_of(to);
            return Ok(());
        }
        let mut sent = 0;
        while sent < got {
            to.writable().await?;
            match to.try_write(&buf[sent..got]) {
                Ok(k) => {
                    sent += k;
                    n.fetch_add(k as u64, Ordering::Relaxed);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

/// Passes an EOF on: shuts the write side of `to` (the other end may be gone already: nothing
/// left to tell it).
fn end_of(to: &TcpStream) {
    let _ = nix::sys::socket::shutdown(to.as_raw_fd(), nix::sys::socket::Shutdown::Write);
}

fn unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS))
}

/// One non-blocking `splice(2)` of at most `len` bytes from `from` to `to` (one is a pipe).
fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: splice(2) on two descriptors the caller keeps open for the call; null offsets
    // (both are streams); it touches no memory of this process.
    let rc = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc as usize)
}

/// A non-blocking pipe, closed when dropped.
struct Pipe {
    r: OwnedFd,
    w: OwnedFd,
}

impl Pipe {
    fn new() -> io::Result<Self> {
        let (r, w) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC)
                .map_err(io::Error::from)?;
        // A larger pipe where allowed (fs.pipe-max-size); the default works too.
        // SAFETY: fcntl(2) F_SETPIPE_SZ on a pipe this struct owns; it takes an int.
        let _ = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE) };
        Ok(Self { r, w })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A connected pair over loopback.
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        (c, s)
    }

    /// client <-> (a | relay | b) <-> server: the client sends `up` bytes and shuts its write
    /// side, the server answers `down` bytes after reading all, then closes. Both see every
    /// byte, in order, and the relay counts them.
    async fn through_relay(splice_on: bool, up: usize, down: usize) -> Mode {
        let (mut client, a) = pair().await;
        let (b, mut server) = pair().await;
        let pattern = |n: usize, k: u8| (0..n).map(|i| (i % 251) as u8 ^ k).collect::<Vec<u8>>();
        let (sent_up, sent_down) = (pattern(up, 0), pattern(down, 0x5a));
        let srv = {
            let (want, answer) = (sent_up.clone(), sent_down.clone());
            tokio::spawn(async move {
                let mut got = Vec::new();
                server.read_to_end(&mut got).await.unwrap();
                assert!(
                    got == want,
                    "server got {} bytes, wanted {}",
                    got.len(),
                    want.len()
                );
                server.write_all(&answer).await.unwrap();
            })
        };
        let cli = tokio::spawn(async move {
            client.write_all(&sent_up).await.unwrap();
            client.shutdown().await.unwrap();
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            got
        });
        let (out, inn) = (AtomicU64::new(0), AtomicU64::new(0));
        let mode = if splice_on {
            let pipe = Pipe::new().unwrap();
            // Run the two ways as `relay` does, but force the mode of this test.
            let one = async {
                match splice_way(&a, &b, &out, &pipe).await {
                    Ok(r) => r,
                    Err(Unsupported) => panic!("splice unsupported on loopback TCP"),
                }
            };
            let pipe2 = Pipe::new().unwrap();
            let other = async {
                match splice_way(&b, &a, &inn, &pipe2).await {
                    Ok(r) => r,
                    Err(Unsupported) => panic!("splice unsupported on loopback TCP"),
                }
            };
            let (x, y) = tokio::join!(one, other);
            x.unwrap();
            y.unwrap();
            Mode::Splice
        } else {
            let (x, y) = tokio::join!(copy_way(&a, &b, &out), copy_way(&b, &a, &inn));
            x.unwrap();
            y.unwrap();
            Mode::Copy
        };
        srv.await.unwrap();
        let got = cli.await.unwrap();
        assert!(got == sent_down, "client got {} bytes", got.len());
        assert_eq!(out.load(Ordering::Relaxed), up as u64);
        assert_eq!(inn.load(Ordering::Relaxed), down as u64);
        mode
    }

    #[tokio::test]
    async fn splice_relays_and_counts_both_ways_with_half_close() {
        assert_eq!(through_relay(true, 7 << 20, 3 << 20).await, Mode::Splice);
        assert_eq!(through_relay(true, 1, 0).await, Mode::Splice);
        assert_eq!(through_relay(true, 0, 0).await, Mode::Splice);
    }

    #[tokio::test]
    async fn copy_fallback_relays_and_counts_both_ways_with_half_close() {
        assert_eq!(through_relay(false, 7 << 20, 3 << 20).await, Mode::Copy);
        assert_eq!(through_relay(false, 0, 1).await, Mode::Copy);
    }

    #[tokio::test]
    async fn relay_picks_splice_and_falls_back_when_it_is_off() {
        for on in [true, false] {
            let (mut client, a) = pair().await;
            let (b, mut server) = pair().await;
            let srv = tokio::spawn(async move {
                let mut got = Vec::new();
                server.read_to_end(&mut got).await.unwrap();
                server.write_all(b"pong").await.unwrap();
                got
            });
            client.write_all(b"ping").await.unwrap();
            client.shutdown().await.unwrap();
            let (out, inn) = (AtomicU64::new(0), AtomicU64::new(0));
            // (The other tests do not read the switch.)
            set_splice(on);
            let mode = relay(&a, &b, &out, &inn).await.unwrap();
            set_splice(true);
            assert_eq!(srv.await.unwrap(), b"ping");
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            assert_eq!(got, b"pong");
            assert_eq!((out.into_inner(), inn.into_inner()), (4, 4));
            assert_eq!(mode, if on { Mode::Splice } else { Mode::Copy });
        }
    }

    #[tokio::test]
    async fn a_reset_side_ends_the_relay_with_an_error_and_keeps_the_counts() {
        let (mut client, a) = pair().await;
        let (b, server) = pair().await;
        client.write_all(b"hello").await.unwrap();
        // The server side goes away with a reset.
        let l = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        nix::sys::socket::setsockopt(&server, nix::sys::socket::sockopt::Linger, &l).unwrap();
        drop(server);
        let (out, inn) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            relay(&a, &b, &out, &inn),
        )
        .await
        .expect("the relay ends");
        assert!(r.is_err(), "{r:?}");
        assert_eq!(inn.into_inner(), 0);
    }
}
