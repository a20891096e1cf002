//! What one alert does. The first of an incident ([`kiln_rules::incident`]) is stored, becomes
//! an `alert` event (events API and webhooks) and a `warn` log line; a repeat updates the
//! stored alert (count, last time, rules, records) and raises no event. Every firing is
//! counted (`kiln_alerts_total{rule,priority}`), appended to the sandbox's audit chain (with
//! the stored alert's id and the incident's count so far) and has its rule's actions taken
//! (each at most once per sandbox), every action appended to the chain as well.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use kiln_rules::{Action, Alert};
use serde_json::json;

use crate::audit::Kind;
use crate::manager::Manager;
use crate::store::alerts_sql::{self, AlertRecord, AlertsDb};

pub struct Handler {
    manager: Arc<Manager>,
    db: AlertsDb,
    /// (sandbox, action) already taken.
    acted: Mutex<HashSet<(String, Action)>>,
}

impl Handler {
    pub fn new(manager: Arc<Manager>, db: AlertsDb) -> Arc<Handler> {
        Arc::new(Handler {
            manager,
            db,
            acted: Mutex::new(HashSet::new()),
        })
    }

    /// Handles `a`, whose incident's stored alert id is (or will be) in `slot`; `opening`
    /// is the slot's guard when `a` opened the incident (taken before its task was spawned,
    /// so the first firing is stored first and its repeats wait for it).
    pub async fn handle(&self, a: Alert, slot: super::Slot, opening: Option<super::SlotGuard>) {
        let rec = AlertRecord {
            id: 0,
            ts_ms: a.ts_ms,
            sandbox_id: a.sandbox.clone(),
            team: a.team.clone(),
            rule: a.rule.clone(),
            priority: a.priority.as_str().to_string(),
            output: a.output.clone(),
            tags: a.tags.clone(),
            actions: a.actions.iter().map(|x| x.as_str().to_string()).collect(),
            records: a.records.clone(),
            count: 1,
            first_ms: a.ts_ms,
            last_ms: a.ts_ms,
            rules: vec![a.rule.clone()],
            incident: a.incident.clone(),
        };
        // Repeats wait for the incident's first alert to be stored (or, if storing it failed,
        // store it themselves).
        let mut stored_id = match opening {
            Some(g) => g,
            None => slot.lock_owned().await,
        };
        let (stored, first) = match *stored_id {
            None => match self.db.run(move |c| alerts_sql::insert(c, &rec)).await {
                Ok(s) => {
                    *stored_id = Some(s.id);
                    (s, true)
                }
                Err(e) => {
                    tracing::error!(error = %e, rule = %a.rule, "storing an alert");
                    return;
                }
            },
            Some(id) => match self.db.run(move |c| alerts_sql::repeat(c, id, &rec)).await {
                Ok(Some(s)) => (s, false),
                Ok(None) => return,
                Err(e) => {
                    tracing::error!(error = %e, rule = %a.rule, "updating an alert");
                    return;
                }
            },
        };
        drop(stored_id);
        if first {
            tracing::warn!(sandbox = %a.sandbox, rule = %a.rule, priority = %a.priority, "alert: {}", a.output);
        } else {
            tracing::info!(sandbox = %a.sandbox, rule = %a.rule, alert = stored.id, count = stored.count, "alert repeated: {}", a.output);
        }
        self.manager
            .telemetry()
            .count_alert(&a.rule, a.priority.as_str());
        let log = self.manager.audit();
        log.record(
            &a.sandbox,
            Kind::Lifecycle,
            json!({
                "event": "alert",
                "alertID": stored.id.to_string(),
                "rule": a.rule,
                "priority": a.priority.as_str(),
                "output": a.output,
                "records": a.records.iter().map(|r| r.to_string()).collect::<Vec<_>>(),
                "incident": a.incident,
                "count": stored.count,
            }),
        )
        .await;
        if first {
            let detail = format!("rule {} ({}): {}", a.rule, a.priority, a.output);
            self.manager.note_event(&a.sandbox, "alert", detail).await;
            self.manager.webhooks().nudge();
        }
        for act in &a.actions {
            if *act == Action::Alert {
                continue;
            }
            let first = self
                .acted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert((a.sandbox.clone(), *act));
            if !first {
                continue;
            }
            let result = self.act(&a, *act).await;
            log.record(
                &a.sandbox,
                Kind::Lifecycle,
                json!({
                    "event": "rule-action",
                    "alertID": stored.id.to_string(),
                    "rule": a.rule,
                    "action": act.as_str(),
                    "result": match &result { Ok(()) => "ok".to_string(), Err(e) => e.clone() },
                    "records": a.records.iter().map(|r| r.to_string()).collect::<Vec<_>>(),
                }),
            )
            .await;
            if let Err(e) = result {
                tracing::warn!(sandbox = %a.sandbox, rule = %a.rule, action = act.as_str(), "rule action failed: {e}");
            }
        }
    }

    async fn act(&self, a: &Alert, act: Action) -> Result<(), String> {
        let m = &self.manager;
        let why = format!("rule {}", a.rule);
        match act {
            Action::Alert => Ok(()),
            Action::Kill => match m.kill(&a.sandbox, &why).await {
                Ok(true) => Ok(()),
                Ok(false) => Err("the sandbox is not running".into()),
                Err(e) => Err(e.to_string()),
            },
            Action::Pause => m.pause(&a.sandbox, true).await.map_err(|e| e.to_string()),
            Action::DenyNetwork => {
                let mut p = m
                    .network(&a.sandbox)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or("the sandbox has no network")?;
                p.allow_internet_access = false;
                p.allow_out.clear();
                m.set_network(&a.sandbox, p)
                    .await
                    .map_err(|e| e.to_string())
            }
        }
    }
}
