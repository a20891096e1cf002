//! Admission control: a create that would exceed the configured cap (`--max-sandboxes`), its
//! team's quota or the host's capacity is refused before anything starts — 429 or 503 with
//! `Retry-After` and the limit named — instead of failing half-way in the runtime and harming
//! running sandboxes.
//!
//! Per-team quotas ([`TeamQuota`]: concurrent sandboxes, creates per minute, largest timeout)
//! come from the server's defaults ([`AdmissionConfig::team_defaults`]) overridden by the
//! team's row in the store (`kiln team set`).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_host::capacity::{self, SandboxCost};

use super::{is_build_sandbox, Manager};
use crate::error::{Error, Result};
use crate::store::AccessStore;
use crate::tenancy::TeamQuota;

/// Admission settings.
#[derive(Debug, Clone, Default)]
pub struct AdmissionConfig {
    /// At most this many sandboxes at once (running or being created); None: host capacity only.
    pub max_sandboxes: Option<usize>,
    /// What one sandbox costs on this host (estimate; see [`SandboxCost::default`]).
    pub cost: SandboxCost,
    /// Where sandbox layers are written (for the disk check); None skips it.
    pub state_dir: Option<PathBuf>,
    /// Skip the host-capacity check (tests that must not depend on the host's load).
    pub skip_host_check: bool,
    /// Quotas of every team without its own (`kiln serve --team-*`).
    pub team_defaults: TeamQuota,
}

/// Seconds a refused client is told to wait.
const RETRY_AFTER_SECS: u64 = 5;

/// The window of the create-rate quota.
const RATE_WINDOW: Duration = Duration::from_secs(60);

/// The admission service: the server's cap, team quotas, host capacity and the create rate,
/// the creates in flight they count, and the boot permits.
pub(super) struct Admission {
    cfg: AdmissionConfig,
    /// Where team quotas are kept.
    teams: Arc<dyn AccessStore>,
    in_flight: InFlight,
    /// Bounds how many sandboxes boot at once: booting is CPU-bound, so running more boots
    /// than CPUs only makes every one of them slower.
    boots: tokio::sync::Semaphore,
}

/// What is alive when a create asks to be admitted.
pub(super) struct Live {
    /// Running, paused and tearing-down sandboxes plus those being provisioned.
    pub total: usize,
    /// The asking team's running and paused sandboxes (template builds' own not counted).
    pub team: usize,
}

/// Creates in flight (in total and per team), so concurrent creates cannot all pass one
/// check, and each team's recent creates for its rate quota.
#[derive(Default)]
struct InFlight {
    total: AtomicUsize,
    teams: Mutex<HashMap<String, usize>>,
    recent: Mutex<HashMap<String, VecDeque<Instant>>>,
}

impl InFlight {
    fn teams(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.teams.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn recent(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<Instant>>> {
        self.recent.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Held while a create runs; releases its slots when dropped.
pub(super) struct Ticket<'a> {
    flight: &'a InFlight,
    team: String,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.flight.total.fetch_sub(1, Ordering::SeqCst);
        let mut teams = self.flight.teams();
        if let Some(n) = teams.get_mut(&self.team) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                teams.remove(&self.team);
            }
        }
    }
}

fn quota_refusal(limit: String, retry_after_secs: u64) -> Error {
    Error::Capacity {
        limit,
        retry_after_secs,
        quota: true,
    }
}

impl Admission {
    pub(super) fn new(cfg: AdmissionConfig, teams: Arc<dyn AccessStore>) -> Self {
        Self {
            cfg,
            teams,
            in_flight: InFlight::default(),
            boots: tokio::sync::Semaphore::new(boots_total()),
        }
    }

    /// The quotas that apply to `team` (its own where set, else the server's defaults).
    pub(super) async fn team_quota(&self, team: &str) -> Result<TeamQuota> {
        let own = self.teams.get_team(team).await?;
        Ok(self.cfg.team_defaults.for_team(own.as_ref()))
    }

    /// Checks a timeout against `team`'s largest (400 naming the limit: retrying cannot help).
    pub(super) async fn check_team_timeout(&self, team: &str, secs: i64) -> Result<()> {
        if let Some(max) = self.team_quota(team).await?.max_timeout_secs {
            if secs > 0 && secs as u64 > max {
                return Err(Error::bad_request(format!(
                    "timeout {secs}s is above team \"{team}\"'s maximum of {max}s"
                )));
            }
        }
        Ok(())
    }

    /// Whether `team`, with `live` sandboxes, has room for `n` more (a fork's children): 429
    /// naming the quota when not.
    pub(super) async fn check_team_room(&self, team: &str, live: usize, n: usize) -> Result<()> {
        if let Some(max) = self.team_quota(team).await?.max_sandboxes {
            if live + n > max as usize {
                return Err(quota_refusal(
                    format!(
                        "team \"{team}\"'s sandbox quota ({max} at once; {live} running or \
                         paused, {n} more asked for)"
                    ),
                    RETRY_AFTER_SECS,
                ));
            }
        }
        Ok(())
    }

