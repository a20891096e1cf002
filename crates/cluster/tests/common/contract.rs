//! The behaviours every `StateStore` must have, written once against the trait and run on
//! both SQLite (the reference) and etcd. They follow the SQLite store's own unit tests.

use std::collections::BTreeMap;

use kiln_server::store::{
    IdempotentAnswer, Ingress, KeyRecord, PauseMode, SandboxRecord, SandboxState, SnapshotRecord,
    StateStore, TeamRecord, TemplateRecord,
};

use super::contract_events;

pub fn sample(id: &str, state: SandboxState) -> SandboxRecord {
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
        driver: "microvm".into(),
        team: "default".into(),
        ..Default::default()
    }
}

/// Every behaviour, on a store that starts empty.
pub async fn run(s: &dyn StateStore) {
    sandboxes_round_trip_and_change_state(s).await;
    pauses_are_recorded_with_their_mode(s).await;
    ingress_settings_are_kept_and_replaced(s).await;
    expired_lists_only_running_sandboxes_past_their_end(s).await;
    keys_and_templates(s).await;
    teams(s).await;
    snapshots(s).await;
    contract_events::events_and_pages(s).await;
    contract_events::webhooks(s).await;
    contract_events::cursor_pages_never_skip_or_repeat(s).await;
    contract_events::deliveries_are_queued_once_filtered_and_retried(s).await;
    contract_events::large_batches_are_queued_in_parts_exactly_once(s).await;
    idempotent_answers(s).await;
}

async fn sandboxes_round_trip_and_change_state(s: &dyn StateStore) {
    let mut a = sample("a", SandboxState::Running);
    a.metadata.insert("slash/key".into(), "ü".into());
    s.insert_sandbox(&a).await.unwrap();
    s.insert_sandbox(&sample("b", SandboxState::Starting))
        .await
        .unwrap();
    assert!(
        s.insert_sandbox(&sample("a", SandboxState::Running))
            .await
            .is_err(),
        "a duplicate id is refused"
    );
    s.set_end_at("a", 5000).await.unwrap();
    s.set_state("b", SandboxState::Killed, Some("expired"))
        .await
        .unwrap();
    let mut want = a.clone();
    want.end_at_ms = 5000;
    assert_eq!(s.get_sandbox("a").await.unwrap(), Some(want));
    let b = s.get_sandbox("b").await.unwrap().unwrap();
    assert_eq!(b.state, SandboxState::Killed);
    assert_eq!(b.end_reason.as_deref(), Some("expired"));
    assert!(b.ended_at_ms.is_some());
    let running = s.list_sandboxes(&[SandboxState::Running]).await.unwrap();
    assert_eq!(
        running.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["a"]
    );
    assert_eq!(s.list_sandboxes(&[]).await.unwrap().len(), 2);
    assert!(s.get_sandbox("zzz").await.unwrap().is_none());
    // Changes to a sandbox that does not exist change nothing and are not errors.
    s.set_state("zzz", SandboxState::Killed, None)
        .await
        .unwrap();
    s.set_end_at("zzz", 1).await.unwrap();
    assert!(s.get_sandbox("zzz").await.unwrap().is_none());
    // A reason-less state change keeps the reason recorded before.
    s.set_state("b", SandboxState::Failed, None).await.unwrap();
    let b = s.get_sandbox("b").await.unwrap().unwrap();
    assert_eq!(
        (b.state, b.end_reason.as_deref()),
        (SandboxState::Failed, Some("expired"))
    );
    for id in ["a", "b"] {
        s.set_state(id, SandboxState::Killed, Some("test"))
            .await
            .unwrap();
    }
}

async fn pauses_are_recorded_with_their_mode(s: &dyn StateStore) {
    let mut rec = sample("p", SandboxState::Running);
    rec.auto_resume = true;
    rec.end_at_ms = 1;
    s.insert_sandbox(&rec).await.unwrap();
    assert_eq!(s.expired(10).await.unwrap(), ["p"]);
    s.set_paused("p", PauseMode::Filesystem).await.unwrap();
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
    assert_eq!(
        s.expired(10).await.unwrap(),
        ["p"],
        "running again: it can expire"
    );
    s.set_state("p", SandboxState::Killed, None).await.unwrap();
    assert!(s.expired(10_000).await.unwrap().is_empty());
}

