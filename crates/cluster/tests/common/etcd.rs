//! Real etcd clusters for tests: members of Debian's `etcd-server` on free loopback ports
//! with temporary data directories, killed when the cluster is dropped (and, through
//! `PR_SET_PDEATHSIG`, when the test process dies).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiln_cluster::EtcdStore;

/// The etcd binary: `$KILN_ETCD`, else `etcd` on PATH; None when `test` is skipped (the skip
/// policy of [`kiln_testkit`]).
pub fn etcd_binary(test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("KILN_ETCD")
        .map(PathBuf::from)
        .or_else(|| kiln_testkit::host::which("etcd"));
    let ok = kiln_testkit::needs()
        .that(
            found.is_some(),
            "no etcd (Debian's etcd-server; scripts/test.sh installs it) and no KILN_ETCD",
        )
        .ok_as(test);
    found.filter(|_| ok)
}

struct Member {
    name: String,
    client_url: String,
    log: PathBuf,
    child: Option<Child>,
}

/// A running etcd cluster on 127.0.0.1.
pub struct EtcdCluster {
    members: Vec<Member>,
    _dir: tempfile::TempDir,
}

fn spawn(etcd: &Path, args: &[String], log: &Path) -> Child {
    let out = std::fs::File::create(log).unwrap();
    let err = out.try_clone().unwrap();
    let mut cmd = Command::new(etcd);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin");
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl(2),
    // which is async-signal-safe; it touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().expect("starting etcd")
}

impl EtcdCluster {
    /// Starts `n` members and waits until the cluster serves writes; None when the test is
    /// skipped (see [`etcd_binary`]). A member that exits at once (another process took its
    /// port between the choice and etcd's bind) makes the whole start go again.
    pub async fn start(test: &str, n: usize) -> Option<Self> {
        let etcd = etcd_binary(test)?;
        let mut failures = Vec::new();
        for _ in 0..3 {
            let mut cluster = Self::spawn_members(&etcd, n);
            match cluster.wait_serving(Duration::from_secs(30)).await {
                Ok(()) => return Some(cluster),
                Err(why) => failures.push(why),
            }
        }
        panic!("etcd did not start:\n{}", failures.join("\n"));
    }

    fn spawn_members(etcd: &Path, n: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ports = kiln_testkit::host::free_ports(2 * n);
        let peer = |i: usize| format!("http://127.0.0.1:{}", ports[2 * i + 1]);
        let initial: Vec<String> = (0..n).map(|i| format!("m{i}={}", peer(i))).collect();
        let token = format!("kiln-test-{}", std::process::id());
        let mut members = Vec::new();
        for i in 0..n {
            let name = format!("m{i}");
            let client_url = format!("http://127.0.0.1:{}", ports[2 * i]);
            let log = dir.path().join(format!("{name}.log"));
            let args: Vec<String> = [
                "--name",
                &name,
                "--data-dir",
                &dir.path().join(&name).display().to_string(),
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
                "--listen-peer-urls",
                &peer(i),
                "--initial-advertise-peer-urls",
                &peer(i),
                "--initial-cluster",
                &initial.join(","),
                "--initial-cluster-token",
                &token,
                "--initial-cluster-state",
                "new",
                "--heartbeat-interval",
                "100",
                "--election-timeout",
                "1000",
                "--logger",
                "zap",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let child = spawn(etcd, &args, &log);
            members.push(Member {
                name,
                client_url,
                log,
                child: Some(child),
            });
        }
        Self { members, _dir: dir }
    }

    /// The client URLs of the members still running.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .filter(|m| m.child.is_some())
            .map(|m| m.client_url.clone())
            .collect()
    }

    /// The client URLs of every member, stopped ones included (as a configured client has).
    pub fn all_endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    pub fn client_url(&self, i: usize) -> &str {
        &self.members[i].client_url
    }

    /// Stops member `i` with SIGKILL (as a crash).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The members' logs (for failure messages).
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for m in &self.members {
            let text = std::fs::read_to_string(&m.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out.push_str(&format!("--- {} ---\n", m.name));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// A store on every member's endpoint under a fresh prefix.
    pub async fn store(&self, prefix: &str) -> EtcdStore {
        EtcdStore::connect(&self.all_endpoints(), prefix)
            .await
            .expect("connecting to etcd")
    }

    /// Waits until a write succeeds; the reason and the logs when a member exits or time
    /// runs out.
    async fn wait_serving(&mut self, within: Duration) -> Result<(), String> {
        let start = Instant::now();
        let mut last = String::new();
        while start.elapsed() < within {
            let exited = self.members.iter_mut().find_map(|m| {
                let status = m.child.as_mut()?.try_wait().ok()??;
                Some(format!("etcd member {} exited: {status}", m.name))
            });
            if let Some(why) = exited {
                return Err(format!("{why}\n{}", self.logs()));
            }
            match etcd_client::Client::connect(self.endpoints(), None).await {
                Ok(mut c) => match c.put("/kiln-test/ready", "1", None).await {
                    Ok(_) => return Ok(()),
                    Err(e) => last = e.to_string(),
                },
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(format!(
            "etcd did not serve within {within:?}: {last}\n{}",
            self.logs()
        ))
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
