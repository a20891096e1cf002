//! `kiln bench density --standby-after SECS`: what standby costs and saves. Before a run, one
//! sandbox's checkpoint is measured on disk and a run that would leave less than
//! [`DISK_RESERVE`] free is refused; per step, the CPU, memory, processes, mounts and disk the
//! host keeps for a sandbox in standby; at the end, a wake → first command against the
//! runtime's raw `restore` + first command on a sandbox of a driver of its own, rounds
//! interleaved so both see the same host.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::density_host as host;
use super::stats::{percentiles, Percentiles};
use kiln_driver::baseline::SandboxBaseline;
use kiln_server::manager::CreateParams;
use kiln_server::store::SqliteStore;
use kiln_server::{LifecycleConfig, Manager};

/// Disk a run must leave free on the state directory's filesystem.
pub(super) const DISK_RESERVE: u64 = 10_000_000_000;

/// A create as the density bench makes it (an hour, an access token).
pub(super) fn params(template: &str) -> CreateParams {
    CreateParams {
        template_id: template.to_string(),
        timeout_secs: Some(3600),
        secure: true,
        ..Default::default()
    }
}

/// One sandbox's state directory on disk after a pause with memory (the checkpoint standby
/// writes), in bytes: creates one, lets it settle, pauses it, measures, kills it.
pub(super) async fn probe_checkpoint(
    m: &Manager,
    template: &str,
    state: &Path,
) -> anyhow::Result<(u64, u64)> {
    let r = m.create(params(template)).await?;
    let measured = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let awake = host::dir_bytes(&crate::drivers::sandbox_dir(state, &r.id));
        m.pause(&r.id, true).await?;
        let asleep = host::dir_bytes(&crate::drivers::sandbox_dir(state, &r.id));
        anyhow::Ok((awake, asleep))
    }
    .await;
    m.kill(&r.id, "bench density: disk probe done").await?;
    measured
}

/// Refuses (an error saying how many would fit) a run of `count` sandboxes of `per` bytes
/// each on `state`'s filesystem that would leave less than [`DISK_RESERVE`] free.
pub(super) fn check_disk(state: &Path, count: usize, per: u64) -> anyhow::Result<u64> {
    let free = host::free_bytes(state)?;
    if let Some(why) = host::disk_refusal(count, per, free, DISK_RESERVE) {
        anyhow::bail!("refusing to start: {why}");
    }
    Ok(free)
}

/// What the host keeps for the sandboxes in standby, per sandbox.
#[derive(Debug, Default)]
pub(super) struct StandbyKeep {
    pub count: usize,
    /// Processes left in their host cgroups (there must be none).
    pub processes: usize,
    /// Host memory still charged to their memory cgroups (page cache included), bytes.
    pub cgroup_bytes: u64,
    /// Mounts left under their state directories.
    pub mounts: usize,
    /// Bytes on disk under their state directories (the checkpoint, the writable layer).
    pub disk_bytes: u64,
}

impl StandbyKeep {
    pub fn per(&self, v: u64) -> f64 {
        v as f64 / self.count.max(1) as f64
    }
}

/// Reads what the host keeps for `ids` (sandboxes in standby).
pub(super) fn standby_keep(state: &Path, ids: &[String]) -> StandbyKeep {
    let mut k = StandbyKeep {
        count: ids.len(),
        ..Default::default()
    };
    for id in ids {
        let dir = crate::drivers::sandbox_dir(state, id);
        k.processes += host::cgroup_procs(id).len();
        k.cgroup_bytes += host::cgroup_memory(id).unwrap_or(0);
        k.mounts += host::mounts_under(&dir);
        k.disk_bytes += host::dir_bytes(&dir);
    }
    k
}

/// Waits until at least `want` sandboxes are in standby (or `limit` passes); how many are.
pub(super) async fn wait_standby(m: &Manager, want: usize, limit: Duration) -> usize {
    let t = Instant::now();
    while m.standby_count() < want && t.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    m.standby_count()
}

/// One raw wake: the runtime's restore, the agent answering, a first command.
pub(super) struct RawRound {
    pub restore: Duration,
    pub ready: Duration,
    pub first: Duration,
}

