//! The engine: evaluates records in order against a [`RuleSet`], keeping per-sandbox process
//! tables (ancestry), windowed counts and sequence state, and returns the alerts they raise.
//!
//! - A plain rule fires on each matching record.
//! - A window rule (`count`, `within`) fires when `count` matching records (or distinct values
//!   of `distinct`) fall within `within` for one sandbox (`per: sandbox`) or one team
//!   (`per: team`); its count then starts over.
//! - A sequence rule (`condition` then `then`, `within`) fires on a record matching `then`
//!   that comes within `within` after one matching `condition` (same sandbox or team).
//! - A window with `sum: FIELD` fires when the field's values of the matching records within
//!   `within` add up to `count` or more.
//! - A rule with `for: T` fires when its condition has held on every record of the same kind
//!   of one sandbox for T (no gap between two matches longer than T), then starts over.
//!
//! The engine never evaluates its own output: `lifecycle` records whose `event` is `alert` or
//! `rule-action` (what the server appends to a chain for an alert and its action) are skipped.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::fields::{caller_of, exec_of, with_values, Event, Field};
use crate::procs::{Proc, Table};
use crate::ruleset::{Action, Override, Per, Piece, Priority, Rule, RuleSet};

/// Lifecycle events the engine's own records carry.
pub const SELF_EVENTS: &[&str] = &["alert", "rule-action"];
/// Lifecycle events after which a sandbox's process table is dropped.
const END_EVENTS: &[&str] = &["killed", "timed-out", "died", "failed"];
/// Most record ids one alert lists.
pub const MAX_RECORD_IDS: usize = 64;

/// A rule fired.
#[derive(Debug, Clone, PartialEq)]
pub struct Alert {
    pub rule: String,
    pub priority: Priority,
    pub output: String,
    pub tags: Vec<String>,
    pub actions: Vec<Action>,
    pub sandbox: String,
    pub team: Option<String>,
    pub ts_ms: i64,
    /// The ids (audit cursors) of the records that triggered it, oldest first (records that
    /// are not audit records, such as metrics samples, have none).
    pub records: Vec<i64>,
    /// The incident it belongs to (the rule's `incident`, by default its name).
    pub incident: String,
}

/// One matching record in a window.
#[derive(Debug)]
struct Hit {
    ts: i64,
    id: i64,
    distinct: Option<String>,
    amount: f64,
}

#[derive(Debug, Default)]
struct WinState {
    hits: VecDeque<Hit>,
    /// How many hits in the window carry each distinct value.
    distinct: HashMap<String, u32>,
    /// The sum of the hits' amounts (`sum` windows).
    total: f64,
}

impl WinState {
    fn pop(&mut self) {
        let Some(h) = self.hits.pop_front() else {
            return;
        };
        self.total -= h.amount;
        if let Some(v) = h.distinct {
            if let Some(n) = self.distinct.get_mut(&v) {
                *n -= 1;
                if *n == 0 {
                    self.distinct.remove(&v);
                }
            }
        }
    }

    fn push(&mut self, hit: Hit) {
        if let Some(v) = &hit.distinct {
            *self.distinct.entry(v.clone()).or_default() += 1;
        }
        self.total += hit.amount;
        self.hits.push_back(hit);
    }
}

/// A `for` rule's current run of matches: (first match's time, newest match's time, first
/// match's record id).
type Run = (i64, i64, i64);

pub struct Engine {
    set: Arc<RuleSet>,
    /// Rules per record kind (rules that can match any kind included in every list).
    by_kind: Arc<HashMap<String, Vec<usize>>>,
    any_kind: Arc<Vec<usize>>,
    procs: HashMap<String, Table>,
    windows: HashMap<(usize, String), WinState>,
    /// Sequences: the first step's newest match (time, record id).
    firsts: HashMap<(usize, String), (i64, i64)>,
    /// `for` rules: the current run of matches per (rule, sandbox).
    runs: HashMap<(usize, String), Run>,
    seen: u64,
}

impl Engine {
    pub fn new(set: Arc<RuleSet>) -> Engine {
        let mut e = Engine {
            set: Arc::new(RuleSet::default()),
            by_kind: Arc::default(),
            any_kind: Arc::default(),
            procs: HashMap::new(),
            windows: HashMap::new(),
            firsts: HashMap::new(),
            runs: HashMap::new(),
            seen: 0,
        };
        e.set_rules(set);
        e
    }

