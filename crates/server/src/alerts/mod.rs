//! Anomaly detection on the audit stream: the [`kiln_rules`] engine evaluating every audit
//! record as the writer stores it, and what an alert does.
//!
//! The audit writer hands each stored record to a bounded channel without waiting
//! ([`crate::audit::RulesTap`]); one task owns the engine and evaluates records in order. It
//! also evaluates each new CPU and memory sample the metrics sampler took
//! ([`Manager::latest_samples`], read every second) as a `sample` record that is not stored
//! (`sandbox`, `cpuPct` of the sandbox's CPU limit, `cpuCount`, `memUsed`, `memTotal`), so
//! rules see sustained load. Alerts are grouped into incidents ([`kiln_rules::incident`]: one
//! incident name, one sandbox, at most 5 minutes apart). Each alert is then handled on its own
//! task ([`actions`]): the incident's first stored (`alerts` table, `GET /alerts`) and added
//! to the event log as an `alert` event (so `GET /events` and webhooks carry it), a repeat
//! updating that alert; every firing counted (`kiln_alerts_total{rule,priority}`), appended
//! to the sandbox's audit chain with the ids of the records that triggered it, and its rule's
//! action taken (`kill`, `pause`, `deny-network`), itself appended to the chain. The engine
//! skips those records, and each action is taken at most once per sandbox, so no rule can loop
//! on its own doing.
//!
//! Rules come from the built-in pack or a file (`kiln serve --rules FILE`); a file is checked
//! for changes every 2 s and on SIGHUP, and a change that does not load is logged and never
//! replaces the working set.

pub mod actions;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kiln_rules::reload::{Reload, Watched};
use kiln_rules::{Admitted, Engine, Event, Incidents, RuleSet};
use serde_json::json;
use tokio::sync::mpsc;

use crate::audit::AuditRecord;
use crate::manager::{Manager, END_EVENTS};
use crate::store::alerts_sql::AlertsDb;

/// Where the rules come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RulesSource {
    /// The built-in pack (`crates/rules/rules/default.yaml`).
    Builtin,
    File(PathBuf),
}

impl RulesSource {
    /// `--rules` as given: `off` (None), `builtin`/`default`, or a file.
    pub fn parse(s: &str) -> Option<RulesSource> {
        match s {
            "off" => None,
            "" | "builtin" | "default" => Some(RulesSource::Builtin),
            path => Some(RulesSource::File(PathBuf::from(path))),
        }
    }
}

/// Records waiting for the engine at most (more are counted and not evaluated).
pub const QUEUE: usize = 16384;
/// How often a rules file is checked for changes.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);
/// How often the metrics sampler's newest samples are looked at.
pub const SAMPLES_EVERY: Duration = Duration::from_secs(1);

/// The stored alert id of one incident, once its first firing is stored.
pub type Slot = Arc<tokio::sync::Mutex<Option<i64>>>;
/// A held [`Slot`].
pub type SlotGuard = tokio::sync::OwnedMutexGuard<Option<i64>>;

/// The slots of the open incidents, by incident number.
#[derive(Default)]
struct Slots(HashMap<u64, (Slot, i64)>);