impl RawRound {
    pub fn total(&self) -> Duration {
        self.restore + self.ready + self.first
    }
}

/// What [`wake_vs_raw`] measured.
pub(super) struct WakeReport {
    /// Kiln's wake → first command.
    pub kiln: Percentiles,
    /// The raw restore + agent listening + first command.
    pub raw: Percentiles,
    pub raw_restore: Percentiles,
    pub raw_ready: Percentiles,
    pub raw_first: Percentiles,
}

/// The runtime's raw restore + first command, on a sandbox of a driver of its own.
pub(super) struct RawWake {
    manager: Arc<Manager>,
    raw: Arc<dyn SandboxBaseline>,
    id: String,
    token: Option<String>,
    dir: tempfile::TempDir,
}

impl RawWake {
    /// A driver (the bench's driver settings) in a directory of its own under `work_root`,
    /// and one sandbox of `template` on it.
    pub async fn start(
        runtime: &crate::drivers::BenchRuntime,
        driver: &crate::drivers::DriverConfig,
        work_root: &Path,
        templates: Arc<dyn kiln_server::templates::Templates>,
        template: &str,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("dw")
            .rand_bytes(4)
            .tempdir_in(work_root)?;
        let bench = runtime.driver(driver, dir.path())?;
        let store = Arc::new(SqliteStore::open(&dir.path().join("kiln.db"))?);
        let manager = Manager::new(LifecycleConfig::default(), store, bench.driver, templates);
        let r = manager.create(params(template)).await?;
        Ok(Self {
            manager,
            raw: bench.raw,
            id: r.id,
            token: r.envd_token,
            dir,
        })
    }

    /// One round: the raw checkpoint (not timed), then timed: the raw restore, the agent
    /// listening again (a first command needs it), a first command.
    pub async fn round(&self, i: usize) -> anyhow::Result<RawRound> {
        let image: PathBuf = self.dir.path().join(format!("raw-{i}"));
        let (_, restore) = self.raw.checkpoint_restore(&self.id, &image).await?;
        let _ = std::fs::remove_dir_all(&image);
        let t = Instant::now();
        self.manager
            .agent(&self.id, self.token.clone())
            .wait_ready(Duration::from_secs(30))
            .await?;
        let ready = t.elapsed();
        let first =
            super::density_active::echo(&self.manager, &self.id, self.token.clone()).await?;
        Ok(RawRound {
            restore,
            ready,
            first,
        })
    }

    pub async fn stop(self) {
        self.manager.kill_all("bench density done").await;
    }
}

/// Wakes up to `samples` of the sandboxes in standby with a first command each, every one
/// after a raw round.
pub(super) async fn wake_vs_raw(
    m: &Manager,
    raw: &RawWake,
    samples: usize,
) -> anyhow::Result<WakeReport> {
    let asleep: Vec<_> = m
        .list()
        .into_iter()
        .filter(|r| m.standby_since(&r.id).is_some())
        .collect();
    let every = (asleep.len() / samples.max(1)).max(1);
    let (mut kiln, mut rounds) = (Vec::new(), Vec::new());
    for (i, r) in asleep.iter().step_by(every).take(samples).enumerate() {
        rounds.push(raw.round(i).await?);
        kiln.push(super::density_active::echo(m, &r.id, r.envd_token.clone()).await?);
    }
    let of = |f: fn(&RawRound) -> Duration| percentiles(&rounds.iter().map(f).collect::<Vec<_>>());
    Ok(WakeReport {
        kiln: percentiles(&kiln),
        raw: of(RawRound::total),
        raw_restore: of(|r| r.restore),
        raw_ready: of(|r| r.ready),
        raw_first: of(|r| r.first),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_standby_keeps_is_divided_by_the_sandboxes() {
        let k = StandbyKeep {
            count: 4,
            disk_bytes: 400,
            ..Default::default()
        };
        assert_eq!(k.per(k.disk_bytes), 100.0);
        let none = standby_keep(Path::new("/no/such/state"), &[]);
        assert_eq!((none.count, none.per(0)), (0, 0.0));
    }
}
