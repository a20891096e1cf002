//! The audit log over a real SQLite state database: chains, paging, follow, tamper detection,
//! retention with anchors, fork links, and no record lost under many concurrent writers.

use std::time::Duration;

use kiln_server::audit::cursor::Cursor;
use kiln_server::audit::{AuditConfig, AuditLog, Filter, Kind, Retention};
use kiln_server::store::SqliteStore;
use serde_json::json;

fn open(dir: &std::path::Path, retention: Retention) -> (AuditLog, std::path::PathBuf) {
    let db = dir.join("kiln.db");
    SqliteStore::open(&db).expect("migrating the state database");
    let cfg = AuditConfig {
        retention,
        queue: 16,
        ..Default::default()
    };
    (
        AuditLog::open(&db, &cfg).expect("opening the audit log"),
        db,
    )
}

fn all(sandbox: &str) -> Filter {
    Filter {
        sandbox_id: Some(sandbox.into()),
        limit: 1000,
        ..Default::default()
    }
}

#[tokio::test]
async fn chains_verify_and_an_edited_record_is_found_at_its_seq() {
    let dir = tempfile::tempdir().unwrap();
    let (log, db) = open(dir.path(), Retention::default());
    for i in 0..10 {
        log.record("sbxa", Kind::Process, json!({ "event": "start", "i": i }))
            .await;
        log.record("sbxb", Kind::File, json!({ "op": "write", "i": i }))
            .await;
    }
    let recs = log.query(all("sbxa")).await.unwrap();
    assert_eq!(recs.len(), 10);
    assert_eq!(
        recs.iter().map(|r| r.seq).collect::<Vec<_>>(),
        (1..=10).collect::<Vec<_>>()
    );
    assert_eq!(recs[0].prev_hash, kiln_server::audit::chain::GENESIS);
    for w in recs.windows(2) {
        assert_eq!(w[1].prev_hash, w[0].hash);
    }
    let reports = log.verify(None, None).await.unwrap();
    assert_eq!(reports.len(), 2);
    assert!(
        reports.iter().all(|r| r.ok && r.records == 10),
        "{reports:?}"
    );

    // Someone edits record 4 of sbxa directly in the database.
    let c = rusqlite::Connection::open(&db).unwrap();
    let n = c
        .execute(
            "UPDATE audit SET body = replace(body, '\"i\":3', '\"i\":33')
             WHERE sandbox_id = 'sbxa' AND seq = 4",
            [],
        )
        .unwrap();
    assert_eq!(n, 1);
    let r = &log.verify(Some("sbxa".into()), None).await.unwrap()[0];
    assert!(!r.ok);
    assert_eq!(r.first_bad_seq, Some(4), "{r:?}");
    // The other chain is untouched.
    assert!(log.verify(Some("sbxb".into()), None).await.unwrap()[0].ok);

    // Deleting a record is found too, at the first missing seq.
    c.execute(
        "DELETE FROM audit WHERE sandbox_id = 'sbxb' AND seq = 7",
        [],
    )
    .unwrap();
    let r = &log.verify(Some("sbxb".into()), None).await.unwrap()[0];
    assert_eq!((r.ok, r.first_bad_seq), (false, Some(7)), "{r:?}");
    // And deleting the newest one (the chain's head is remembered).
    c.execute(
        "DELETE FROM audit WHERE sandbox_id = 'sbxa' AND seq = 10",
        [],
    )
    .unwrap();
    c.execute(
        "UPDATE audit SET body = replace(body, '\"i\":33', '\"i\":3')
         WHERE sandbox_id = 'sbxa' AND seq = 4",
        [],
    )
    .unwrap();
    let r = &log.verify(Some("sbxa".into()), None).await.unwrap()[0];
    assert_eq!((r.ok, r.first_bad_seq), (false, Some(10)), "{r:?}");
}

