//! One tick for everything idleness decides (`kiln serve --idle-hint-after`,
//! `--standby-after`): every running sandbox that may stand by is looked at once, its host CPU
//! read at most once, and then
//! - one quiet for the hint period and not busy is hinted idle to its driver
//!   ([`kiln_driver::Driver::set_idle`]: the driver may make its runtime cheaper), and a hinted one whose
//!   runtime got busy is hinted in use again (its first request, API call or connection takes
//!   the hint back before it goes on: [`Manager::use_sandbox`], [`Manager::used`]);
//! - one quiet for the standby period and not busy enters standby (`standby.rs`); it is hinted
//!   idle too, so that it costs little while it waits its turn. A tick spends at most its
//!   period (`standby_tick_budget`) on standbys, one at least: during a long wave (hundreds
//!   of sandboxes going quiet together) the next tick's hints are not held up by it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::idle::Cpu;
use super::standby::{may_stand_by, tick_for};
use super::Manager;
use crate::store::SandboxState;

/// What one tick did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Sandboxes hinted idle.
    pub hinted: Vec<String>,
    /// Hinted sandboxes whose runtime got busy, hinted in use again.
    pub unhinted: Vec<String>,
    /// Sandboxes that entered standby.
    pub standby: Vec<String>,
}

impl Manager {
    /// `id` was used now (an API call on it): it is not idle, and its driver hears so first
    /// when it had been hinted idle.
    pub(crate) fn used(&self, id: &str) {
        if self.idle.touch(id) {
            self.driver.set_idle(id, false);
        }
    }

    /// How many awake sandboxes are hinted idle now.
    pub fn idle_hinted_count(&self) -> usize {
        self.idle.hinted_count()
    }

    /// One round of idle detection (see the module doc).
    pub async fn idle_tick(&self) -> TickReport {
        let mut report = TickReport::default();
        let (hint_after, standby_after) = (self.cfg.idle_hint_after, self.cfg.standby_after);
        if hint_after.is_none() && standby_after.is_none() {
            return report;
        }
        let live = self.registry.list();
        {
            let ids: HashSet<&str> = live.iter().map(|r| r.id.as_str()).collect();
            self.idle.retain(&ids);
        }
        let mut to_standby = Vec::new();
        for r in live.iter().filter(|r| {
            r.state == SandboxState::Running
                && may_stand_by(r)
                && self.idle.standby_since(&r.id).is_none()
        }) {
            let now = Instant::now();
            let hinted = self.idle.hinted(&r.id);
            let quiet_for =
                |after: Option<Duration>| after.is_some_and(|a| self.idle.quiet(&r.id, now, a));
            let (hint_due, standby_due) =
                (!hinted && quiet_for(hint_after), quiet_for(standby_after));
            if !(hinted || hint_due || standby_due) {
                continue;
            }
            let Ok(stats) = self.driver.stats(&r.id).await else {
                continue;
            };
            match self.idle.cpu_reading(&r.id, Instant::now(), stats.cpu_ns) {
                Cpu::Busy if hinted && self.idle.end_hint(&r.id) => {
                    self.driver.set_idle(&r.id, false);
                    report.unhinted.push(r.id.clone());
                }
                Cpu::Quiet => {
                    if let Some(after) = hint_after.filter(|_| hint_due) {
                        let tell = || self.driver.set_idle(&r.id, true);
                        if self.idle.begin_hint(&r.id, Instant::now(), after, tell) {
                            report.hinted.push(r.id.clone());
                        }
                    }
                    if standby_due {
                        to_standby.push(r.id.clone());
                    }
                }
                _ => {}
            }
        }
        if let Some(after) = standby_after {
            let budget = self
                .cfg
                .standby_tick_budget
                .or_else(|| self.tick_period())
                .unwrap_or_default();
            let t = Instant::now();
            for (n, id) in to_standby.into_iter().enumerate() {
                // The rest are due again at the next tick, after its hints.
                if n > 0 && t.elapsed() >= budget {
                    break;
                }
                if self.enter_standby(&id, after).await {
                    report.standby.push(id);
                }
            }
        }
        report
    }

    /// How often the idle tick runs (None: idle hints and standby are both off).
    fn tick_period(&self) -> Option<Duration> {
        let after = match (self.cfg.idle_hint_after, self.cfg.standby_after) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        Some(tick_for(after))
    }

    /// Runs [`Self::idle_tick`] forever (nothing when idle hints and standby are both off).
    pub fn spawn_idle_tick(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        let period = self.tick_period()?;
        let me = Arc::clone(self);
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                me.idle_tick().await;
            }
        }))
    }
}
