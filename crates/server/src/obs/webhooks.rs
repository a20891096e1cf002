//! Webhook delivery: a worker turns new lifecycle events into queued deliveries (persisted, so
//! they survive a restart), POSTs each one signed (see [`super::sign`]), and retries failures
//! with exponential backoff until `max_attempts`. Every attempt is recorded (the delivery log).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;

use super::sign::{sign, SIGNATURE_HEADER};
use super::Telemetry;
use crate::store::{now_ms, Attempt, DeliveryRecord, StateStore, WebhookRecord};

/// Delivery settings.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Delay before the first retry; each further retry waits twice as long.
    pub retry_base: Duration,
    /// Longest wait between two attempts.
    pub retry_max: Duration,
    /// Attempts before a delivery is marked failed.
    pub max_attempts: u32,
    /// Time limit of one attempt.
    pub attempt_timeout: Duration,
    /// How often the queue is checked when nothing wakes the worker.
    pub poll: Duration,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        Self {
            retry_base: Duration::from_secs(2),
            retry_max: Duration::from_secs(600),
            max_attempts: 10,
            attempt_timeout: Duration::from_secs(10),
            poll: Duration::from_millis(500),
        }
    }
}

impl WebhookConfig {
    /// The wait after the `attempts`-th failed attempt (1-based), or None once they are used up.
    pub fn backoff(&self, attempts: u32) -> Option<Duration> {
        if attempts >= self.max_attempts {
            return None;
        }
        let factor = 2u32.saturating_pow(attempts.saturating_sub(1));
        Some(self.retry_base.saturating_mul(factor).min(self.retry_max))
    }
}

/// Error messages longer than this are cut in the delivery log.
const MAX_ERROR_LEN: usize = 300;

/// The webhook delivery service (one per server).
pub struct Webhooks {
    store: Arc<dyn StateStore>,
    telemetry: Arc<Telemetry>,
    cfg: WebhookConfig,
    client: reqwest::Client,
    wake: Notify,
}

impl Webhooks {
    pub fn new(store: Arc<dyn StateStore>, telemetry: Arc<Telemetry>, cfg: WebhookConfig) -> Self {
        let client = reqwest::Client::builder()
            .timeout(cfg.attempt_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("kiln-webhooks/", env!("CARGO_PKG_VERSION")))
            .build()
            .unwrap_or_default();
        Self {
            store,
            telemetry,
            cfg,
            client,
            wake: Notify::new(),
        }
    }

    /// Makes the worker look at the queue now.
    pub fn nudge(&self) {
        self.wake.notify_one();
    }

    /// POSTs one delivery once.
    async fn attempt(&self, d: &DeliveryRecord, w: &WebhookRecord) -> Attempt {
        let now = now_ms();
        let sig = sign(&w.secret, now.div_euclid(1000), d.payload.as_bytes());
        let r = self
            .client
            .post(&w.url)
            .header("content-type", "application/json")
            .header(SIGNATURE_HEADER, sig)
            .header("kiln-webhook-id", &w.id)
            .header("kiln-delivery-id", d.id.to_string())
            .header("kiln-event", &d.kind)
            .body(d.payload.clone())
            .send()
            .await;
        let (code, error) = match r {
            Ok(resp) if resp.status().is_success() => (Some(resp.status().as_u16()), None),
            Ok(resp) => {
                let code = resp.status().as_u16();
                (Some(code), Some(format!("answered {code}")))
            }
            Err(e) => {
                let mut msg = e.to_string();
                msg.truncate(MAX_ERROR_LEN);
                (None, Some(msg))
            }
        };
        let delivered = error.is_none();
        let retry_at_ms = if delivered {
            None
        } else {
            Telemetry::add(&self.telemetry.webhook_failed_attempts, 1);
            self.cfg
                .backoff(d.attempts + 1)
                .map(|b| now_ms() + b.as_millis() as i64)
        };
        if delivered {
            Telemetry::add(&self.telemetry.webhook_delivered, 1);
        }
        Attempt {
            at_ms: now,
            status_code: code,
            error,
            delivered,
            retry_at_ms,
        }
    }

    /// One pass: queue new events, attempt every due delivery.
    pub async fn run_once(&self) {
        if let Err(e) = self.store.queue_deliveries(now_ms(), 500).await {
            tracing::warn!(error = %e, "queueing webhook deliveries");
        }
        let due = match self.store.due_deliveries(now_ms(), 64).await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "reading due webhook deliveries");
                return;
            }
        };
        futures::stream::iter(due)
            .for_each_concurrent(8, |(d, w)| async move {
                let a = self.attempt(&d, &w).await;
                if let Some(err) = &a.error {
                    tracing::info!(webhook = %w.id, delivery = d.id, attempt = d.attempts + 1,
                        "webhook delivery failed: {err}");
                }
                if let Err(e) = self.store.record_attempt(d.id, &a).await {
                    tracing::warn!(error = %e, "recording a webhook delivery attempt");
                }
            })
            .await;
    }

    /// Runs the worker forever, woken by lifecycle events, nudges and its poll interval.
    pub fn spawn(
        self: &Arc<Self>,
        mut events: tokio::sync::broadcast::Receiver<crate::LifecycleEvent>,
    ) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                me.run_once().await;
                tokio::select! {
                    _ = me.wake.notified() => {}
                    r = events.recv() => {
                        if let Err(tokio::sync::broadcast::error::RecvError::Closed) = r {
                            tokio::time::sleep(me.cfg.poll).await;
                        }
                    }
                    _ = tokio::time::sleep(me.cfg.poll) => {}
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_caps_and_gives_up() {
        let c = WebhookConfig {
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(5),
            max_attempts: 5,
            ..WebhookConfig::default()
        };
        let waits: Vec<Option<u64>> = (1..=6).map(|n| c.backoff(n).map(|d| d.as_secs())).collect();
        assert_eq!(waits, vec![Some(1), Some(2), Some(4), Some(5), None, None]);
    }
}
