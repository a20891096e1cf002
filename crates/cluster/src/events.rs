//! The event log and webhooks on etcd. An event's sequence number is the etcd revision that
//! created its key: unique, increasing, and given by etcd itself, so replicas need no shared
//! counter.

use std::collections::HashMap;

use etcd_client::TxnOp;
use kiln_server::store::{now_ms, Event, EventQuery, StoredEvent, WebhookRecord};

use crate::docs::{json, parse, EventDoc, SandboxDoc, WebhookDoc};
use crate::error::{ClusterError, Result};
use crate::store::{EtcdStore, Step};

/// Events read per round trip while filling a page.
const BATCH: i64 = 256;

impl EtcdStore {
    pub(crate) async fn add_event_doc(
        &self,
        sandbox_id: &str,
        kind: &str,
        detail: &str,
    ) -> Result<()> {
        let ts_ms = now_ms();
        let doc = EventDoc {
            ts_ms,
            sandbox_id: sandbox_id.to_string(),
            kind: kind.to_string(),
            detail: detail.to_string(),
        };
        let key = self.keys().new_event(sandbox_id, ts_ms);
        self.commit(vec![TxnOp::put(key, json(&doc), None)]).await
    }

    /// The events of one sandbox in the order they were added.
    pub(crate) async fn event_docs(&self, sandbox_id: &str) -> Result<Vec<Event>> {
        let prefix = self.keys().events_of(sandbox_id);
        let (kvs, _) = self.created_after(&prefix, 0, 0, 0).await?;
        kvs.iter()
            .map(|kv| Ok(parse::<EventDoc>(kv.key(), kv.value())?.into()))
            .collect()
    }

    /// A page of the event log in sequence order, read at one revision.
    pub(crate) async fn events_page_docs(&self, q: &EventQuery) -> Result<Vec<StoredEvent>> {
        let limit = q.limit as usize;
        let mut out = Vec::new();
        if limit == 0 {
            return Ok(out);
        }
        let prefix = match &q.sandbox_id {
            Some(id) => self.keys().events_of(id),
            None => self.keys().dir("events"),
        };
        let mut after = q.after_seq.unwrap_or(0);
        let mut revision = 0;
        let mut teams: HashMap<String, Option<String>> = HashMap::new();
        loop {
            let (kvs, rev) = self.created_after(&prefix, after, BATCH, revision).await?;
            revision = rev;
            for kv in &kvs {
                after = kv.create_revision();
                let e: EventDoc = parse(kv.key(), kv.value())?;
                if q.after_seq.is_none() && q.since_ms.is_some_and(|s| e.ts_ms < s) {
                    continue;
                }
                if !q.kinds.is_empty() && !q.kinds.contains(&e.kind) {
                    continue;
                }
                if let Some(team) = &q.team {
                    if !teams.contains_key(&e.sandbox_id) {
                        let t = self.team_of(&e.sandbox_id, revision).await?;
                        teams.insert(e.sandbox_id.clone(), t);
                    }
                    if teams[&e.sandbox_id].as_deref() != Some(team.as_str()) {
                        continue;
                    }
                }
                out.push(StoredEvent {
                    seq: kv.create_revision(),
                    event: e.into(),
                });
                if out.len() == limit {
                    return Ok(out);
                }
            }
            if (kvs.len() as i64) < BATCH {
                return Ok(out);
            }
        }
    }

    /// The team of sandbox `id` at `revision` (None: no such sandbox).
    pub(crate) async fn team_of(&self, id: &str, revision: i64) -> Result<Option<String>> {
        let key = self.keys().sandbox(id);
        let mut r = self
            .get(&key, etcd_client::GetOptions::new().with_revision(revision))
            .await?;
        match r.take_kvs().into_iter().next() {
            Some(kv) => Ok(Some(parse::<SandboxDoc>(kv.key(), kv.value())?.team)),
            None => Ok(None),
        }
    }

    pub(crate) async fn insert_webhook_doc(&self, w: &WebhookRecord) -> Result<()> {
        let key = self.keys().webhook(&w.id);
        let ops = vec![TxnOp::put(key.as_str(), json(&WebhookDoc::from(w)), None)];
        if !self.create(&[key], ops).await? {
            return Err(ClusterError::Exists {
                what: "webhook",
                id: w.id.clone(),
            });
        }
        Ok(())
    }

    /// Every webhook of every team.
    pub(crate) async fn all_webhooks(&self) -> Result<Vec<WebhookRecord>> {
        let mut out = Vec::new();
        for kv in self.get_prefix(&self.keys().dir("webhooks"), 0).await? {
            out.push(parse::<WebhookDoc>(kv.key(), kv.value())?.into());
        }
        Ok(out)
    }

    pub(crate) async fn list_webhook_docs(&self, team: &str) -> Result<Vec<WebhookRecord>> {
        let mut out = self.all_webhooks().await?;
        out.retain(|w| w.team == team);
        out.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(out)
    }

    pub(crate) async fn get_webhook_doc(
        &self,
        team: &str,
        id: &str,
    ) -> Result<Option<WebhookRecord>> {
        let Some(kv) = self.get_one(&self.keys().webhook(id)).await? else {
            return Ok(None);
        };
        let w: WebhookDoc = parse(kv.key(), kv.value())?;
        Ok((w.team == team).then(|| w.into()))
    }

    /// Deletes the webhook when `team` owns it (revision-checked against a concurrent change).
    pub(crate) async fn delete_webhook_doc(&self, team: &str, id: &str) -> Result<bool> {
        let key = self.keys().webhook(id);
        self.read_modify_write(std::slice::from_ref(&key), |seen| {
            let Some(kv) = &seen[0] else {
                return Ok(Step::Done(false));
            };
            let w: WebhookDoc = parse(kv.key(), kv.value())?;
            if w.team != team {
                return Ok(Step::Done(false));
            }
            // The webhook and its queue go together.
            let ops = vec![TxnOp::delete(key.as_str(), None), self.drop_queue_op(id)];
            Ok(Step::Write(ops, true))
        })
        .await
    }
}