#[tokio::test]
async fn paging_by_cursor_with_kind_and_time_filters() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(dir.path(), Retention::default());
    for i in 0..25 {
        let k = if i % 2 == 0 {
            Kind::Process
        } else {
            Kind::File
        };
        log.record("pg", k, json!({ "i": i })).await;
    }
    log.record("other", Kind::Process, json!({})).await;
    // Pages of 10 over process records of "pg": 13 records, no repeats, no gaps.
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = log
            .query(Filter {
                sandbox_id: Some("pg".into()),
                kinds: vec![Kind::Process],
                after,
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap();
        if page.is_empty() {
            break;
        }
        after = Some(Cursor::At(page.last().unwrap().cursor));
        seen.extend(page.iter().map(|r| r.body_json()["i"].as_i64().unwrap()));
    }
    assert_eq!(seen, (0..25).step_by(2).collect::<Vec<i64>>());
    // Time window: nothing before the first record, everything until after the last.
    let first = log.query(all("pg")).await.unwrap()[0].ts_ms;
    let none = log
        .query(Filter {
            until_ms: Some(first),
            ..all("pg")
        })
        .await
        .unwrap();
    assert!(none.is_empty());
    let every = log
        .query(Filter {
            since_ms: Some(first),
            ..all("pg")
        })
        .await
        .unwrap();
    assert_eq!(every.len(), 25);
    // Server-wide search sees both sandboxes.
    let both = log
        .query(Filter {
            limit: 1000,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(both.len(), 26);
    // A page's next cursor: its last record's, or where it started when empty.
    let p = log
        .page(Filter {
            limit: 3,
            ..all("pg")
        })
        .await
        .unwrap();
    assert_eq!(p.next, Cursor::At(p.items[2].cursor));
    let end = log
        .page(Filter {
            after: Some(Cursor::At(10_000)),
            ..all("pg")
        })
        .await
        .unwrap();
    assert_eq!((end.items.len(), end.next), (0, Cursor::At(10_000)));
    // A cluster's cursor (each node's position) means nothing here: refused, saying so.
    let theirs = Cursor::Nodes([("n1".to_string(), 4)].into());
    let e = log
        .page(Filter {
            after: Some(theirs),
            ..all("pg")
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&e, kiln_server::audit::AuditError::Store(kiln_server::store::StoreError::Invalid(m)) if m.contains("nextCursor")),
        "{e}"
    );
}

#[tokio::test]
async fn many_concurrent_writers_lose_nothing_through_a_small_queue() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(dir.path(), Retention::default());
    let mut tasks = Vec::new();
    for t in 0..100 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..20 {
                log.record("busy", Kind::Process, json!({ "t": t, "i": i }))
                    .await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let recs = log
        .query(Filter {
            limit: 1000,
            ..all("busy")
        })
        .await
        .unwrap();
    let more = log
        .query(Filter {
            after: Some(Cursor::At(recs.last().unwrap().cursor)),
            limit: 1000,
            ..all("busy")
        })
        .await
        .unwrap();
    assert_eq!(recs.len() + more.len(), 2000);
    let r = &log.verify(Some("busy".into()), None).await.unwrap()[0];
    assert!(r.ok && r.records == 2000, "{r:?}");
}

#[tokio::test]
async fn retention_prunes_with_an_anchor_and_the_rest_still_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(
        dir.path(),
        Retention {
            max_age: None,
            max_records: Some(8),
        },
    );
    for i in 0..10 {
        log.record("keep", Kind::Lifecycle, json!({ "i": i })).await;
        log.record("gone", Kind::Lifecycle, json!({ "i": i })).await;
    }
    assert_eq!(log.prune_now().await, 12);
    let left = log.query(all("keep")).await.unwrap();
    assert_eq!(left.len(), 4);
    assert_eq!(left[0].seq, 7);
    let reports = log.verify(None, None).await.unwrap();
    assert!(reports.iter().all(|r| r.ok), "{reports:?}");
    let k = reports.iter().find(|r| r.sandbox_id == "keep").unwrap();
    assert_eq!((k.records, k.pruned), (4, 6));
    // Appending after pruning continues the chain.
    log.record("keep", Kind::Lifecycle, json!({ "i": 10 }))
        .await;
    assert!(log.verify(Some("keep".into()), None).await.unwrap()[0].ok);
}

#[tokio::test]
async fn a_fork_starts_its_own_chain_linked_to_its_parents_head() {
    let dir = tempfile::tempdir().unwrap();
    let (log, db) = open(dir.path(), Retention::default());
    for i in 0..3 {
        log.record("parent", Kind::Process, json!({ "i": i })).await;
    }
    log.link("child", "parent", json!({ "snapshot": "s1" }))
        .await;
    log.record("child", Kind::Process, json!({ "i": 0 })).await;
    log.record("parent", Kind::Process, json!({ "i": 3 })).await;
    let parent = log.query(all("parent")).await.unwrap();
    let child = log.query(all("child")).await.unwrap();
    assert_eq!(child.len(), 2);
    assert_eq!(child[0].seq, 1);
    assert_eq!(
        child[0].prev_hash, parent[2].hash,
        "links to the parent's head"
    );
    let b = child[0].body_json();
    assert_eq!(b["event"], "chain_start");
    assert_eq!(
        (b["parent"].as_str(), b["parentSeq"].as_i64()),
        (Some("parent"), Some(3))
    );
    let r = &log.verify(Some("child".into()), None).await.unwrap()[0];
    assert!(r.ok, "{r:?}");
    assert_eq!(r.parent.as_deref(), Some("parent"));
    // Forging the link (pointing the child at another parent record) is found.
    let c = rusqlite::Connection::open(&db).unwrap();
    c.execute(
        "UPDATE audit SET body = replace(body, '\"parentSeq\":3', '\"parentSeq\":2')
         WHERE sandbox_id = 'child' AND seq = 1",
        [],
    )
    .unwrap();
    let r = &log.verify(Some("child".into()), None).await.unwrap()[0];
    assert_eq!((r.ok, r.first_bad_seq), (false, Some(1)));
}

#[tokio::test]
async fn follow_sees_new_records_as_they_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(dir.path(), Retention::default());
    let mut live = log.subscribe().unwrap();
    log.record("f", Kind::Dns, json!({ "name": "example.test" }))
        .await;
    let r = tokio::time::timeout(Duration::from_secs(5), live.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (r.sandbox_id.as_str(), r.kind.as_str(), r.seq),
        ("f", "dns", 1)
    );
}

#[tokio::test]
async fn a_disabled_log_records_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kiln.db");
    SqliteStore::open(&db).unwrap();
    let log = AuditLog::open(
        &db,
        &AuditConfig {
            enabled: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(!log.enabled());
    log.record("x", Kind::Api, json!({})).await;
    assert!(log.query(all("x")).await.is_err());
}

#[tokio::test]
async fn a_restarted_server_continues_each_chain() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(dir.path(), Retention::default());
    for i in 0..3 {
        log.record("r", Kind::Process, json!({ "i": i })).await;
    }
    log.flush().await;
    drop(log);
    let (log, _) = open(dir.path(), Retention::default());
    log.record("r", Kind::Process, json!({ "i": 3 })).await;
    let recs = log.query(all("r")).await.unwrap();
    assert_eq!(recs.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(recs[3].prev_hash, recs[2].hash);
    assert!(log.verify(Some("r".into()), None).await.unwrap()[0].ok);
}
