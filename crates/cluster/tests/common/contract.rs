//! The behaviours every `StateStore` must have, written once against the trait and run on
//! both SQLite (the reference) and etcd. They follow the SQLite store's own unit tests.

use std::collections::BTreeMap;

use kiln_server::store::{
    Attempt, DeliveryStatus, EventQuery, IdempotentAnswer, KeyRecord, PauseMode, SandboxRecord,
    SandboxState, SnapshotRecord, StateStore, TeamRecord, TemplateRecord, WebhookRecord,
    DEFAULT_TEAM,
};

pub fn sample(id: &str, state: SandboxState) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        template_id: "base".into(),
        alias: Some("base".into()),
        client_id: "kiln".into(),
        state,
        metadata: BTreeMap::from([("k".into(), "v".into())]),
        env_vars: BTreeMap::from([("A".into(), "1".into())]),
        cpu_count: 2,
        memory_mb: 512,
        disk_size_mb: 1024,
        envd_token: Some("tok".into()),
        started_at_ms: 1000,
        end_at_ms: 2000,
        ended_at_ms: None,
        end_reason: None,
        auto_pause: false,
        driver: "microvm".into(),
        pause_mode: None,
        auto_resume: false,
        auto_pause_memory: true,
        team: "default".into(),
    }
}

/// Every behaviour, on a store that starts empty.
pub async fn run(s: &dyn StateStore) {
    sandboxes_round_trip_and_change_state(s).await;
    pauses_are_recorded_with_their_mode(s).await;
    expired_lists_only_running_sandboxes_past_their_end(s).await;
    keys_and_templates(s).await;
    teams(s).await;
    snapshots(s).await;
    events_and_pages(s).await;
    webhooks(s).await;
    cursor_pages_never_skip_or_repeat(s).await;
    deliveries_are_queued_once_filtered_and_retried(s).await;
    large_batches_are_queued_in_parts_exactly_once(s).await;
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

async fn events_and_pages(s: &dyn StateStore) {
    let mut red = sample("ev-red", SandboxState::Killed);
    red.team = "red".into();
    s.insert_sandbox(&red).await.unwrap();
    s.insert_sandbox(&sample("ev-def", SandboxState::Killed))
        .await
        .unwrap();
    for (id, kind) in [
        ("ev-red", "created"),
        ("ev-def", "created"),
        ("ev-red", "paused"),
        ("ev-gone", "created"),
        ("ev-red", "killed"),
    ] {
        s.add_event(id, kind, &format!("{kind} {id}"))
            .await
            .unwrap();
    }
    let ev = s.events("ev-red").await.unwrap();
    let kinds: Vec<&str> = ev.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["created", "paused", "killed"]);
    assert_eq!(ev[1].detail, "paused ev-red");
    assert!(ev.iter().all(|e| e.sandbox_id == "ev-red" && e.ts_ms > 0));
    assert!(
        s.events("ev").await.unwrap().is_empty(),
        "no prefix matches"
    );

    let page = |q: EventQuery| async move { s.events_page(&q).await.unwrap() };
    let all = page(EventQuery {
        limit: 100,
        ..EventQuery::default()
    })
    .await;
    let ours: Vec<_> = all
        .iter()
        .filter(|e| e.event.sandbox_id.starts_with("ev-"))
        .collect();
    assert_eq!(ours.len(), 5);
    assert!(
        all.windows(2).all(|w| w[0].seq < w[1].seq),
        "sequence order"
    );
    let first = ours[0].seq;
    let after = page(EventQuery {
        after_seq: Some(first),
        limit: 2,
        ..EventQuery::default()
    })
    .await;
    assert_eq!(after.len(), 2);
    assert_eq!(after[0].seq, ours[1].seq);
    assert_eq!(after[0].event.sandbox_id, "ev-def");
    let red_only = page(EventQuery {
        team: Some("red".into()),
        kinds: vec!["created".into(), "killed".into()],
        limit: 100,
        ..EventQuery::default()
    })
    .await;
    let got: Vec<_> = red_only.iter().map(|e| e.event.kind.as_str()).collect();
    assert_eq!(got, ["created", "killed"]);
    let by_sandbox = page(EventQuery {
        sandbox_id: Some("ev-gone".into()),
        limit: 100,
        ..EventQuery::default()
    })
    .await;
    assert_eq!(by_sandbox.len(), 1);
    let future = page(EventQuery {
        since_ms: Some(i64::MAX),
        limit: 100,
        ..EventQuery::default()
    })
    .await;
    assert!(future.is_empty());
    assert!(page(EventQuery::default()).await.is_empty(), "limit 0");
}

