//! Sandboxes on etcd, and the revision-checked state change two replicas can
//! race on ([`EtcdStore::transition`]).

use etcd_client::{KeyValue, TxnOp};
use kiln_server::store::{now_ms, Ingress, PauseMode, SandboxRecord, SandboxState};

use crate::docs::{json, parse, SandboxDoc, TemplateDoc};
use crate::error::{ClusterError, Result};
use crate::store::{EtcdStore, Step};

/// The outcome of a revision-checked state change.
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// This caller made the change; the sandbox as it now is.
    Done(SandboxRecord),
    /// The sandbox was not in one of the expected states (another replica changed it first);
    /// the sandbox as it is.
    Lost(SandboxRecord),
    /// No such sandbox.
    Missing,
}

fn sandbox_of(kv: &KeyValue) -> Result<SandboxRecord> {
    Ok(parse::<SandboxDoc>(kv.key(), kv.value())?.into())
}

impl EtcdStore {
    /// The writes that store `new` (replacing `old`) and keep its expiry key in step: the key
    /// exists exactly while the sandbox is running.
    fn sandbox_ops(&self, old: Option<&SandboxRecord>, new: &SandboxRecord) -> Vec<TxnOp> {
        let k = self.keys();
        let expiry = |s: &SandboxRecord| {
            (s.state == SandboxState::Running).then(|| k.expiry(s.end_at_ms, &s.id))
        };
        let (was, is) = (old.and_then(expiry), expiry(new));
        let mut ops = vec![TxnOp::put(
            k.sandbox(&new.id),
            json(&SandboxDoc::from(new)),
            None,
        )];
        if was != is {
            if let Some(was) = was {
                ops.push(TxnOp::delete(was, None));
            }
            if let Some(is) = is {
                ops.push(TxnOp::put(is, Vec::new(), None));
            }
        }
        ops
    }

    pub(crate) async fn insert_sandbox_doc(&self, s: &SandboxRecord) -> Result<()> {
        let key = self.keys().sandbox(&s.id);
        if !self.create(&[key], self.sandbox_ops(None, s)).await? {
            return Err(ClusterError::Exists {
                what: "sandbox",
                id: s.id.clone(),
            });
        }
        Ok(())
    }

    pub(crate) async fn get_sandbox_doc(&self, id: &str) -> Result<Option<SandboxRecord>> {
        self.get_one(&self.keys().sandbox(id))
            .await?
            .as_ref()
            .map(sandbox_of)
            .transpose()
    }

    pub(crate) async fn list_sandbox_docs(
        &self,
        states: &[SandboxState],
    ) -> Result<Vec<SandboxRecord>> {
        let mut out = Vec::new();
        for kv in self.get_prefix(&self.keys().dir("sandboxes"), 0).await? {
            let s = sandbox_of(&kv)?;
            if states.is_empty() || states.contains(&s.state) {
                out.push(s);
            }
        }
        out.sort_by(|a, b| (a.started_at_ms, &a.id).cmp(&(b.started_at_ms, &b.id)));
        Ok(out)
    }

    /// Changes one sandbox with `f` in a revision-checked write (a missing sandbox is left
    /// alone, as an SQL `UPDATE` that matches no row).
    pub(crate) async fn update_sandbox(
        &self,
        id: &str,
        f: impl Fn(&mut SandboxRecord),
    ) -> Result<()> {
        let key = self.keys().sandbox(id);
        self.read_modify_write(std::slice::from_ref(&key), |seen| {
            let Some(kv) = &seen[0] else {
                return Ok(Step::Done(()));
            };
            let old = sandbox_of(kv)?;
            let mut new = old.clone();
            f(&mut new);
            Ok(Step::Write(self.sandbox_ops(Some(&old), &new), ()))
        })
        .await
    }

    pub(crate) async fn set_state_doc(
        &self,
        id: &str,
        state: SandboxState,
        reason: Option<&str>,
    ) -> Result<()> {
        self.update_sandbox(id, |s| apply_state(s, state, reason))
            .await
    }

