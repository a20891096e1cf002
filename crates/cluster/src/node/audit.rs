//! The node's side of the audit log on a cluster ([`crate::audit`]): control replicas append
//! the records they make about this node's sandboxes, and read its chains, through one route.
//! Records of a chain another node extends now are not kept: the answer names that node.
//! A node whose audit log is off takes appends and keeps nothing, and answers reads `501`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use kiln_server::audit::{AuditError, NewRecord};
use kiln_server::ApiError;

use super::NodeApi;
use crate::audit::{AlertDoc, AuditAnswer, AuditCall, ChainDoc, MovedDoc, NewRecordDoc, RecordDoc};

pub(super) async fn call(
    State(n): State<Arc<NodeApi>>,
    Json(call): Json<AuditCall>,
) -> Result<Json<AuditAnswer>, ApiError> {
    let log = &n.audit;
    let mut a = AuditAnswer::default();
    match call {
        AuditCall::Append { records } => {
            let refused = log
                .append_records(records.into_iter().map(NewRecord::from).collect())
                .await;
            let mut by_node: std::collections::BTreeMap<Option<String>, Vec<NewRecordDoc>> =
                Default::default();
            for r in &refused {
                by_node
                    .entry(n.heads.holder(&r.sandbox_id))
                    .or_default()
                    .push(NewRecordDoc::from(r));
            }
            a.moved = by_node
                .into_iter()
                .map(|(node, records)| MovedDoc { node, records })
                .collect();
        }
        AuditCall::Query { filter } => {
            let recs = log.query(filter).await.map_err(|e| refusal(&n.name, e))?;
            a.records = recs.iter().map(RecordDoc::from).collect();
        }
        AuditCall::Alerts { filter } => {
            let page = log.alerts(filter).await.map_err(|e| refusal(&n.name, e))?;
            a.alerts = page.items.into_iter().map(AlertDoc::from).collect();
        }
        AuditCall::Chains { team } => {
            log.flush().await;
            a.ids = read(&n.name, log, move |s| s.chains(team.as_deref())).await?;
        }
        AuditCall::Chain { sandbox_id } => {
            log.flush().await;
            let c = read(&n.name, log, move |s| s.chain(&sandbox_id)).await?;
            a.chain = Some(ChainDoc::from(&c));
        }
        AuditCall::RecordHash { sandbox_id, seq } => {
            a.text = read(&n.name, log, move |s| s.record_hash(&sandbox_id, seq)).await?;
        }
        AuditCall::Owner { sandbox_id } => {
            a.text = read(&n.name, log, move |s| s.owner(&sandbox_id)).await?;
        }
        AuditCall::TeamOf { sandbox_id } => {
            a.text = read(&n.name, log, move |s| s.team_of(&sandbox_id)).await?;
        }
    }
    Ok(Json(a))
}

async fn read<T: Send + 'static>(
    node: &str,
    log: &kiln_server::audit::AuditLog,
    f: impl FnOnce(&dyn kiln_server::store::AuditStore) -> kiln_server::store::Result<T>
        + Send
        + 'static,
) -> Result<T, ApiError> {
    log.read(f).await.map_err(|e| refusal(node, e))
}

fn refusal(node: &str, e: AuditError) -> ApiError {
    match e {
        AuditError::Off => ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("the audit log is off on node {node} (its kiln node runs with --audit off)"),
        ),
        other => {
            tracing::error!(error = %other, "audit read for a control replica");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("reading the audit log of node {node} failed"),
            )
        }
    }
}
