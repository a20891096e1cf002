//! [`kiln_server::store::StateStore`] on etcd, one impl per aggregate trait: what a method changes, it changes in one etcd txn (see the
//! modules that build them); only housekeeping (old idempotent answers, due keys of deleted
//! webhooks) takes txns of its own.

use kiln_server::store::{AccessStore, EventStore, IdempotencyStore, SandboxStore, TemplateStore};
use kiln_server::store::{
    Attempt, DeliveryRecord, Event, EventQuery, IdempotentAnswer, Ingress, KeyRecord, PauseMode,
    Result, SandboxRecord, SandboxState, SnapshotRecord, StoredEvent, TeamRecord, TemplateRecord,
    WebhookRecord,
};

use crate::store::EtcdStore;

#[async_trait::async_trait]
impl SandboxStore for EtcdStore {
    async fn insert_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        Ok(self.insert_sandbox_doc(s).await?)
    }
    async fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>> {
        Ok(self.get_sandbox_doc(id).await?)
    }
    async fn list_sandboxes(&self, states: &[SandboxState]) -> Result<Vec<SandboxRecord>> {
        Ok(self.list_sandbox_docs(states).await?)
    }
    async fn set_state(&self, id: &str, state: SandboxState, reason: Option<&str>) -> Result<()> {
        Ok(self.set_state_doc(id, state, reason).await?)
    }
    async fn set_paused(&self, id: &str, mode: PauseMode) -> Result<()> {
        Ok(self.set_paused_doc(id, mode).await?)
    }
    async fn set_end_at(&self, id: &str, end_at_ms: i64) -> Result<()> {
        Ok(self.set_end_at_doc(id, end_at_ms).await?)
    }
    async fn set_ingress(&self, id: &str, ingress: &Ingress) -> Result<()> {
        Ok(self.set_ingress_doc(id, ingress).await?)
    }
    async fn set_running(&self, id: &str, end_at_ms: i64, template: &str) -> Result<()> {
        Ok(self.set_running_doc(id, end_at_ms, template).await?)
    }
    async fn expired(&self, now_ms: i64) -> Result<Vec<String>> {
        Ok(self.expired_ids(now_ms).await?)
    }
    async fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<()> {
        Ok(self.insert_snapshot_at(s, None).await?)
    }
    async fn get_snapshot(&self, key: &str) -> Result<Option<SnapshotRecord>> {
        Ok(self.snapshot_at(key).await?.map(|l| l.snapshot))
    }
    async fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>> {
        let all = self.snapshots_at().await?;
        Ok(all.into_iter().map(|l| l.snapshot).collect())
    }
    async fn delete_snapshot(&self, id: &str) -> Result<bool> {
        Ok(self.delete_snapshot_at(id, None).await?)
    }
}

#[async_trait::async_trait]
impl EventStore for EtcdStore {
    async fn add_event(&self, sandbox_id: &str, kind: &str, detail: &str) -> Result<()> {
        Ok(self.add_event_doc(sandbox_id, kind, detail).await?)
    }
    async fn events(&self, sandbox_id: &str) -> Result<Vec<Event>> {
        Ok(self.event_docs(sandbox_id).await?)
    }
    async fn events_page(&self, q: &EventQuery) -> Result<Vec<StoredEvent>> {
        Ok(self.events_page_docs(q).await?)
    }
    async fn insert_webhook(&self, w: &WebhookRecord) -> Result<()> {
        Ok(self.insert_webhook_doc(w).await?)
    }
    async fn list_webhooks(&self, team: &str) -> Result<Vec<WebhookRecord>> {
        Ok(self.list_webhook_docs(team).await?)
    }
    async fn get_webhook(&self, team: &str, id: &str) -> Result<Option<WebhookRecord>> {
        Ok(self.get_webhook_doc(team, id).await?)
    }
    async fn delete_webhook(&self, team: &str, id: &str) -> Result<bool> {
        Ok(self.delete_webhook_doc(team, id).await?)
    }
    async fn queue_deliveries(&self, now_ms: i64, max_events: u32) -> Result<usize> {
        Ok(self.queue_delivery_docs(now_ms, max_events).await?)
    }
    async fn enqueue_delivery(&self, webhook_id: &str, kind: &str, payload: &str) -> Result<i64> {
        Ok(self.enqueue_delivery_doc(webhook_id, kind, payload).await?)
    }
    async fn due_deliveries(
        &self,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<(DeliveryRecord, WebhookRecord)>> {
        Ok(self.due_delivery_docs(now_ms, limit).await?)
    }
    async fn record_attempt(&self, id: i64, a: &Attempt) -> Result<()> {
        Ok(self.record_attempt_doc(id, a).await?)
    }
    async fn deliveries(
        &self,
        webhook_id: &str,
        before: Option<i64>,
        limit: u32,
    ) -> Result<Vec<DeliveryRecord>> {
        Ok(self.delivery_docs(webhook_id, before, limit).await?)
    }
}

#[async_trait::async_trait]
impl AccessStore for EtcdStore {
    async fn insert_key(&self, k: &KeyRecord) -> Result<()> {
        Ok(self.insert_key_doc(k).await?)
    }
    async fn list_keys(&self) -> Result<Vec<KeyRecord>> {
        Ok(self.list_key_docs().await?)
    }
    async fn key_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>> {
        Ok(self.key_doc_by_hash(hash).await?)
    }
    async fn touch_key(&self, id: &str) -> Result<()> {
        Ok(self.touch_key_doc(id).await?)
    }
    async fn revoke_key(&self, id: &str) -> Result<bool> {
        Ok(self.revoke_key_doc(id).await?)
    }
    async fn upsert_team(&self, t: &TeamRecord) -> Result<()> {
        Ok(self.upsert_team_doc(t).await?)
    }
    async fn get_team(&self, name: &str) -> Result<Option<TeamRecord>> {
        Ok(self.get_team_doc(name).await?)
    }
    async fn list_teams(&self) -> Result<Vec<TeamRecord>> {
        Ok(self.list_team_docs().await?)
    }
}

#[async_trait::async_trait]
impl TemplateStore for EtcdStore {
    async fn upsert_template(&self, t: &TemplateRecord) -> Result<()> {
        Ok(self.upsert_template_doc(t).await?)
    }
    async fn get_template(&self, name: &str) -> Result<Option<TemplateRecord>> {
        Ok(self.get_template_doc(name).await?)
    }
}

#[async_trait::async_trait]
impl IdempotencyStore for EtcdStore {
    async fn put_idempotent(&self, a: &IdempotentAnswer) -> Result<()> {
        Ok(self.put_idempotent_doc(a).await?)
    }
    async fn get_idempotent(
        &self,
        scope: &str,
        key: &str,
        since_ms: i64,
    ) -> Result<Option<IdempotentAnswer>> {
        Ok(self.get_idempotent_doc(scope, key, since_ms).await?)
    }
}
