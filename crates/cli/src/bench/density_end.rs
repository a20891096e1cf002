//! The end of `kiln bench density`: wake → first command of sandboxes in standby against the
//! runtime's raw restore + first command, the restart with every sandbox alive (listening,
//! all adopted), the kill throughput, and what is left on the host after the kills (processes
//! found and killed through the sandboxes' `cgroup.procs`, state directories).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kiln_server::Manager;

use super::density_active::exec_round_trips;
use super::density_host;
use super::density_host::Host;
use crate::drivers::ServerSetup;

/// What the raw wake baseline needs.
pub(super) struct RawWakeSetup {
    pub runtime: crate::drivers::BenchRuntime,
    pub driver: crate::drivers::DriverConfig,
    pub work_root: PathBuf,
}

/// Wake → first command of sandboxes in standby against the raw restore + first command.
pub(super) async fn wake(
    template: &str,
    samples: usize,
    m: &Arc<Manager>,
    s: &RawWakeSetup,
    templates: Arc<dyn kiln_server::templates::Templates>,
) -> anyhow::Result<()> {
    use super::density_standby::{wake_vs_raw, RawWake};
    let raw = RawWake::start(&s.runtime, &s.driver, &s.work_root, templates, template).await?;
    let r = wake_vs_raw(m, &raw, samples).await;
    raw.stop().await;
    let w = r?;
    println!(
        "  wake → first command: p50 {:.0} ms, p99 {:.0} ms ({} sandboxes in standby); raw \
         restore + agent listening + first command: p50 {:.0} ms, p99 {:.0} ms (restore p50 \
         {:.0}, listening {:.0}, first command {:.0}); p50 {:.2}x raw",
        w.kiln.p50_ms,
        w.kiln.p99_ms,
        w.kiln.n,
        w.raw.p50_ms,
        w.raw.p99_ms,
        w.raw_restore.p50_ms,
        w.raw_ready.p50_ms,
        w.raw_first.p50_ms,
        w.kiln.p50_ms / w.raw.p50_ms
    );
    Ok(())
}

/// Kills whatever is left in the host cgroups of `ids` (through their `cgroup.procs`).
fn sweep(ids: &[String]) {
    let n = density_host::kill_cgroup_procs(ids);
    if n > 0 {
        println!("  killed {n} process(es) left in the sandboxes' host cgroups");
    }
}

/// After a failed or interrupted run: kills the sandboxes `old` knows, then starts a server on
/// the run's state whose recovery adopts or cleans up what a create cut short left, kills
/// what it adopted, and kills whatever is still in the sandboxes' host cgroups.
pub(super) async fn kill_everything(
    old: Arc<Manager>,
    cfg: ServerSetup,
    templates: Arc<dyn kiln_server::templates::Templates>,
) {
    let mut ids: Vec<String> = old.list().into_iter().map(|r| r.id).collect();
    old.kill_all("bench density failed").await;
    drop(old);
    match cfg.prepare(templates).await {
        Ok(server) => {
            if let Err(e) = server.recovery.done().await {
                eprintln!("  recovering what the run left: {e}");
            }
            let m = server.manager.clone();
            ids.extend(m.list().into_iter().map(|r| r.id));
            m.kill_all("bench density failed").await;
        }
        Err(e) => eprintln!("  starting a server to clean up what the run left: {e:#}"),
    }
    sweep(&ids);
}

/// Restarts the server with every sandbox alive (listen time, time until all are adopted),
/// then kills them all, `kill_concurrency` at a time.
pub(super) async fn restart_and_kill(
    exec_samples: usize,
    kill_concurrency: usize,
    old: Arc<Manager>,
    cfg: ServerSetup,
    templates: Arc<dyn kiln_server::templates::Templates>,
    host: &Host,
) -> anyhow::Result<()> {
    let live = old.list().len();
    let standby = old.standby_count();
    drop(old);
    let t = Instant::now();
    let server = cfg.prepare(templates).await?;
    let listening = t.elapsed();
    let report = server.recovery.done().await.map_err(anyhow::Error::msg)?;
    let adopted = t.elapsed();
    println!(
        "  restart with {live} live sandboxes ({standby} in standby): listening after {:.0} ms, \
         {} adopted awake, {} in standby and {} paused after {:.1} s ({} cleaned up)",
        listening.as_secs_f64() * 1000.0,
        report.adopted.len(),
        report.standby.len(),
        report.paused.len(),
        adopted.as_secs_f64(),
        report.cleaned.len()
    );
    let m = server.manager.clone();
    let exec = exec_round_trips(&m, exec_samples).await?;
    if exec.n > 0 {
        println!(
            "  exec p50 after the restart (awake sandboxes): {:.1} ms",
            exec.p50_ms
        );
    }
    let ids: Vec<String> = m.list().into_iter().map(|r| r.id).collect();
    let n = ids.len();
    let queue = Arc::new(Mutex::new(ids.clone()));
    let t = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..kill_concurrency.max(1) {
        let (m, queue) = (m.clone(), queue.clone());
        workers.spawn(async move {
            loop {
                let id = queue.lock().unwrap_or_else(|p| p.into_inner()).pop();
                let Some(id) = id else { break };
                if let Err(e) = m.kill(&id, "bench density done").await {
                    eprintln!("  kill {id}: {e}");
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    let took = t.elapsed();
    println!(
        "  kill: {n} sandboxes in {:.1} s ({} at once) = {:.1} kills/s",
        took.as_secs_f64(),
        kill_concurrency,
        n as f64 / took.as_secs_f64().max(1e-9)
    );
    let left = host.usage();
    let in_cgroups = density_host::kill_cgroup_procs(&ids);
    let dirs = crate::drivers::sandboxes_on_disk(&host.root);
    let disk = density_host::dir_bytes(&crate::drivers::sandboxes_dir(&host.root));
    println!(
        "  left after the kills: {} {} processes, {in_cgroups} in the sandboxes' cgroups \
         (killed), {dirs} sandbox directories ({:.1} MB)",
        left.processes,
        host.raw.tool(),
        disk as f64 / 1e6
    );
    anyhow::ensure!(
        left.processes == 0 && in_cgroups == 0,
        "processes left after killing every sandbox"
    );
    Ok(())
}
