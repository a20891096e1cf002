//! Incidents: alerts of one incident (the rules' `incident`, by default the rule's name) on
//! one sandbox that come within [`GAP_MS`] of the previous one are one incident, so one
//! attack — a reverse shell seen by its command line, its `connect` and its `dup2`s — is one
//! alert with a count, not several.
//!
//! [`Incidents::admit`] is called for every alert in the order the engine raised them; it
//! says which incident the alert belongs to and whether it opened it.

use std::collections::HashMap;

use crate::engine::Alert;

/// Longest quiet time within one incident (ms).
pub const GAP_MS: i64 = 5 * 60 * 1000;
/// Most open incidents kept (the stalest go first beyond).
const MAX_OPEN: usize = 65536;

/// Where an alert goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    /// The incident's number (unique for the life of this [`Incidents`]).
    pub incident: u64,
    /// The alert opened the incident (false: it repeats an open one).
    pub opened: bool,
    /// Alerts in the incident so far, this one included.
    pub count: u64,
}

#[derive(Debug, Clone, Copy)]
struct Open {
    no: u64,
    first_ms: i64,
    last_ms: i64,
    count: u64,
}

/// The open incidents, by (sandbox, incident name).
#[derive(Debug)]
pub struct Incidents {
    open: HashMap<(String, String), Open>,
    next: u64,
    gap_ms: i64,
}

impl Default for Incidents {
    fn default() -> Self {
        Incidents::new(GAP_MS)
    }
}

impl Incidents {
    /// Incidents whose alerts are at most `gap_ms` apart.
    pub fn new(gap_ms: i64) -> Incidents {
        Incidents {
            open: HashMap::new(),
            next: 1,
            gap_ms,
        }
    }

    /// The incident `a` belongs to.
    pub fn admit(&mut self, a: &Alert) -> Admitted {
        let key = (a.sandbox.clone(), a.incident.clone());
        if let Some(o) = self.open.get_mut(&key) {
            if a.ts_ms - o.last_ms <= self.gap_ms && a.ts_ms >= o.first_ms - self.gap_ms {
                o.last_ms = o.last_ms.max(a.ts_ms);
                o.count += 1;
                return Admitted {
                    incident: o.no,
                    opened: false,
                    count: o.count,
                };
            }
        }
        if self.open.len() >= MAX_OPEN {
            let now = a.ts_ms;
            let gap = self.gap_ms;
            self.open.retain(|_, o| now - o.last_ms <= gap);
            if self.open.len() >= MAX_OPEN {
                self.open.clear();
            }
        }
        let no = self.next;
        self.next += 1;
        self.open.insert(
            key,
            Open {
                no,
                first_ms: a.ts_ms,
                last_ms: a.ts_ms,
                count: 1,
            },
        );
        Admitted {
            incident: no,
            opened: true,
            count: 1,
        }
    }

    /// Forgets the incidents of a sandbox that ended.
    pub fn ended(&mut self, sandbox: &str) {
        self.open.retain(|(s, _), _| s != sandbox);
    }

    /// Open incidents (for tests and introspection).
    pub fn len(&self) -> usize {
        self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ruleset::{Action, Priority};

    fn alert(sandbox: &str, rule: &str, incident: &str, ts: i64) -> Alert {
        Alert {
            rule: rule.into(),
            priority: Priority::Critical,
            output: String::new(),
            tags: vec![],
            actions: vec![Action::Alert],
            sandbox: sandbox.into(),
            team: None,
            ts_ms: ts,
            records: vec![ts],
            incident: incident.into(),
        }
    }

    #[test]
    fn related_alerts_close_in_time_are_one_incident() {
        let mut inc = Incidents::new(1000);
        let a = inc.admit(&alert("s", "reverse_shell_dev_tcp", "reverse_shell", 0));
        let b = inc.admit(&alert("s", "shell_connects_out", "reverse_shell", 10));
        let c = inc.admit(&alert(
            "s",
            "reverse_shell_stdio_socket",
            "reverse_shell",
            900,
        ));
        assert!(a.opened && !b.opened && !c.opened);
        assert_eq!((a.incident, b.incident, c.incident), (1, 1, 1));
        assert_eq!(c.count, 3);
        // Another incident name, another sandbox: their own.
        let d = inc.admit(&alert("s", "read_shadow", "credential_access", 20));
        let e = inc.admit(&alert("t", "reverse_shell_dev_tcp", "reverse_shell", 20));
        assert!(d.opened && e.opened);
        assert_eq!((d.incident, e.incident), (2, 3));
        // A gap longer than the window opens a new one.
        let f = inc.admit(&alert("s", "reverse_shell_dev_tcp", "reverse_shell", 2000));
        assert!(f.opened);
        assert_eq!((f.incident, f.count), (4, 1));
        assert_eq!(inc.len(), 3);
        inc.ended("s");
        assert_eq!(inc.len(), 1);
        assert!(inc.admit(&alert("s", "x", "reverse_shell", 2001)).opened);
    }
}
