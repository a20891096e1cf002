//! Standby: a running sandbox nobody has used for `standby_after` (`kiln serve
//! --standby-after`) and whose runtime is not busy is checkpointed with its memory to disk
//! through the driver's pause, so it holds no host threads, CPU or memory. To every client it
//! is still `running`: its timeout keeps counting, and the first traffic to it — a proxied
//! request to any port (envd calls, commands, files, PTYs), a `connect`, a snapshot, a fork, a
//! pause — restores it (the driver's resume) before it goes on. Lists and `GET
//! /sandboxes/{id}` show `kilnStandby`; the event log records `standby` and `wake`.
//!
//! Idle detection (`idle.rs`) is event-driven: the proxy counts open requests and stamps the
//! last use, and one tick for all sandboxes reads the host-cgroup CPU of those quiet long
//! enough; a busy runtime counts as used. A sandbox opts out with metadata `kiln.standby=off`;
//! template-build sandboxes never enter standby (the build talks to their agent directly).
//!
//! The store keeps a standby sandbox as `running` while the driver has it paused: after a
//! restart, recovery adopts such a sandbox in standby (`recovery.rs`).

use std::time::{Duration, Instant};

use super::idle::{InUse, Use};
use super::Manager;
use crate::error::{Error, Result};
use crate::store::{now_ms, EventQuery, PauseMode, SandboxRecord, SandboxState, StateStore};

/// What [`Manager::hold_one`] holds.
pub(super) struct HeldOne<'a> {
    _gate: tokio::sync::OwnedMutexGuard<()>,
    _shared: tokio::sync::RwLockReadGuard<'a, ()>,
}

/// Metadata key of the per-sandbox opt-out (`kiln.standby=off`).
pub const STANDBY_META: &str = "kiln.standby";

/// Whether sandbox `r` may enter standby.
pub fn may_stand_by(r: &SandboxRecord) -> bool {
    let off = r.metadata.get(STANDBY_META).is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "off" | "false" | "0" | "no"
        )
    });
    !off && !r.metadata.contains_key(super::BUILD_META)
}

/// After a failed standby, the sandbox is tried again after this many periods.
const STANDBY_RETRY_PERIODS: u32 = 10;

/// How often the idle check runs for a given `standby_after`.
pub fn tick_for(after: Duration) -> Duration {
    (after / 4).clamp(Duration::from_millis(250), Duration::from_secs(5))
}

/// Parses `--standby-after`: `off` (or `0`), or a duration such as `90s`, `500ms`, `5m`,
/// `1h` (a bare number is seconds).
pub fn parse_standby_after(s: &str) -> std::result::Result<Option<Duration>, String> {
    let t = s.trim().to_ascii_lowercase();
    if matches!(t.as_str(), "off" | "0" | "never" | "") {
        return Ok(None);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("not a duration: {s:?} (examples: 30s, 5m, off)"))?;
    let secs = match unit.trim() {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        u => return Err(format!("unknown unit {u:?} in {s:?} (use ms, s, m or h)")),
    };
    if !(secs.is_finite() && secs > 0.0 && secs <= 7.0 * 86_400.0) {
        return Err(format!("{s:?} must be above 0 and at most a week, or off"));
    }
    Ok(Some(Duration::from_secs_f64(secs)))
}

/// Event written before a standby's checkpoint (then `standby` once its memory is saved, or
/// [`STANDBY_FAILED`]): a server that ends between the two leaves a record that it was going
/// to standby, not to a pause.
pub const STANDBY_BEGUN: &str = "standby-begun";
/// Event of a standby whose checkpoint failed: the sandbox stays awake.
pub const STANDBY_FAILED: &str = "standby-failed";

/// Whether the store's running sandbox `id` was left in standby: its latest standby, wake,
/// pause or resume event is a `standby`, or a [`STANDBY_BEGUN`] whose end the server did not
/// see. (A server killed between a `pause`'s checkpoint and its store update left it paused,
/// not in standby: no standby event comes last then.)
pub async fn left_in_standby(store: &dyn StateStore, id: &str) -> crate::store::Result<bool> {
    let events = store
        .events_page(&EventQuery {
            sandbox_id: Some(id.to_string()),
            kinds: [
                "standby",
                STANDBY_BEGUN,
                STANDBY_FAILED,
                "wake",
                "paused",
                "resumed",
            ]
            .map(String::from)
            .to_vec(),
            limit: u32::MAX,
            ..EventQuery::default()
        })
        .await?;
    Ok(events
        .last()
        .is_some_and(|e| e.event.kind == "standby" || e.event.kind == STANDBY_BEGUN))
}

/// The sandboxes a state store holds, as `kiln doctor` reports them: awake, in standby
/// (running to clients, checkpointed on disk) and paused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Census {
    pub running: usize,
    pub standby: usize,
    pub paused: usize,
}

