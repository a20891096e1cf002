//! What a rules file compiles to: rules with their priority, actions, window and output,
//! team overrides, and load errors with line and column.

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::cond::Cond;
use crate::fields::Field;

/// How urgent an alert is (Falco's levels; `info` = `informational`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    Debug,
    Informational,
    Notice,
    Warning,
    Error,
    Critical,
    Alert,
    Emergency,
}

impl Priority {
    pub const ALL: [Priority; 8] = [
        Priority::Debug,
        Priority::Informational,
        Priority::Notice,
        Priority::Warning,
        Priority::Error,
        Priority::Critical,
        Priority::Alert,
        Priority::Emergency,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Debug => "debug",
            Priority::Informational => "informational",
            Priority::Notice => "notice",
            Priority::Warning => "warning",
            Priority::Error => "error",
            Priority::Critical => "critical",
            Priority::Alert => "alert",
            Priority::Emergency => "emergency",
        }
    }

    pub fn parse(s: &str) -> Option<Priority> {
        let s = s.to_ascii_lowercase();
        if s == "info" {
            return Some(Priority::Informational);
        }
        Priority::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What happens besides the alert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Only the alert (the default).
    Alert,
    Kill,
    /// Pause with memory kept (for forensics).
    Pause,
    /// The sandbox's egress becomes deny-all.
    DenyNetwork,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Alert => "alert",
            Action::Kill => "kill",
            Action::Pause => "pause",
            Action::DenyNetwork => "deny-network",
        }
    }

    pub fn parse(s: &str) -> Option<Action> {
        [
            Action::Alert,
            Action::Kill,
            Action::Pause,
            Action::DenyNetwork,
        ]
        .into_iter()
        .find(|a| a.as_str() == s)
    }
}

/// Who a windowed count or a sequence is kept for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Per {
    Sandbox,
    Team,
}

/// "`count` matching records within `within_ms`" (distinct values of `distinct` when set;
/// with `sum`, the total of that field's values reaching `count`).
#[derive(Debug, Clone)]
pub struct Window {
    pub count: u64,
    pub within_ms: i64,
    pub per: Per,
    pub distinct: Option<Field>,
    pub sum: Option<Field>,
}

/// A piece of a rule's `output`.
#[derive(Debug, Clone)]
pub enum Piece {
    Text(String),
    Field(Field),
}

#[derive(Debug, Clone)]
pub struct Rule {
    pub name: String,
    pub desc: String,
    pub output: Vec<Piece>,
    pub priority: Priority,
    pub tags: Vec<String>,
    pub actions: Vec<Action>,
    pub enabled: bool,
    pub cond: Cond,
    /// The second step of a sequence ("`cond` then `then` within the window's time").
    pub then: Option<Cond>,
    pub window: Option<Window>,
    /// `for`: the condition held on every record of its kind (per sandbox) for this long,
    /// with no gap between two matches longer than it.
    pub hold_ms: Option<i64>,
    /// The incident its alerts belong to (`incident`, default: the rule's name): alerts of
    /// one incident on one sandbox close together in time are one alert (see
    /// [`crate::incident`]).
    pub incident: String,
    /// Record kinds it can match (None: any).
    pub kinds: Option<HashSet<String>>,
    pub uses_proc: bool,
    pub line: usize,
}

/// A team's changes to one rule.
#[derive(Debug, Clone, Default)]
pub struct Override {
    pub enabled: Option<bool>,
    pub count: Option<u64>,
    pub within_ms: Option<i64>,
    pub actions: Option<Vec<Action>>,
    pub priority: Option<Priority>,
}

/// A compiled rules file.
#[derive(Debug, Clone, Default)]
pub struct RuleSet {
    pub rules: Vec<Rule>,
    /// (team, rule name) → changes.
    pub overrides: HashMap<(String, String), Override>,
    pub lists: usize,
    pub macros: usize,
}

/// One error in a rules file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    pub line: usize,
    pub col: usize,
    pub msg: String,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.line, self.col, self.msg)
    }
}

/// Every error of a rules file (at least one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadErrors(pub Vec<LoadError>);

impl fmt::Display for LoadErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for LoadErrors {}

/// A duration: `500ms`, `10s`, `5m`, `1h` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Option<i64> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1000)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60_000)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3_600_000)
    } else {
        (s, 1000)
    };
    let n: f64 = num.trim().parse().ok()?;
    (n > 0.0 && n.is_finite()).then_some((n * mult as f64) as i64)
}