impl Slots {
    fn of(&mut self, adm: Admitted, ts_ms: i64) -> Slot {
        if adm.opened && self.0.len() >= 4096 {
            self.0
                .retain(|_, (_, last)| ts_ms - *last <= kiln_rules::incident::GAP_MS);
        }
        let e = self.0.entry(adm.incident).or_default();
        e.1 = e.1.max(ts_ms);
        e.0.clone()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AlertsError {
    #[error("rules file {path}:\n{errors}")]
    Rules {
        path: String,
        errors: kiln_rules::LoadErrors,
    },
    #[error("anomaly detection needs the audit log (kiln serve --audit on, or --rules off)")]
    AuditOff,
    #[error("opening the alerts table: {0}")]
    Db(#[from] crate::store::StoreError),
}

/// What `start` loaded.
#[derive(Debug, Clone)]
pub struct Started {
    pub rules: usize,
    pub source: RulesSource,
}

/// Loads the rules and starts evaluating the audit stream of `manager`'s sandboxes; alerts go
/// to `db`.
pub fn start(
    manager: &Arc<Manager>,
    db: AlertsDb,
    source: RulesSource,
) -> Result<Started, AlertsError> {
    let log = manager.audit().clone();
    let Some(tap) = log.rules_tap().cloned() else {
        return Err(AlertsError::AuditOff);
    };
    let mut watched = None;
    let set = match &source {
        RulesSource::Builtin => Arc::new(RuleSet::default_pack()),
        RulesSource::File(p) => {
            let w = Watched::open(p).map_err(|errors| AlertsError::Rules {
                path: p.display().to_string(),
                errors,
            })?;
            let s = w.current().clone();
            watched = Some(w);
            s
        }
    };
    let rules = set.rules.len();
    let handler = actions::Handler::new(manager.clone(), db);
    let (tx, rx) = mpsc::channel(QUEUE);
    tap.set(tx);
    tokio::spawn(run(Engine::new(set), rx, watched, handler, manager.clone()));
    Ok(Started { rules, source })
}

/// The sandbox → team cache of the evaluation task.
#[derive(Default)]
struct Teams(HashMap<String, String>);

impl Teams {
    fn of(&mut self, m: &Manager, id: &str) -> Option<String> {
        if let Some(t) = self.0.get(id) {
            return Some(t.clone());
        }
        let t = m.get(id).ok()?.team;
        if self.0.len() > 65536 {
            self.0.clear();
        }
        self.0.insert(id.to_string(), t.clone());
        Some(t)
    }
}

/// The record as the engine reads it.
pub fn event_of(r: &AuditRecord, team: Option<String>) -> Event {
    Event {
        id: r.cursor,
        sandbox: r.sandbox_id.clone(),
        team,
        ts_ms: r.ts_ms,
        kind: r.kind.clone(),
        body: r.body_json(),
    }
}

/// A metrics sample as the engine reads it (kind `sample`, no audit record: id 0).
pub fn sample_event(id: &str, s: &crate::manager::MetricSample, team: Option<String>) -> Event {
    Event {
        id: 0,
        sandbox: id.to_string(),
        team,
        ts_ms: s.timestamp_ms,
        kind: "sample".into(),
        body: json!({
            "cpuPct": (s.cpu_used_pct * 10.0).round() / 10.0,
            "cpuCount": s.cpu_count,
            "memUsed": s.mem_used,
            "memTotal": s.mem_total,
        }),
    }
}

/// The engine and what its alerts go through.
struct Evaluator {
    engine: Engine,
    incidents: Incidents,
    slots: Slots,
    handler: Arc<actions::Handler>,
    /// The newest sample evaluated, per sandbox.
    sampled: HashMap<String, i64>,
}

impl Evaluator {
    fn eval(&mut self, ev: &Event) {
        for a in self.engine.eval(ev) {
            let adm = self.incidents.admit(&a);
            let slot = self.slots.of(adm, a.ts_ms);
            // A new incident's slot is free: held now, before any repeat's task can ask.
            let opening = adm
                .opened
                .then(|| slot.clone().try_lock_owned().ok())
                .flatten();
            let h = self.handler.clone();
            tokio::spawn(async move { h.handle(a, slot, opening).await });
        }
        let event = ev.body.get("event").and_then(|e| e.as_str());
        if ev.kind == "lifecycle" && event.is_some_and(|e| END_EVENTS.contains(&e)) {
            self.incidents.ended(&ev.sandbox);
        }
    }

    /// Evaluates the samples taken since the last look.
    fn samples(&mut self, manager: &Manager, teams: &mut Teams) {
        let latest = manager.latest_samples();
        let live: std::collections::HashSet<&str> =
            latest.iter().map(|(id, _)| id.as_str()).collect();
        self.sampled.retain(|id, _| live.contains(id.as_str()));
        for (id, s) in &latest {
            if self.sampled.get(id).is_some_and(|t| *t >= s.timestamp_ms) {
                continue;
            }
            self.sampled.insert(id.clone(), s.timestamp_ms);
            let ev = sample_event(id, s, teams.of(manager, id));
            self.eval(&ev);
        }
    }
}

async fn run(
    engine: Engine,
    mut rx: mpsc::Receiver<Arc<AuditRecord>>,
    mut watched: Option<Watched>,
    handler: Arc<actions::Handler>,
    manager: Arc<Manager>,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = signal(SignalKind::hangup()).ok();
    let mut tick = tokio::time::interval(RELOAD_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sample_tick = tokio::time::interval(SAMPLES_EVERY);
    sample_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut teams = Teams::default();
    let mut ev = Evaluator {
        engine,
        incidents: Incidents::default(),
        slots: Slots::default(),
        handler,
        sampled: HashMap::new(),
    };
    loop {
        let force = tokio::select! {
            r = rx.recv() => {
                let Some(r) = r else { return };
                ev.eval(&event_of(&r, teams.of(&manager, &r.sandbox_id)));
                continue;
            }
            _ = sample_tick.tick() => {
                ev.samples(&manager, &mut teams);
                continue;
            }
            _ = tick.tick() => false,
            Some(_) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => true,
        };
        let Some(w) = watched.as_mut() else { continue };
        match w.check(force) {
            Reload::Unchanged => {}
            Reload::Loaded(set) => {
                tracing::info!(rules = set.rules.len(), file = %w.path().display(), "rules reloaded");
                ev.engine.set_rules(set);
            }
            Reload::Refused(e) => {
                tracing::error!(file = %w.path().display(), errors = %e, "the changed rules file does not load; the rules in force stay");
            }
        }
    }
}
