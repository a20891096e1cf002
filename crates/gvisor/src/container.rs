//! The host side of a sandbox's container: ending it (processes killed and reaped, then
//! `runsc delete`), and connecting to its agent's socket in the directory the sandbox shares
//! with the host without following anything planted there, to a peer that must be the
//! sandbox's own runtime ([`super::peer`]), sealing that directory ([`super::seal`]).

use std::path::{Path, PathBuf};

use super::peer::Peers;
use super::reap::{self, reap_adopted_zombies};
use super::runsc::Runsc;
use super::seal::Seals;
use super::SOCKET_NAME;
use crate::driver::{DriverError, Result};

/// What sealing keeps in a sandbox's `run/`: the agent's socket (made through runsc).
const KEEP: &[&str] = &[SOCKET_NAME];

/// Why the agent of sandbox `id` cannot be reached on `port`, from the error of a connection
/// to its socket (no host paths).
pub(super) fn unreachable(id: &str, port: u16, e: std::io::Error) -> DriverError {
    DriverError::Unreachable {
        id: id.to_string(),
        port,
        reason: match e.kind() {
            std::io::ErrorKind::NotFound => "the agent is not listening (yet)".into(),
            std::io::ErrorKind::ConnectionRefused => {
                "the agent is not accepting connections".into()
            }
            std::io::ErrorKind::PermissionDenied => e.to_string(),
            _ => format!("connecting to the agent: {}", e.kind()),
        },
    }
}

/// What the driver keeps about the directories its sandboxes share with the host: their seal
/// state and the verified peers of their agent sockets (shared with background work, such as
/// a snapshot's source continuing).
#[derive(Default)]
pub(super) struct RunDirs {
    pub seals: Seals,
    pub peers: Peers,
}

/// One sandbox's agent socket: the sandbox's id and directory, and the driver's [`RunDirs`].
pub(super) struct AgentSocket<'a> {
    id: &'a str,
    dir: PathBuf,
    run_dirs: &'a RunDirs,
}

impl<'a> AgentSocket<'a> {
    pub fn new(id: &'a str, dir: PathBuf, run_dirs: &'a RunDirs) -> Self {
        Self { id, dir, run_dirs }
    }

    fn run(&self) -> PathBuf {
        self.dir.join("run")
    }

    /// The sandbox's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Connects to the agent without following links, and checks who listens
    /// ([`Peers::check`]). Does not seal (see [`Self::connect_and_seal`]).
    pub async fn connect(&self) -> std::io::Result<tokio::net::UnixStream> {
        let s = connect_no_follow(&self.run().join(SOCKET_NAME)).await?;
        self.run_dirs.peers.check(self.id, &self.dir, &s)?;
        Ok(s)
    }

    /// [`Self::connect`], then the directory is sealed if it never was (the first connection
    /// after a boot or a server restart).
    pub async fn connect_and_seal(&self) -> std::io::Result<tokio::net::UnixStream> {
        let s = self.connect().await?;
        self.run_dirs
            .seals
            .after_connect(self.id, &self.run(), KEEP);
        Ok(s)
    }

    /// Opens the directory for one of the server's windows (see [`Seals::open`]).
    pub fn open(&self) {
        self.run_dirs.seals.open(self.id, &self.run());
    }

    /// Seals it again after a window (see [`Seals::close`]).
    pub fn close(&self) {
        self.run_dirs.seals.close(self.id, &self.run(), KEEP);
    }

    /// Forgets the sandbox's seal and peers: it boots afresh, or it goes (see
    /// [`Seals::forget`]).
    pub fn forget(&self) {
        self.run_dirs.seals.forget(self.id, &self.run());
        self.run_dirs.peers.forget(self.id);
    }
}

/// Ends container `id` of sandbox directory `dir` and its processes (see
/// [`GvisorDriver::halt`]).
pub async fn halt_container(runsc: &Runsc, id: &str, dir: &Path) -> Result<()> {
    // Kill the sandbox's processes and reap them ourselves: runsc delete then finds them
    // gone instead of polling for seconds until the host's init reaps the zombies.
    reap::kill_and_reap(&reap::sandbox_processes(id, Some(dir), &runsc.root)).await;
    delete(runsc, id).await
}

