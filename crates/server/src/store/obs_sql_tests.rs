//! The event log's cursors and the webhook delivery queue, on a real (in-memory) SQLite.

use crate::store::{
    Attempt, DeliveryStatus, EventQuery, EventStore, SqliteStore, WebhookRecord, DEFAULT_TEAM,
};

fn hook(id: &str, events: &[&str]) -> WebhookRecord {
    WebhookRecord {
        id: id.into(),
        team: DEFAULT_TEAM.into(),
        url: "http://127.0.0.1:9/hook".into(),
        secret: "0123456789abcdef".into(),
        events: events.iter().map(|s| s.to_string()).collect(),
        created_at_ms: 1,
    }
}

#[tokio::test]
async fn cursor_pages_never_skip_or_repeat() {
    let s = SqliteStore::open_in_memory().unwrap();
    for i in 0..25 {
        let kind = if i % 2 == 0 { "created" } else { "killed" };
        s.add_event(&format!("sb{}", i % 3), kind, &format!("n{i}"))
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = s
            .events_page(&EventQuery {
                after_seq: cursor,
                limit: 7,
                ..Default::default()
            })
            .await
            .unwrap();
        if page.is_empty() {
            break;
        }
        // Events arriving between two pages show up on the next one.
        if seen.len() == 7 {
            s.add_event("sb9", "paused", "late").await.unwrap();
        }
        cursor = page.last().map(|e| e.seq);
        seen.extend(page.into_iter().map(|e| e.event.detail));
    }
    let mut want: Vec<String> = (0..25).map(|i| format!("n{i}")).collect();
    want.insert(25, "late".into());
    assert_eq!(seen, want);

    // Filters: one sandbox, some kinds, since a time.
    let sb0 = s
        .events_page(&EventQuery {
            sandbox_id: Some("sb0".into()),
            kinds: vec!["created".into()],
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(sb0
        .iter()
        .all(|e| e.event.sandbox_id == "sb0" && e.event.kind == "created"));
    assert_eq!(sb0.len(), 5);
    let future = s
        .events_page(&EventQuery {
            since_ms: Some(i64::MAX),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(future.is_empty());
}

#[tokio::test]
async fn deliveries_are_queued_once_filtered_and_retried() {
    let s = SqliteStore::open_in_memory().unwrap();
    // Events from before any webhook existed are not delivered to it.
    s.add_event("old", "created", "").await.unwrap();
    assert_eq!(s.queue_deliveries(0, 100).await.unwrap(), 0);
    s.insert_webhook(&hook("all", &[])).await.unwrap();
    s.insert_webhook(&hook("pauses", &["paused"]))
        .await
        .unwrap();
    s.add_event("a", "created", "").await.unwrap();
    s.add_event("a", "paused", "").await.unwrap();
    s.add_event("a", "refreshed", "").await.unwrap(); // not a lifecycle kind
    assert_eq!(s.queue_deliveries(1000, 100).await.unwrap(), 3);
    // Queued exactly once.
    assert_eq!(s.queue_deliveries(1000, 100).await.unwrap(), 0);
    let due = s.due_deliveries(1000, 10).await.unwrap();
    assert_eq!(due.len(), 3);
    let kinds: Vec<(String, String)> = due
        .iter()
        .map(|(d, w)| (w.id.clone(), d.kind.clone()))
        .collect();
    assert!(kinds.contains(&("all".into(), "created".into())));
    assert!(kinds.contains(&("all".into(), "paused".into())));
    assert!(kinds.contains(&("pauses".into(), "paused".into())));
    let payload: serde_json::Value = serde_json::from_str(&due[0].0.payload).unwrap();
    assert_eq!(payload["event"]["sandboxID"], "a");

    // A failed attempt with a retry time is pending again only then.
    let (d, _) = &due[0];
    s.record_attempt(
        d.id,
        &Attempt {
            at_ms: 1000,
            status_code: Some(500),
            error: Some("answered 500".into()),
            delivered: false,
            retry_at_ms: Some(3000),
        },
    )
    .await
    .unwrap();
    assert_eq!(s.due_deliveries(2000, 10).await.unwrap().len(), 2);
    assert_eq!(s.due_deliveries(3000, 10).await.unwrap().len(), 3);
    s.record_attempt(
        d.id,
        &Attempt {
            at_ms: 3000,
            status_code: Some(200),
            error: None,
            delivered: true,
            retry_at_ms: None,
        },
    )
    .await
    .unwrap();
    let log = s.deliveries(&d.webhook_id, None, 10).await.unwrap();
    let rec = log.iter().find(|x| x.id == d.id).unwrap();
    assert_eq!(rec.status, DeliveryStatus::Delivered);
    assert_eq!(rec.attempts, 2);
    assert_eq!(rec.last_status_code, Some(200));
    assert_eq!(s.due_deliveries(10_000, 10).await.unwrap().len(), 2);

    // Deleting a webhook drops its queue; other teams cannot see or delete it.
    assert!(!s.delete_webhook("other-team", "pauses").await.unwrap());
    assert!(s
        .get_webhook("other-team", "pauses")
        .await
        .unwrap()
        .is_none());
    assert!(s.delete_webhook(DEFAULT_TEAM, "pauses").await.unwrap());
    assert_eq!(s.due_deliveries(10_000, 10).await.unwrap().len(), 1);
    assert_eq!(s.list_webhooks(DEFAULT_TEAM).await.unwrap().len(), 1);
}

#[tokio::test]
async fn queue_survives_reopening_the_database() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kiln.db");
    {
        let s = SqliteStore::open(&path).unwrap();
        s.insert_webhook(&hook("h", &[])).await.unwrap();
        s.add_event("a", "killed", "").await.unwrap();
        assert_eq!(s.queue_deliveries(0, 100).await.unwrap(), 1);
    }
    let s = SqliteStore::open(&path).unwrap();
    assert_eq!(s.queue_deliveries(0, 100).await.unwrap(), 0, "queued twice");
    assert_eq!(s.due_deliveries(0, 10).await.unwrap().len(), 1);
}

/// Queueing deliveries reads (the cursor, the new events) and then writes; another connection
/// writing in between (the audit writer, another store) must make it wait for the lock, not
/// fail with "database is locked" as an upgraded read transaction would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queueing_beside_another_writer_never_fails_busy() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kiln.db");
    let s = SqliteStore::open(&db).unwrap();
    s.insert_webhook(&hook("w1", &[])).await.unwrap();
    let writer = crate::store::busy_writer::BusyWriter::start(SqliteStore::open(&db).unwrap());
    let mut queued = 0;
    for _ in 0..300 {
        queued += s
            .queue_deliveries(crate::store::now_ms(), 50)
            .await
            .expect("queueing beside a writer");
    }
    let written = writer.stop().await;
    assert!(
        written > 0 && queued > 0,
        "{written} events, {queued} queued"
    );
}
