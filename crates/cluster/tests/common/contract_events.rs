//! The event log, webhooks and the webhook delivery queue: the part of the store contract
//! (see `contract.rs`) that the events API and the webhook dispatcher rely on.

use kiln_server::store::{
    Attempt, DeliveryStatus, EventQuery, SandboxState, StateStore, WebhookRecord, DEFAULT_TEAM,
};

use super::contract::sample;

pub async fn events_and_pages(s: &dyn StateStore) {
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

pub async fn webhooks(s: &dyn StateStore) {
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

pub async fn cursor_pages_never_skip_or_repeat(s: &dyn StateStore) {
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

pub async fn deliveries_are_queued_once_filtered_and_retried(s: &dyn StateStore) {
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
pub async fn large_batches_are_queued_in_parts_exactly_once(s: &dyn StateStore) {
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
    assert_eq!(s.due_deliveries(i64::MAX, 300).await.unwrap().len(), 200);
    assert_eq!(s.due_deliveries(i64::MAX, 30).await.unwrap().len(), 30);
    let drop_hook = |i: usize| async move {
        assert!(s
            .delete_webhook(DEFAULT_TEAM, &format!("bulk{i}"))
            .await
            .unwrap());
    };
    for i in 0..5 {
        drop_hook(i).await;
    }
    let due = s.due_deliveries(i64::MAX, 300).await.unwrap();
    assert_eq!(due.len(), 100, "the deleted webhooks' queues are gone");
    assert!(
        due.windows(2).all(|w| w[0].0.id < w[1].0.id),
        "due together: by id"
    );
    for i in 5..10 {
        drop_hook(i).await;
    }
    assert!(s.due_deliveries(i64::MAX, 300).await.unwrap().is_empty());
}
