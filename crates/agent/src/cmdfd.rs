//! Readiness of the commands' pipes and PTY masters, watched by a reactor of the agent's own
//! instead of tokio's.
//!
//! Why: after a gVisor restore (runsc 0.0~20240729), the restored epoll instance reported
//! `EPOLLHUP` for two pipes that had been deleted from it (`EPOLL_CTL_DEL`, then closed) before
//! the checkpoint, with the data they were registered with. tokio's data is the address of the
//! registration's state, freed since, so its driver woke freed memory and the agent (PID 1,
//! and the sandbox with it) died of a SIGSEGV (seen in runsc's strace of the crash; a
//! pause → resume → fork loop hit it about one run in five). Here the data is a number that is
//! never reused, looked up in a table: an event for a registration that is gone finds nothing
//! and is dropped.
//!
//! One thread waits on one epoll instance (edge-triggered) for every command fd; a waiting
//! task sleeps on its registration's [`Notify`] until the registration's event counter moves.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Notify;

/// What one registration has seen.
#[derive(Default)]
struct Entry {
    /// Events that make a read worth trying (in, hang-up, error), counted.
    reads: AtomicU64,
    /// Events that make a write worth trying (out, hang-up, error), counted.
    writes: AtomicU64,
    notify: Notify,
}

struct Reactor {
    epoll: OwnedFd,
    entries: Mutex<HashMap<u64, Arc<Entry>>>,
    next: AtomicU64,
}

static REACTOR: OnceLock<io::Result<Arc<Reactor>>> = OnceLock::new();

fn reactor() -> io::Result<Arc<Reactor>> {
    let r = REACTOR.get_or_init(|| {
        // SAFETY: epoll_create1 takes flags only; it returns a new descriptor or -1.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor epoll_create1 just returned, owned by nobody else.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        let r = Arc::new(Reactor {
            epoll,
            entries: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        });
        let run = r.clone();
        std::thread::Builder::new()
            .name("cmd-fds".into())
            .stack_size(256 << 10)
            .spawn(move || run.run())?;
        Ok(r)
    });
    match r {
        Ok(r) => Ok(r.clone()),
        Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
    }
}

impl Reactor {
    /// `epoll_ctl(op, fd)`, watching `fd` edge-triggered for reads and writes under `token`
    /// (ignored by `EPOLL_CTL_DEL`).
    fn ctl(&self, op: libc::c_int, fd: RawFd, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32,
            u64: token,
        };
        // SAFETY: the epoll descriptor is open (the reactor is never dropped), `fd` is the
        // caller's open descriptor and `ev` a valid epoll_event.
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Entry>>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(&self) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            // SAFETY: `events` is a valid buffer of `events.len()` entries for the kernel to
            // fill; the epoll descriptor stays open (the reactor is never dropped).
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as i32,
                    -1,
                )
            };
            if n < 0 {
                if io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                    tracing::error!(
                        "waiting for command output failed: {}",
                        io::Error::last_os_error()
                    );
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                continue;
            }
            for ev in &events[..n as usize] {
                let (bits, token) = (ev.events, ev.u64);
                // A registration that is gone (see the module docs) is not in the table.
                let Some(e) = self.entries().get(&token).cloned() else {
                    continue;
                };
                let gone = (libc::EPOLLHUP | libc::EPOLLERR) as u32;
                if bits & (libc::EPOLLIN as u32 | libc::EPOLLRDHUP as u32 | gone) != 0 {
                    e.reads.fetch_add(1, Ordering::AcqRel);
                }
                if bits & (libc::EPOLLOUT as u32 | gone) != 0 {
                    e.writes.fetch_add(1, Ordering::AcqRel);
                }
                e.notify.notify_waiters();
            }
        }
    }
}

/// A command fd (made non-blocking) registered with the reactor; dropping it deregisters and
/// closes it.
pub struct CmdFd {
    fd: OwnedFd,
    token: u64,
    entry: Arc<Entry>,
    reactor: Arc<Reactor>,
}

#[derive(Clone, Copy)]
enum Dir {
    Read,
    Write,
}

