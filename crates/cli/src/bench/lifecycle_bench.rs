//! `kiln bench lifecycle`: pause, resume, fork and create-from-pool latencies, each beside the
//! raw `runsc checkpoint` / `runsc restore` of the same sandboxes measured in the same run.
//!
//! - pause = `Manager::pause` (memory kept); resume = `Manager::connect` until the agent has
//!   answered and is initialised;
//! - raw checkpoint / restore = the runsc commands alone, on the same sandbox, after its agent
//!   let go of its host socket (which gVisor cannot save);
//! - fork = `Manager::fork` with count 1 and 5, until every child's agent has answered (the
//!   parent continues after them: its downtime is measured too, until its agent answers);
//! - pool = `Manager::create` with a warm pool of the template, sequential and 10 at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::stats::{percentiles, Percentiles};
use kiln_gvisor::{GvisorConfig, GvisorDriver};
use kiln_server::manager::{CreateParams, LifecycleConfig, Manager};
use kiln_server::store::SqliteStore;
use kiln_server::templates::Templates;

#[derive(Debug, Clone)]
pub struct LifecycleBenchOptions {
    pub template: String,
    /// Rounds of pause/resume (and of raw checkpoint/restore).
    pub rounds: usize,
    /// Rounds of each fork size.
    pub fork_rounds: usize,
    /// Sequential creates from the pool.
    pub pool_creates: usize,
    pub platform: String,
    pub runsc: Option<std::path::PathBuf>,
    pub work_dir: std::path::PathBuf,
}

#[derive(Debug, Clone)]
pub struct LifecycleBenchReport {
    pub pause: Percentiles,
    pub resume: Percentiles,
    pub raw_checkpoint: Percentiles,
    pub raw_restore: Percentiles,
    pub fork1: Percentiles,
    pub fork5: Percentiles,
    /// From the start of a fork of 1 until the parent answers again (it continues after its
    /// child answered).
    pub fork1_parent: Percentiles,
    pub pool_sequential: Percentiles,
    pub pool_concurrent: Percentiles,
}

fn params(template: &str) -> CreateParams {
    CreateParams {
        template_id: template.to_string(),
        timeout_secs: Some(600),
        secure: true,
        ..Default::default()
    }
}

