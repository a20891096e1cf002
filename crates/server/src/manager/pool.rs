//! Warm pools (`--pool TEMPLATE=N`): N sandboxes per template booted ahead of time, their agent
//! answering but not initialised. A create of that template takes one, gives it the request's
//! identity through the agent's first `/init` (environment, access token, user, workdir, clock)
//! and its start command, exactly as a cold create does after booting, so a pooled sandbox is
//! indistinguishable from a cold one. A background task refills the pool.
//!
//! Pooled sandboxes are not in the store: after a restart they are host leftovers, which
//! recovery removes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Manager;

/// After a take, the refiller waits for this long without another take before booting
/// replacements: a burst of creates finishes giving the pooled sandboxes their identity first,
/// instead of sharing the CPU with boots beside it.
const REFILL_QUIET: Duration = Duration::from_millis(50);
/// ... but never longer than this after the first take.
const REFILL_QUIET_MAX: Duration = Duration::from_millis(250);
use crate::driver::SandboxSpec;
use crate::error::{Error, Result};

/// Booted, not yet initialised sandboxes, per template name.
#[derive(Default)]
pub(super) struct Pools {
    ready: Mutex<HashMap<String, Vec<String>>>,
    /// Wakes the refiller when a sandbox was taken.
    pub(super) taken: tokio::sync::Notify,
}

impl Pools {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<String>>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ready sandbox of `template`, removed from the pool.
    pub(super) fn take(&self, template: &str) -> Option<String> {
        let id = self.lock().get_mut(template)?.pop();
        if id.is_some() {
            self.taken.notify_one();
        }
        id
    }

    fn put(&self, template: &str, id: String) {
        self.lock()
            .entry(template.to_string())
            .or_default()
            .push(id);
    }

    pub(super) fn len(&self, template: &str) -> usize {
        self.lock().get(template).map_or(0, Vec::len)
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

impl Manager {
    /// How many booted sandboxes of `template` wait in its warm pool.
    pub fn pool_ready(&self, template: &str) -> usize {
        self.pools.len(template)
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
        }
    }

    /// Boots one sandbox of `template` into its pool.
    async fn fill_one(&self, template: &str) -> Result<()> {
        let tpl = self.lookup_template(template).await?;
        let id = super::new_sandbox_id();
        let spec = self.spec_for(&id, &tpl);
        let booted = async {
            let _permit = self.boot_permit().await?;
            self.driver.create(&spec).await?;
            self.driver.start(&id).await?;
            self.agent(&id, None)
                .wait_ready(self.cfg.agent_ready_timeout)
                .await?;
            Ok::<(), Error>(())
        }
        .await;
        match booted {
            Ok(()) => {
                self.pools.put(template, id);
                Ok(())
            }
            Err(e) => {
                let _ = self.driver.stop(&id).await;
                Err(e)
            }
        }
    }

    /// Keeps every configured pool full, forever.
    pub fn spawn_pools(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        if self.cfg.pools.is_empty() {
            return None;
        }
        let me = Arc::clone(self);
        Some(tokio::spawn(async move {
            loop {
                let mut failed = false;
                for (template, want) in me.cfg.pools.clone() {
                    while me.pools.len(&template) < want as usize {
                        if let Err(e) = me.fill_one(&template).await {
                            tracing::warn!(template = %template, error = %e, "filling the pool");
                            failed = true;
                            break;
                        }
                    }
                }
                let wait = if failed {
                    Duration::from_secs(5)
                } else {
                    Duration::from_secs(1)
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
        }))
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
        assert_eq!(p.len("base"), 1);
        assert_eq!(p.take("base").as_deref(), Some("a"));
        assert_eq!(p.len("base"), 0);
    }
}