async fn ingress_settings_are_kept_and_replaced(s: &dyn StateStore) {
    let private = Ingress {
        traffic_token: Some("traffic".into()),
        mask_request_host: Some("app-${PORT}.local".into()),
    };
    let mut rec = sample("ing1", SandboxState::Running);
    rec.ingress = private.clone();
    s.insert_sandbox(&rec).await.unwrap();
    s.insert_sandbox(&sample("ing2", SandboxState::Running))
        .await
        .unwrap();
    assert_eq!(
        s.get_sandbox("ing1").await.unwrap().unwrap().ingress,
        private
    );
    assert!(s
        .get_sandbox("ing2")
        .await
        .unwrap()
        .unwrap()
        .ingress
        .is_public());
    s.set_ingress("ing2", &private).await.unwrap();
    s.set_ingress("ing1", &Ingress::default()).await.unwrap();
    assert_eq!(
        s.get_sandbox("ing2").await.unwrap().unwrap().ingress,
        private
    );
    assert!(s
        .get_sandbox("ing1")
        .await
        .unwrap()
        .unwrap()
        .ingress
        .is_public());
    // Only the ingress changed.
    assert_eq!(
        s.get_sandbox("ing1").await.unwrap().unwrap(),
        sample("ing1", SandboxState::Running)
    );
    // A sandbox that does not exist: nothing changes, no error.
    s.set_ingress("zzz", &private).await.unwrap();
    assert!(s.get_sandbox("zzz").await.unwrap().is_none());
    for id in ["ing1", "ing2"] {
        s.set_state(id, SandboxState::Killed, Some("test"))
            .await
            .unwrap();
    }
}

async fn expired_lists_only_running_sandboxes_past_their_end(s: &dyn StateStore) {
    for (id, state, end) in [
        ("due", SandboxState::Running, 100),
        ("later", SandboxState::Running, 10_000),
        ("before", SandboxState::Running, -5),
        ("paused", SandboxState::Paused, 50),
        ("killed", SandboxState::Killed, 50),
        ("starting", SandboxState::Starting, 50),
    ] {
        let mut r = sample(id, state);
        r.end_at_ms = end;
        s.insert_sandbox(&r).await.unwrap();
    }
    assert_eq!(s.expired(1000).await.unwrap(), ["before", "due"]);
    assert_eq!(
        s.expired(100).await.unwrap(),
        ["before", "due"],
        "at the end is due"
    );
    assert_eq!(s.expired(99).await.unwrap(), ["before"]);
    s.set_end_at("due", 5000).await.unwrap();
    s.set_state("before", SandboxState::Killed, None)
        .await
        .unwrap();
    assert!(s.expired(1000).await.unwrap().is_empty());
    assert_eq!(s.expired(20_000).await.unwrap(), ["due", "later"]);
    assert_eq!(s.expired(i64::MAX).await.unwrap(), ["due", "later"]);
    s.set_running("starting", 7, "no-such-template")
        .await
        .unwrap();
    assert_eq!(
        s.expired(20_000).await.unwrap(),
        ["starting", "due", "later"]
    );
    for id in ["due", "later", "starting"] {
        s.set_state(id, SandboxState::Killed, None).await.unwrap();
    }
    assert!(s.expired(i64::MAX).await.unwrap().is_empty());
}

async fn keys_and_templates(s: &dyn StateStore) {
    let k = KeyRecord {
        id: "k1".into(),
        name: "first".into(),
        prefix: "e2b_12".into(),
        hash: "h".into(),
        created_at_ms: 1,
        last_used_ms: None,
        revoked_at_ms: None,
        team: "red".into(),
    };
    s.insert_key(&k).await.unwrap();
    assert!(
        s.insert_key(&k).await.is_err(),
        "a duplicate key is refused"
    );
    let mut k0 = k.clone();
    (k0.id, k0.hash, k0.created_at_ms) = ("k0".into(), "h0".into(), 0);
    s.insert_key(&k0).await.unwrap();
    assert_eq!(s.key_by_hash("h").await.unwrap().unwrap(), k);
    assert!(s.key_by_hash("nope").await.unwrap().is_none());
    s.touch_key("k1").await.unwrap();
    let keys = s.list_keys().await.unwrap();
    assert_eq!(
        keys.iter().map(|k| k.id.as_str()).collect::<Vec<_>>(),
        ["k0", "k1"]
    );
    assert!(keys[1].last_used_ms.is_some());
    assert!(s.revoke_key("k1").await.unwrap());
    assert!(
        !s.revoke_key("k1").await.unwrap(),
        "second revoke is a no-op"
    );
    assert!(!s.revoke_key("nope").await.unwrap());
    let got = s.key_by_hash("h").await.unwrap().unwrap();
    assert!(got.revoked_at_ms.is_some());
    assert_eq!(got.team, "red");

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
    let mut t2 = t.clone();
    t2.key = "def".into();
    s.upsert_template(&t2).await.unwrap(); // re-upsert keeps the counters
    let got = s.get_template("base").await.unwrap().unwrap();
    assert_eq!((got.spawn_count, got.key.as_str()), (1, "def"));
    assert!(got.last_spawned_ms.is_some());
    assert_eq!(got.image.as_deref(), Some("/t/rootfs.ext4"));
    assert!(s.get_template("nope").await.unwrap().is_none());
    s.set_state("from-base", SandboxState::Killed, None)
        .await
        .unwrap();
}

