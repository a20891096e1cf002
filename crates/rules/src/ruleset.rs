//! A rules file: YAML entries (`rule`, `macro`, `list`, `override`) read into a compiled
//! [`RuleSet`]; every error names the line and column it is at. See docs/rules.md for the
//! format.

use std::collections::HashMap;

pub use crate::model::*;

use crate::cond::{Cond, Scope};
use crate::fields::Field;
use crate::parse::{parse, Expr};
use crate::yaml::{self, locate, Node, Pos};

struct Loader<'a> {
    src: &'a str,
    errors: Vec<LoadError>,
}

const RULE_KEYS: &[&str] = &[
    "rule",
    "desc",
    "condition",
    "output",
    "priority",
    "tags",
    "action",
    "enabled",
    "count",
    "within",
    "per",
    "distinct",
    "then",
    "sum",
    "for",
    "incident",
    "source",
];
const OVERRIDE_KEYS: &[&str] = &[
    "override", "team", "enabled", "count", "within", "action", "priority",
];

impl Loader<'_> {
    fn err(&mut self, at: Pos, msg: impl Into<String>) {
        self.errors.push(LoadError {
            line: at.line,
            col: at.col,
            msg: msg.into(),
        });
    }

    fn text<'n>(&mut self, n: &'n Node, what: &str) -> Option<&'n str> {
        match n {
            Node::Scalar { text, .. } => Some(text),
            other => {
                self.err(
                    other.at(),
                    format!("{what} must be text, found {}", other.describe()),
                );
                None
            }
        }
    }

    fn strings(&mut self, n: &Node, what: &str) -> Option<Vec<String>> {
        match n {
            Node::Seq(items, _) => items
                .iter()
                .map(|i| self.text(i, what).map(str::to_string))
                .collect(),
            Node::Scalar { text, .. } if !n.is_null() => Some(vec![text.clone()]),
            Node::Scalar { .. } => Some(Vec::new()),
            other => {
                self.err(
                    other.at(),
                    format!("{what} must be a list, found {}", other.describe()),
                );
                None
            }
        }
    }

    fn condition(&mut self, n: &Node) -> Option<(Expr, Pos, String)> {
        let text = self.text(n, "condition")?.to_string();
        match parse(&text) {
            Ok(e) => Some((e, n.at(), text)),
            Err(e) => {
                let at = locate(self.src, n.at(), &text, e.offset);
                self.err(at, e.msg);
                None
            }
        }
    }

    fn bool(&mut self, n: &Node, what: &str) -> Option<bool> {
        match n.str() {
            Some("true") => Some(true),
            Some("false") => Some(false),
            _ => {
                self.err(n.at(), format!("{what} must be true or false"));
                None
            }
        }
    }

    fn count(&mut self, n: &Node) -> Option<u64> {
        match n
            .str()
            .and_then(|s| s.parse::<u64>().ok())
            .filter(|c| *c >= 1)
        {
            Some(c) => Some(c),
            None => {
                self.err(n.at(), "count must be a whole number of 1 or more");
                None
            }
        }
    }

    fn within(&mut self, n: &Node) -> Option<i64> {
        self.duration(n, "within")
    }

    fn duration(&mut self, n: &Node, key: &str) -> Option<i64> {
        let d = n.str().and_then(parse_duration);
        if d.is_none() {
            let msg = format!("{key} must be a duration such as 500ms, 10s, 5m or 1h");
            self.err(n.at(), msg);
        }
        d
    }

    fn field(&mut self, n: &Node, key: &str) -> Option<Field> {
        Field::parse(n.str().unwrap_or(""))
            .map_err(|m| self.err(n.at(), format!("{key}: {m}")))
            .ok()
    }

    fn actions(&mut self, n: &Node) -> Option<Vec<Action>> {
        let names = self.strings(n, "action")?;
        let mut out = Vec::new();
        for a in names {
            match Action::parse(&a) {
                Some(x) => out.push(x),
                None => {
                    self.err(
                        n.at(),
                        format!("unknown action {a:?} (alert, kill, pause, deny-network)"),
                    );
                    return None;
                }
            }
        }
        Some(out)
    }

    fn priority(&mut self, n: &Node) -> Option<Priority> {
        let s = self.text(n, "priority")?;
        match Priority::parse(s) {
            Some(p) => Some(p),
            None => {
                self.err(
                    n.at(),
                    format!("unknown priority {s:?} (emergency, alert, critical, error, warning, notice, informational, debug)"),
                );
                None
            }
        }
    }

    fn output(&mut self, n: &Node) -> Vec<Piece> {
        let Some(text) = self.text(n, "output") else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut lit = String::new();
        let mut rest = text;
        while let Some(i) = rest.find('%') {
            lit.push_str(&rest[..i]);
            let after = &rest[i + 1..];
            let end = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || "._[]".contains(c)))
                .unwrap_or(after.len());
            let name = after[..end].trim_end_matches('.');
            if name.is_empty() {
                lit.push('%');
                rest = after;
                continue;
            }
            match Field::parse(name) {
                Ok(f) => {
                    if !lit.is_empty() {
                        out.push(Piece::Text(std::mem::take(&mut lit)));
                    }
                    out.push(Piece::Field(f));
                }
                Err(m) => {
                    let at = locate(self.src, n.at(), text, text.len() - rest.len() + i);
                    self.err(at, format!("output: {m}"));
                }
            }
            rest = &after[name.len()..];
        }
        lit.push_str(rest);
        if !lit.is_empty() {
            out.push(Piece::Text(lit));
        }
        out
    }
}

