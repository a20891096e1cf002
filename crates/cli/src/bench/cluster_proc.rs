//! The processes `kiln bench cluster` starts: a one-member etcd and `kiln node` / `kiln
//! control` children of this binary, each listening on 127.0.0.1 only, its output in a log
//! file of the bench's work directory. A [`Proc`] dropped on any path is stopped (SIGTERM,
//! then SIGKILL after a bound), so nothing outlives the bench.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// How long a stopped process has to exit before it is killed.
const STOP_WAIT: Duration = Duration::from_secs(20);

/// One child process and its log.
pub(crate) struct Proc {
    pub name: String,
    child: Option<Child>,
    log: PathBuf,
}

/// A free TCP port on 127.0.0.1.
pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Proc {
    /// Starts `cmd` with its output appended to `<dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, dir: &Path) -> anyhow::Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).with_context(|| format!("creating {name}.log"))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .env("NO_COLOR", "1")
            .env("KILN_TEMPLATE_GC_STORE", "off")
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Self {
            name: name.to_string(),
            child: Some(child),
            log,
        })
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The tail of the log, for an error message.
    pub fn tail(&self) -> String {
        let log = self.log();
        let start = log.len().saturating_sub(3000);
        let start = (start..log.len())
            .find(|i| log.is_char_boundary(*i))
            .unwrap_or(log.len());
        log[start..].to_string()
    }

    /// Waits (at most `limit`) for a log line containing `marker`; returns that line's text
    /// after the marker.
    pub async fn wait_for(&mut self, marker: &str, limit: Duration) -> anyhow::Result<String> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(rest) = self.log().lines().find_map(|l| {
                l.find(marker)
                    .map(|i| l[i + marker.len()..].trim().to_string())
            }) {
                return Ok(rest);
            }
            if let Some(c) = self.child.as_mut() {
                if let Some(st) = c.try_wait()? {
                    bail!("{} exited ({st}):\n{}", self.name, self.tail());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "{}: no {marker:?} within {limit:?}:\n{}",
            self.name,
            self.tail()
        )
    }

    /// Stops the process: SIGTERM, then SIGKILL once [`STOP_WAIT`] has passed.
    pub fn stop(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        if matches!(c.try_wait(), Ok(Some(_))) {
            return;
        }
        // SAFETY: kill takes no pointers; the pid is our own unreaped child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < STOP_WAIT {
            if matches!(c.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A one-member etcd on 127.0.0.1 with its data in `<dir>/etcd`.
pub(crate) struct Etcd {
    /// Stopped when dropped.
    _proc: Proc,
    pub url: String,
}

impl Etcd {
    pub async fn start(bin: &Path, dir: &Path) -> anyhow::Result<Self> {
        let (client, peer) = (free_port()?, free_port()?);
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut cmd = Command::new(bin);
        cmd.args(["--name", "bench", "--data-dir"])
            .arg(dir.join("etcd"))
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("bench={peer_url}")])
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"]);
        let mut proc = Proc::spawn("etcd", cmd, dir)
            .with_context(|| format!("starting {} (Debian's etcd-server)", bin.display()))?;
        proc.wait_for("ready to serve client requests", Duration::from_secs(30))
            .await?;
        Ok(Self { _proc: proc, url })
    }
}

/// A `kiln node` or `kiln control` of this binary joined to the cluster at `etcd` under
/// `prefix`, listening on 127.0.0.1, logging warnings (`KILN_BENCH_LOG`: another filter).
pub(crate) fn kiln(role: &str, etcd: &str, prefix: &str, secret: &str) -> anyhow::Result<Command> {
    let exe = std::env::current_exe().context("finding the kiln binary")?;
    let mut cmd = Command::new(exe);
    cmd.arg(role)
        .args(["--etcd", etcd, "--etcd-prefix", prefix])
        .args(["--cluster-secret", secret])
        .args(["--listen", "127.0.0.1:0"])
        .env(
            "KILN_LOG",
            std::env::var("KILN_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
        );
    Ok(cmd)
}

/// The sandboxes a part made and has not killed yet (killed on every way out).
#[derive(Default)]
pub(crate) struct Live(std::sync::Mutex<std::collections::BTreeSet<String>>);

impl Live {
    fn set(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub fn add(&self, id: &str) {
        self.set().insert(id.to_string());
    }
    pub fn remove(&self, id: &str) {
        self.set().remove(id);
    }
    /// Kills each with `kill` (errors are reported, not returned).
    pub async fn kill_all(&self, kill: impl AsyncFn(&str) -> anyhow::Result<()>) {
        let ids: Vec<String> = self.set().iter().cloned().collect();
        for id in ids {
            if let Err(e) = kill(&id).await {
                eprintln!("cleanup: killing {id}: {e:#}");
            }
        }
    }
}

/// An envd client of sandbox `id` through the gateway of the control replica at `control`
/// (header mode, the sandbox's envd token).
pub(crate) fn envd_via_control(
    control: SocketAddr,
    id: &str,
    token: &str,
) -> kiln_envd::EnvdClient {
    kiln_envd::EnvdClient::tcp(control)
        .with_header("host", control.to_string())
        .with_header("e2b-sandbox-id", id.to_string())
        .with_header("e2b-sandbox-port", kiln_proto::envd::ENVD_PORT.to_string())
        .with_access_token(Some(token.to_string()))
}

/// The `host:port` a `kiln` role printed after `listening on http://`.
pub(crate) fn listen_addr(line: &str) -> anyhow::Result<SocketAddr> {
    let addr = line.split_whitespace().next().unwrap_or_default();
    addr.parse()
        .with_context(|| format!("the address in {line:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_printed_address_is_parsed() {
        let a = listen_addr("127.0.0.1:4123 (advertised as 127.0.0.1:4123)").unwrap();
        assert_eq!(a, "127.0.0.1:4123".parse().unwrap());
        assert!(listen_addr("nowhere").is_err());
    }
}
