//! Idle bookkeeping for idle hints and standby (see `standby.rs`): per running sandbox, when
//! it was last used, how many proxied requests and connections are open on it, its last
//! host-CPU reading, whether its driver has been told it is idle, and whether (since when) it
//! is in standby. Nothing here polls: the proxy marks use as it forwards, and the idle tick
//! reads the CPU of the sandboxes that have been quiet long enough or are hinted idle.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A sandbox using at least this much of one host core (its runtime's whole cgroup) over the
/// measured window is busy and does not enter standby. An idle sandbox's runtime costs
/// 2.5–3.5 % of a core (docs/density.md); a process spinning inside it costs ~100 %, and still
/// well above this on a host loaded enough to give it a fraction of a core.
pub const CPU_BUSY_PCT: f64 = 20.0;

/// The shortest window a CPU rate is measured over.
pub const MIN_CPU_WINDOW: Duration = Duration::from_millis(250);

#[derive(Debug, Default)]
struct Idle {
    /// Last time a request or connection began or ended (None: not seen yet).
    last_active: Option<Instant>,
    /// Proxied requests and connections open now.
    in_use: u32,
    /// The previous host-CPU reading (time, total CPU ns).
    cpu: Option<(Instant, u64)>,
    /// In standby since (Unix ms); None while awake.
    since_ms: Option<i64>,
    /// The driver has been told the sandbox is idle ([`kiln_driver::Driver::set_idle`]).
    hinted: bool,
    /// Held (with the lifecycle lock shared) by whatever changes or asks this sandbox alone:
    /// its standby, its wake, a metrics sample.
    gate: Arc<tokio::sync::Mutex<()>>,
}

/// What the CPU readings say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cpu {
    /// Not enough to tell yet (first reading, a counter that restarted, a short window).
    Unknown,
    Busy,
    Quiet,
}

/// Compares a CPU reading with the previous one: the rate over the window between them, in
/// percent of one core, against `busy_pct`.
pub fn cpu_verdict(
    prev: Option<(Instant, u64)>,
    now: Instant,
    cpu_ns: u64,
    min_window: Duration,
    busy_pct: f64,
) -> Cpu {
    let Some((t, before)) = prev else {
        return Cpu::Unknown;
    };
    let wall = now.saturating_duration_since(t);
    if cpu_ns < before || wall < min_window {
        return Cpu::Unknown;
    }
    let pct = (cpu_ns - before) as f64 / wall.as_nanos() as f64 * 100.0;
    if pct >= busy_pct {
        Cpu::Busy
    } else {
        Cpu::Quiet
    }
}

/// Whether a sandbox last active at `last_active` with `in_use` open requests has been quiet
/// for `after` at `now`.
pub fn quiet_for(last_active: Option<Instant>, in_use: u32, now: Instant, after: Duration) -> bool {
    in_use == 0 && last_active.is_some_and(|t| now.saturating_duration_since(t) >= after)
}

/// The idle state of every running sandbox the server has seen.
#[derive(Default)]
pub struct IdleTable {
    map: Mutex<HashMap<String, Idle>>,
}

/// What [`IdleTable::begin_use`] found.
pub enum Use {
    /// The sandbox is awake; the guard keeps it so until dropped. `was_idle`: its driver had
    /// been told it is idle, and must hear it is not before the use goes on.
    Awake { guard: InUse, was_idle: bool },
    /// The sandbox is in standby: wake it, then ask again.
    Standby,
}

/// A request or connection open on a sandbox: it does not enter standby while one is.
pub struct InUse {
    table: Arc<IdleTable>,
    id: String,
}

impl InUse {
    /// A guard that tracks nothing: for a service whose sandboxes' idleness is kept elsewhere
    /// (a cluster's control replica; the node that runs the sandbox keeps its own).
    pub fn untracked() -> Self {
        Self {
            table: Arc::new(IdleTable::default()),
            id: String::new(),
        }
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        let mut map = self.table.lock();
        if let Some(e) = map.get_mut(&self.id) {
            e.in_use = e.in_use.saturating_sub(1);
            e.last_active = Some(Instant::now());
        }
    }
}

