//! `kiln bench lifecycle`: pause, resume, fork and create-from-pool latencies, each beside the
//! runtime's raw checkpoint and restore of the same sandboxes measured in the same run.
//!
//! - pause = `Manager::pause` (memory kept); resume = `Manager::connect` until the agent has
//!   answered and is initialised;
//! - raw checkpoint / restore = the runtime's commands alone, on the same sandbox, after its
//!   agent let go of its host socket (see [`kiln_driver::baseline::SandboxBaseline`]);
//! - fork = `Manager::fork` with count 1 and 5, until every child's agent has answered (the
//!   parent continues after them: its downtime is measured too, until its agent answers);
//! - pool = `Manager::create` with a warm pool of the template, sequential and 10 at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::stats::{percentiles, Percentiles};
use crate::drivers::BenchRuntime;
use kiln_driver::baseline::SandboxBaseline;
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

/// The raw commands on sandbox `id` (see [`SandboxBaseline::checkpoint_restore`]), then its
/// agent answering again through the manager (not timed).
async fn raw_round(
    raw: &dyn SandboxBaseline,
    m: &Manager,
    id: &str,
    image: &std::path::Path,
) -> Result<(Duration, Duration), String> {
    let times = raw
        .checkpoint_restore(id, image)
        .await
        .map_err(|e| e.to_string())?;
    let token = m.get(id).map_err(|e| e.to_string())?.envd_token;
    m.agent(id, token)
        .wait_ready(Duration::from_secs(30))
        .await
        .map_err(|e| e.to_string())?;
    Ok(times)
}

/// Runs the bench on `runtime` in a fresh directory under `work_root`.
pub async fn lifecycle_bench(
    opts: &LifecycleBenchOptions,
    runtime: &BenchRuntime,
    work_root: &std::path::Path,
    templates: Arc<dyn Templates>,
) -> Result<LifecycleBenchReport, String> {
    let work = tempfile::Builder::new()
        .prefix("life")
        .tempdir_in(work_root)
        .map_err(|e| e.to_string())?;
    let bench = runtime
        .driver(&runtime.driver_config(), work.path())
        .map_err(|e| e.to_string())?;
    let driver = bench.driver;
    let store =
        Arc::new(SqliteStore::open(&work.path().join("kiln.db")).map_err(|e| e.to_string())?);
    let cfg = LifecycleConfig {
        pools: vec![(opts.template.clone(), 10)],
        ..LifecycleConfig::default()
    };
    let m = Manager::new(cfg, store, driver.clone(), templates);
    let r = run(opts, &m, bench.raw.as_ref(), work.path()).await;
    m.kill_all("bench done").await;
    // Pooled sandboxes are not the manager's yet: stop whatever is left on the host.
    if let Ok(left) = driver.list_on_host().await {
        for h in left {
            let _ = driver.stop(&h.id).await;
        }
    }
    driver.shutdown().await;
    r
}

async fn run(
    opts: &LifecycleBenchOptions,
    m: &Arc<Manager>,
    raw: &dyn SandboxBaseline,
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
        let (c, r) = raw_round(raw, m, &sbx.id, &work.join(format!("raw-{i}"))).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The raw round on a sandbox kiln runs, whose `run/` the driver keeps sealed between its
    /// own windows: twice in a row, then after a pause and resume (a new container), the agent
    /// lets go of its socket, the runtime checkpoints and restores, and the agent answers again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn raw_rounds_on_a_sealed_sandbox() {
        let skip = |why: String| {
            assert!(
                std::env::var("KILN_ALLOW_SKIPS").as_deref() == Ok("1"),
                "{why}; set KILN_ALLOW_SKIPS=1 to skip"
            );
            eprintln!("skipped: {why}");
        };
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return skip("sandboxes need root".into());
        }
        let runtime = match crate::drivers::RuntimeFlags::default().resolve() {
            Ok(r) => r,
            Err(e) => return skip(format!("no runtime: {e}")),
        };
        let store = kiln_template::Store::open_default().expect("the template store");
        if Templates::lookup(&store, "base").ok().flatten().is_none() {
            return skip("the base template is not built".into());
        }
        let work = tempfile::Builder::new()
            .prefix("lb")
            .tempdir_in("/tmp")
            .unwrap();
        let bench = runtime
            .driver(&runtime.driver_config(), work.path())
            .unwrap();
        let db = Arc::new(SqliteStore::open(&work.path().join("kiln.db")).unwrap());
        let m = Manager::new(
            LifecycleConfig::default(),
            db,
            bench.driver.clone(),
            Arc::new(store),
        );
        let checked = async {
            let sbx = m.create(params("base")).await.map_err(|e| e.to_string())?;
            let round = |i: usize| {
                let image = work.path().join(format!("raw-{i}"));
                let (raw, m, id) = (bench.raw.clone(), m.clone(), sbx.id.clone());
                async move { raw_round(raw.as_ref(), &m, &id, &image).await }
            };
            for i in 0..2 {
                let (c, r) = round(i).await?;
                assert!(c > Duration::ZERO && r > Duration::ZERO);
            }
            m.pause(&sbx.id, true).await.map_err(|e| e.to_string())?;
            m.connect(&sbx.id, 600, true)
                .await
                .map_err(|e| e.to_string())?;
            round(2).await?;
            let out = m
                .agent(&sbx.id, sbx.envd_token.clone())
                .run("echo still here", Default::default())
                .await
                .map_err(|e| e.to_string())?;
            assert_eq!(out.stdout, b"still here\n");
            Ok::<_, String>(())
        }
        .await;
        m.kill_all("test done").await;
        bench.driver.shutdown().await;
        checked.unwrap();
    }
}
