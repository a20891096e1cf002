//! Anomaly detection from the command line: `kiln rules check FILE` (parse a rules file,
//! errors with line:column), `kiln alerts [--sandbox ID] [--follow]` (a server's alerts), and
//! `kiln audit scan --rules FILE` (stored audit replayed through rules, here in the client).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kiln_rules::{Engine, Event, RuleSet};
use serde_json::Value;

use crate::client::Client;
use crate::sandbox::Conn;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Parse a rules file and report every error as FILE:LINE:COLUMN: reason (exit 1), or
    /// what it holds. `builtin` checks the built-in pack.
    Check {
        #[arg(value_name = "FILE")]
        file: String,
    },
    /// Print the built-in rule pack (a starting point for a rules file).
    Default,
}

pub fn run(c: Cmd) -> anyhow::Result<i32> {
    match c {
        Cmd::Check { file } => Ok(check(&file)),
        Cmd::Default => {
            print!("{}", kiln_rules::ruleset::DEFAULT_PACK);
            Ok(0)
        }
    }
}

fn load(file: &str) -> Result<RuleSet, String> {
    if file == "builtin" {
        return Ok(RuleSet::default_pack());
    }
    RuleSet::load_file(Path::new(file)).map_err(|e| {
        e.0.iter()
            .map(|x| {
                if x.line == 0 {
                    format!("{file}: {}", x.msg)
                } else {
                    format!("{file}:{}:{}: {}", x.line, x.col, x.msg)
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    })
}

fn check(file: &str) -> i32 {
    match load(file) {
        Ok(set) => {
            let enabled = set.rules.iter().filter(|r| r.enabled).count();
            println!(
                "{file}: ok: {} rules ({enabled} enabled), {} macros, {} lists, {} team overrides",
                set.rules.len(),
                set.macros,
                set.lists,
                set.overrides.len()
            );
            0
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  kiln alerts\n  kiln alerts --sandbox ID --follow\n  \
    kiln alerts --priority critical,error --since 2026-12-01T00:00:00Z"
)]
pub struct AlertsArgs {
    /// Only this sandbox's alerts.
    #[arg(long)]
    sandbox: Option<String>,
    /// Only this rule's alerts.
    #[arg(long)]
    rule: Option<String>,
    /// Only these priorities (comma-separated).
    #[arg(long)]
    priority: Option<String>,
    /// From this time on (RFC 3339 or Unix ms).
    #[arg(long)]
    since: Option<String>,
    /// Keep printing alerts as they are raised.
    #[arg(long, short)]
    follow: bool,
    /// One JSON object per line, as the API sends them.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    conn: Conn,
}

fn enc(s: &str) -> String {
    kiln_envd::urlencode(s)
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

fn print_alert(a: &Value, json: bool) {
    if json {
        println!("{a}");
        return;
    }
    let actions: Vec<String> = a["actions"]
        .as_array()
        .map(|x| x.iter().map(s).filter(|x| x != "alert").collect())
        .unwrap_or_default();
    // An incident that fired more than once: how often, by which rules, until when.
    let repeated = match a["count"].as_u64() {
        Some(n) if n > 1 => {
            let rules: Vec<String> = a["rules"]
                .as_array()
                .map(|x| x.iter().map(s).collect())
                .unwrap_or_default();
            format!("  (x{n}: {}; last {})", rules.join(","), s(&a["lastSeen"]))
        }
        _ => String::new(),
    };
    println!(
        "{}  {}  {:<9} {}{}  {}{}",
        s(&a["timestamp"]),
        s(&a["sandboxID"]),
        s(&a["priority"]),
        s(&a["rule"]),
        if actions.is_empty() {
            String::new()
        } else {
            format!(" [{}]", actions.join(","))
        },
        s(&a["output"]),
        repeated
    );
}

pub fn alerts(a: AlertsArgs) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async move {
        let client = a.conn.client()?;
        let mut q = Vec::new();
        for (k, v) in [
            ("sandboxID", &a.sandbox),
            ("rule", &a.rule),
            ("priority", &a.priority),
            ("since", &a.since),
        ] {
            if let Some(v) = v {
                q.push(format!("{k}={}", enc(v)));
            }
        }
        let mut cursor = String::new();
        loop {
            let v = client.get_json(&page_path("/alerts", &q, &cursor)).await?;
            let list = v["alerts"].as_array().cloned().unwrap_or_default();
            for x in &list {
                print_alert(x, a.json);
            }
            if let Some(c) = v["nextCursor"].as_str() {
                cursor = c.to_string();
            }
            if list.len() < 1000 {
                if !a.follow {
                    return Ok(0);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    })
}

/// One page (1000 entries) of a cursor-paged listing at `base` with query parameters `q`.
fn page_path(base: &str, q: &[String], cursor: &str) -> String {
    let mut page = q.to_vec();
    page.push("limit=1000".into());
    if !cursor.is_empty() {
        page.push(format!("cursor={}", enc(cursor)));
    }
    format!("{base}?{}", page.join("&"))
}

/// `kiln audit scan --rules FILE [--since T] [ID]`: reads the stored audit (one sandbox's or
/// the team's) page by page and evaluates it with `rules` here; prints each alert; exit 1 when
/// any fired.
pub async fn scan(
    client: &Client,
    rules: &Path,
    sandbox: Option<&str>,
    since: Option<&str>,
    until: Option<&str>,
    json: bool,
) -> anyhow::Result<i32> {
    let set = load(&rules.display().to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut engine = Engine::new(Arc::new(set));
    let base = match sandbox {
        Some(id) => format!("/sandboxes/{}/audit", enc(id)),
        None => "/audit".into(),
    };
    let mut q = Vec::new();
    if let Some(t) = since {
        q.push(format!("since={}", enc(t)));
    }
    if let Some(t) = until {
        q.push(format!("until={}", enc(t)));
    }
    let (mut cursor, mut seen, mut fired) = (String::new(), 0usize, 0usize);
    loop {
        let v = client.get_json(&page_path(&base, &q, &cursor)).await?;
        let recs = v["records"].as_array().cloned().unwrap_or_default();
        for r in &recs {
            seen += 1;
            for al in engine.eval(&event_of(r)) {
                fired += 1;
                let out = serde_json::json!({
                    "timestamp": r["timestamp"],
                    "sandboxID": al.sandbox,
                    "rule": al.rule,
                    "priority": al.priority.as_str(),
                    "output": al.output,
                    "actions": al.actions.iter().map(|x| x.as_str()).collect::<Vec<_>>(),
                    "records": al.records.iter().map(|x| x.to_string()).collect::<Vec<_>>(),
                    "incident": al.incident,
                });
                print_alert(&out, json);
            }
        }
        cursor = v["nextCursor"].as_str().unwrap_or("").to_string();
        if recs.len() < 1000 || cursor.is_empty() {
            break;
        }
    }
    eprintln!("kiln: scanned {seen} audit records, {fired} alerts");
    Ok(if fired > 0 { 1 } else { 0 })
}

/// An audit record as the API shows it, as the engine reads it.
fn event_of(r: &Value) -> Event {
    let ts = r["timestamp"]
        .as_str()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.timestamp_millis())
        .unwrap_or(0);
    Event {
        id: r["cursor"]
            .as_str()
            .and_then(|c| c.parse().ok())
            .unwrap_or(0),
        sandbox: s(&r["sandboxID"]),
        team: None,
        ts_ms: ts,
        kind: s(&r["kind"]),
        body: r["body"].clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_reports_line_and_column() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("r.yaml");
        std::fs::write(
            &f,
            "- rule: r\n  desc: d\n  output: o\n  priority: warning\n  condition: kind = = file\n",
        )
        .unwrap();
        let e = load(&f.display().to_string()).unwrap_err();
        assert!(e.starts_with(&format!("{}:5:21: ", f.display())), "{e}");
        assert_eq!(check(&f.display().to_string()), 1);
        assert_eq!(check("builtin"), 0);
    }

    #[test]
    fn api_records_become_events() {
        let r = serde_json::json!({"cursor": "42", "sandboxID": "s", "seq": 1,
            "timestamp": "2026-12-01T00:00:00.000Z", "kind": "file", "body": {"op": "read"}});
        let e = event_of(&r);
        assert_eq!(
            (e.id, e.sandbox.as_str(), e.kind.as_str()),
            (42, "s", "file")
        );
        assert_eq!(e.ts_ms, 1796083200000);
        assert_eq!(e.body["op"], "read");
    }
}