    /// The server's cap on sandboxes at once (`--max-sandboxes`), if any.
    pub(super) fn max_sandboxes(&self) -> Option<usize> {
        self.cfg.max_sandboxes
    }

    /// The host limit with the least room left for sandboxes, read now; None when the host
    /// check is off or no limit binds.
    pub(super) fn host_headroom(&self) -> Option<capacity::Headroom> {
        if self.cfg.skip_host_check {
            return None;
        }
        let dir = self
            .cfg
            .state_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("/"));
        let limits = capacity::read_limits(&dir);
        capacity::headroom(&limits, &self.cfg.cost)
            .into_iter()
            .next()
    }

    /// Creates admitted and not finished yet.
    pub(super) fn creates_in_flight(&self) -> usize {
        self.in_flight.total.load(Ordering::SeqCst)
    }

    /// How many sandboxes may boot at once.
    pub(super) fn boots_total(&self) -> usize {
        boots_total()
    }

    /// One of the boot permits, or 503 once the server shuts down.
    pub(super) async fn boot_permit(&self) -> Result<tokio::sync::SemaphorePermit<'_>> {
        self.boots
            .acquire()
            .await
            .map_err(|_| Error::Unavailable("the sandbox manager is shutting down".into()))
    }

    /// Admits one more create for `team`, or says which limit refuses it. A create that will
    /// take a `pooled` sandbox (already booted) skips the host-capacity check.
    pub(super) fn admit(
        &self,
        team: &str,
        quota: &TeamQuota,
        pooled: bool,
        live: Live,
    ) -> Result<Ticket<'_>> {
        let pending = self.in_flight.total.fetch_add(1, Ordering::SeqCst);
        let team_pending = {
            let mut teams = self.in_flight.teams();
            let n = teams.entry(team.to_string()).or_default();
            *n += 1;
            *n - 1
        };
        let ticket = Ticket {
            flight: &self.in_flight,
            team: team.to_string(),
        };
        let adm = &self.cfg;
        if let Some(max) = adm.max_sandboxes {
            let live = live.total;
            if live + pending >= max {
                return Err(quota_refusal(
                    format!(
                        "the server's sandbox limit (--max-sandboxes {max}; {live} running, \
                         {pending} being created)"
                    ),
                    RETRY_AFTER_SECS,
                ));
            }
        }
        if let Some(max) = quota.max_sandboxes {
            let live = live.team;
            if live + team_pending >= max as usize {
                return Err(quota_refusal(
                    format!(
                        "team \"{team}\"'s sandbox quota ({max} at once; {live} running or \
                         paused, {team_pending} being created)"
                    ),
                    RETRY_AFTER_SECS,
                ));
            }
        }
        if !pooled {
            if let Some(tight) = self.host_headroom() {
                // Creates already in flight will take their share too.
                if tight.sandboxes <= pending as u64 {
                    return Err(Error::Capacity {
                        limit: format!("host capacity: {} is nearly used up", tight.limit),
                        retry_after_secs: RETRY_AFTER_SECS,
                        quota: false,
                    });
                }
            }
        }
        // Last: only an admitted create counts against the rate.
        if let Some(per_min) = quota.creates_per_minute {
            let now = Instant::now();
            let mut recent = self.in_flight.recent();
            let q = recent.entry(team.to_string()).or_default();
            while q
                .front()
                .is_some_and(|t| now.duration_since(*t) >= RATE_WINDOW)
            {
                q.pop_front();
            }
            if q.len() >= per_min as usize {
                let wait = q
                    .front()
                    .map(|t| RATE_WINDOW.saturating_sub(now.duration_since(*t)))
                    .unwrap_or(RATE_WINDOW);
                return Err(quota_refusal(
                    format!("team \"{team}\"'s create rate quota ({per_min} per minute)"),
                    wait.as_secs().max(1),
                ));
            }
            q.push_back(now);
        }
        Ok(ticket)
    }
}

/// How many sandboxes may boot at once: one per CPU, at least two.
fn boots_total() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .max(2)
}

impl Manager {
    /// What is alive now, as admission counts it for `team`.
    pub(super) fn live_for(&self, team: &str) -> Live {
        Live {
            total: self.registry.len() + self.registry.pending_len(),
            team: self.team_live(team),
        }
    }

    /// Running and paused sandboxes counted against `team`'s quota (template builds' own are
    /// not).
    fn team_live(&self, team: &str) -> usize {
        self.registry
            .list()
            .iter()
            .filter(|r| r.team == team && !is_build_sandbox(&r.metadata))
            .count()
    }

    /// The quotas that apply to `team`.
    pub async fn team_quota(&self, team: &str) -> Result<TeamQuota> {
        self.admission.team_quota(team).await
    }

    /// Checks a timeout against `team`'s largest.
    pub async fn check_team_timeout(&self, team: &str, secs: i64) -> Result<()> {
        self.admission.check_team_timeout(team, secs).await
    }

    /// Whether `team` has room for `n` more sandboxes (a fork's children).
    pub async fn check_team_room(&self, team: &str, n: usize) -> Result<()> {
        let live = self.team_live(team);
        self.admission.check_team_room(team, live, n).await
    }
}
