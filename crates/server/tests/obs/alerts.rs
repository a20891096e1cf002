//! Alerts through the real router, SQLite store, audit writer and gVisor sandboxes: rules
//! fire on records as they are written; `GET /alerts` is scoped to the caller's team (the
//! operator's team sees all; naming another team's sandbox is a 404) and filters; a rule whose
//! action causes records it matches does not loop (each action once per sandbox, the engine
//! never reads its own alert records); a changed rules file is reloaded, a bad one never
//! replaces the rules in force.

use crate::common;

use std::time::{Duration, Instant};

use http::StatusCode;
use kiln_server::alerts::{start, RulesSource};
use kiln_server::audit::{AuditConfig, AuditLog};
use kiln_server::manager::AdmissionConfig;
use serde_json::Value;

const CREATE: &str = r#"{"templateID":"t","timeout":120}"#;

const RULES: &str = r#"
- rule: sandbox_created
  desc: Every create through the API.
  condition: kind = api and method = POST and route = /sandboxes
  output: "created %sandbox by key %key"
  priority: notice
- rule: any_lifecycle_pauses
  desc: Pauses on any lifecycle record, including those its own pause causes.
  condition: kind = lifecycle and event in (connect, timeout, paused)
  output: "lifecycle %event in %sandbox"
  priority: warning
  action: pause
"#;

async fn alerts(app: &axum::Router, key: &str, q: &str) -> (StatusCode, Value) {
    common::call(app, Some(key), "GET", &format!("/alerts{q}"), None, &[]).await
}

fn rules_of(v: &Value) -> Vec<String> {
    let mut r: Vec<String> = v["alerts"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|a| {
            format!(
                "{}@{}",
                a["rule"].as_str().unwrap(),
                a["sandboxID"].as_str().unwrap()
            )
        })
        .collect();
    r.sort();
    r
}