async fn webhooks(s: &dyn StateStore) {
    let hook = |id: &str, team: &str, at: i64| WebhookRecord {
        id: id.into(),
        team: team.into(),
        url: "http://198.51.100.7/hook".into(),
        secret: "s".into(),
        events: vec!["created".into()],
        created_at_ms: at,
    };
    s.insert_webhook(&hook("w2", "red", 2)).await.unwrap();
    s.insert_webhook(&hook("w1", "red", 1)).await.unwrap();
    s.insert_webhook(&hook("w3", "blue", 3)).await.unwrap();
    let ids: Vec<String> = s
        .list_webhooks("red")
        .await
        .unwrap()
        .into_iter()
        .map(|w| w.id)
        .collect();
    assert_eq!(ids, ["w1", "w2"]);
    assert_eq!(
        s.get_webhook("red", "w1").await.unwrap(),
        Some(hook("w1", "red", 1))
    );
    assert!(
        s.get_webhook("blue", "w1").await.unwrap().is_none(),
        "another team's"
    );
    assert!(!s.delete_webhook("blue", "w1").await.unwrap());
    assert!(s.delete_webhook("red", "w1").await.unwrap());
    assert!(!s.delete_webhook("red", "w1").await.unwrap());
    assert_eq!(s.list_webhooks("red").await.unwrap().len(), 1);
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

async fn cursor_pages_never_skip_or_repeat(s: &dyn StateStore) {
    for i in 0..25 {
        let kind = if i % 2 == 0 { "created" } else { "killed" };
        s.add_event(&format!("pg{}", i % 3), kind, &format!("n{i}"))
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let q = EventQuery {
            after_seq: cursor,
            limit: 7,
            ..EventQuery::default()
        };
        let page = s.events_page(&q).await.unwrap();
        if page.is_empty() {
            break;
        }
        // Events arriving between two pages show up on a later one.
        if cursor.is_none() {
            s.add_event("pg9", "paused", "late").await.unwrap();
        }
        cursor = page.last().map(|e| e.seq);
        seen.extend(
            page.into_iter()
                .filter(|e| e.event.sandbox_id.starts_with("pg"))
                .map(|e| e.event.detail),
        );
    }
    let mut want: Vec<String> = (0..25).map(|i| format!("n{i}")).collect();
    want.push("late".into());
    assert_eq!(seen, want);
}

fn hook(id: &str, events: &[&str]) -> WebhookRecord {
    WebhookRecord {
        id: id.into(),
        team: DEFAULT_TEAM.into(),
        url: "http://198.51.100.9/hook".into(),
        secret: "0123456789abcdef".into(),
        events: events.iter().map(|s| s.to_string()).collect(),
        created_at_ms: 1,
    }
}

/// Queues until nothing is left; how many deliveries that made.
async fn queue_all(s: &dyn StateStore, now: i64) -> usize {
    let mut total = 0;
    loop {
        match s.queue_deliveries(now, 100).await.unwrap() {
            0 => return total,
            n => total += n,
        }
    }
}

async fn deliveries_are_queued_once_filtered_and_retried(s: &dyn StateStore) {
    // Events from before these webhooks existed are not delivered to them.
    s.add_event("dq-old", "created", "").await.unwrap();
    queue_all(s, 0).await;
    // What earlier parts queued is delivered: nothing is due.
    for (d, _) in s.due_deliveries(i64::MAX, 1000).await.unwrap() {
        let ok = Attempt {
            at_ms: 1,
            status_code: Some(204),
            error: None,
            delivered: true,
            retry_at_ms: None,
        };
        s.record_attempt(d.id, &ok).await.unwrap();
    }
    assert!(s.due_deliveries(i64::MAX, 10).await.unwrap().is_empty());
    s.insert_webhook(&hook("all", &[])).await.unwrap();
    s.insert_webhook(&hook("pauses", &["paused"]))
        .await
        .unwrap();
    s.add_event("dq-a", "created", "").await.unwrap();
    s.add_event("dq-a", "paused", "").await.unwrap();
    s.add_event("dq-a", "refreshed", "").await.unwrap(); // not a lifecycle kind
    assert_eq!(s.queue_deliveries(1000, 100).await.unwrap(), 3);
    assert_eq!(
        s.queue_deliveries(1000, 100).await.unwrap(),
        0,
        "queued once"
    );
    let due = s.due_deliveries(1000, 10).await.unwrap();
    let kinds: Vec<(String, String)> = due
        .iter()
        .map(|(d, w)| (w.id.clone(), d.kind.clone()))
        .collect();
    assert_eq!(kinds.len(), 3, "{kinds:?}");
    for want in [("all", "created"), ("all", "paused"), ("pauses", "paused")] {
        assert!(kinds.contains(&(want.0.into(), want.1.into())), "{kinds:?}");
    }
    let payload: serde_json::Value = serde_json::from_str(&due[0].0.payload).unwrap();
    assert_eq!(payload["event"]["sandboxID"], "dq-a");
    assert!(due.iter().all(|(d, _)| d.status == DeliveryStatus::Pending));
    // A failed attempt with a retry time is due again only then.
    let (d, _) = &due[0];
    let failed = Attempt {
        at_ms: 1000,
        status_code: Some(500),
        error: Some("answered 500".into()),
        delivered: false,
        retry_at_ms: Some(3000),
    };
    s.record_attempt(d.id, &failed).await.unwrap();
    assert_eq!(s.due_deliveries(2000, 10).await.unwrap().len(), 2);
    assert_eq!(s.due_deliveries(3000, 10).await.unwrap().len(), 3);
    assert_eq!(
        s.due_deliveries(3000, 1).await.unwrap().len(),
        1,
        "the limit"
    );
    let delivered = Attempt {
        at_ms: 3000,
        status_code: Some(200),
        error: None,
        delivered: true,
        retry_at_ms: None,
    };
    s.record_attempt(d.id, &delivered).await.unwrap();
    s.record_attempt(i64::MAX, &delivered).await.unwrap(); // no such delivery: nothing
    let log = s.deliveries(&d.webhook_id, None, 10).await.unwrap();
    assert!(log.windows(2).all(|w| w[0].id > w[1].id), "newest first");
    let rec = log.iter().find(|x| x.id == d.id).unwrap();
    assert_eq!(rec.status, DeliveryStatus::Delivered);
    assert_eq!((rec.attempts, rec.last_status_code), (2, Some(200)));
    assert_eq!(rec.last_attempt_ms, Some(3000));
    assert_eq!(s.due_deliveries(10_000, 10).await.unwrap().len(), 2);
    // A test delivery is due at once; paging with `before`.
    let test_id = s.enqueue_delivery("all", "test", "{}").await.unwrap();
    assert!(test_id > d.id);
    let all_log = s.deliveries("all", None, 10).await.unwrap();
    assert_eq!(all_log[0].id, test_id);
    assert_eq!(all_log[0].event_seq, None);
    let older = s.deliveries("all", Some(test_id), 10).await.unwrap();
    assert!(older.iter().all(|x| x.id < test_id) && older.len() == all_log.len() - 1);
    assert_eq!(s.due_deliveries(i64::MAX, 10).await.unwrap().len(), 3);
    // Deleting a webhook drops its queue; other teams cannot see or delete it.
    assert!(!s.delete_webhook("other-team", "pauses").await.unwrap());
    assert!(s
        .get_webhook("other-team", "pauses")
        .await
        .unwrap()
        .is_none());
    assert!(s.delete_webhook(DEFAULT_TEAM, "pauses").await.unwrap());
    assert!(s.deliveries("pauses", None, 10).await.unwrap().is_empty());
    let due = s.due_deliveries(i64::MAX, 10).await.unwrap();
    assert_eq!(due.len(), 2);
    assert!(due.iter().all(|(_, w)| w.id == "all"));
    assert!(s.delete_webhook(DEFAULT_TEAM, "all").await.unwrap());
    assert!(s.due_deliveries(i64::MAX, 10).await.unwrap().is_empty());
}

/// More deliveries than one etcd txn holds: queued over several calls, each exactly once.
async fn large_batches_are_queued_in_parts_exactly_once(s: &dyn StateStore) {
    queue_all(s, 0).await;
    for i in 0..10 {
        s.insert_webhook(&hook(&format!("bulk{i}"), &[]))
            .await
            .unwrap();
    }
    for i in 0..20 {
        s.add_event(&format!("bulk-{i}"), "created", "")
            .await
            .unwrap();
    }
    assert_eq!(queue_all(s, 5).await, 200);
    let mut ids = Vec::new();
    for i in 0..10 {
        let log = s.deliveries(&format!("bulk{i}"), None, 100).await.unwrap();
        assert_eq!(log.len(), 20, "bulk{i}");
        let mut seqs: Vec<i64> = log.iter().map(|d| d.event_seq.unwrap()).collect();
        seqs.dedup();
        assert_eq!(seqs.len(), 20, "one delivery per event");
        ids.extend(log.iter().map(|d| d.id));
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 200, "ids are unique");
    for i in 0..10 {
        assert!(s
            .delete_webhook(DEFAULT_TEAM, &format!("bulk{i}"))
            .await
            .unwrap());
    }
}