impl CmdFd {
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        set_nonblocking(fd.as_raw_fd())?;
        let reactor = reactor()?;
        let token = reactor.next.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(Entry::default());
        reactor.entries().insert(token, entry.clone());
        if let Err(e) = reactor.ctl(libc::EPOLL_CTL_ADD, fd.as_raw_fd(), token) {
            reactor.entries().remove(&token);
            return Err(e);
        }
        Ok(CmdFd {
            fd,
            token,
            entry,
            reactor,
        })
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    fn seen(&self, dir: Dir) -> u64 {
        match dir {
            Dir::Read => self.entry.reads.load(Ordering::Acquire),
            Dir::Write => self.entry.writes.load(Ordering::Acquire),
        }
    }

    /// Waits until an event of `dir` came after the count `seen`.
    async fn changed(&self, dir: Dir, seen: u64) {
        loop {
            let notified = self.entry.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.seen(dir) != seen {
                return;
            }
            notified.await;
        }
    }

    /// Runs `op` (a non-blocking read or write returning a count or -1) until it does not
    /// say `EAGAIN`, waiting for readiness in between. The count is read before `op`, so an
    /// edge that comes while `op` runs is not missed.
    async fn retry(&self, dir: Dir, mut op: impl FnMut(RawFd) -> isize) -> io::Result<usize> {
        loop {
            let seen = self.seen(dir);
            let n = op(self.raw());
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => self.changed(dir, seen).await,
                io::ErrorKind::Interrupted => {}
                _ => return Err(e),
            }
        }
    }

    /// Reads what is there (at most `buf.len()` bytes), waiting for it; 0 at the end.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.retry(Dir::Read, |fd| {
            // SAFETY: reads into a valid mutable slice from an open descriptor.
            unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) }
        })
        .await
    }

    /// Writes all of `data`, waiting while the other end is full.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let n = self
                .retry(Dir::Write, |fd| {
                    // SAFETY: writes from a valid slice to an open descriptor.
                    unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) }
                })
                .await?;
            data = &data[n..];
        }
        Ok(())
    }
}

impl Drop for CmdFd {
    fn drop(&mut self) {
        // Out of the table first: whatever the epoll instance reports for it later is dropped.
        self.reactor.entries().remove(&self.token);
        // (The fd closes after this, with `self.fd`.)
        let _ = self
            .reactor
            .ctl(libc::EPOLL_CTL_DEL, self.fd.as_raw_fd(), self.token);
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a valid fd.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two fds into the array.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both fds were just created and are owned by nobody else.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_writes_and_sees_the_end() {
        let (r, w) = pipe();
        let (r, w) = (CmdFd::new(r).unwrap(), CmdFd::new(w).unwrap());
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                match r.read(&mut buf).await.unwrap() {
                    0 => return got,
                    n => got.extend_from_slice(&buf[..n]),
                }
            }
        });
        // More than a pipe holds: the writer waits for the reader.
        let data: Vec<u8> = (0..1_000_000u32).map(|i| i as u8).collect();
        w.write_all(&data).await.unwrap();
        drop(w);
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), reader)
            .await
            .expect("the reader saw the end")
            .unwrap();
        assert_eq!(got, data);
    }

    #[tokio::test]
    async fn an_event_for_a_dropped_registration_is_dropped() {
        let (r, w) = pipe();
        let r = CmdFd::new(r).unwrap();
        let (reactor, token) = (r.reactor.clone(), r.token);
        drop(r);
        assert!(!reactor.entries().contains_key(&token));
        // What the restored epoll did: an event for the token of a registration that is gone,
        // here a live pipe registered again under it by hand.
        let (r2, w2) = pipe();
        reactor
            .ctl(libc::EPOLL_CTL_ADD, r2.as_raw_fd(), token)
            .unwrap();
        // SAFETY: writes one byte from a valid buffer to an open pipe.
        let wrote = unsafe { libc::write(w2.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        assert_eq!(wrote, 1);
        // The reactor goes on serving registrations that exist.
        let (r3, w3) = pipe();
        let r3 = CmdFd::new(r3).unwrap();
        drop(w3);
        let mut buf = [0u8; 8];
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), r3.read(&mut buf))
            .await
            .expect("the live registration is served")
            .unwrap();
        assert_eq!(n, 0);
        drop((w, r2));
    }
}