/// Counts the store's live sandboxes (template-build sandboxes left out).
pub async fn census(store: &dyn StateStore) -> crate::store::Result<Census> {
    let mut c = Census::default();
    for r in store
        .list_sandboxes(&[SandboxState::Running, SandboxState::Paused])
        .await?
    {
        if super::is_build_sandbox(&r.metadata) {
            continue;
        }
        match r.state {
            SandboxState::Paused => c.paused += 1,
            _ if left_in_standby(store, &r.id).await? => c.standby += 1,
            _ => c.running += 1,
        }
    }
    Ok(c)
}

impl Manager {
    /// Since when `id` is in standby (Unix ms); None when it is awake or unknown.
    pub fn standby_since(&self, id: &str) -> Option<i64> {
        self.idle.standby_since(id)
    }

    /// How many sandboxes are in standby now.
    pub fn standby_count(&self) -> usize {
        self.idle.standby_count()
    }

    /// A request or connection begins on `id`: wakes it first when it is in standby. The
    /// guard keeps it awake until dropped.
    pub async fn use_sandbox(&self, id: &str, why: &str) -> Result<InUse> {
        // A wake that fails returns its error; after a wake that worked the sandbox is awake
        // unless it went back to standby meanwhile, which takes `standby_after` of quiet.
        for _ in 0..3 {
            match self.idle.begin_use(id) {
                Use::Awake { guard, was_idle } => {
                    if was_idle {
                        self.driver.set_idle(id, false);
                    }
                    return Ok(guard);
                }
                Use::Standby => self.wake(id, why).await?,
            }
        }
        Err(Error::Unavailable(format!(
            "sandbox \"{id}\" could not be woken from standby"
        )))
    }