fn pairs(n: &Node) -> Option<&[(Node, Node)]> {
    match n {
        Node::Map(p, _) => Some(p),
        _ => None,
    }
}

fn get<'n>(p: &'n [(Node, Node)], k: &str) -> Option<&'n Node> {
    p.iter()
        .find(|(key, _)| key.str() == Some(k))
        .map(|(_, v)| v)
}

/// A parsed but not yet compiled rule entry.
struct Draft<'n> {
    name: String,
    map: &'n [(Node, Node)],
    at: Pos,
    cond: (Expr, Pos, String),
    then: Option<(Expr, Pos, String)>,
}

impl RuleSet {
    /// Reads a rules file's text.
    pub fn load(src: &str) -> Result<RuleSet, LoadErrors> {
        let root = yaml::load(src).map_err(|e| {
            LoadErrors(vec![LoadError {
                line: e.at.line,
                col: e.at.col,
                msg: format!("YAML: {}", e.msg),
            }])
        })?;
        let mut l = Loader {
            src,
            errors: Vec::new(),
        };
        let entries: &[Node] = match &root {
            Node::Seq(items, _) => items,
            other => {
                l.err(
                    other.at(),
                    "a rules file is a YAML list of rule, macro, list and override entries",
                );
                return Err(LoadErrors(l.errors));
            }
        };
        let mut lists: HashMap<String, Vec<String>> = HashMap::new();
        let mut macros: HashMap<String, Expr> = HashMap::new();
        let mut macro_at: HashMap<String, (Pos, String)> = HashMap::new();
        let mut drafts: Vec<Draft<'_>> = Vec::new();
        let mut overrides: Vec<(&[(Node, Node)], Pos)> = Vec::new();
        for e in entries {
            let Some(p) = pairs(e) else {
                l.err(
                    e.at(),
                    format!("each entry must be a mapping, found {}", e.describe()),
                );
                continue;
            };
            if let Some(n) = get(p, "list") {
                let Some(name) = l.text(n, "list").map(str::to_string) else {
                    continue;
                };
                let items = match get(p, "items") {
                    Some(i) => l.strings(i, "items").unwrap_or_default(),
                    None => {
                        l.err(e.at(), format!("list {name:?} has no items"));
                        continue;
                    }
                };
                // A list may name other lists.
                let items = items
                    .into_iter()
                    .flat_map(|i| lists.get(&i).cloned().unwrap_or_else(|| vec![i]))
                    .collect();
                lists.insert(name, items);
            } else if let Some(n) = get(p, "macro") {
                let Some(name) = l.text(n, "macro").map(str::to_string) else {
                    continue;
                };
                let Some(c) = get(p, "condition") else {
                    l.err(e.at(), format!("macro {name:?} has no condition"));
                    continue;
                };
                if let Some((expr, at, text)) = l.condition(c) {
                    macros.insert(name.clone(), expr);
                    macro_at.insert(name, (at, text));
                }
            } else if let Some(n) = get(p, "rule") {
                let Some(name) = l.text(n, "rule").map(str::to_string) else {
                    continue;
                };
                for (k, _) in p {
                    if let Some(ks) = k.str().filter(|ks| !RULE_KEYS.contains(ks)) {
                        l.err(k.at(), format!("rule {name:?}: unknown key {ks:?}"));
                    }
                }
                if drafts.iter().any(|d| d.name == name) {
                    l.err(n.at(), format!("rule {name:?} is defined twice"));
                    continue;
                }
                let Some(c) = get(p, "condition") else {
                    l.err(e.at(), format!("rule {name:?} has no condition"));
                    continue;
                };
                let Some(cond) = l.condition(c) else { continue };
                let then = match get(p, "then") {
                    Some(t) => match l.condition(t) {
                        Some(x) => Some(x),
                        None => continue,
                    },
                    None => None,
                };
                drafts.push(Draft {
                    name,
                    map: p,
                    at: e.at(),
                    cond,
                    then,
                });
            } else if get(p, "override").is_some() {
                for (k, _) in p {
                    if let Some(ks) = k.str().filter(|ks| !OVERRIDE_KEYS.contains(ks)) {
                        l.err(k.at(), format!("override: unknown key {ks:?}"));
                    }
                }
                overrides.push((p, e.at()));
            } else if get(p, "required_engine_version").is_none() {
                l.err(
                    e.at(),
                    "an entry needs one of the keys rule, macro, list or override",
                );
            }
        }
        // Macros are compiled in every rule that uses them; check each once on its own too,
        // so an unused macro's error is still reported where it is.
        for (name, m) in &macros {
            let scope = Scope {
                lists: &lists,
                macros: &macros,
            };
            if let Err(e) = scope.compile(m) {
                if e.in_macro.is_none() {
                    let (at, text) = &macro_at[name];
                    let pos = locate(src, *at, text, e.offset);
                    l.err(pos, format!("macro {name:?}: {}", e.msg));
                }
            }
        }
        let mut set = RuleSet {
            lists: lists.len(),
            macros: macros.len(),
            ..Default::default()
        };
        for d in drafts {
            if let Some(r) = compile_rule(&mut l, &d, &lists, &macros) {
                set.rules.push(r);
            }
        }
        for (p, at) in overrides {
            let rule = get(p, "override")
                .and_then(|n| n.str())
                .unwrap_or("")
                .to_string();
            if !set.rules.iter().any(|r| r.name == rule) {
                l.err(at, format!("override of unknown rule {rule:?}"));
                continue;
            }
            let team = match get(p, "team").and_then(|n| n.str()) {
                Some(t) => t.to_string(),
                None => {
                    l.err(
                        at,
                        format!("override of {rule:?} names no team (team: NAME)"),
                    );
                    continue;
                }
            };
            let o = Override {
                enabled: get(p, "enabled").and_then(|n| l.bool(n, "enabled")),
                count: get(p, "count").and_then(|n| l.count(n)),
                within_ms: get(p, "within").and_then(|n| l.within(n)),
                actions: get(p, "action").and_then(|n| l.actions(n)),
                priority: get(p, "priority").and_then(|n| l.priority(n)),
            };
            let r = set
                .rules
                .iter()
                .find(|r| r.name == rule)
                .expect("checked above");
            let bad = (o.count.is_some() && r.window.is_none())
                || (o.within_ms.is_some() && r.window.is_none() && r.hold_ms.is_none());
            if bad {
                l.err(
                    at,
                    format!(
                        "override of {rule:?}: count applies only to rules with a window, within also to for"
                    ),
                );
                continue;
            }
            set.overrides.insert((team, rule), o);
        }
        if l.errors.is_empty() {
            Ok(set)
        } else {
            l.errors.sort_by_key(|e| (e.line, e.col));
            Err(LoadErrors(l.errors))
        }
    }

