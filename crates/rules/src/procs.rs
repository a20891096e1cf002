//! The per-sandbox process table the engine keeps from exec records, for ancestry fields
//! (`proc.pname`, `proc.aname[N]` …).
//!
//! kiln's records do not carry a parent pid, so the chain is built from what they do say:
//! - a `process` start record (the agent started it) is a child of the agent, named
//!   `kiln-agent`;
//! - a `syscall` `execve` record of pid P names the calling image (`process`: the thread
//!   group's name before the exec). If P is in the table, its current image becomes the
//!   parent of the new one (`bash -c 'exec nc …'` reads nc ← bash ← kiln-agent); otherwise
//!   the parent is an entry with the calling image's name (a forked `bash` that execs `nc`
//!   reads nc ← bash);
//! - a `process` end record removes the pid.
//!
//! Each entry is immutable and shared (`Arc`), so an exec never rewrites what an older
//! entry's chain said.

use std::collections::HashMap;
use std::sync::Arc;

/// One process image.
#[derive(Debug)]
pub struct Proc {
    pub pid: Option<i64>,
    pub name: String,
    pub cmdline: String,
    pub parent: Option<Arc<Proc>>,
}

impl Proc {
    /// The `n`-th ancestor (1 = parent).
    pub fn ancestor(&self, n: usize) -> Option<&Proc> {
        let mut p = self.parent.as_deref()?;
        for _ in 1..n {
            p = p.parent.as_deref()?;
        }
        Some(p)
    }

    /// Every ancestor, nearest first (at most `MAX_DEPTH`).
    pub fn ancestors(&self) -> impl Iterator<Item = &Proc> {
        let mut cur = self.parent.as_deref();
        let mut depth = 0;
        std::iter::from_fn(move || {
            let p = cur?;
            depth += 1;
            if depth > MAX_DEPTH {
                return None;
            }
            cur = p.parent.as_deref();
            Some(p)
        })
    }
}

/// Longest chain kept or walked.
pub const MAX_DEPTH: usize = 16;
/// Most processes kept per sandbox (the oldest entries go first).
pub const MAX_PROCS: usize = 4096;

/// The agent: parent of every process it starts.
pub const AGENT: &str = "kiln-agent";

/// The last path component of `path`.
pub fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

fn depth(p: &Option<Arc<Proc>>) -> usize {
    p.as_deref().map_or(0, |p| 1 + p.ancestors().count())
}

/// One sandbox's processes by pid.
#[derive(Debug, Default)]
pub struct Table {
    by_pid: HashMap<i64, Arc<Proc>>,
    order: std::collections::VecDeque<i64>,
    agent: Option<Arc<Proc>>,
}

impl Table {
    pub fn get(&self, pid: i64) -> Option<Arc<Proc>> {
        self.by_pid.get(&pid).cloned()
    }

    fn agent(&mut self) -> Arc<Proc> {
        self.agent
            .get_or_insert_with(|| {
                Arc::new(Proc {
                    pid: Some(1),
                    name: AGENT.into(),
                    cmdline: AGENT.into(),
                    parent: None,
                })
            })
            .clone()
    }

    fn insert(&mut self, pid: Option<i64>, p: Arc<Proc>) -> Arc<Proc> {
        if let Some(pid) = pid {
            if self.by_pid.insert(pid, p.clone()).is_none() {
                self.order.push_back(pid);
            }
            while self.by_pid.len() > MAX_PROCS {
                match self.order.pop_front() {
                    Some(old) => {
                        self.by_pid.remove(&old);
                    }
                    None => break,
                }
            }
        }
        p
    }

    /// A process the agent started.
    pub fn started(&mut self, pid: Option<i64>, exe: &str, cmdline: String) -> Arc<Proc> {
        let parent = Some(self.agent());
        let p = Arc::new(Proc {
            pid,
            name: basename(exe).to_string(),
            cmdline,
            parent,
        });
        self.insert(pid, p)
    }

    /// Pid `pid`, whose image was named `caller`, exec'd `exe` with `cmdline`.
    pub fn exec(
        &mut self,
        pid: Option<i64>,
        caller: &str,
        exe: &str,
        cmdline: String,
    ) -> Arc<Proc> {
        let known = pid.and_then(|p| self.get(p));
        let mut parent = match known {
            Some(k) => Some(k),
            None if !caller.is_empty() => Some(Arc::new(Proc {
                pid: None,
                name: caller.to_string(),
                cmdline: caller.to_string(),
                parent: None,
            })),
            None => None,
        };
        if depth(&parent) >= MAX_DEPTH {
            // Keep chains bounded: a loop of execs in one pid starts over below its caller.
            parent = parent.and_then(|p| p.parent.clone());
        }
        let p = Arc::new(Proc {
            pid,
            name: basename(exe).to_string(),
            cmdline,
            parent,
        });
        self.insert(pid, p)
    }

    pub fn ended(&mut self, pid: i64) {
        self.by_pid.remove(&pid);
    }

    pub fn len(&self) -> usize {
        self.by_pid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_pid.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_chains() {
        let mut t = Table::default();
        t.started(Some(7), "/bin/bash", "/bin/bash -l -c x".into());
        let nc = t.exec(Some(7), "bash", "/usr/bin/nc", "nc -e /bin/sh h 1".into());
        assert_eq!(nc.name, "nc");
        assert_eq!(nc.ancestor(1).unwrap().name, "bash");
        assert_eq!(nc.ancestor(2).unwrap().name, AGENT);
        assert!(nc.ancestor(3).is_none());
        let child = t.exec(Some(9), "python3", "/bin/sh", "sh -c id".into());
        assert_eq!(child.ancestor(1).unwrap().name, "python3");
        let names: Vec<_> = nc.ancestors().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["bash", AGENT]);
        t.ended(7);
        assert!(t.get(7).is_none());
    }

    #[test]
    fn bounded() {
        let mut t = Table::default();
        for i in 0..50 {
            t.exec(Some(3), "sh", &format!("/bin/x{i}"), String::new());
        }
        assert!(t.get(3).unwrap().ancestors().count() <= MAX_DEPTH);
        for pid in 0..(MAX_PROCS as i64 + 10) {
            t.exec(Some(pid + 100), "sh", "/bin/y", String::new());
        }
        assert_eq!(t.len(), MAX_PROCS);
    }
}
