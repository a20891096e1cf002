//! The webhook delivery queue on etcd. Deliveries live under their webhook (so deleting a
//! webhook drops its queue with one range delete); a `due` key per pending delivery, ordered
//! by its next attempt, makes "what is due now" a range read; delivery ids come from one
//! counter key and the webhooks' place in the event log from one cursor key, both advanced in
//! the same revision-checked txn as the deliveries they number.

use std::collections::HashMap;

use etcd_client::{DeleteOptions, KeyValue, TxnOp};
use kiln_server::store::{
    event_payload, now_ms, webhook_wants, Attempt, DeliveryRecord, DeliveryStatus, EventQuery,
    WebhookRecord, DEFAULT_TEAM,
};

use crate::docs::{json, parse, DeliveryDoc, WebhookDoc};
use crate::error::{ClusterError, Result};
use crate::store::{EtcdStore, Step, MAX_TRIES};

/// Operations one queueing txn holds at most (etcd's default limit is 128 per txn).
const MAX_OPS: usize = 120;

/// A number kept as decimal text (0 when absent).
fn number(kv: &Option<KeyValue>) -> i64 {
    kv.as_ref()
        .and_then(|kv| std::str::from_utf8(kv.value()).ok()?.parse().ok())
        .unwrap_or(0)
}

impl EtcdStore {
    /// The writes that store delivery `d` and keep its `due` key in step with `old`.
    fn delivery_ops(&self, old: Option<&DeliveryDoc>, d: &DeliveryDoc) -> Vec<TxnOp> {
        let k = self.keys();
        let due = |d: &DeliveryDoc| {
            (d.status == DeliveryStatus::Pending.as_str()).then(|| k.due(d.next_attempt_ms, d.id))
        };
        let (was, is) = (old.and_then(due), due(d));
        let mut ops = vec![TxnOp::put(k.delivery(&d.webhook_id, d.id), json(d), None)];
        if old.is_none() {
            ops.push(TxnOp::put(
                k.delivery_id(d.id),
                d.webhook_id.as_bytes(),
                None,
            ));
        }
        if was != is {
            if let Some(was) = was {
                ops.push(TxnOp::delete(was, None));
            }
            if let Some(is) = is {
                ops.push(TxnOp::put(is, d.webhook_id.as_bytes(), None));
            }
        }
        ops
    }

    /// Turns the events after the webhook cursor into pending deliveries and advances the
    /// cursor, in one txn checked against the cursor and the id counter (a replica that
    /// queued meanwhile makes this one read and plan again), so each event is queued once.
    pub(crate) async fn queue_delivery_docs(&self, now: i64, max_events: u32) -> Result<usize> {
        let k = self.keys();
        let guard = [k.webhook_cursor(), k.delivery_seq()];
        for attempt in 0..MAX_TRIES {
            let seen = self.get_many(&guard).await?;
            let (cursor, mut next_id) = (number(&seen[0]), number(&seen[1]));
            let q = EventQuery {
                after_seq: Some(cursor),
                limit: max_events,
                ..EventQuery::default()
            };
            let events = self.events_page_docs(&q).await?;
            if events.is_empty() {
                return Ok(0);
            }
            let hooks = self.all_webhooks().await?;
            let mut teams: HashMap<String, String> = HashMap::new();
            let (mut ops, mut last, mut queued) = (Vec::new(), cursor, 0);
            for e in &events {
                let sid = &e.event.sandbox_id;
                if !teams.contains_key(sid) {
                    let team = self.team_of(sid, 0).await?;
                    teams.insert(sid.clone(), team.unwrap_or_else(|| DEFAULT_TEAM.into()));
                }
                let team = &teams[sid];
                let mut these = Vec::new();
                let mut id = next_id;
                for w in hooks
                    .iter()
                    .filter(|w| &w.team == team && webhook_wants(w, &e.event.kind))
                {
                    id += 1;
                    let d = DeliveryDoc::pending(
                        id,
                        &w.id,
                        Some(e.seq),
                        &e.event.kind,
                        event_payload(w, e),
                        now,
                    );
                    these.extend(self.delivery_ops(None, &d));
                }
                // The rest waits for the next call (the cursor stops before it).
                if last != cursor && ops.len() + these.len() + 2 > MAX_OPS {
                    break;
                }
                queued += (id - next_id) as usize;
                (next_id, last) = (id, e.seq);
                ops.extend(these);
            }
            ops.push(TxnOp::put(guard[0].as_str(), last.to_string(), None));
            ops.push(TxnOp::put(guard[1].as_str(), next_id.to_string(), None));
            if self.commit_guarded(&guard, &seen, ops).await? {
                return Ok(queued);
            }
            tokio::time::sleep(crate::store::backoff(attempt)).await;
        }
        Err(ClusterError::Contended {
            key: guard[0].clone(),
            tries: MAX_TRIES,
        })
    }

    /// Queues one delivery of `payload` (a test delivery), due now; returns its id.
    pub(crate) async fn enqueue_delivery_doc(
        &self,
        webhook_id: &str,
        kind: &str,
        payload: &str,
    ) -> Result<i64> {
        let seq = self.keys().delivery_seq();
        let now = now_ms();
        self.read_modify_write(std::slice::from_ref(&seq), |seen| {
            let id = number(&seen[0]) + 1;
            let d = DeliveryDoc::pending(id, webhook_id, None, kind, payload.to_string(), now);
            let mut ops = self.delivery_ops(None, &d);
            ops.push(TxnOp::put(seq.as_str(), id.to_string(), None));
            Ok(Step::Write(ops, id))
        })
        .await
    }

