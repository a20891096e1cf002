//! The outlets service: where what happens to sandboxes goes — lifecycle events (the store's
//! event log and the broadcast that feeds `kiln serve`'s output, webhooks and alerts), the
//! audit log, the server's counters and webhook delivery. Shared (an `Arc`) so tasks the
//! Manager spawns can report too.

use std::sync::{Arc, OnceLock};

use tokio::sync::broadcast;

use super::LifecycleEvent;
use crate::audit::AuditLog;
use crate::obs::webhooks::Webhooks;
use crate::obs::Telemetry;
use crate::store::{now_ms, EventStore};

pub(super) struct Outlets {
    events_log: Arc<dyn EventStore>,
    events: broadcast::Sender<LifecycleEvent>,
    /// Set once by the server; unset: nothing is audited.
    audit: OnceLock<AuditLog>,
    telemetry: Arc<Telemetry>,
    webhooks: Arc<Webhooks>,
}

impl Outlets {
    pub(super) fn new(
        events_log: Arc<dyn EventStore>,
        telemetry: Arc<Telemetry>,
        webhooks: Arc<Webhooks>,
    ) -> Self {
        let (events, _) = broadcast::channel(1024);
        Self {
            events_log,
            events,
            audit: OnceLock::new(),
            telemetry,
            webhooks,
        }
    }

    /// A lifecycle event: audited, stored and broadcast.
    pub(super) async fn event(&self, id: &str, kind: &str, detail: String) {
        self.audit()
            .record(
                id,
                crate::audit::Kind::Lifecycle,
                serde_json::json!({ "event": kind, "detail": detail }),
            )
            .await;
        self.note(id, kind, detail).await;
    }

    /// A lifecycle event stored and broadcast but not audited (a start command's output
    /// lines, which the audit log does not carry).
    pub(super) async fn note(&self, id: &str, kind: &str, detail: String) {
        if let Err(e) = self.events_log.add_event(id, kind, &detail).await {
            tracing::warn!(error = %e, "recording a lifecycle event");
        }
        tracing::info!(sandbox = id, event = kind, "{detail}");
        let _ = self.events.send(LifecycleEvent {
            ts_ms: now_ms(),
            sandbox_id: id.to_string(),
            kind: kind.to_string(),
            detail,
        });
    }

    /// Lifecycle events as they happen.
    pub(super) fn subscribe(&self) -> broadcast::Receiver<LifecycleEvent> {
        self.events.subscribe()
    }

    /// Takes the audit log (once; later calls are ignored).
    pub(super) fn set_audit(&self, log: AuditLog) {
        let _ = self.audit.set(log);
    }

    /// The audit log (a disabled one when none was set).
    pub(super) fn audit(&self) -> &AuditLog {
        static OFF: OnceLock<AuditLog> = OnceLock::new();
        self.audit
            .get()
            .unwrap_or_else(|| OFF.get_or_init(AuditLog::disabled))
    }

    pub(super) fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
    }

    pub(super) fn webhooks(&self) -> &Arc<Webhooks> {
        &self.webhooks
    }
}
