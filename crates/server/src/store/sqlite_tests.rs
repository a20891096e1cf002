use std::collections::BTreeMap;

use super::*;
use crate::store::{CURRENT_VERSION, MIGRATIONS};

pub(crate) fn sample(id: &str, state: SandboxState) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        alias: Some("base".into()),
        client_id: "kiln".into(),
        state,
        metadata: BTreeMap::from([("k".into(), "v".into())]),
        env_vars: BTreeMap::from([("A".into(), "1".into())]),
        cpu_count: 2,
        disk_size_mb: 1024,
        envd_token: Some("tok".into()),
        started_at_ms: 1000,
        end_at_ms: 2000,
        driver: "gvisor".into(),
        team: "default".into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn ingress_settings_are_kept_and_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kiln.db");
    let private = kiln_net::Ingress {
        traffic_token: Some("traffic".into()),
        mask_request_host: Some("app-${PORT}.local".into()),
    };
    {
        let s = SqliteStore::open(&db).unwrap();
        let mut rec = sample("i", SandboxState::Running);
        rec.ingress = private.clone();
        s.insert_sandbox(&rec).await.unwrap();
        s.insert_sandbox(&sample("j", SandboxState::Running))
            .await
            .unwrap();
    }
    let s = SqliteStore::open(&db).unwrap();
    assert_eq!(s.get_sandbox("i").await.unwrap().unwrap().ingress, private);
    assert!(s
        .get_sandbox("j")
        .await
        .unwrap()
        .unwrap()
        .ingress
        .is_public());
    s.set_ingress("j", &private).await.unwrap();
    assert_eq!(s.get_sandbox("j").await.unwrap().unwrap().ingress, private);
    s.set_ingress("i", &Default::default()).await.unwrap();
    let listed = s.list_sandboxes(&[SandboxState::Running]).await.unwrap();
    assert_eq!(listed[0].ingress, kiln_net::Ingress::default());
    assert_eq!(listed[1].ingress, private);
}

#[tokio::test]
async fn pauses_are_recorded_with_their_mode() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kiln.db");
    {
        let s = SqliteStore::open(&db).unwrap();
        let mut rec = sample("p", SandboxState::Running);
        rec.auto_resume = true;
        s.insert_sandbox(&rec).await.unwrap();
        s.set_paused("p", PauseMode::Filesystem).await.unwrap();
    }
    let s = SqliteStore::open(&db).unwrap();
    let got = s.get_sandbox("p").await.unwrap().unwrap();
    assert_eq!(got.state, SandboxState::Paused);
    assert_eq!(got.pause_mode, Some(PauseMode::Filesystem));
    assert!(got.auto_resume);
    assert_eq!(got.ended_at_ms, None, "a paused sandbox has not ended");
    // A paused sandbox never expires.
    s.set_end_at("p", 1).await.unwrap();
    assert!(s.expired(10_000).await.unwrap().is_empty());
    s.set_state("p", SandboxState::Running, None).await.unwrap();
    let got = s.get_sandbox("p").await.unwrap().unwrap();
    assert_eq!(got.state, SandboxState::Running);
    assert_eq!(
        got.pause_mode,
        Some(PauseMode::Filesystem),
        "the last pause's mode stays"
    );
}

#[tokio::test]
async fn sandbox_roundtrip_and_state_changes_persist_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kiln.db");
    {
        let s = SqliteStore::open(&db).unwrap();
        s.insert_sandbox(&sample("a", SandboxState::Running))
            .await
            .unwrap();
        s.insert_sandbox(&sample("b", SandboxState::Starting))
            .await
            .unwrap();
        s.set_end_at("a", 5000).await.unwrap();
        s.set_state("b", SandboxState::Killed, Some("expired"))
            .await
            .unwrap();
        s.add_event("a", "created", "template base").await.unwrap();
    }
    // Reopen: everything was written through to the file, which only its owner can read.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&db).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let s = SqliteStore::open(&db).unwrap();
    let a = s.get_sandbox("a").await.unwrap().unwrap();
    let mut want = sample("a", SandboxState::Running);
    want.end_at_ms = 5000;
    assert_eq!(a, want);
    let b = s.get_sandbox("b").await.unwrap().unwrap();
    assert_eq!(b.state, SandboxState::Killed);
    assert_eq!(b.end_reason.as_deref(), Some("expired"));
    assert!(b.ended_at_ms.is_some());
    let running = s.list_sandboxes(&[SandboxState::Running]).await.unwrap();
    assert_eq!(running.len(), 1);
    assert_eq!(running[0].id, "a");
    assert_eq!(s.list_sandboxes(&[]).await.unwrap().len(), 2);
    assert!(s.get_sandbox("zzz").await.unwrap().is_none());
    let ev = s.events("a").await.unwrap();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].kind, "created");
}

