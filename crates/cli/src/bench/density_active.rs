//! `kiln bench density --active N`: N workers, each running `/bin/echo` in its own sandbox in
//! a loop (a round trip, then a pause), through the manager as a proxied envd request reaches
//! it (the sandbox is marked in use, and woken first if it is in standby). The loop runs in
//! the background while the bench creates and measures the rest; each step takes the round
//! trips that ended since the previous one.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use kiln_server::store::SandboxState;
use kiln_server::Manager;

use super::stats::{percentiles, Percentiles};

/// The longest the loop waits for each worker's first round trip.
pub(super) const WARM_UP: Duration = Duration::from_secs(60);

/// One `/bin/echo kiln-density` in sandbox `id`, from the request's start (its wake, when in
/// standby, included) to the end event; the output is checked.
pub(super) async fn echo(m: &Manager, id: &str, token: Option<String>) -> anyhow::Result<Duration> {
    use kiln_proto::process as pb;
    let agent = m.agent(id, token);
    let req = pb::StartRequest {
        process: Some(pb::ProcessConfig {
            cmd: "/bin/echo".into(),
            args: vec!["kiln-density".into()],
            envs: Default::default(),
            cwd: None,
        }),
        pty: None,
        tag: None,
        stdin: Some(false),
    };
    let t = Instant::now();
    // As a proxied request would: a sandbox hinted idle is told otherwise, one in standby is
    // woken, and it counts as in use until the answer ends.
    let _use = m.use_sandbox(id, "bench").await?;
    let mut stream = agent
        .start(&req, None)
        .await
        .with_context(|| format!("exec in {id}"))?;
    let mut out = Vec::new();
    loop {
        match stream.next_event().await? {
            Some(kiln_envd::ProcessEvent::Stdout(b)) => out.extend(b),
            Some(kiln_envd::ProcessEvent::Exited { .. }) => break,
            Some(_) => {}
            None => anyhow::bail!("exec in {id}: no end event"),
        }
    }
    let took = t.elapsed();
    anyhow::ensure!(
        out == b"kiln-density\n",
        "exec in {id}: unexpected output {:?}",
        String::from_utf8_lossy(&out)
    );
    Ok(took)
}

/// The exec loop running in the background.
pub(super) struct ActiveLoop {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Duration>>>,
    errors: Arc<AtomicUsize>,
    first_error: Arc<Mutex<Option<String>>>,
    /// Workers whose first round trip has ended.
    ready: Arc<AtomicUsize>,
    workers: tokio::task::JoinSet<()>,
}

impl ActiveLoop {
    /// Starts `workers` workers; worker `i` execs in `ids[i % ids.len()]`, then sleeps
    /// `pause` before the next.
    pub fn start(
        m: &Arc<Manager>,
        ids: &[(String, Option<String>)],
        workers: usize,
        pause: Duration,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let errors = Arc::new(AtomicUsize::new(0));
        let first_error = Arc::new(Mutex::new(None));
        let ready = Arc::new(AtomicUsize::new(0));
        let mut set = tokio::task::JoinSet::new();
        if !ids.is_empty() {
            for i in 0..workers {
                let (id, token) = ids[i % ids.len()].clone();
                let (m, stop, samples, errors, first_error, ready) = (
                    m.clone(),
                    stop.clone(),
                    samples.clone(),
                    errors.clone(),
                    first_error.clone(),
                    ready.clone(),
                );
                set.spawn(async move {
                    // Spread the workers' first requests over one pause.
                    let lag = pause.mul_f64(i as f64 / workers.max(1) as f64);
                    tokio::time::sleep(lag).await;
                    let mut first = true;
                    while !stop.load(Ordering::Relaxed) {
                        let r = echo(&m, &id, token.clone()).await;
                        if std::mem::take(&mut first) {
                            ready.fetch_add(1, Ordering::Relaxed);
                        }
                        match r {
                            Ok(d) => lock(&samples).push(d),
                            Err(e) => {
                                errors.fetch_add(1, Ordering::Relaxed);
                                lock(&first_error).get_or_insert_with(|| format!("{e:#}"));
                                // A failing sandbox is not hammered.
                                tokio::time::sleep(Duration::from_secs(1)).await;
                            }
                        }
                        tokio::time::sleep(pause).await;
                    }
                });
            }
        }
        Self {
            stop,
            samples,
            errors,
            first_error,
            ready,
            workers: set,
        }
    }

    /// Waits until each worker has made one round trip (its sandbox woken, if the bench's
    /// creates took long enough for it to go to standby first) or `limit` passes, then drops
    /// what was measured so far.
    pub async fn warm_up(&self, limit: Duration) {
        let t = Instant::now();
        let want = self.workers.len();
        while self.ready.load(Ordering::Relaxed) < want && t.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.take();
    }

    /// The round trips that ended since the previous call (and the failures, with the first
    /// failure's message).
    pub fn take(&self) -> (Vec<Duration>, usize, Option<String>) {
        (
            std::mem::take(&mut *lock(&self.samples)),
            self.errors.swap(0, Ordering::Relaxed),
            lock(&self.first_error).take(),
        )
    }

    /// Stops the workers (each ends after its current round trip).
    pub async fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let deadline = tokio::time::sleep(Duration::from_secs(60));
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                next = self.workers.join_next() => if next.is_none() { break },
                _ = &mut deadline => {
                    self.workers.abort_all();
                    break;
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs the loop for `window` on `ids` and returns what it measured (the baseline: the same
/// loop with only these sandboxes alive).
pub(super) async fn measure_for(
    m: &Arc<Manager>,
    ids: &[(String, Option<String>)],
    workers: usize,
    pause: Duration,
    window: Duration,
) -> (Vec<Duration>, usize, Option<String>) {
    let l = ActiveLoop::start(m, ids, workers, pause);
    l.warm_up(WARM_UP).await;
    tokio::time::sleep(window).await;
    // Round trips ending after the window are not counted.
    let r = l.take();
    l.stop().await;
    r
}

/// Sequential `/bin/echo` round trips through the agents of up to `samples` awake sandboxes
/// spread over them.
pub(super) async fn exec_round_trips(m: &Manager, samples: usize) -> anyhow::Result<Percentiles> {
    let all: Vec<_> = m
        .list()
        .into_iter()
        .filter(|r| r.state == SandboxState::Running && m.standby_since(&r.id).is_none())
        .collect();
    let every = (all.len() / samples.max(1)).max(1);
    let mut times = Vec::new();
    for rec in all.iter().step_by(every).take(samples) {
        times.push(echo(m, &rec.id, rec.envd_token.clone()).await?);
    }
    Ok(percentiles(&times))
}