    /// Holds `id` alone: the lifecycle lock shared (no pause, resume, snapshot or fork of any
    /// sandbox meanwhile: they hold it exclusively) and `id`'s gate (no other standby, wake or
    /// sample of `id`). Standbys, wakes and samples of other sandboxes go on beside it.
    pub(super) async fn hold_one(&self, id: &str) -> HeldOne<'_> {
        let shared = self.lifecycle_lock.read().await;
        let gate = self.idle.gate(id).lock_owned().await;
        HeldOne {
            _gate: gate,
            _shared: shared,
        }
    }

    /// Wakes `id` if it is in standby (see [`Self::wake_locked`]).
    pub async fn wake(&self, id: &str, why: &str) -> Result<()> {
        if self.idle.standby_since(id).is_none() {
            return Ok(());
        }
        let _held = self.hold_one(id).await;
        self.wake_locked(id, why).await
    }

    /// Restores `id` from standby (the lifecycle lock held exclusively, or [`Self::hold_one`]):
    /// its runtime runs again from the saved memory, its agent answers and has its clock set;
    /// a `wake` event says by what. Nothing to do when it is awake.
    pub(super) async fn wake_locked(&self, id: &str, why: &str) -> Result<()> {
        let Some(since) = self.idle.standby_since(id) else {
            return Ok(());
        };
        let rec = self.get(id)?;
        let t = Instant::now();
        let restored = match self.driver.resume(id, true).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(sandbox = id, error = %e, "waking from standby");
                return Err(e.into());
            }
        };
        // Awake from here on, whatever the agent does: the runtime runs.
        self.idle.set_awake(id);
        if let Err(e) = self.reinit_agent(&rec, restored).await {
            self.event(
                id,
                "wake",
                format!("by {why}; the agent did not come back: {e}"),
            )
            .await;
            return Err(e);
        }
        let how = if restored {
            "memory restored"
        } else {
            "booted on its saved disk"
        };
        self.event(
            id,
            "wake",
            format!(
                "by {why} after {} s in standby; {how} in {} ms",
                (now_ms() - since).max(0) / 1000,
                t.elapsed().as_millis()
            ),
        )
        .await;
        Ok(())
    }

    /// `pause` with memory of a sandbox in standby (the lifecycle lock held): its memory and
    /// disk are already saved, so it only becomes paused.
    pub(super) async fn pause_from_standby(&self, id: &str) -> Result<()> {
        let mode = PauseMode::Full;
        self.store.set_paused(id, mode).await?;
        self.registry.update(id, |r| {
            r.state = SandboxState::Paused;
            r.pause_mode = Some(mode);
        });
        self.idle.forget(id);
        self.event(
            id,
            "paused",
            "full pause from standby (memory already on disk)",
        )
        .await;
        Ok(())
    }

    /// Puts running `id` in standby if it is still quiet; true when it did.
    pub(super) async fn enter_standby(&self, id: &str, after: Duration) -> bool {
        let _guard = self.hold_one(id).await;
        if self.registry.get(id).map(|r| r.state) != Some(SandboxState::Running) {
            return false;
        }
        // From here requests to it wait for the lifecycle lock, then wake it.
        if !self.idle.begin_standby(id, Instant::now(), after, now_ms()) {
            return false;
        }
        // On record first: a server that ends during the checkpoint leaves the sandbox paused
        // on the host, and the next one must know it was a standby (running to clients), not a
        // pause.
        self.event(
            id,
            STANDBY_BEGUN,
            format!(
                "idle for {} s; saving its memory",
                after.as_secs_f64().round() as u64
            ),
        )
        .await;
        let t = Instant::now();
        match self.driver.pause(id, true).await {
            Ok(()) => {
                self.event(
                    id,
                    "standby",
                    format!(
                        "idle for {} s; memory saved to disk in {} ms",
                        after.as_secs_f64().round() as u64,
                        t.elapsed().as_millis()
                    ),
                )
                .await;
                true
            }
            Err(e) => {
                // Not tried again for a while: a sandbox that cannot be checkpointed would
                // otherwise be tried every period.
                self.idle.defer(id, after * STANDBY_RETRY_PERIODS);
                // (The error, which may name host files, goes to the server's log only.)
                self.event(id, STANDBY_FAILED, "its checkpoint failed")
                    .await;
                let running = self.driver.is_running(id).await.unwrap_or(false);
                if !running && !self.driver.is_paused(id).await.unwrap_or(false) {
                    // A runtime may stop the sandbox when its checkpoint fails.
                    drop(_guard);
                    let _ = self
                        .end(id, "died", &format!("lost while entering standby: {e}"))
                        .await;
                } else {
                    tracing::warn!(sandbox = id, error = %e, "entering standby; it stays awake");
                }
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{EventStore, SandboxStore};

    fn rec(meta: &[(&str, &str)]) -> SandboxRecord {
        SandboxRecord {
            id: "a".into(),
            metadata: meta
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            driver: "test".into(),
            ..Default::default()
        }
    }

    #[test]
    fn metadata_opts_out_and_build_sandboxes_never_stand_by() {
        assert!(may_stand_by(&rec(&[])));
        assert!(may_stand_by(&rec(&[("kiln.standby", "on")])));
        assert!(!may_stand_by(&rec(&[("kiln.standby", "off")])));
        assert!(!may_stand_by(&rec(&[("kiln.standby", " OFF ")])));
        assert!(!may_stand_by(&rec(&[("kiln.standby", "false")])));
        assert!(!may_stand_by(&rec(&[("kiln.template.build", "b1")])));
    }

    #[tokio::test]
    async fn the_census_tells_awake_standby_and_paused_apart() {
        let store = crate::store::SqliteStore::open_in_memory().unwrap();
        let add = |id: &str, state, meta: &[(&str, &str)]| {
            let mut r = rec(meta);
            r.id = id.into();
            r.state = state;
            r
        };
        let running = SandboxState::Running;
        for r in [
            add("awake", running, &[]),
            add("woken", running, &[]),
            add("asleep", running, &[]),
            add("cut", running, &[]),
            add("failed", running, &[]),
            add("held", SandboxState::Paused, &[]),
            add("build", running, &[("kiln.template.build", "b1")]),
            add("gone", SandboxState::Killed, &[]),
        ] {
            store.insert_sandbox(&r).await.unwrap();
        }
        for (id, kind) in [
            ("woken", STANDBY_BEGUN),
            ("woken", "standby"),
            ("woken", "wake"),
            ("asleep", "wake"),
            ("asleep", "standby"),
            ("asleep", "exec"),
            // A standby the server's end cut short (memory saved or not): in standby.
            ("cut", "wake"),
            ("cut", STANDBY_BEGUN),
            // A standby that failed, then a `pause` the server's end cut short: not in standby.
            ("failed", STANDBY_BEGUN),
            ("failed", STANDBY_FAILED),
        ] {
            store.add_event(id, kind, "").await.unwrap();
        }
        let c = census(&store).await.unwrap();
        assert_eq!(
            c,
            Census {
                running: 3,
                standby: 2,
                paused: 1
            }
        );
    }

    #[test]
    fn standby_after_parses_units_and_off() {
        let p = |s| parse_standby_after(s).unwrap();
        assert_eq!(p("off"), None);
        assert_eq!(p("0"), None);
        assert_eq!(p("2s"), Some(Duration::from_secs(2)));
        assert_eq!(p("2"), Some(Duration::from_secs(2)));
        assert_eq!(p("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(p("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(p("5m"), Some(Duration::from_secs(300)));
        assert_eq!(p(" 1H "), Some(Duration::from_secs(3600)));
        for bad in ["x", "5d", "-1s", "s", "1e9s", "9999h"] {
            assert!(parse_standby_after(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_tick_follows_the_period_within_bounds() {
        assert_eq!(tick_for(Duration::from_secs(2)), Duration::from_millis(500));
        assert_eq!(
            tick_for(Duration::from_millis(100)),
            Duration::from_millis(250)
        );
        assert_eq!(tick_for(Duration::from_secs(600)), Duration::from_secs(5));
    }
}