async fn teams(s: &dyn StateStore) {
    assert!(s.get_team("red").await.unwrap().is_none());
    let mut t = TeamRecord {
        name: "red".into(),
        max_sandboxes: Some(3),
        max_timeout_secs: Some(3600),
        creates_per_minute: None,
        max_volumes: Some(5),
        created_at_ms: 7,
    };
    s.upsert_team(&t).await.unwrap();
    assert_eq!(s.get_team("red").await.unwrap(), Some(t.clone()));
    t.max_sandboxes = None;
    t.created_at_ms = 99;
    s.upsert_team(&t).await.unwrap();
    let got = s.get_team("red").await.unwrap().unwrap();
    assert_eq!(
        (got.max_sandboxes, got.created_at_ms),
        (None, 7),
        "created_at is kept"
    );
    s.upsert_team(&TeamRecord {
        name: "blue".into(),
        ..TeamRecord::default()
    })
    .await
    .unwrap();
    let names: Vec<String> = s
        .list_teams()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, ["blue", "red"]);
}

async fn snapshots(s: &dyn StateStore) {
    let snap = |id: &str, name: Option<&str>, at: i64| SnapshotRecord {
        id: id.into(),
        name: name.map(str::to_string),
        sandbox_id: "a".into(),
        template_id: "base".into(),
        envd_token: Some("t".into()),
        env_vars: BTreeMap::from([("E".into(), "2".into())]),
        created_at_ms: at,
        size_bytes: 1 << 40,
        team: "red".into(),
    };
    s.insert_snapshot(&snap("s2", Some("named"), 20))
        .await
        .unwrap();
    s.insert_snapshot(&snap("s1", None, 10)).await.unwrap();
    assert!(s.insert_snapshot(&snap("s1", None, 10)).await.is_err());
    assert!(
        s.insert_snapshot(&snap("s3", Some("named"), 30))
            .await
            .is_err(),
        "names are unique"
    );
    assert_eq!(
        s.get_snapshot("s2").await.unwrap(),
        Some(snap("s2", Some("named"), 20))
    );
    assert_eq!(s.get_snapshot("named").await.unwrap().unwrap().id, "s2");
    assert!(s.get_snapshot("nope").await.unwrap().is_none());
    let ids: Vec<String> = s
        .list_snapshots()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(ids, ["s1", "s2"]);
    assert!(s.delete_snapshot("s2").await.unwrap());
    assert!(!s.delete_snapshot("s2").await.unwrap());
    assert!(s.get_snapshot("named").await.unwrap().is_none());
    // The name is free again.
    s.insert_snapshot(&snap("s3", Some("named"), 30))
        .await
        .unwrap();
    assert_eq!(s.get_snapshot("named").await.unwrap().unwrap().id, "s3");
}

async fn idempotent_answers(s: &dyn StateStore) {
    let answer = |key: &str, at: i64, body: &[u8]| IdempotentAnswer {
        scope: "red/POST /sandboxes".into(),
        key: key.into(),
        fingerprint: "f".into(),
        status: 201,
        content_type: Some("application/json".into()),
        body: body.to_vec(),
        created_at_ms: at,
    };
    assert!(s
        .get_idempotent("red/POST /sandboxes", "k", 0)
        .await
        .unwrap()
        .is_none());
    s.put_idempotent(&answer("k", 100, b"{\"a\":1}\0\xff"))
        .await
        .unwrap();
    s.put_idempotent(&answer("old", 10, b"x")).await.unwrap();
    assert_eq!(
        s.get_idempotent("red/POST /sandboxes", "k", 50)
            .await
            .unwrap(),
        Some(answer("k", 100, b"{\"a\":1}\0\xff"))
    );
    assert!(s.get_idempotent("other", "k", 50).await.unwrap().is_none());
    assert!(
        s.get_idempotent("red/POST /sandboxes", "old", 50)
            .await
            .unwrap()
            .is_none(),
        "too old"
    );
    assert!(
        s.get_idempotent("red/POST /sandboxes", "old", 0)
            .await
            .unwrap()
            .is_none(),
        "and deleted"
    );
    s.put_idempotent(&answer("k", 200, b"new")).await.unwrap();
    assert_eq!(
        s.get_idempotent("red/POST /sandboxes", "k", 150)
            .await
            .unwrap()
            .unwrap()
            .body,
        b"new"
    );
}
