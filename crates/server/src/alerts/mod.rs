//! Anomaly detection on the audit stream: the [`kiln_rules`] engine evaluating every audit
//! record as the writer stores it, and what an alert does.
//!
//! The audit writer hands each stored record to a bounded channel without waiting
//! ([`crate::audit::RulesTap`]); one task owns the engine and evaluates records in order. Each
//! alert is then handled on its own task ([`actions`]): stored (`alerts` table, `GET /alerts`),
//! added to the event log as an `alert` event (so `GET /events` and webhooks carry it),
//! counted (`kiln_alerts_total{rule,priority}`), appended to the sandbox's audit chain with
//! the ids of the records that triggered it, and its rule's action taken (`kill`, `pause`,
//! `deny-network`), itself appended to the chain. The engine skips those records, and each
//! action is taken at most once per sandbox, so no rule can loop on its own doing.
//!
//! Rules come from the built-in pack or a file (`kiln serve --rules FILE`); a file is checked
//! for changes every 2 s and on SIGHUP, and a change that does not load is logged and never
//! replaces the working set.

pub mod actions;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kiln_rules::reload::{Reload, Watched};
use kiln_rules::{Engine, Event, RuleSet};
use tokio::sync::mpsc;

use crate::audit::AuditRecord;
use crate::manager::Manager;
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
/// to the state database at `db`.
pub fn start(
    manager: &Arc<Manager>,
    db: &Path,
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
    let handler = actions::Handler::new(
        manager.clone(),
        AlertsDb::open(db).map_err(crate::store::StoreError::from)?,
    );
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

async fn run(
    mut engine: Engine,
    mut rx: mpsc::Receiver<Arc<AuditRecord>>,
    mut watched: Option<Watched>,
    handler: Arc<actions::Handler>,
    manager: Arc<Manager>,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = signal(SignalKind::hangup()).ok();
    let mut tick = tokio::time::interval(RELOAD_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut teams = Teams::default();
    loop {
        let force = tokio::select! {
            r = rx.recv() => {
                let Some(r) = r else { return };
                let ev = event_of(&r, teams.of(&manager, &r.sandbox_id));
                for a in engine.eval(&ev) {
                    let h = handler.clone();
                    tokio::spawn(async move { h.handle(a).await });
                }
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
                engine.set_rules(set);
            }
            Reload::Refused(e) => {
                tracing::error!(file = %w.path().display(), errors = %e, "the changed rules file does not load; the rules in force stay");
            }
        }
    }
}