#[tokio::test]
async fn expired_lists_only_running_sandboxes_past_their_end() {
    let s = SqliteStore::open_in_memory().unwrap();
    for (id, state, end) in [
        ("due", SandboxState::Running, 100),
        ("later", SandboxState::Running, 10_000),
        ("paused", SandboxState::Paused, 50),
        ("killed", SandboxState::Killed, 50),
    ] {
        let mut r = sample(id, state);
        r.end_at_ms = end;
        s.insert_sandbox(&r).await.unwrap();
    }
    assert_eq!(s.expired(1000).await.unwrap(), vec!["due".to_string()]);
    s.set_end_at("due", 5000).await.unwrap();
    assert!(s.expired(1000).await.unwrap().is_empty());
    assert_eq!(s.expired(20_000).await.unwrap(), vec!["due", "later"]);
}

#[tokio::test]
async fn duplicate_sandbox_id_is_rejected() {
    let s = SqliteStore::open_in_memory().unwrap();
    s.insert_sandbox(&sample("a", SandboxState::Running))
        .await
        .unwrap();
    assert!(s
        .insert_sandbox(&sample("a", SandboxState::Running))
        .await
        .is_err());
}

#[tokio::test]
async fn keys_and_templates() {
    let s = SqliteStore::open_in_memory().unwrap();
    let k = KeyRecord {
        id: "k1".into(),
        name: "first".into(),
        prefix: "e2b_12".into(),
        hash: "h".into(),
        created_at_ms: 1,
        last_used_ms: None,
        revoked_at_ms: None,
        team: "default".into(),
    };
    s.insert_key(&k).await.unwrap();
    assert_eq!(s.key_by_hash("h").await.unwrap().unwrap().id, "k1");
    assert!(s.key_by_hash("nope").await.unwrap().is_none());
    s.touch_key("k1").await.unwrap();
    assert!(s.list_keys().await.unwrap()[0].last_used_ms.is_some());
    assert!(s.revoke_key("k1").await.unwrap());
    assert!(
        !s.revoke_key("k1").await.unwrap(),
        "second revoke is a no-op"
    );
    assert!(s
        .key_by_hash("h")
        .await
        .unwrap()
        .unwrap()
        .revoked_at_ms
        .is_some());

    let t = TemplateRecord {
        name: "base".into(),
        key: "abc".into(),
        built_at_ms: 7,
        size_bytes: 9,
        spawn_count: 0,
        last_spawned_ms: None,
        image: Some("/t/rootfs.ext4".into()),
    };
    s.upsert_template(&t).await.unwrap();
    s.insert_sandbox(&sample("from-base", SandboxState::Starting))
        .await
        .unwrap();
    s.set_running("from-base", 4242, "base").await.unwrap();
    let sbx = s.get_sandbox("from-base").await.unwrap().unwrap();
    assert_eq!((sbx.state, sbx.end_at_ms), (SandboxState::Running, 4242));
    s.upsert_template(&t).await.unwrap(); // re-upsert keeps the counters
    let got = s.get_template("base").await.unwrap().unwrap();
    assert_eq!(got.spawn_count, 1);
    assert!(got.last_spawned_ms.is_some());
    assert_eq!(got.image.as_deref(), Some("/t/rootfs.ext4"));
}

