//! Warm pools: sandboxes booted ahead of time per template, their agent answering but not
//! initialised. A create of that template claims one and gives it the request's identity
//! through the agent's first `/init` (environment, access token, user, workdir, clock), its
//! network policy and its start command, exactly as a cold create does after booting, so a
//! pooled sandbox is indistinguishable from a cold one.
//!
//! Pools are on by default and adaptive: each used template's pool is sized from its recent
//! demand (`pool_demand.rs`), capped by `--max-sandboxes` and the host's capacity; `--pool
//! TEMPLATE=N` pins a size, `--pool-off` turns pools off. A create that finds no pooled
//! sandbox and no free boot slot waits for whichever comes first, for at most
//! [`PoolPolicy::queue`](super::pool_demand::PoolPolicy), then gets a 503 with `Retry-After`.
//!
//! Pooled sandboxes are not in the store, not listed and not counted against any team: after
//! a restart they are host leftovers, which recovery removes; an orderly shutdown stops them.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::pool_demand::{self, Demand};
use super::Manager;
use crate::driver::SandboxSpec;
use crate::error::{Error, Result};

/// After a take, the refiller waits for this long without another take before booting
/// replacements: a burst of creates finishes giving the pooled sandboxes their identity first,
/// instead of sharing the CPU with boots beside it.
const REFILL_QUIET: Duration = Duration::from_millis(50);
/// ... but never longer than this after the first take.
const REFILL_QUIET_MAX: Duration = Duration::from_millis(250);
/// Seconds a create refused by the queue is told to wait.
const QUEUE_RETRY_AFTER_SECS: u64 = 2;

/// Booted, not yet initialised sandboxes per template name, and each template's demand.
pub(super) struct Pools {
    ready: Mutex<HashMap<String, Vec<String>>>,
    booting: Mutex<Booting>,
    demand: Mutex<HashMap<String, Demand>>,
    /// Wakes the refiller when a sandbox was taken.
    pub(super) taken: tokio::sync::Notify,
    /// Counts sandboxes put into a pool (wakes queued creates).
    added: tokio::sync::watch::Sender<u64>,
}

/// Logged (debug) when a pool boot runs at the normal CPU weight because a create waits.
const CREATE_WAITS: &str = "a create waits: pool boots run at the normal CPU weight";

impl Default for Pools {
    fn default() -> Self {
        Self {
            ready: Mutex::default(),
            booting: Mutex::default(),
            demand: Mutex::default(),
            taken: tokio::sync::Notify::new(),
            added: tokio::sync::watch::channel(0).0,
        }
    }
}

/// Pool boots under way, and the creates waiting for one.
#[derive(Default)]
struct Booting {
    /// Sandboxes being booted into a pool: a shutdown that aborts their boot stops them.
    ids: std::collections::HashSet<String>,
    /// Creates that found no pooled sandbox and wait: while there are any, pool boots run
    /// at the normal CPU weight (whichever ends first serves a create).
    waiting: usize,
}

/// One create waiting for a pooled sandbox or a boot slot (counted while it lives).
struct Waiting<'a>(&'a Pools);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.booting().waiting -= 1;
    }
}

impl Pools {
    fn booting(&self) -> std::sync::MutexGuard<'_, Booting> {
        self.booting.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<String>>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn demand(&self) -> std::sync::MutexGuard<'_, HashMap<String, Demand>> {
        self.demand.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ready sandbox of `template`, removed from the pool (the oldest first).
    pub(super) fn take(&self, template: &str) -> Option<String> {
        let mut ready = self.lock();
        let v = ready.get_mut(template)?;
        let id = (!v.is_empty()).then(|| v.remove(0));
        drop(ready);
        if id.is_some() {
            self.taken.notify_one();
        }
        id
    }

    /// The newest ready sandbox of `template` (the one a shrinking pool stops).
    fn pop(&self, template: &str) -> Option<String> {
        self.lock().get_mut(template)?.pop()
    }

    fn put(&self, template: &str, id: String) {
        self.lock()
            .entry(template.to_string())
            .or_default()
            .push(id);
        self.added.send_modify(|n| *n += 1);
    }

    pub(super) fn len(&self, template: &str) -> usize {
        self.lock().get(template).map_or(0, Vec::len)
    }

    /// Pooled sandboxes of every template.
    fn total(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// A create of `template` (its demand).
    pub(super) fn note(&self, template: &str, window: Duration) {
        self.demand()
            .entry(template.to_string())
            .or_default()
            .note(Instant::now(), window);
    }
}

/// Parses `TEMPLATE=N` (a `--pool` value).
pub fn parse_pool(s: &str) -> std::result::Result<(String, u32), String> {
    let (t, n) = s
        .split_once('=')
        .ok_or_else(|| format!("--pool {s:?}: expected TEMPLATE=N"))?;
    let n: u32 = n
        .parse()
        .map_err(|_| format!("--pool {s:?}: N must be a number"))?;
    if t.is_empty() || n > 100 {
        return Err(format!("--pool {s:?}: a template name and N of 0-100"));
    }
    Ok((t.to_string(), n))
}

/// How a create gets its sandbox: a pooled one, or a boot slot to boot one cold.
pub(super) enum Claim<'a> {
    Pooled(String),
    Cold(tokio::sync::SemaphorePermit<'a>),
}

impl Manager {
    /// How many booted sandboxes of `template` wait in its warm pool.
    pub fn pool_ready(&self, template: &str) -> usize {
        self.pools.len(template)
    }

