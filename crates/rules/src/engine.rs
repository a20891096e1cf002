//! The engine: evaluates records in order against a [`RuleSet`], keeping per-sandbox process
//! tables (ancestry), windowed counts and sequence state, and returns the alerts they raise.
//!
//! - A plain rule fires on each matching record.
//! - A window rule (`count`, `within`) fires when `count` matching records (or distinct values
//!   of `distinct`) fall within `within` for one sandbox (`per: sandbox`) or one team
//!   (`per: team`); its count then starts over.
//! - A sequence rule (`condition` then `then`, `within`) fires on a record matching `then`
//!   that comes within `within` after one matching `condition` (same sandbox or team).
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
    /// The ids (audit cursors) of the records that triggered it, oldest first.
    pub records: Vec<i64>,
}

#[derive(Debug, Default)]
struct WinState {
    /// (time, record id, distinct value).
    hits: VecDeque<(i64, i64, Option<String>)>,
    /// How many hits in the window carry each distinct value.
    distinct: HashMap<String, u32>,
}

impl WinState {
    fn pop(&mut self) {
        if let Some((_, _, Some(v))) = self.hits.pop_front() {
            if let Some(n) = self.distinct.get_mut(&v) {
                *n -= 1;
                if *n == 0 {
                    self.distinct.remove(&v);
                }
            }
        }
    }

    fn push(&mut self, hit: (i64, i64, Option<String>)) {
        if let Some(v) = &hit.2 {
            *self.distinct.entry(v.clone()).or_default() += 1;
        }
        self.hits.push_back(hit);
    }
}

pub struct Engine {
    set: Arc<RuleSet>,
    /// Rules per record kind (rules that can match any kind included in every list).
    by_kind: Arc<HashMap<String, Vec<usize>>>,
    any_kind: Arc<Vec<usize>>,
    procs: HashMap<String, Table>,
    windows: HashMap<(usize, String), WinState>,
    /// Sequences: the first step's newest match (time, record id).
    firsts: HashMap<(usize, String), (i64, i64)>,
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
                    let value = w
                        .distinct
                        .as_ref()
                        .map(|f| first_text(f, ev, p).unwrap_or_default());
                    let st = self.windows.entry((i, key(w.per, ev))).or_default();
                    while st.hits.front().is_some_and(|h| ev.ts_ms - h.0 > within) {
                        st.pop();
                    }
                    st.push((ev.ts_ms, ev.id, value));
                    let n = if w.distinct.is_some() {
                        st.distinct.len()
                    } else {
                        st.hits.len()
                    };
                    if n >= count {
                        st.distinct.clear();
                        let ids: Vec<i64> = st.hits.drain(..).map(|h| h.1).collect();
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
                .is_some_and(|h| now - h.0 <= within.max(3_600_000))
        });
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