/// A database written by kiln 0.1 (no schema version, migration 1's tables) opens, is
/// upgraded in place, and keeps every row.
#[tokio::test]
async fn upgrade_from_the_unversioned_schema_keeps_data() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kiln.db");
    {
        let c = rusqlite::Connection::open(&db).unwrap();
        // Exactly what kiln 0.1 wrote: its schema, its rows, user_version 0.
        c.execute_batch(MIGRATIONS[0]).unwrap();
        c.execute(
            "INSERT INTO sandboxes (id, template_id, alias, client_id, state, metadata,
               env_vars, cpu_count, memory_mb, disk_size_mb, envd_token, started_at, end_at,
               ended_at, end_reason, auto_pause, driver)
             VALUES ('old1', 'base', 'base', 'kiln', 'running', '{\"team\":\"a\"}', '{}', 2,
               512, 2048, 'tok', 10, 20, NULL, NULL, 0, 'gvisor')",
            [],
        )
        .unwrap();
        c.execute(
            "INSERT INTO templates (name, key, built_at, size_bytes, spawn_count, last_spawned)
             VALUES ('base', 'k', 1, 2, 3, 4)",
            [],
        )
        .unwrap();
        c.execute(
            "INSERT INTO api_keys (id, name, prefix, hash, created_at) VALUES
             ('key_1', 'first', 'e2b_0', 'hash1', 5)",
            [],
        )
        .unwrap();
        let v: i64 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, 0);
    }
    let s = SqliteStore::open(&db).unwrap();
    assert_eq!(s.schema_version().unwrap(), CURRENT_VERSION);
    let r = s.get_sandbox("old1").await.unwrap().unwrap();
    assert_eq!(r.state, SandboxState::Running);
    assert_eq!(r.metadata.get("team").map(String::as_str), Some("a"));
    assert_eq!(r.envd_token.as_deref(), Some("tok"));
    assert!(r.ingress.is_public(), "no ingress settings in an old row");
    let t = s.get_template("base").await.unwrap().unwrap();
    assert_eq!((t.spawn_count, t.image), (3, None));
    assert!(s.key_by_hash("hash1").await.unwrap().is_some());
    // The new schema's query works on the upgraded file.
    assert_eq!(s.expired(100).await.unwrap(), vec!["old1".to_string()]);
    drop(s);
    // Opening again is a no-op.
    let s = SqliteStore::open(&db).unwrap();
    assert_eq!(s.schema_version().unwrap(), CURRENT_VERSION);
}

#[test]
fn a_database_from_a_newer_kiln_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kiln.db");
    {
        let c = rusqlite::Connection::open(&db).unwrap();
        c.pragma_update(None, "user_version", CURRENT_VERSION + 5)
            .unwrap();
    }
    let err = SqliteStore::open(&db).err().expect("must refuse");
    assert!(
        matches!(err, StoreError::TooNew { found, .. } if found == CURRENT_VERSION + 5),
        "{err}"
    );
    assert!(err.to_string().contains("upgrade kiln"), "{err}");
    let c = rusqlite::Connection::open(&db).unwrap();
    let v: i64 = c
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v, CURRENT_VERSION + 5, "left as it was");
}

#[tokio::test]
async fn a_read_only_open_reads_and_never_writes_or_migrates() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kiln.db");
    let rw = SqliteStore::open(&db).unwrap();
    rw.insert_sandbox(&sample("a", SandboxState::Running))
        .await
        .unwrap();
    let ro = SqliteStore::open_read_only(&db).unwrap();
    assert_eq!(ro.list_sandboxes(&[]).await.unwrap().len(), 1);
    assert!(ro.add_event("a", "exec", "").await.is_err(), "read only");
    drop((rw, ro));

    // A database at another version is refused and left as it was.
    let old = dir.path().join("old.db");
    rusqlite::Connection::open(&old)
        .unwrap()
        .pragma_update(None, "user_version", CURRENT_VERSION - 1)
        .unwrap();
    let err = SqliteStore::open_read_only(&old)
        .err()
        .expect("must refuse");
    assert!(matches!(err, StoreError::OtherVersion { .. }), "{err}");
    let v: i64 = rusqlite::Connection::open(&old)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v, CURRENT_VERSION - 1);
    // No file is made where none was.
    assert!(SqliteStore::open_read_only(&dir.path().join("none.db")).is_err());
    assert!(!dir.path().join("none.db").exists());
}