async fn wait_for(app: &axum::Router, key: &str, q: &str, n: usize) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (s, v) = alerts(app, key, q).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        if v["alerts"].as_array().unwrap().len() >= n || Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_are_team_scoped_filtered_and_never_loop() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::team_config(AdmissionConfig::default()));
    let db = rig.path().join("kiln.db");
    rig.manager
        .set_audit(AuditLog::open(&db, &AuditConfig::default()).unwrap());
    let rules = rig.path().join("rules.yaml");
    std::fs::write(&rules, RULES).unwrap();
    let alerts_db = kiln_server::store::StateDb::open(&db)
        .unwrap()
        .alerts()
        .unwrap();
    let st = start(&rig.manager, alerts_db, RulesSource::File(rules.clone())).unwrap();
    assert_eq!(st.rules, 2);
    let (app, operator) = rig.app().await;
    let red = common::team_key(rig.path(), "red").await;
    let blue = common::team_key(rig.path(), "blue").await;
    let mut ids = Vec::new();
    for key in [&red, &blue] {
        let (s, v) = common::call(&app, Some(key), "POST", "/sandboxes", Some(CREATE), &[]).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let id = v["sandboxID"].as_str().unwrap().to_string();
        rig.cleanup.add(&id);
        ids.push(id);
    }
    let (r, b) = (ids[0].clone(), ids[1].clone());

    let all = wait_for(&app, &operator, "", 2).await;
    assert_eq!(
        rules_of(&all),
        {
            let mut w = vec![
                format!("sandbox_created@{r}"),
                format!("sandbox_created@{b}"),
            ];
            w.sort();
            w
        },
        "{all}"
    );
    let (_, v) = alerts(&app, &red, "").await;
    assert_eq!(rules_of(&v), [format!("sandbox_created@{r}")]);
    let (_, v) = alerts(&app, &blue, "?rule=sandbox_created").await;
    assert_eq!(rules_of(&v), [format!("sandbox_created@{b}")]);
    let (s, v) = alerts(&app, &blue, &format!("?sandboxID={r}")).await;
    common::assert_error(s, &v, 404);
    let (s, v) = alerts(&app, &red, "?priority=loud").await;
    common::assert_error(s, &v, 400);
    let (_, v) = alerts(&app, &operator, "?priority=warning").await;
    assert_eq!(rules_of(&v), Vec::<String>::new());
    // Paging: one at a time, the cursor moves on.
    let (_, p1) = alerts(&app, &operator, "?limit=1").await;
    let c = p1["nextCursor"].as_str().unwrap().to_string();
    let (_, p2) = alerts(&app, &operator, &format!("?limit=1&cursor={c}")).await;
    assert_eq!(p2["alerts"].as_array().unwrap().len(), 1);
    assert_ne!(p1["alerts"][0]["id"], p2["alerts"][0]["id"]);

    // A timeout change fires the pausing rule; the pause it causes fires it again (the same
    // incident: one alert, counted twice), but the action is taken once, and the alerts' own
    // records are never evaluated.
    let (s, v) = common::call(
        &app,
        Some(&red),
        "POST",
        &format!("/sandboxes/{r}/timeout"),
        Some(r#"{"timeout":90}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let q = format!("?sandboxID={r}&rule=any_lifecycle_pauses");
    let deadline = Instant::now() + Duration::from_secs(20);
    let v = loop {
        let v = wait_for(&app, &red, &q, 1).await;
        if v["alerts"][0]["count"] == 2 || Instant::now() > deadline {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, again) = alerts(&app, &red, &q).await;
    assert_eq!(again["alerts"], v["alerts"], "no more alerts: {again}");
    assert_eq!(v["alerts"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["alerts"][0]["count"], 2, "{v}");
    let (s, recs) = common::call(
        &app,
        Some(&red),
        "GET",
        &format!("/sandboxes/{r}/audit?kind=lifecycle&limit=1000"),
        None,
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let bodies: Vec<&Value> = recs["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| &x["body"])
        .collect();
    let actions: Vec<&Value> = bodies
        .iter()
        .copied()
        .filter(|b| b["event"] == "rule-action")
        .collect();
    assert_eq!(actions.len(), 1, "{recs}");
    assert_eq!(actions[0]["action"], "pause");
    assert_eq!(actions[0]["result"], "ok", "{recs}");
    assert_eq!(bodies.iter().filter(|b| b["event"] == "paused").count(), 1);
    let (s, v) = common::call(
        &app,
        Some(&red),
        "GET",
        &format!("/sandboxes/{r}"),
        None,
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["state"], "paused", "{v}");

    // Hot reload: a bad file is refused (the rules in force stay), a good one replaces them.
    let create = |key: String| {
        let app = app.clone();
        async move {
            let (s, v) =
                common::call(&app, Some(&key), "POST", "/sandboxes", Some(CREATE), &[]).await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            v["sandboxID"].as_str().unwrap().to_string()
        }
    };
    std::fs::write(&rules, "- rule: broken\n  condition: kind = = api\n").unwrap();
    tokio::time::sleep(kiln_server::alerts::RELOAD_EVERY + Duration::from_millis(800)).await;
    let c = create(blue.clone()).await;
    rig.cleanup.add(&c);
    let v = wait_for(&app, &blue, &format!("?sandboxID={c}"), 1).await;
    assert_eq!(rules_of(&v), [format!("sandbox_created@{c}")], "{v}");
    std::fs::write(&rules, RULES.replace("sandbox_created", "sandbox_made")).unwrap();
    tokio::time::sleep(kiln_server::alerts::RELOAD_EVERY + Duration::from_millis(800)).await;
    let d = create(blue.clone()).await;
    rig.cleanup.add(&d);
    let v = wait_for(&app, &blue, &format!("?sandboxID={d}"), 1).await;
    assert_eq!(rules_of(&v), [format!("sandbox_made@{d}")], "{v}");
}
