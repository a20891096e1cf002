//! Versioned schema migrations of the SQLite store, tracked in `PRAGMA user_version`.
//!
//! Migration `n` (1-based) takes a database at version `n - 1` to version `n`. Version 0 is
//! both "empty file" and "written by a kiln from before versioning" (whose schema is exactly
//! migration 1, created with `IF NOT EXISTS`, so applying it to such a file is a no-op).
//! Never edit a migration that has shipped: append a new one.

use rusqlite::Connection;

use super::{Result, StoreError};

/// The schema migrations, oldest first.
pub const MIGRATIONS: &[&str] = &[
    // 1: the schema of kiln 0.1 (unversioned).
    "
    CREATE TABLE IF NOT EXISTS sandboxes (
        id TEXT PRIMARY KEY,
        template_id TEXT NOT NULL,
        alias TEXT,
        client_id TEXT NOT NULL,
        state TEXT NOT NULL,
        metadata TEXT NOT NULL,
        env_vars TEXT NOT NULL,
        cpu_count INTEGER NOT NULL,
        memory_mb INTEGER NOT NULL,
        disk_size_mb INTEGER NOT NULL,
        envd_token TEXT,
        started_at INTEGER NOT NULL,
        end_at INTEGER NOT NULL,
        ended_at INTEGER,
        end_reason TEXT,
        auto_pause INTEGER NOT NULL DEFAULT 0,
        driver TEXT NOT NULL
    );
    CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
    CREATE TABLE IF NOT EXISTS api_keys (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        prefix TEXT NOT NULL,
        hash TEXT NOT NULL UNIQUE,
        created_at INTEGER NOT NULL,
        last_used INTEGER,
        revoked_at INTEGER
    );
    CREATE TABLE IF NOT EXISTS events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        ts INTEGER NOT NULL,
        sandbox_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        detail TEXT NOT NULL
    );
    CREATE INDEX IF NOT EXISTS events_sandbox ON events(sandbox_id);
    CREATE TABLE IF NOT EXISTS templates (
        name TEXT PRIMARY KEY,
        key TEXT NOT NULL,
        built_at INTEGER NOT NULL,
        size_bytes INTEGER NOT NULL,
        spawn_count INTEGER NOT NULL DEFAULT 0,
        last_spawned INTEGER
    );
    ",
    // 2: expiry is a query on the store (the reaper asks for running sandboxes past their
    // end), and templates remember their ext4 image for drivers that boot from one.
    "
    CREATE INDEX IF NOT EXISTS sandboxes_state_end ON sandboxes(state, end_at);
    ALTER TABLE templates ADD COLUMN image TEXT;
    ",
    // 3: paused sandboxes remember what their pause saved (`full` or `filesystem`), whether
    // traffic resumes them and what an auto-pause keeps; snapshots of sandboxes.
    "
    ALTER TABLE sandboxes ADD COLUMN pause_mode TEXT;
    ALTER TABLE sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN auto_pause_memory INTEGER NOT NULL DEFAULT 1;
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY,
        name TEXT UNIQUE,
        sandbox_id TEXT NOT NULL,
        template_id TEXT NOT NULL,
        envd_token TEXT,
        env_vars TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        size_bytes INTEGER NOT NULL
    );
    ",
    // 4: the events API reads the event log by time too; webhooks (per team), their
    // persisted delivery queue and log, and the dispatcher's cursor into the event log.
    "
    CREATE INDEX IF NOT EXISTS events_ts ON events(ts);
    CREATE TABLE webhooks (
        id TEXT PRIMARY KEY,
        team TEXT NOT NULL DEFAULT 'default',
        url TEXT NOT NULL,
        secret TEXT NOT NULL,
        events TEXT NOT NULL,
        created_at INTEGER NOT NULL
    );
    CREATE INDEX webhooks_team ON webhooks(team);
    CREATE TABLE webhook_deliveries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        webhook_id TEXT NOT NULL,
        event_seq INTEGER,
        kind TEXT NOT NULL,
        payload TEXT NOT NULL,
        status TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_at INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        last_attempt_at INTEGER,
        last_status INTEGER,
        last_error TEXT
    );
    CREATE INDEX webhook_deliveries_due ON webhook_deliveries(status, next_attempt_at);
    CREATE INDEX webhook_deliveries_hook ON webhook_deliveries(webhook_id, id);
    CREATE TABLE webhook_cursor (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        seq INTEGER NOT NULL
    );
    INSERT INTO webhook_cursor (id, seq) SELECT 1, COALESCE(MAX(seq), 0) FROM events;
    ",
    // 5: tenancy. API keys belong to a team; sandboxes and snapshots to the team of the key
    // that made them (everything before teams existed belongs to `default`). Per-team quotas
    // (NULL: the server's default).
    "
    ALTER TABLE api_keys ADD COLUMN team TEXT NOT NULL DEFAULT 'default';
    ALTER TABLE sandboxes ADD COLUMN team TEXT NOT NULL DEFAULT 'default';
    ALTER TABLE snapshots ADD COLUMN team TEXT NOT NULL DEFAULT 'default';
    CREATE INDEX sandboxes_team ON sandboxes(team, state);
    CREATE TABLE teams (
        name TEXT PRIMARY KEY,
        max_sandboxes INTEGER,
        max_timeout_secs INTEGER,
        creates_per_minute INTEGER,
        created_at INTEGER NOT NULL
    );
    ",
    // 6: the audit log (crates/server/src/audit): one hash chain of records per sandbox, the
    // head of each chain, and the anchor retention leaves where it pruned a chain's start.
    "
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        ts INTEGER NOT NULL,
        kind TEXT NOT NULL,
        body TEXT NOT NULL,
        prev_hash TEXT NOT NULL,
        hash TEXT NOT NULL,
        UNIQUE (sandbox_id, seq)
    );
    CREATE INDEX audit_ts ON audit(ts);
    CREATE TABLE audit_heads (
        sandbox_id TEXT PRIMARY KEY,
        seq INTEGER NOT NULL,
        hash TEXT NOT NULL
    );
    CREATE TABLE audit_anchors (
        sandbox_id TEXT PRIMARY KEY,
        seq INTEGER NOT NULL,
        hash TEXT NOT NULL,
        pruned_at INTEGER NOT NULL
    );
    ",
    // 7: metrics history (crates/server/src/obs/persist.rs): the samples each live or paused
    // sandbox's ring keeps, so a restarted server still answers `get_metrics(start, end)` for
    // the time before; bounded like the ring, deleted with the sandbox.
    "
    CREATE TABLE metric_samples (
        sandbox_id TEXT NOT NULL,
        ts INTEGER NOT NULL,
        cpu_count INTEGER NOT NULL,
        cpu_used_pct REAL NOT NULL,
        mem_used INTEGER NOT NULL,
        mem_total INTEGER NOT NULL,
        mem_cache INTEGER NOT NULL,
        disk_used INTEGER NOT NULL,
        disk_total INTEGER NOT NULL,
        PRIMARY KEY (sandbox_id, ts)
    ) WITHOUT ROWID;
    ",
    // 8: answers of creates made with an Idempotency-Key (crates/server/src/api/idempotency.rs),
    // so a create retried after a restart returns the same sandbox.
    "
    CREATE TABLE idempotency (
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        status INTEGER NOT NULL,
        content_type TEXT,
        body BLOB NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (scope, key)
    );
    CREATE INDEX idempotency_created ON idempotency(created_at);
    ",
    // 9: alerts raised by the rule engine over the audit stream (crates/server/src/alerts/,
    // store/alerts_sql.rs): what fired, where, and the audit records that triggered it.
    "
    CREATE TABLE alerts (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts INTEGER NOT NULL,
        sandbox_id TEXT NOT NULL,
        team TEXT,
        rule TEXT NOT NULL,
        priority TEXT NOT NULL,
        output TEXT NOT NULL,
        tags TEXT NOT NULL,
        actions TEXT NOT NULL,
        records TEXT NOT NULL
    );
    CREATE INDEX alerts_sandbox ON alerts(sandbox_id, id);
    CREATE INDEX alerts_rule ON alerts(rule, id);
    CREATE INDEX alerts_ts ON alerts(ts);
    ",
    // 10: secrets (crates/server/src/store/secrets_sql.rs): per team, the current version's
    // value encrypted with the server's key (AEAD; never stored or returned in clear); the
    // `mcp` field sandboxes were created with (echoed by get_info).
    "
    CREATE TABLE secrets (
        id TEXT PRIMARY KEY,
        team TEXT NOT NULL,
        name TEXT NOT NULL,
        version INTEGER NOT NULL,
        metadata TEXT NOT NULL,
        sealed BLOB NOT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        UNIQUE (team, name)
    );
    CREATE INDEX secrets_team_created ON secrets(team, created_at, id);
    CREATE TABLE sandbox_mcp (
        sandbox_id TEXT PRIMARY KEY,
        mcp TEXT NOT NULL
    );
    ",
    // 11: templates built through E2B's Template API (crates/server/src/tplbuild/,
    // store/tplbuild_sql.rs): per team, their builds (status, the spec, what a template's
    // sandboxes start from), the build log, tags, the step cache and uploaded COPY archives.
    "
    CREATE TABLE tpl_templates (
        id TEXT PRIMARY KEY,
        team TEXT NOT NULL,
        name TEXT NOT NULL,
        public INTEGER NOT NULL DEFAULT 0,
        cpu_count INTEGER,
        memory_mb INTEGER,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        UNIQUE (team, name)
    );
    CREATE TABLE tpl_builds (
        id TEXT PRIMARY KEY,
        template_id TEXT NOT NULL,
        status TEXT NOT NULL,
        tags TEXT NOT NULL,
        spec TEXT,
        reason TEXT,
        reason_step TEXT,
        target TEXT,
        user_name TEXT,
        workdir TEXT,
        created_at INTEGER NOT NULL,
        finished_at INTEGER
    );
    CREATE INDEX tpl_builds_template ON tpl_builds(template_id, created_at);
    CREATE TABLE tpl_build_logs (
        build_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        ts INTEGER NOT NULL,
        level TEXT NOT NULL,
        step TEXT,
        message TEXT NOT NULL,
        PRIMARY KEY (build_id, seq)
    ) WITHOUT ROWID;
    CREATE TABLE tpl_tags (
        template_id TEXT NOT NULL,
        tag TEXT NOT NULL,
        build_id TEXT NOT NULL,
        assigned_at INTEGER NOT NULL,
        PRIMARY KEY (template_id, tag)
    );
    CREATE TABLE tpl_layers (
        team TEXT NOT NULL,
        key TEXT NOT NULL,
        snapshot_id TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (team, key)
    );
    CREATE TABLE tpl_files (
        team TEXT NOT NULL,
        hash TEXT NOT NULL,
        size INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (team, hash)
    );
    ",
    // 12: volumes (crates/server/src/store/volumes_sql.rs): per team, with the volume-content
    // API's token and the size of the volume's filesystem; the volumes each sandbox mounts.
    // The `network.rules`/`egressProxy` a sandbox runs with, sealed by the vault (they hold
    // the proxy's password), to apply them again after a restart.
    "
    CREATE TABLE volumes (
        id TEXT PRIMARY KEY,
        team TEXT NOT NULL,
        name TEXT NOT NULL,
        token TEXT NOT NULL,
        size_mb INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        UNIQUE (team, name)
    );
    CREATE TABLE sandbox_volumes (
        sandbox_id TEXT NOT NULL,
        volume_id TEXT NOT NULL,
        name TEXT NOT NULL,
        path TEXT NOT NULL,
        PRIMARY KEY (sandbox_id, path)
    );
    CREATE INDEX sandbox_volumes_volume ON sandbox_volumes(volume_id);
    CREATE TABLE sandbox_network (
        sandbox_id TEXT PRIMARY KEY,
        team TEXT NOT NULL,
        sealed BLOB NOT NULL
    );
    ",
    // 13: alerts are incidents (crates/rules/src/incident.rs): repeats of one incident on one
    // sandbox update its alert (how many, the newest time, every rule that fired in it).
    "
    ALTER TABLE alerts ADD COLUMN count INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE alerts ADD COLUMN last_ts INTEGER;
    ALTER TABLE alerts ADD COLUMN rules TEXT;
    ALTER TABLE alerts ADD COLUMN incident TEXT;
    ",
    // 14: template builds (crates/server/src/store/tplbuild_tags_sql.rs, tplbuild_gc_sql.rs):
    // every assignment of a tag to a build (E2B's tag groups and assignments; the current
    // ones are seeded from `tpl_tags`), the step-cache layers each build used or made (what
    // the garbage collection keeps for the builds still named), and the snapshots of deleted
    // templates it has yet to remove (kept while a sandbox runs on them).
    "
    CREATE TABLE tpl_tag_assignments (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        template_id TEXT NOT NULL,
        tag TEXT NOT NULL,
        build_id TEXT NOT NULL,
        assigned_at INTEGER NOT NULL
    );
    CREATE INDEX tpl_tag_assignments_tag ON tpl_tag_assignments(template_id, tag, seq);
    INSERT INTO tpl_tag_assignments (id, template_id, tag, build_id, assigned_at)
        SELECT lower(hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4'
                 || substr(hex(randomblob(2)), 2) || '-a' || substr(hex(randomblob(2)), 2)
                 || '-' || hex(randomblob(6))),
               template_id, tag, build_id, assigned_at
        FROM tpl_tags ORDER BY assigned_at;
    CREATE TABLE tpl_build_layers (
        build_id TEXT NOT NULL,
        snapshot_id TEXT NOT NULL,
        PRIMARY KEY (build_id, snapshot_id)
    ) WITHOUT ROWID;
    CREATE INDEX tpl_build_layers_snapshot ON tpl_build_layers(snapshot_id);
    CREATE TABLE tpl_orphans (
        team TEXT NOT NULL,
        snapshot_id TEXT NOT NULL,
        PRIMARY KEY (team, snapshot_id)
    ) WITHOUT ROWID;
    ",
    // 15: web console sessions (crates/server/src/store/console_sql.rs), so a restart signs
    // no one out: the SHA-256 of the session id (the cookie's value) and of the API key it
    // was opened with, and when it ends.
    "
    CREATE TABLE console_sessions (
        id_hash TEXT PRIMARY KEY,
        key_hash TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX console_sessions_expiry ON console_sessions(expires_at);
    ",
    // 16: a team's own volume cap (`kiln team set T --max-volumes N`; NULL: the server's
    // `--team-max-volumes`).
    "
    ALTER TABLE teams ADD COLUMN max_volumes INTEGER;
    ",
    // 17: the uploaded COPY archive a step-cache entry was made from (its `filesHash`), so
    // the template collection keeps the archives cache entries name
    // (crates/server/src/store/tplbuild_gc_sql.rs).
    "
    ALTER TABLE tpl_layers ADD COLUMN files_hash TEXT;
    ",
    // 18: a sandbox's ingress settings (E2B's `trafficAccessToken` of `allowPublicTraffic=false`
    // and `maskRequestHost`; NULL: public, kiln's Host), which the proxy reads from the record.
    // A sandbox of an older kiln gets them from its driver at recovery.
    "
    ALTER TABLE sandboxes ADD COLUMN traffic_token TEXT;
    ALTER TABLE sandboxes ADD COLUMN mask_request_host TEXT;
    ",
];

/// Schema version this kiln writes.
pub const CURRENT_VERSION: i64 = MIGRATIONS.len() as i64;

/// The database's schema version.
pub fn version(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row("PRAGMA user_version", [], |r| r.get(0))?)
}

/// Brings the database to [`CURRENT_VERSION`], one transaction per migration, so a crash
/// mid-upgrade leaves the file at the last completed version.
pub fn migrate(conn: &mut Connection) -> Result<()> {
    let found = version(conn)?;
    if found > CURRENT_VERSION {
        return Err(StoreError::TooNew {
            found,
            known: CURRENT_VERSION,
        });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        let v = i as i64 + 1;
        let step = |conn: &mut Connection| -> rusqlite::Result<()> {
            let tx = conn.transaction()?;
            tx.execute_batch(sql)?;
            tx.pragma_update(None, "user_version", v)?;
            tx.commit()
        };
        step(conn).map_err(|source| StoreError::Migration { version: v, source })?;
        tracing::debug!(version = v, "state database migrated");
    }
    Ok(())
}