    pub(crate) async fn set_paused_doc(&self, id: &str, mode: PauseMode) -> Result<()> {
        self.update_sandbox(id, |s| {
            s.state = SandboxState::Paused;
            s.pause_mode = Some(mode);
        })
        .await
    }

    pub(crate) async fn set_end_at_doc(&self, id: &str, end_at_ms: i64) -> Result<()> {
        self.update_sandbox(id, |s| s.end_at_ms = end_at_ms).await
    }

    pub(crate) async fn set_ingress_doc(&self, id: &str, ingress: &Ingress) -> Result<()> {
        self.update_sandbox(id, |s| s.ingress = ingress.clone())
            .await
    }

    /// The sandbox becomes running until `end_at_ms` and its template counts one more spawn,
    /// in one txn checked against both keys.
    pub(crate) async fn set_running_doc(
        &self,
        id: &str,
        end_at_ms: i64,
        template: &str,
    ) -> Result<()> {
        let keys = [self.keys().sandbox(id), self.keys().template(template)];
        self.read_modify_write(&keys, |seen| {
            let mut ops = Vec::new();
            if let Some(kv) = &seen[0] {
                let old = sandbox_of(kv)?;
                let mut new = old.clone();
                new.state = SandboxState::Running;
                new.end_at_ms = end_at_ms;
                ops.extend(self.sandbox_ops(Some(&old), &new));
            }
            if let Some(kv) = &seen[1] {
                let mut t: TemplateDoc = parse(kv.key(), kv.value())?;
                t.spawn_count += 1;
                t.last_spawned_ms = Some(now_ms());
                ops.push(TxnOp::put(keys[1].as_str(), json(&t), None));
            }
            Ok(if ops.is_empty() {
                Step::Done(())
            } else {
                Step::Write(ops, ())
            })
        })
        .await
    }

    /// Running sandboxes whose end is at or before `now_ms`, by end time then id: a range
    /// read of the expiry keys, not a scan of the sandboxes.
    pub(crate) async fn expired_ids(&self, now: i64) -> Result<Vec<String>> {
        let k = self.keys();
        let dir = k.dir("expiry");
        let kvs = self.get_range(&dir, &k.expiry_end(now), 0, true).await?;
        Ok(kvs
            .iter()
            .filter_map(|kv| {
                let rest = std::str::from_utf8(kv.key()).ok()?.strip_prefix(&dir)?;
                crate::keys::unescape(rest.split_once('/')?.1)
            })
            .collect())
    }

    /// Moves sandbox `id` from one of the states `from` to `to` in a revision-checked write.
    /// Of two replicas racing on the same change (two resumes, a pause and a kill), exactly
    /// one gets [`Transition::Done`]; the other sees the state the winner left.
    pub async fn transition(
        &self,
        id: &str,
        from: &[SandboxState],
        to: SandboxState,
        reason: Option<&str>,
    ) -> Result<Transition> {
        let key = self.keys().sandbox(id);
        self.read_modify_write(std::slice::from_ref(&key), |seen| {
            let Some(kv) = &seen[0] else {
                return Ok(Step::Done(Transition::Missing));
            };
            let old = sandbox_of(kv)?;
            if !from.contains(&old.state) {
                return Ok(Step::Done(Transition::Lost(old)));
            }
            let mut new = old.clone();
            apply_state(&mut new, to, reason);
            Ok(Step::Write(
                self.sandbox_ops(Some(&old), &new),
                Transition::Done(new),
            ))
        })
        .await
    }
}

/// A state change as the SQLite store makes it: ending states record when, and why when a
/// reason is given.
fn apply_state(s: &mut SandboxRecord, state: SandboxState, reason: Option<&str>) {
    s.state = state;
    if !state.is_live() {
        s.ended_at_ms = Some(now_ms());
    }
    if let Some(r) = reason {
        s.end_reason = Some(r.to_string());
    }
}