    /// Whether creates may take pooled sandboxes.
    fn pools_on(&self) -> bool {
        !self.cfg.pool.off
    }

    /// The spec of a new sandbox of `template` (the same for pooled and cold sandboxes).
    pub(super) fn spec_for(&self, id: &str, tpl: &crate::templates::TemplateInfo) -> SandboxSpec {
        SandboxSpec {
            id: id.to_string(),
            template_name: tpl.name.clone(),
            rootfs: tpl.rootfs.clone(),
            image: tpl.image.clone(),
            env: tpl.env.clone(),
            cpu_count: self.cfg.default_cpu_count,
            memory_mb: tpl.memory_mb.unwrap_or(self.cfg.default_memory_mb),
            pids_limit: self.cfg.pids_limit,
            syscall_audit: false,
            disk_mb: tpl.disk_mb.unwrap_or(self.cfg.default_disk_mb),
            volumes: Vec::new(),
            network: None,
            background: false,
        }
    }

    /// A create of `template` is about to claim a sandbox (its pool's demand).
    pub(super) fn note_demand(&self, template: &str) {
        if self.pools_on() {
            self.pools.note(template, self.cfg.pool.idle);
        }
    }

    /// A sandbox for a create of `template`: a pooled one when there is one (`pooled_ok`),
    /// else a boot slot; waits for whichever comes first, at most the create queue's time.
    pub(super) async fn claim(&self, template: &str, pooled_ok: bool) -> Result<Claim<'_>> {
        let pooled_ok = pooled_ok && self.pools_on();
        let deadline = tokio::time::Instant::now() + self.cfg.pool.queue;
        let mut added = self.pools.added.subscribe();
        let mut waiting: Option<Waiting> = None;
        loop {
            if pooled_ok {
                if let Some(id) = self.pools.take(template) {
                    self.driver.set_background(&id, false);
                    return Ok(Claim::Pooled(id));
                }
            }
            tokio::select! {
                biased;
                permit = self.admission.boot_permit() => return permit.map(Claim::Cold),
                () = std::future::ready(()), if waiting.is_none() => {
                    // This create waits. Whichever pool boot ends first serves it or frees a
                    // boot slot for it: none of them runs on leftover CPU meanwhile.
                    let mut booting = self.pools.booting();
                    booting.waiting += 1;
                    for id in &booting.ids {
                        self.driver.set_background(id, false);
                    }
                    if !booting.ids.is_empty() {
                        tracing::debug!(template, boots = booting.ids.len(), "{CREATE_WAITS}");
                    }
                    waiting = Some(Waiting(&self.pools));
                }
                Ok(()) = added.changed(), if pooled_ok => {}
                () = tokio::time::sleep_until(deadline) => {
                    return Err(Error::Capacity {
                        limit: format!(
                            "no sandbox of \"{template}\" became ready within the create queue's \
                             {}s (every boot slot is busy; `kiln serve --create-queue` sets the \
                             wait)",
                            self.cfg.pool.queue.as_secs()
                        ),
                        retry_after_secs: QUEUE_RETRY_AFTER_SECS,
                        quota: false,
                    });
                }
            }
        }
    }

    /// How many sandboxes `template`'s pool should hold now (before capacity caps).
    fn pool_target(&self, template: &str, now: Instant) -> usize {
        if let Some(n) = pool_demand::pinned(&self.cfg.pools, template) {
            return n as usize;
        }
        self.pools
            .demand()
            .get_mut(template)
            .map_or(0, |d| d.target(now, &self.cfg.pool)) as usize
    }

    /// How many more sandboxes that serve no request yet (pooled ones, the template builds'
    /// standing ones) may boot now: what `--max-sandboxes` leaves beside the live, pending and
    /// pooled ones, and at most half of the host's remaining room (the rest stays for cold
    /// creates and the sandboxes' own growth).
    pub fn spare_room(&self) -> usize {
        let pending = self.admission.creates_in_flight();
        let mut room = usize::MAX;
        if let Some(max) = self.admission.max_sandboxes() {
            let used = self.registry.len() + self.registry.pending_len() + pending;
            room = max.saturating_sub(used + self.pools.total());
        }
        if let Some(tight) = self.admission.host_headroom() {
            let fits = (tight.sandboxes / 2).saturating_sub(pending as u64);
            room = room.min(fits as usize);
        }
        room
    }