    /// Reads a rules file.
    pub fn load_file(path: &std::path::Path) -> Result<RuleSet, LoadErrors> {
        let src = std::fs::read_to_string(path).map_err(|e| {
            LoadErrors(vec![LoadError {
                line: 0,
                col: 0,
                msg: format!("reading {}: {e}", path.display()),
            }])
        })?;
        RuleSet::load(&src)
    }

    /// The built-in rule pack.
    pub fn default_pack() -> RuleSet {
        RuleSet::load(DEFAULT_PACK).expect("the built-in rule pack loads (tested)")
    }
}

/// The text of the built-in rule pack (`crates/rules/rules/default.yaml`).
pub const DEFAULT_PACK: &str = include_str!("../rules/default.yaml");

fn compile_rule(
    l: &mut Loader<'_>,
    d: &Draft<'_>,
    lists: &HashMap<String, Vec<String>>,
    macros: &HashMap<String, Expr>,
) -> Option<Rule> {
    let scope = Scope { lists, macros };
    let compile = |l: &mut Loader<'_>, (e, at, text): &(Expr, Pos, String)| match scope.compile(e) {
        Ok(c) => Some(c),
        Err(err) => {
            let pos = locate(l.src, *at, text, err.offset);
            l.err(pos, format!("rule {:?}: {}", d.name, err.msg));
            None
        }
    };
    let cond = compile(l, &d.cond);
    let then = match &d.then {
        Some(t) => Some(compile(l, t)?),
        None => None,
    };
    let cond = cond?;
    let p = d.map;
    let need = |l: &mut Loader<'_>, k: &str| {
        let n = get(p, k);
        if n.is_none() {
            l.err(d.at, format!("rule {:?} has no {k}", d.name));
        }
        n
    };
    let desc = need(l, "desc")
        .and_then(|n| l.text(n, "desc"))
        .unwrap_or("")
        .to_string();
    let output = need(l, "output").map(|n| l.output(n)).unwrap_or_default();
    let priority = need(l, "priority").and_then(|n| l.priority(n));
    let tags = get(p, "tags")
        .and_then(|n| l.strings(n, "tags"))
        .unwrap_or_default();
    let actions = match get(p, "action") {
        Some(n) => l.actions(n)?,
        None => vec![Action::Alert],
    };
    let enabled = match get(p, "enabled") {
        Some(n) => l.bool(n, "enabled")?,
        None => true,
    };
    let count = get(p, "count").map(|n| l.count(n));
    let within = get(p, "within").map(|n| l.within(n));
    let per = match get(p, "per").map(|n| (n, n.str())) {
        None => Per::Sandbox,
        Some((_, Some("sandbox"))) => Per::Sandbox,
        Some((_, Some("team"))) => Per::Team,
        Some((n, _)) => {
            l.err(n.at(), "per must be sandbox or team");
            return None;
        }
    };
    let distinct = match get(p, "distinct") {
        Some(n) => Some(l.field(n, "distinct")?),
        None => None,
    };
    let sum = match get(p, "sum") {
        Some(n) => Some(l.field(n, "sum")?),
        None => None,
    };
    let hold_ms = match get(p, "for") {
        Some(n) => Some(l.duration(n, "for")?),
        None => None,
    };
    let incident = match get(p, "incident") {
        Some(n) => l.text(n, "incident")?.to_string(),
        None => d.name.clone(),
    };
    let conflict = if hold_ms.is_some() && (count.is_some() || within.is_some() || then.is_some()) {
        Some("for takes no count, within or then")
    } else if sum.is_some() && (distinct.is_some() || count.is_none()) {
        Some("sum needs count and within, and takes no distinct")
    } else {
        None
    };
    if let Some(msg) = conflict {
        l.err(d.at, format!("rule {:?}: {msg}", d.name));
        return None;
    }
    let window = match (count, within, then.is_some()) {
        (None, None, false) if distinct.is_none() => None,
        (Some(c), Some(w), false) => Some(Window {
            count: c?,
            within_ms: w?,
            per,
            distinct,
            sum,
        }),
        (None, Some(w), true) => Some(Window {
            count: 2,
            within_ms: w?,
            per,
            distinct: None,
            sum: None,
        }),
        (_, None, true) => {
            l.err(
                d.at,
                format!("rule {:?}: a sequence (then) needs within", d.name),
            );
            return None;
        }
        (Some(_), _, true) => {
            l.err(
                d.at,
                format!("rule {:?}: a sequence (then) takes no count", d.name),
            );
            return None;
        }
        _ => {
            l.err(
                d.at,
                format!("rule {:?}: a window needs both count and within", d.name),
            );
            return None;
        }
    };
    let mut kinds = cond.kinds();
    if let (Some(k), Some(t)) = (&kinds, &then) {
        kinds = t.kinds().map(|tk| k.union(&tk).cloned().collect());
    }
    let uses_proc = cond.uses_proc() || then.as_ref().is_some_and(Cond::uses_proc);
    Some(Rule {
        name: d.name.clone(),
        desc,
        output,
        priority: priority?,
        tags,
        actions,
        enabled,
        cond,
        then,
        window,
        hold_ms,
        incident,
        kinds,
        uses_proc,
        line: d.at.line,
    })
}