impl IdleTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Idle>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request or connection begins on `id`: a guard while it is awake, else
    /// [`Use::Standby`].
    pub fn begin_use(self: &Arc<Self>, id: &str) -> Use {
        let mut map = self.lock();
        let e = map.entry(id.to_string()).or_default();
        if e.since_ms.is_some() {
            return Use::Standby;
        }
        e.in_use += 1;
        e.last_active = Some(Instant::now());
        Use::Awake {
            guard: InUse {
                table: self.clone(),
                id: id.to_string(),
            },
            was_idle: std::mem::take(&mut e.hinted),
        }
    }

    /// `id` was used now (an API call on it); true when its driver had been told it is idle.
    pub fn touch(&self, id: &str) -> bool {
        let mut map = self.lock();
        let e = map.entry(id.to_string()).or_default();
        e.last_active = Some(Instant::now());
        std::mem::take(&mut e.hinted)
    }

    /// Marks awake `id` as hinted idle if it is still unused and quiet for `after`, running
    /// `tell` (which gives the driver the hint) first, under the table's lock: a use that
    /// takes the hint back comes after it; false (nothing changed) otherwise.
    pub fn begin_hint(&self, id: &str, now: Instant, after: Duration, tell: impl FnOnce()) -> bool {
        let mut map = self.lock();
        let Some(e) = map.get_mut(id) else {
            return false;
        };
        if e.hinted || e.since_ms.is_some() || !quiet_for(e.last_active, e.in_use, now, after) {
            return false;
        }
        tell();
        e.hinted = true;
        true
    }

    /// Clears `id`'s idle hint; true when it had one.
    pub fn end_hint(&self, id: &str) -> bool {
        self.lock()
            .get_mut(id)
            .is_some_and(|e| std::mem::take(&mut e.hinted))
    }

    /// Whether `id`'s driver has been told it is idle.
    pub fn hinted(&self, id: &str) -> bool {
        self.lock().get(id).is_some_and(|e| e.hinted)
    }

    /// How many awake sandboxes are hinted idle.
    pub fn hinted_count(&self) -> usize {
        self.lock()
            .values()
            .filter(|e| e.hinted && e.since_ms.is_none())
            .count()
    }

    /// Whether `id` has been quiet for `after` at `now` (and is awake). A sandbox seen for
    /// the first time counts as used now.
    pub fn quiet(&self, id: &str, now: Instant, after: Duration) -> bool {
        let mut map = self.lock();
        let e = map.entry(id.to_string()).or_default();
        if e.since_ms.is_some() {
            return false;
        }
        let last = *e.last_active.get_or_insert(now);
        quiet_for(Some(last), e.in_use, now, after)
    }

    /// Records a CPU reading of `id` and says what it means; a busy sandbox counts as used
    /// now.
    pub fn cpu_reading(&self, id: &str, now: Instant, cpu_ns: u64) -> Cpu {
        let mut map = self.lock();
        let e = map.entry(id.to_string()).or_default();
        let v = cpu_verdict(e.cpu, now, cpu_ns, MIN_CPU_WINDOW, CPU_BUSY_PCT);
        match v {
            Cpu::Unknown => {
                let short = e.cpu.is_some_and(|(t, n)| {
                    cpu_ns >= n && now.saturating_duration_since(t) < MIN_CPU_WINDOW
                });
                if !short {
                    e.cpu = Some((now, cpu_ns));
                }
            }
            Cpu::Busy => {
                e.cpu = Some((now, cpu_ns));
                e.last_active = Some(now);
            }
            Cpu::Quiet => e.cpu = Some((now, cpu_ns)),
        }
        v
    }

    /// Marks `id` as in standby from `now_ms` if it is still awake, unused and quiet for
    /// `after`; false (nothing changed) otherwise. New requests find it in standby from here
    /// on and wake it.
    pub fn begin_standby(&self, id: &str, now: Instant, after: Duration, now_ms: i64) -> bool {
        let mut map = self.lock();
        let Some(e) = map.get_mut(id) else {
            return false;
        };
        if e.since_ms.is_some() || !quiet_for(e.last_active, e.in_use, now, after) {
            return false;
        }
        e.since_ms = Some(now_ms);
        true
    }

    /// Marks `id` as in standby (adopted so after a restart).
    pub fn set_standby(&self, id: &str, since_ms: i64) {
        self.lock().entry(id.to_string()).or_default().since_ms = Some(since_ms);
    }

    /// `id` is awake (woken, or its standby failed): used now, CPU measured afresh; a woken
    /// runtime starts without the idle hint.
    pub fn set_awake(&self, id: &str) {
        let mut map = self.lock();
        let e = map.entry(id.to_string()).or_default();
        e.since_ms = None;
        e.cpu = None;
        e.hinted = false;
        e.last_active = Some(Instant::now());
    }

    /// `id` is awake and not to be judged quiet before `by` from now plus the usual period
    /// (after a standby that failed).
    pub fn defer(&self, id: &str, by: Duration) {
        let mut map = self.lock();
        let e = map.entry(id.to_string()).or_default();
        e.since_ms = None;
        e.cpu = None;
        e.last_active = Some(Instant::now() + by);
    }

    /// `id`'s gate (see [`Idle::gate`]).
    pub fn gate(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.lock().entry(id.to_string()).or_default().gate.clone()
    }

    /// Since when `id` is in standby (Unix ms), if it is.
    pub fn standby_since(&self, id: &str) -> Option<i64> {
        self.lock().get(id).and_then(|e| e.since_ms)
    }

    /// How many sandboxes are in standby.
    pub fn standby_count(&self) -> usize {
        self.lock()
            .values()
            .filter(|e| e.since_ms.is_some())
            .count()
    }

    /// Forgets every sandbox not in `live` that has nothing open on it.
    pub fn retain(&self, live: &HashSet<&str>) {
        self.lock()
            .retain(|id, e| live.contains(id.as_str()) || e.in_use > 0);
    }

    /// Forgets `id` (it ended).
    pub fn forget(&self, id: &str) {
        let mut map = self.lock();
        if map.get(id).is_some_and(|e| e.in_use == 0) {
            map.remove(id);
        } else if let Some(e) = map.get_mut(id) {
            e.since_ms = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_cpu_rate_needs_two_readings_a_window_apart() {
        let t0 = Instant::now();
        assert_eq!(cpu_verdict(None, t0, 5, MIN_CPU_WINDOW, 10.0), Cpu::Unknown);
        // Too short a window says nothing, however much CPU it shows.
        let short = t0 + Duration::from_millis(100);
        assert_eq!(
            cpu_verdict(Some((t0, 0)), short, 1_000_000_000, MIN_CPU_WINDOW, 10.0),
            Cpu::Unknown
        );
        // A counter that went back (the runtime's cgroup is new after a wake) says nothing.
        assert_eq!(
            cpu_verdict(Some((t0, 500)), t0 + S, 10, MIN_CPU_WINDOW, 10.0),
            Cpu::Unknown
        );
    }

    #[test]
    fn busy_and_quiet_are_told_apart_by_the_rate_over_the_window() {
        let t0 = Instant::now();
        // 30 ms of CPU in 1 s: an idle sandbox's runtime (3 %).
        assert_eq!(
            cpu_verdict(Some((t0, 0)), t0 + S, 30_000_000, MIN_CPU_WINDOW, 10.0),
            Cpu::Quiet
        );
        // 400 ms in 1 s: a process spinning on a loaded host.
        assert_eq!(
            cpu_verdict(Some((t0, 0)), t0 + S, 400_000_000, MIN_CPU_WINDOW, 10.0),
            Cpu::Busy
        );
        // Exactly the threshold is busy.
        assert_eq!(
            cpu_verdict(Some((t0, 0)), t0 + S, 100_000_000, MIN_CPU_WINDOW, 10.0),
            Cpu::Busy
        );
    }

    #[test]
    fn quiet_means_unused_for_the_whole_period() {
        let t0 = Instant::now();
        assert!(!quiet_for(None, 0, t0, S), "never seen: not quiet yet");
        assert!(!quiet_for(Some(t0), 0, t0 + S / 2, S));
        assert!(quiet_for(Some(t0), 0, t0 + S, S));
        assert!(
            !quiet_for(Some(t0), 1, t0 + 10 * S, S),
            "an open request or connection keeps it awake"
        );
    }

    #[test]
    fn a_sandbox_seen_first_counts_as_used_then() {
        let t = IdleTable::default();
        let t0 = Instant::now();
        assert!(!t.quiet("a", t0, S));
        assert!(!t.quiet("a", t0 + S / 2, S));
        assert!(t.quiet("a", t0 + S, S));
    }

    #[test]
    fn open_use_blocks_standby_and_its_end_restarts_the_clock() {
        let t = Arc::new(IdleTable::default());
        let guard = match t.begin_use("a") {
            Use::Awake { guard, .. } => guard,
            Use::Standby => panic!("awake"),
        };
        let later = Instant::now() + 10 * S;
        assert!(!t.quiet("a", later, S), "in use");
        assert!(!t.begin_standby("a", later, S, 1));
        drop(guard);
        assert!(!t.quiet("a", Instant::now(), S), "just used");
        assert!(t.quiet("a", Instant::now() + 2 * S, S));
        assert!(t.begin_standby("a", Instant::now() + 2 * S, S, 7));
        assert_eq!(t.standby_since("a"), Some(7));
        assert_eq!(t.standby_count(), 1);
        assert!(
            matches!(t.begin_use("a"), Use::Standby),
            "traffic must wake it"
        );
        assert!(
            !t.begin_standby("a", Instant::now() + 9 * S, S, 8),
            "already"
        );
        t.set_awake("a");
        assert_eq!(t.standby_since("a"), None);
        assert!(matches!(t.begin_use("a"), Use::Awake { .. }));
    }

    #[test]
    fn an_idle_hint_is_given_once_and_taken_back_by_the_first_use() {
        let t = Arc::new(IdleTable::default());
        let t0 = Instant::now();
        assert!(!t.quiet("a", t0, S));
        assert!(
            !t.begin_hint("a", t0 + S / 2, S, || ()),
            "not quiet long enough"
        );
        let mut told = 0;
        assert!(t.begin_hint("a", t0 + S, S, || told += 1));
        assert!(
            !t.begin_hint("a", t0 + 2 * S, S, || told += 1),
            "already hinted"
        );
        assert_eq!(told, 1, "the driver hears the hint once");
        assert!(t.hinted("a") && t.hinted_count() == 1);
        // The first use says the hint must be taken back; the next does not.
        match t.begin_use("a") {
            Use::Awake { was_idle, .. } => assert!(was_idle),
            Use::Standby => panic!("awake"),
        }
        match t.begin_use("a") {
            Use::Awake { was_idle, .. } => assert!(!was_idle),
            Use::Standby => panic!("awake"),
        }
        assert_eq!(t.hinted_count(), 0);
        // An API call takes it back too, and a busy runtime's hint ends once.
        let later = Instant::now() + 5 * S;
        assert!(t.begin_hint("a", later, S, || ()));
        assert!(t.touch("a") && !t.touch("a"));
        assert!(t.begin_hint("a", Instant::now() + 5 * S, S, || ()));
        assert!(t.end_hint("a") && !t.end_hint("a"));
        // In standby it does not count; woken, the runtime is new and unhinted.
        assert!(t.begin_hint("a", Instant::now() + 5 * S, S, || ()));
        assert!(t.begin_standby("a", Instant::now() + 5 * S, S, 1));
        assert_eq!(t.hinted_count(), 0);
        t.set_awake("a");
        assert!(!t.hinted("a"));
    }

    #[test]
    fn a_busy_reading_counts_as_use() {
        let t = IdleTable::default();
        let t0 = Instant::now();
        assert!(!t.quiet("a", t0, S));
        assert_eq!(t.cpu_reading("a", t0, 0), Cpu::Unknown);
        assert_eq!(t.cpu_reading("a", t0 + S, 900_000_000), Cpu::Busy);
        assert!(
            !t.quiet("a", t0 + S + S / 2, S),
            "the busy reading reset the clock"
        );
        assert!(t.quiet("a", t0 + 2 * S, S));
        assert_eq!(t.cpu_reading("a", t0 + 2 * S, 920_000_000), Cpu::Quiet);
    }

    #[test]
    fn a_short_window_keeps_the_older_reading() {
        let t = IdleTable::default();
        let t0 = Instant::now();
        assert_eq!(t.cpu_reading("a", t0, 0), Cpu::Unknown);
        assert_eq!(
            t.cpu_reading("a", t0 + Duration::from_millis(50), 1_000),
            Cpu::Unknown
        );
        // Measured from t0, not from the 50 ms reading.
        assert_eq!(t.cpu_reading("a", t0 + S, 500_000_000), Cpu::Busy);
    }

    #[test]
    fn a_deferred_sandbox_is_quiet_only_after_the_delay_and_the_period() {
        let t = IdleTable::default();
        t.defer("a", 10 * S);
        let now = Instant::now();
        assert!(!t.quiet("a", now + 10 * S, S));
        assert!(t.quiet("a", now + 12 * S, S));
    }

    #[tokio::test]
    async fn each_sandbox_has_its_own_gate() {
        let t = IdleTable::default();
        let a = t.gate("a");
        let held = a.clone().lock_owned().await;
        assert!(t.gate("a").try_lock().is_err(), "the same sandbox waits");
        assert!(t.gate("b").try_lock().is_ok(), "another sandbox does not");
        drop(held);
        assert!(t.gate("a").try_lock().is_ok());
    }

    #[test]
    fn forgetting_keeps_entries_with_open_use() {
        let t = Arc::new(IdleTable::default());
        let g = match t.begin_use("a") {
            Use::Awake { guard, .. } => guard,
            Use::Standby => panic!("awake"),
        };
        t.touch("b");
        t.retain(&HashSet::new());
        assert!(t.lock().contains_key("a"));
        assert!(!t.lock().contains_key("b"));
        drop(g);
        t.forget("a");
        assert!(!t.lock().contains_key("a"));
    }
}