    /// Boots one sandbox of `template` into its pool.
    async fn fill_one(&self, template: &str) -> Result<()> {
        let tpl = self.lookup_template(template).await?;
        let id = super::new_sandbox_id();
        let mut spec = self.spec_for(&id, &tpl);
        {
            // It boots and waits on the CPU the sandboxes at work leave, until a create claims
            // it, unless creates wait (then any boot may serve one).
            let mut booting = self.pools.booting();
            spec.background = booting.waiting == 0;
            if !spec.background {
                tracing::debug!(template, "{CREATE_WAITS}");
            }
            booting.ids.insert(id.clone());
        }
        let booted = async {
            let _permit = self.admission.boot_permit().await?;
            self.driver.create(&spec).await?;
            self.driver.start(&id).await?;
            let agent = self.agent(&id, None);
            agent.wait_ready(self.cfg.agent_ready_timeout).await?;
            // The extra CAs now, off the create path: the claim's `/init` finds them in place.
            if let Some(trust) = super::network::trust_init(self.extra_cas()) {
                agent.init(&trust).await?;
            }
            Ok::<(), Error>(())
        }
        .await;
        let r = match booted {
            Ok(()) => {
                self.pools.put(template, id.clone());
                Ok(())
            }
            Err(e) => {
                let _ = self.driver.stop(&id).await;
                Err(e)
            }
        };
        self.pools.booting().ids.remove(&id);
        r
    }

    /// Brings every pool to its target once: stops the surplus, boots the missing (as many
    /// at once as there are boot slots). False when a boot failed.
    async fn tend_pools(self: &Arc<Self>) -> bool {
        let names: BTreeSet<String> = {
            let mut n: BTreeSet<String> = self.cfg.pools.iter().map(|(t, _)| t.clone()).collect();
            n.extend(self.pools.demand().keys().cloned());
            n.extend(self.pools.lock().keys().cloned());
            n
        };
        let parallel = self.admission.boots_total();
        for template in names {
            let want = self.pool_target(&template, Instant::now());
            while self.pools.len(&template) > want {
                match self.pools.pop(&template) {
                    Some(id) => {
                        let _ = self.driver.stop(&id).await;
                    }
                    None => break,
                }
            }
            loop {
                let want = self.pool_target(&template, Instant::now());
                let missing = want
                    .saturating_sub(self.pools.len(&template))
                    .min(self.spare_room())
                    .min(parallel);
                if missing == 0 {
                    break;
                }
                let mut boots = tokio::task::JoinSet::new();
                for _ in 0..missing {
                    let (me, t) = (Arc::clone(self), template.clone());
                    boots.spawn(async move { me.fill_one(&t).await });
                }
                let mut failed = false;
                while let Some(r) = boots.join_next().await {
                    if let Ok(Err(e)) = r {
                        tracing::warn!(template = %template, error = %e, "filling the warm pool");
                        failed = true;
                    }
                }
                if failed {
                    return false;
                }
            }
        }
        true
    }

    /// Keeps every pool at its target, forever, in a task (None when pools are off).
    pub fn spawn_pools(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        self.pools_on()
            .then(|| tokio::spawn(Arc::clone(self).run_pools()))
    }

    /// Keeps every pool at its target, forever (returns at once when pools are off).
    pub async fn run_pools(self: Arc<Self>) {
        if !self.pools_on() {
            return;
        }
        let me = self;
        // Idleness is noticed within a quarter of the idle period (at most a second late).
        let tick = (me.cfg.pool.idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        {
            loop {
                let wait = if me.tend_pools().await {
                    tick
                } else {
                    Duration::from_secs(5)
                };
                if tokio::time::timeout(wait, me.pools.taken.notified())
                    .await
                    .is_ok()
                {
                    let until = tokio::time::Instant::now() + REFILL_QUIET_MAX;
                    while tokio::time::Instant::now() < until
                        && tokio::time::timeout(REFILL_QUIET, me.pools.taken.notified())
                            .await
                            .is_ok()
                    {}
                }
            }
        }
    }

    /// Stops every pooled sandbox and every one whose boot into a pool was cut short (an
    /// orderly shutdown; the refiller must be stopped first).
    pub async fn drain_pools(&self) {
        // Booting before ready: a boot that ends meanwhile is in one or the other.
        let mut all: Vec<String> = self.pools.booting().ids.drain().collect();
        all.extend(self.pools.lock().drain().flat_map(|(_, v)| v));
        for id in all {
            let _ = self.driver.stop(&id).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_flags() {
        assert_eq!(parse_pool("base=3").unwrap(), ("base".into(), 3));
        for bad in ["base", "=3", "base=x", "base=1000"] {
            assert!(parse_pool(bad).is_err(), "{bad}");
        }
        let p = Pools::default();
        assert_eq!(p.take("base"), None);
        p.put("base", "a".into());
        p.put("base", "b".into());
        assert_eq!(p.len("base"), 2);
        assert_eq!(p.total(), 2);
        assert_eq!(p.take("base").as_deref(), Some("a"), "the oldest first");
        assert_eq!(p.pop("base").as_deref(), Some("b"));
        assert_eq!(p.len("base"), 0);
    }
}