/// The raw commands on sandbox `id`: its agent is detached, then `runsc checkpoint` and
/// `runsc restore` are timed alone; the agent is attached again afterwards.
async fn raw_round(
    driver: &GvisorDriver,
    m: &Manager,
    id: &str,
    image: &std::path::Path,
) -> Result<(Duration, Duration), String> {
    let dir = driver.config().dir.join("sandboxes").join(id);
    let runsc = driver.runsc();
    // The sandbox's current container (a resume made a new one); it is restored under the
    // same id after its delete.
    let cid = driver.cid(id);
    let cid = cid.as_str();
    let marker = dir.join("run/agent.sock.detached");
    runsc
        .output(&["kill", cid, "USR1"])
        .await
        .map_err(|e| e.to_string())?;
    let t = Instant::now();
    while !marker.exists() {
        if t.elapsed() > Duration::from_secs(5) {
            return Err("the agent did not detach".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let _ = std::fs::remove_dir_all(image);
    std::fs::create_dir_all(image).map_err(|e| e.to_string())?;
    let t = Instant::now();
    runsc
        .checkpoint(cid, image, false)
        .await
        .map_err(|e| e.to_string())?;
    let checkpoint = t.elapsed();
    // The checkpointed sandbox's processes exit; delete the container while reaping them
    // (this process adopted them), as the driver does (not timed).
    kiln_gvisor::halt_container(runsc, cid, &dir)
        .await
        .map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(dir.join("run/agent.sock"));
    let t = Instant::now();
    runsc
        .restore_detached(
            image,
            &dir.join("bundle"),
            cid,
            &dir.join("console.log"),
            false,
            None,
        )
        .await
        .map_err(|e| e.to_string())?;
    let restore = t.elapsed();
    runsc
        .output(&["kill", cid, "USR2"])
        .await
        .map_err(|e| e.to_string())?;
    let token = m.get(id).map_err(|e| e.to_string())?.envd_token;
    m.agent(id, token)
        .wait_ready(Duration::from_secs(30))
        .await
        .map_err(|e| e.to_string())?;
    Ok((checkpoint, restore))
}

pub async fn lifecycle_bench(
    opts: &LifecycleBenchOptions,
    templates: Arc<dyn Templates>,
) -> Result<LifecycleBenchReport, String> {
    std::fs::create_dir_all(&opts.work_dir).map_err(|e| e.to_string())?;
    let work = tempfile::Builder::new()
        .prefix("life")
        .tempdir_in(&opts.work_dir)
        .map_err(|e| e.to_string())?;
    let mut gcfg = GvisorConfig::new(work.path());
    gcfg.platform = opts.platform.clone();
    if let Some(r) = &opts.runsc {
        gcfg.runsc = r.clone();
    }
    let driver = Arc::new(GvisorDriver::new(gcfg).map_err(|e| e.to_string())?);
    let store =
        Arc::new(SqliteStore::open(&work.path().join("kiln.db")).map_err(|e| e.to_string())?);
    let cfg = LifecycleConfig {
        pools: vec![(opts.template.clone(), 10)],
        ..LifecycleConfig::default()
    };
    let m = Manager::new(cfg, store, driver.clone(), templates);
    let r = run(opts, &m, &driver, work.path()).await;
    m.kill_all("bench done").await;
    // Pooled sandboxes are not the manager's yet: stop whatever is left on the host.
    if let Ok(left) = kiln_server::driver::Driver::list_on_host(driver.as_ref()).await {
        for h in left {
            let _ = kiln_server::driver::Driver::stop(driver.as_ref(), &h.id).await;
        }
    }
    kiln_server::driver::Driver::shutdown(driver.as_ref()).await;
    r
}

async fn run(
    opts: &LifecycleBenchOptions,
    m: &Arc<Manager>,
    driver: &GvisorDriver,
    work: &std::path::Path,
) -> Result<LifecycleBenchReport, String> {
    let e = |e: kiln_server::Error| e.to_string();
    let (mut pause, mut resume, mut ckpt, mut restore) = (vec![], vec![], vec![], vec![]);
    let sbx = m.create(params(&opts.template)).await.map_err(e)?;
    for i in 0..opts.rounds {
        let t = Instant::now();
        m.pause(&sbx.id, true).await.map_err(e)?;
        pause.push(t.elapsed());
        let t = Instant::now();
        let (_, resumed) = m.connect(&sbx.id, 600, true).await.map_err(e)?;
        resume.push(t.elapsed());
        if !resumed {
            return Err("connect did not resume".into());
        }
        let (c, r) = raw_round(driver, m, &sbx.id, &work.join(format!("raw-{i}"))).await?;
        ckpt.push(c);
        restore.push(r);
    }
    let (mut fork1, mut fork5, mut parent) = (vec![], vec![], vec![]);
    let token = m.get(&sbx.id).map_err(e)?.envd_token;
    for _ in 0..opts.fork_rounds {
        for (count, out) in [(1, &mut fork1), (5, &mut fork5)] {
            let t = Instant::now();
            let children = m.fork(&sbx.id, count, Some(600)).await.map_err(e)?;
            out.push(t.elapsed());
            m.agent(&sbx.id, token.clone())
                .wait_ready(Duration::from_secs(30))
                .await
                .map_err(|e| e.to_string())?;
            if count == 1 {
                parent.push(t.elapsed());
            }
            for c in children {
                let c = c.map_err(e)?;
                m.kill(&c.id, "bench").await.map_err(e)?;
            }
        }
    }
    m.kill(&sbx.id, "bench").await.map_err(e)?;

    let filler = m.spawn_pools();
    let fill = |want: usize| async move {
        let t = Instant::now();
        while m.pool_ready(&opts.template) < want {
            if t.elapsed() > Duration::from_secs(300) {
                return Err("the warm pool did not fill".to_string());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    };
    let mut pool_seq = vec![];
    for _ in 0..opts.pool_creates {
        fill(1).await?;
        let t = Instant::now();
        let s = m.create(params(&opts.template)).await.map_err(e)?;
        pool_seq.push(t.elapsed());
        m.kill(&s.id, "bench").await.map_err(e)?;
    }
    fill(10).await?;
    let t0 = Instant::now();
    let creates = (0..10).map(|_| {
        let m = m.clone();
        let tpl = opts.template.clone();
        async move {
            let s = m.create(params(&tpl)).await;
            (t0.elapsed(), s)
        }
    });
    let mut pool_conc = vec![];
    for (d, s) in futures::future::join_all(creates).await {
        let s = s.map_err(e)?;
        pool_conc.push(d);
        m.kill(&s.id, "bench").await.map_err(e)?;
    }
    if let Some(f) = filler {
        f.abort();
    }
    Ok(LifecycleBenchReport {
        pause: percentiles(&pause),
        resume: percentiles(&resume),
        raw_checkpoint: percentiles(&ckpt),
        raw_restore: percentiles(&restore),
        fork1: percentiles(&fork1),
        fork5: percentiles(&fork5),
        fork1_parent: percentiles(&parent),
        pool_sequential: percentiles(&pool_seq),
        pool_concurrent: percentiles(&pool_conc),
    })
}