/// `runsc delete --force` of container `id`, reaping its processes as they exit; done when
/// the container is gone (deleted now or before), its leftover cgroups removed. runsc takes a unique prefix of an id: a
/// container that is already gone is not asked for again.
pub(super) async fn delete(runsc: &Runsc, id: &str) -> Result<()> {
    if !runsc.exists(id).await {
        reap_adopted_zombies();
        crate::cgroup_dirs::remove(id);
        return Ok(());
    }
    // delete --force kills what is left, removes the cgroups and runsc's state. It fails for
    // an unknown container (never created, or a concurrent stop won): only fail if the
    // container is still there. Processes that exit meanwhile (a checkpointed sandbox's do
    // on their own) are reaped as they go, or runsc waits seconds for them.
    let reaping = async {
        loop {
            reap_adopted_zombies();
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    };
    let args = ["delete", "--force", id];
    let deleted = tokio::select! {
        r = runsc.output(&args) => r,
        never = reaping => never,
    };
    if let Err(e) = deleted {
        if runsc.exists(id).await {
            return Err(e);
        }
    }
    reap_adopted_zombies();
    crate::cgroup_dirs::remove(id);
    Ok(())
}

/// Connects to the agent's socket at `path` in the directory shared with the sandbox, where
/// root in the sandbox can plant anything: the final component must be a socket itself (never
/// a symlink), and the connection goes through the descriptor opened with `O_NOFOLLOW`, so the
/// name cannot be swapped between the check and the connect. The caller checks the peer.
async fn connect_no_follow(path: &Path) -> std::io::Result<tokio::net::UnixStream> {
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "the agent socket was replaced by a link",
            ),
            _ => e,
        })?;
    if !f.metadata()?.file_type().is_socket() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "the agent socket was replaced by something else",
        ));
    }
    use std::os::fd::AsRawFd;
    let via_fd = format!("/proc/self/fd/{}", f.as_raw_fd());
    let s = tokio::net::UnixStream::connect(via_fd).await;
    drop(f);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// The cost of the peer check on the connection path, against a stand-in gofer (a process
    /// named `runsc-gofer` naming the sandbox's bundle) that accepts and closes:
    /// `cargo test -p kiln-server --lib connect_cost -- --ignored --nocapture`.
    #[tokio::test]
    #[ignore = "a measurement, not a test"]
    async fn connect_cost() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("sandboxes").join("abc");
        std::fs::create_dir_all(dir.join("run")).unwrap();
        let sock = dir.join("run").join(SOCKET_NAME);
        let script = "import socket,sys\n\
                      s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(4096)\n\
                      print('up', flush=True)\n\
                      while True:\n    c,_=s.accept(); c.close()";
        let child = std::process::Command::new("/usr/bin/python3")
            .arg0("runsc-gofer")
            .args(["-c", script, sock.to_str().unwrap(), "--bundle"])
            .arg(dir.join("bundle"))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        /// Kills the stand-in whatever happens.
        struct Reaped(std::process::Child);
        impl Drop for Reaped {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut child = Reaped(child);
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.0.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let run_dirs = RunDirs::default();
        let agent = AgentSocket::new("abc", dir.clone(), &run_dirs);
        let n = 3000;
        let mut rounds = Vec::new();
        for round in 0..3 {
            let mut plain = Vec::with_capacity(n);
            let mut checked = Vec::with_capacity(n);
            for i in 0..n {
                if i % 100 == 0 {
                    // Let the stand-in's accept loop catch up (untimed).
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                let t = std::time::Instant::now();
                let s = connect_no_follow(&sock).await.unwrap();
                plain.push(t.elapsed());
                drop(s);
                let t = std::time::Instant::now();
                let s = agent.connect().await.unwrap();
                checked.push(t.elapsed());
                drop(s);
            }
            let p = |v: &mut Vec<std::time::Duration>, q: f64| {
                v.sort();
                v[((v.len() - 1) as f64 * q) as usize]
            };
            let line = format!(
                "round {round}: connect p50 {:?} p99 {:?}; with the peer check p50 {:?} p99 {:?}",
                p(&mut plain, 0.5),
                p(&mut plain, 0.99),
                p(&mut checked, 0.5),
                p(&mut checked, 0.99)
            );
            rounds.push(line);
        }
        // The check alone, uncached: a new Peers each time.
        let s = connect_no_follow(&sock).await.unwrap();
        let t = std::time::Instant::now();
        for _ in 0..n {
            Peers::default().check("abc", &dir, &s).unwrap();
        }
        let uncached = t.elapsed() / n as u32;
        let peers = Peers::default();
        let t = std::time::Instant::now();
        for _ in 0..n {
            peers.check("abc", &dir, &s).unwrap();
        }
        let cached = t.elapsed() / n as u32;
        drop(child);
        for l in rounds {
            println!("{l}");
        }
        // A window and the seal after it, on a real run/ tmpfs holding the agent's socket.
        let run = d.path().join("bench-run");
        std::fs::create_dir(&run).unwrap();
        super::super::mounts::mount_run_dir(&run).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(run.join(SOCKET_NAME)).unwrap();
        let t = std::time::Instant::now();
        for _ in 0..1000 {
            run_dirs.seals.open("bench", &run);
            run_dirs.seals.close("bench", &run, KEEP);
        }
        println!("open + seal: {:?}", t.elapsed() / 1000);
        run_dirs.seals.forget("bench", &run);
        super::super::mounts::unmount(&run).unwrap();
        println!("peer check alone: uncached {uncached:?}, cached {cached:?}");
    }
}