    /// Pending deliveries due at `now`, by due time then id, with their webhooks: a range
    /// read of the due keys, in batches. Due keys left by a deleted webhook are skipped and
    /// deleted.
    pub(crate) async fn due_delivery_docs(
        &self,
        now: i64,
        limit: u32,
    ) -> Result<Vec<(DeliveryRecord, WebhookRecord)>> {
        let k = self.keys();
        let (mut from, end) = (k.dir("due"), k.due_end(now));
        let batch = i64::from(limit).clamp(16, 256);
        let mut hooks: HashMap<String, Option<WebhookRecord>> = HashMap::new();
        let mut out = Vec::new();
        while out.len() < limit as usize {
            let due = self.get_range(&from, &end, batch, false).await?;
            let full = due.len() as i64 == batch;
            for kv in due {
                if out.len() == limit as usize {
                    break;
                }
                from = format!("{}\0", String::from_utf8_lossy(kv.key()));
                let webhook_id = String::from_utf8_lossy(kv.value()).into_owned();
                if !hooks.contains_key(&webhook_id) {
                    let w = match self.get_one(&k.webhook(&webhook_id)).await? {
                        Some(w) => Some(parse::<WebhookDoc>(w.key(), w.value())?.into()),
                        None => None,
                    };
                    hooks.insert(webhook_id.clone(), w);
                }
                let d = match due_id(kv.key()) {
                    Some(id) => self.get_one(&k.delivery(&webhook_id, id)).await?,
                    None => None,
                };
                match (d, &hooks[&webhook_id]) {
                    (Some(d), Some(w)) => {
                        let d: DeliveryDoc = parse(d.key(), d.value())?;
                        out.push((d.into(), w.clone()));
                    }
                    // The webhook (and so its deliveries) is gone: drop the stale due key,
                    // unless it changed meanwhile.
                    _ => {
                        let key = String::from_utf8_lossy(kv.key()).into_owned();
                        let delete = vec![TxnOp::delete(key.as_str(), None)];
                        self.commit_guarded(std::slice::from_ref(&key), &[Some(kv)], delete)
                            .await?;
                    }
                }
            }
            if !full {
                break;
            }
        }
        Ok(out)
    }

    /// Records one attempt of delivery `id` (revision-checked; no such delivery: nothing).
    pub(crate) async fn record_attempt_doc(&self, id: i64, a: &Attempt) -> Result<()> {
        let k = self.keys();
        let Some(owner) = self.get_one(&k.delivery_id(id)).await? else {
            return Ok(());
        };
        let key = k.delivery(&String::from_utf8_lossy(owner.value()), id);
        self.read_modify_write(std::slice::from_ref(&key), |seen| {
            let Some(kv) = &seen[0] else {
                return Ok(Step::Done(()));
            };
            let old: DeliveryDoc = parse(kv.key(), kv.value())?;
            let mut d = old.clone();
            let status = match (a.delivered, a.retry_at_ms) {
                (true, _) => DeliveryStatus::Delivered,
                (false, Some(_)) => DeliveryStatus::Pending,
                (false, None) => DeliveryStatus::Failed,
            };
            d.attempts += 1;
            d.last_attempt_ms = Some(a.at_ms);
            d.last_status_code = a.status_code;
            d.last_error = a.error.clone();
            d.status = status.as_str().into();
            if let Some(at) = a.retry_at_ms {
                d.next_attempt_ms = at;
            }
            Ok(Step::Write(self.delivery_ops(Some(&old), &d), ()))
        })
        .await
    }

    /// The deliveries of a webhook, newest first, before id `before` when given.
    pub(crate) async fn delivery_docs(
        &self,
        webhook_id: &str,
        before: Option<i64>,
        limit: u32,
    ) -> Result<Vec<DeliveryRecord>> {
        let k = self.keys();
        let start = k.deliveries_of(webhook_id);
        let end = match before {
            Some(id) => k.delivery(webhook_id, id),
            None => crate::keys::range_end(&start),
        };
        let opts = etcd_client::GetOptions::new()
            .with_range(end)
            .with_sort(
                etcd_client::SortTarget::Key,
                etcd_client::SortOrder::Descend,
            )
            .with_limit(i64::from(limit));
        let kvs = self.get(&start, opts).await?.take_kvs();
        kvs.iter()
            .map(|kv| Ok(parse::<DeliveryDoc>(kv.key(), kv.value())?.into()))
            .collect()
    }

    /// The ops that drop a webhook's whole queue (its deliveries, in one range delete).
    pub(crate) fn drop_queue_op(&self, webhook_id: &str) -> TxnOp {
        TxnOp::delete(
            self.keys().deliveries_of(webhook_id),
            Some(DeleteOptions::new().with_prefix()),
        )
    }
}

/// The delivery id at the end of a `due` key.
fn due_id(key: &[u8]) -> Option<i64> {
    crate::keys::from_ordered(std::str::from_utf8(key).ok()?.rsplit('/').next()?)
}