    /// Replaces the rules (windows and sequences start over; process tables are kept).
    pub fn set_rules(&mut self, set: Arc<RuleSet>) {
        let mut by_kind: HashMap<String, Vec<usize>> = HashMap::new();
        let mut any_kind = Vec::new();
        for (i, r) in set.rules.iter().enumerate() {
            match &r.kinds {
                Some(ks) => {
                    for k in ks {
                        by_kind.entry(k.clone()).or_default().push(i);
                    }
                }
                None => any_kind.push(i),
            }
        }
        for v in by_kind.values_mut() {
            v.extend(any_kind.iter().copied());
            v.sort_unstable();
        }
        self.by_kind = Arc::new(by_kind);
        self.any_kind = Arc::new(any_kind);
        self.windows.clear();
        self.firsts.clear();
        self.runs.clear();
        self.set = set;
    }

    pub fn rules(&self) -> &Arc<RuleSet> {
        &self.set
    }

    fn effective<'a>(&'a self, r: &'a Rule, team: Option<&str>) -> Option<&'a Override> {
        let t = team?;
        if self.set.overrides.is_empty() {
            return None;
        }
        self.set.overrides.get(&(t.to_string(), r.name.clone()))
    }

    /// Evaluates one record; the alerts it raises.
    pub fn eval(&mut self, ev: &Event) -> Vec<Alert> {
        let mut out = Vec::new();
        let body = &ev.body;
        let event = body.get("event").and_then(|v| v.as_str());
        if ev.kind == "lifecycle" && event.is_some_and(|e| SELF_EVENTS.contains(&e)) {
            return out;
        }
        self.seen += 1;
        if self.seen.is_multiple_of(8192) {
            self.sweep(ev.ts_ms);
        }
        let proc = self.track(ev);
        let set = self.set.clone();
        let (by_kind, any_kind) = (self.by_kind.clone(), self.any_kind.clone());
        let candidates = by_kind.get(&ev.kind).unwrap_or(&any_kind);
        for &i in candidates.iter() {
            let r = &set.rules[i];
            let o = self.effective(r, ev.team.as_deref()).cloned();
            if !o.as_ref().and_then(|o| o.enabled).unwrap_or(r.enabled) {
                continue;
            }
            let p = proc.as_deref();
            let fired = match (&r.window, &r.then) {
                (None, _) if r.hold_ms.is_some() => {
                    let hold = o
                        .as_ref()
                        .and_then(|o| o.within_ms)
                        .or(r.hold_ms)
                        .unwrap_or(0);
                    let k = (i, ev.sandbox.clone());
                    if !r.cond.eval(ev, p) {
                        self.runs.remove(&k);
                        continue;
                    }
                    let run = self
                        .runs
                        .entry(k.clone())
                        .or_insert((ev.ts_ms, ev.ts_ms, ev.id));
                    if ev.ts_ms - run.1 > hold {
                        *run = (ev.ts_ms, ev.ts_ms, ev.id);
                    }
                    run.1 = ev.ts_ms;
                    if ev.ts_ms - run.0 >= hold {
                        let first = run.2;
                        self.runs.remove(&k);
                        Some([first, ev.id].into_iter().filter(|id| *id > 0).collect())
                    } else {
                        None
                    }
                }
                (None, _) => r.cond.eval(ev, p).then(|| vec![ev.id]),
                (Some(w), Some(then)) => {
                    let key = key(w.per, ev);
                    let within = o.as_ref().and_then(|o| o.within_ms).unwrap_or(w.within_ms);
                    let mut fired = None;
                    if then.eval(ev, p) {
                        if let Some((t, id)) = self.firsts.get(&(i, key.clone())).copied() {
                            if ev.ts_ms - t <= within && id != ev.id {
                                self.firsts.remove(&(i, key.clone()));
                                fired = Some(vec![id, ev.id]);
                            }
                        }
                    }
                    if fired.is_none() && r.cond.eval(ev, p) {
                        self.firsts.insert((i, key), (ev.ts_ms, ev.id));
                    }
                    fired
                }
                (Some(w), None) => {
                    if !r.cond.eval(ev, p) {
                        continue;
                    }
                    let count = o.as_ref().and_then(|o| o.count).unwrap_or(w.count) as usize;
                    let within = o.as_ref().and_then(|o| o.within_ms).unwrap_or(w.within_ms);
                    let distinct = w
                        .distinct
                        .as_ref()
                        .map(|f| first_text(f, ev, p).unwrap_or_default());
                    let amount = w.sum.as_ref().map_or(0.0, |f| {
                        first_text(f, ev, p)
                            .and_then(|t| t.trim().parse::<f64>().ok())
                            .filter(|n| n.is_finite() && *n > 0.0)
                            .unwrap_or(0.0)
                    });
                    let st = self.windows.entry((i, key(w.per, ev))).or_default();
                    while st.hits.front().is_some_and(|h| ev.ts_ms - h.ts > within) {
                        st.pop();
                    }
                    st.push(Hit {
                        ts: ev.ts_ms,
                        id: ev.id,
                        distinct,
                        amount,
                    });
                    let reached = if w.sum.is_some() {
                        st.total >= count as f64
                    } else if w.distinct.is_some() {
                        st.distinct.len() >= count
                    } else {
                        st.hits.len() >= count
                    };
                    if reached {
                        st.distinct.clear();
                        st.total = 0.0;
                        let ids: Vec<i64> = st.hits.drain(..).map(|h| h.id).collect();
                        let skip = ids.len().saturating_sub(MAX_RECORD_IDS);
                        Some(ids[skip..].to_vec())
                    } else {
                        None
                    }
                }
            };
            if let Some(records) = fired {
                out.push(Alert {
                    rule: r.name.clone(),
                    priority: o.as_ref().and_then(|o| o.priority).unwrap_or(r.priority),
                    output: render(&r.output, ev, p),
                    tags: r.tags.clone(),
                    actions: o
                        .as_ref()
                        .and_then(|o| o.actions.clone())
                        .unwrap_or_else(|| r.actions.clone()),
                    sandbox: ev.sandbox.clone(),
                    team: ev.team.clone(),
                    ts_ms: ev.ts_ms,
                    records,
                    incident: r.incident.clone(),
                });
            }
        }
        if ev.kind == "lifecycle" && event.is_some_and(|e| END_EVENTS.contains(&e)) {
            self.procs.remove(&ev.sandbox);
        }
        if ev.kind == "process" && event == Some("end") {
            if let (Some(t), Some(pid)) = (
                self.procs.get_mut(&ev.sandbox),
                body.get("pid").and_then(|p| p.as_i64()),
            ) {
                t.ended(pid);
            }
        }
        out
    }

