//! Events for the processes a sandbox's agent killed to keep the sandbox alive: the agent's
//! `/metrics` answer carries its recent kills (`kiln_kills`, see `kiln_agent::kills`), and the
//! metrics sampler turns each one it has not reported yet into an event — `oom` (the
//! sandbox's memory was exceeded), `pids-limit` (a command forked past its process cap) or
//! `host-limit` (the sandbox's host side neared its limits) — which the events API, webhooks
//! and the audit log then carry like any other. The same log carries the sudo requests the
//! agent's broker refused, which become `sudo-refused` events (the rules' `sudo_refused`).
//!
//! What "not reported yet" means: kills newer than the newest one this server reported for
//! the sandbox. The first time, the mark is the sandbox's start (so a fork, or a sandbox
//! created from a memory snapshot, does not report its source's kills) or, for a sandbox a
//! restarted server adopted, the time of its newest kill event on record.
//!
//! A sandbox that ends (killed, timed out) is asked once more before it stops
//! ([`Manager::report_last_kills`]), so a kill inside it between two samples is on record too.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use kiln_proto::envd::KillRecord;

use super::Manager;
use crate::store::{EventQuery, SandboxRecord, SandboxState};

/// How long an ending sandbox's agent gets to hand over its last kills: it answers in a few
/// milliseconds, and a starved or hung one does not hold up the stop for longer than this.
const LAST_KILLS_WAIT: Duration = Duration::from_millis(300);

/// The event kinds kills become, by the agent's reason.
pub const KILL_EVENT_KINDS: &[&str] = &["oom", "pids-limit", "host-limit", "sudo-refused"];

/// The event kind of a kill of the agent's reason `kind` (`oom`, `pids`, `host`).
pub fn event_kind(kind: &str) -> &'static str {
    match kind {
        "oom" => "oom",
        "pids" => "pids-limit",
        "sudo" => "sudo-refused",
        _ => "host-limit",
    }
}

/// Per sandbox: the time of the newest kill reported.
#[derive(Default)]
pub struct KillMarks {
    marks: Mutex<HashMap<String, i64>>,
}

impl KillMarks {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, i64>> {
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets the sandboxes not in `live`.
    pub fn retain(&self, live: &std::collections::HashSet<&str>) {
        self.lock().retain(|id, _| live.contains(id.as_str()));
    }
}

/// The kills of `kills` after `mark`, and the new mark.
pub fn unreported(kills: &[KillRecord], mark: i64) -> (Vec<&KillRecord>, i64) {
    let new: Vec<&KillRecord> = kills.iter().filter(|k| k.ts_ms > mark).collect();
    let next = new.iter().map(|k| k.ts_ms).max().unwrap_or(mark).max(mark);
    (new, next)
}

impl Manager {
    /// Where reporting starts for `r` when this server has no mark for it yet.
    async fn first_kill_mark(&self, r: &SandboxRecord) -> i64 {
        let q = EventQuery {
            sandbox_id: Some(r.id.clone()),
            kinds: KILL_EVENT_KINDS.iter().map(|k| k.to_string()).collect(),
            limit: 10_000,
            ..Default::default()
        };
        let newest = match self.store.events_page(&q).await {
            Ok(page) => page.last().map(|e| e.event.ts_ms),
            Err(e) => {
                tracing::warn!(sandbox = %r.id, error = %e, "reading the sandbox's kill events");
                None
            }
        };
        newest.unwrap_or(0).max(r.started_at_ms)
    }

    /// Before sandbox `id` stops: records the kills its agent made since the last sample (an
    /// OOM kill a moment before a `DELETE` or the timeout) when it runs, and forgets its mark.
    pub(super) async fn report_last_kills(&self, id: &str) {
        let Some(r) = self.registry.get(id) else {
            return;
        };
        if r.state == SandboxState::Running && self.idle.standby_since(id).is_none() {
            let agent = self.agent(&r.id, r.envd_token.clone());
            if let Ok(Ok(m)) = tokio::time::timeout(LAST_KILLS_WAIT, agent.metrics()).await {
                self.report_kills(&r, &m.kiln_kills).await;
            }
        }
        self.kill_marks.lock().remove(id);
    }

    /// Records an event for each kill of `kills` (the agent's log) not reported before.
    pub(super) async fn report_kills(&self, r: &SandboxRecord, kills: &[KillRecord]) {
        if kills.is_empty() {
            return;
        }
        let known = self.kill_marks.lock().get(&r.id).copied();
        let mark = match known {
            Some(m) => m,
            None => self.first_kill_mark(r).await,
        };
        let (new, next) = unreported(kills, mark);
        self.kill_marks.lock().insert(r.id.clone(), next);
        for k in new {
            self.event(&r.id, event_kind(&k.kind), k.detail.clone())
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kill(ts_ms: i64, kind: &str) -> KillRecord {
        KillRecord {
            ts_ms,
            kind: kind.into(),
            detail: format!("{kind} at {ts_ms}"),
        }
    }

    #[test]
    fn only_kills_after_the_mark_are_reported_once() {
        let log = [kill(10, "oom"), kill(20, "pids"), kill(30, "host")];
        let (new, mark) = unreported(&log, 15);
        assert_eq!(new.len(), 2);
        assert_eq!((new[0].ts_ms, new[1].ts_ms, mark), (20, 30, 30));
        let (again, mark2) = unreported(&log, mark);
        assert!(again.is_empty());
        assert_eq!(mark2, 30);
        // A mark is never moved back by an older log (a restored agent).
        let (none, mark3) = unreported(&log[..1], 30);
        assert!(none.is_empty());
        assert_eq!(mark3, 30);
    }

    #[test]
    fn reasons_map_to_event_kinds() {
        assert_eq!(event_kind("oom"), "oom");
        assert_eq!(event_kind("pids"), "pids-limit");
        assert_eq!(event_kind("host"), "host-limit");
        assert_eq!(event_kind("sudo"), "sudo-refused");
        for k in ["oom", "pids", "host", "sudo"] {
            assert!(KILL_EVENT_KINDS.contains(&event_kind(k)));
        }
    }
}
