//! Rows of the SQLite store to records: sandboxes, snapshots and API keys.

use std::collections::BTreeMap;

use rusqlite::Row;

use super::{KeyRecord, PauseMode, Result, SandboxRecord, SandboxState, SnapshotRecord};

pub(super) fn sandbox_from_row(r: &Row<'_>) -> rusqlite::Result<(SandboxRecord, String, String)> {
    let state: String = r.get("state")?;
    Ok((
        SandboxRecord {
            id: r.get("id")?,
            template_id: r.get("template_id")?,
            alias: r.get("alias")?,
            client_id: r.get("client_id")?,
            state: SandboxState::parse(&state).unwrap_or(SandboxState::Failed),
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            cpu_count: r.get("cpu_count")?,
            memory_mb: r.get("memory_mb")?,
            disk_size_mb: r.get("disk_size_mb")?,
            envd_token: r.get("envd_token")?,
            started_at_ms: r.get("started_at")?,
            end_at_ms: r.get("end_at")?,
            ended_at_ms: r.get("ended_at")?,
            end_reason: r.get("end_reason")?,
            auto_pause: r.get::<_, i64>("auto_pause")? != 0,
            driver: r.get("driver")?,
            pause_mode: r
                .get::<_, Option<String>>("pause_mode")?
                .as_deref()
                .and_then(PauseMode::parse),
            auto_resume: r.get::<_, i64>("auto_resume")? != 0,
            auto_pause_memory: r.get::<_, i64>("auto_pause_memory")? != 0,
            team: r.get("team")?,
            ingress: super::Ingress {
                traffic_token: r.get("traffic_token")?,
                mask_request_host: r.get("mask_request_host")?,
            },
        },
        r.get("metadata")?,
        r.get("env_vars")?,
    ))
}

pub(super) fn finish(row: (SandboxRecord, String, String)) -> Result<SandboxRecord> {
    let (mut s, md, env) = row;
    s.metadata = serde_json::from_str(&md)?;
    s.env_vars = serde_json::from_str(&env)?;
    Ok(s)
}

pub(super) fn snapshot_from_row(r: &Row<'_>) -> rusqlite::Result<(SnapshotRecord, String)> {
    Ok((
        SnapshotRecord {
            id: r.get("id")?,
            name: r.get("name")?,
            sandbox_id: r.get("sandbox_id")?,
            template_id: r.get("template_id")?,
            envd_token: r.get("envd_token")?,
            env_vars: BTreeMap::new(),
            created_at_ms: r.get("created_at")?,
            size_bytes: r.get::<_, i64>("size_bytes")? as u64,
            team: r.get("team")?,
        },
        r.get("env_vars")?,
    ))
}

pub(super) fn finish_snapshot(row: (SnapshotRecord, String)) -> Result<SnapshotRecord> {
    let (mut s, env) = row;
    s.env_vars = serde_json::from_str(&env)?;
    Ok(s)
}

pub(super) fn key_from_row(r: &Row<'_>) -> rusqlite::Result<KeyRecord> {
    Ok(KeyRecord {
        id: r.get("id")?,
        name: r.get("name")?,
        prefix: r.get("prefix")?,
        hash: r.get("hash")?,
        created_at_ms: r.get("created_at")?,
        last_used_ms: r.get("last_used")?,
        revoked_at_ms: r.get("revoked_at")?,
        team: r.get("team")?,
    })
}