    /// Updates the sandbox's process table from `ev`; the process `ev` is about.
    fn track(&mut self, ev: &Event) -> Option<Arc<Proc>> {
        if ev.kind != "process" && ev.kind != "syscall" {
            return None;
        }
        if let Some((pid, exe, line)) = exec_of(ev) {
            let t = self.procs.entry(ev.sandbox.clone()).or_default();
            return Some(if ev.kind == "process" {
                t.started(pid, &exe, line)
            } else {
                t.exec(pid, caller_of(ev), &exe, line)
            });
        }
        // A syscall of a pid not seen exec'ing is known by its name only (`proc.name` reads
        // the record's `process` then).
        let pid = ev.body.get("pid").and_then(|p| p.as_i64())?;
        self.procs.get(&ev.sandbox)?.get(pid)
    }

    /// Drops window state with nothing left in its time.
    fn sweep(&mut self, now: i64) {
        let set = self.set.clone();
        self.windows.retain(|(i, _), st| {
            let within = set.rules[*i].window.as_ref().map_or(0, |w| w.within_ms);
            st.hits
                .back()
                .is_some_and(|h| now - h.ts <= within.max(3_600_000))
        });
        self.runs
            .retain(|(i, _), run| now - run.1 <= set.rules[*i].hold_ms.unwrap_or(0).max(3_600_000));
        self.firsts.retain(|(i, _), (t, _)| {
            let within = set.rules[*i].window.as_ref().map_or(0, |w| w.within_ms);
            now - *t <= within.max(3_600_000)
        });
    }

    /// Sandboxes with a process table (for tests and introspection).
    pub fn tracked_sandboxes(&self) -> usize {
        self.procs.len()
    }
}

fn key(per: Per, ev: &Event) -> String {
    match per {
        Per::Sandbox => ev.sandbox.clone(),
        Per::Team => format!("team:{}", ev.team.as_deref().unwrap_or("")),
    }
}

fn first_text(f: &Field, ev: &Event, p: Option<&Proc>) -> Option<String> {
    let mut out = None;
    with_values(f, ev, p, &mut |v| {
        out = Some(v.text().into_owned());
        true
    });
    out
}

fn render(pieces: &[Piece], ev: &Event, p: Option<&Proc>) -> String {
    let mut s = String::new();
    for piece in pieces {
        match piece {
            Piece::Text(t) => s.push_str(t),
            Piece::Field(f) => s.push_str(first_text(f, ev, p).as_deref().unwrap_or("<NA>")),
        }
    }
    s
}
