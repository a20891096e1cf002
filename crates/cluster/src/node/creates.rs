//! A node's creates: each runs in a task of its own, so a control replica that dies (or
//! disconnects) mid-create does not cut it short and leave a half-started sandbox; a create
//! carrying an idempotency token ([`crate::wire::CreateDoc::idempotency`]) that this node is
//! running or ran within the window gets that create's answer instead of a second sandbox, so
//! a client's retry at another replica (sent to this node by the placement record, see
//! [`crate::placements`]) ends with one sandbox.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kiln_server::manager::CreateParams;
use kiln_server::store::SandboxRecord;
use kiln_server::{ApiError, SandboxService};
use tokio::sync::watch;

/// How long a token's answer is kept (the API's idempotency window).
const WINDOW: Duration = kiln_server::api::idempotency::WINDOW;
/// Most tokens kept at once (the oldest finished ones go first).
const MAX_TOKENS: usize = 10_000;

type Answer = Result<SandboxRecord, (StatusCode, String)>;

struct Entry {
    at: Instant,
    answer: watch::Receiver<Option<Answer>>,
}

/// The creates of one node, by idempotency token.
#[derive(Clone, Default)]
pub struct Creates {
    entries: Arc<Mutex<HashMap<String, Entry>>>,
}

impl Creates {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `p` on `service` in a task of its own, or waits for the create that already has
    /// `token`. Failed creates are not kept: a retry runs again.
    pub async fn run(
        &self,
        service: Arc<dyn SandboxService>,
        p: CreateParams,
        token: Option<String>,
    ) -> Result<SandboxRecord, ApiError> {
        let (tx, mut rx) = watch::channel(None);
        if let Some(t) = &token {
            let mut entries = self.lock();
            let now = Instant::now();
            entries.retain(|_, e| now.duration_since(e.at) < WINDOW);
            if let Some(e) = entries.get(t) {
                rx = e.answer.clone();
            } else {
                if entries.len() >= MAX_TOKENS {
                    evict_oldest(&mut entries);
                }
                entries.insert(
                    t.clone(),
                    Entry {
                        at: now,
                        answer: rx.clone(),
                    },
                );
                self.spawn(service, p, token.clone(), tx);
            }
        } else {
            self.spawn(service, p, None, tx);
        }
        let answer = rx
            .wait_for(|a| a.is_some())
            .await
            .ok()
            .and_then(|a| a.clone());
        match answer {
            Some(Ok(rec)) => Ok(rec),
            Some(Err((status, message))) => Err(ApiError::new(status, message)),
            None => Err(ApiError::internal("the create ended without an answer")),
        }
    }

    fn spawn(
        &self,
        service: Arc<dyn SandboxService>,
        p: CreateParams,
        token: Option<String>,
        tx: watch::Sender<Option<Answer>>,
    ) {
        let me = self.clone();
        tokio::spawn(async move {
            let answer = service.create(p).await.map_err(|e| {
                let e = ApiError::from(e);
                (e.status, e.message)
            });
            if let (Err(_), Some(t)) = (&answer, &token) {
                me.lock().remove(t);
            }
            let _ = tx.send(Some(answer));
        });
    }
}

fn evict_oldest(entries: &mut HashMap<String, Entry>) {
    let oldest = entries
        .iter()
        .filter(|(_, e)| e.answer.borrow().is_some())
        .min_by_key(|(_, e)| e.at)
        .map(|(k, _)| k.clone());
    if let Some(k) = oldest {
        entries.remove(&k);
    }
}
