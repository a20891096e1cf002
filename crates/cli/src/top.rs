//! `kiln top`: a live table of a server's sandboxes (state, CPU, memory, disk, age), refreshed
//! every few seconds from `GET /v2/sandboxes` and the newest metrics samples; `--once` prints
//! one table (or JSON with `--json`) for scripts.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;
use tokio::signal::unix::{signal, SignalKind};

use crate::client::Client;
use crate::sandbox::Conn;
use crate::sandbox_info::mib;

/// Most ids one bulk metrics request may name (the server's limit).
const METRICS_BATCH: usize = 100;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    conn: Conn,
    /// Print one table and exit.
    #[arg(long)]
    once: bool,
    /// Seconds between refreshes (the server samples metrics every 5 s).
    #[arg(long, short = 'n', default_value_t = 2.0)]
    interval: f64,
    /// Print JSON (one array per refresh).
    #[arg(long)]
    json: bool,
    /// Order of the rows.
    #[arg(long, value_enum, default_value_t = SortBy::Cpu)]
    sort: SortBy,
}

#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum SortBy {
    Cpu,
    Mem,
    Age,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    anyhow::ensure!(
        a.interval.is_finite() && a.interval >= 0.2,
        "--interval must be at least 0.2 seconds"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(run_async(a))
}

/// Every running or paused sandbox of the caller with its newest metrics sample (`metrics`:
/// null before the first).
pub async fn rows(client: &Client) -> anyhow::Result<Vec<Value>> {
    let list = client
        .get_json("/v2/sandboxes?state=running,paused&limit=1000")
        .await?;
    let mut rows = list.as_array().cloned().unwrap_or_default();
    let ids: Vec<String> = rows
        .iter()
        .filter_map(|r| r["sandboxID"].as_str().map(str::to_string))
        .collect();
    let mut samples = serde_json::Map::new();
    for chunk in ids.chunks(METRICS_BATCH) {
        let q = chunk
            .iter()
            .map(|id| kiln_envd::urlencode(id))
            .collect::<Vec<_>>()
            .join(",");
        let v = client
            .get_json(&format!("/sandboxes/metrics?sandbox_ids={q}"))
            .await?;
        if let Some(m) = v["sandboxes"].as_object() {
            samples.extend(m.clone());
        }
    }
    for r in &mut rows {
        let id = r["sandboxID"].as_str().unwrap_or("").to_string();
        r["metrics"] = samples.get(&id).cloned().unwrap_or(Value::Null);
    }
    Ok(rows)
}

fn sort(rows: &mut [Value], by: SortBy) {
    let key = |r: &Value| -> f64 {
        match by {
            SortBy::Cpu => r["metrics"]["cpuUsedPct"].as_f64().unwrap_or(-1.0),
            SortBy::Mem => r["metrics"]["memUsed"].as_f64().unwrap_or(-1.0),
            // Oldest first: the earliest start sorts highest.
            SortBy::Age => -started_ms(r).unwrap_or(i64::MAX) as f64,
        }
    };
    rows.sort_by(|a, b| key(b).total_cmp(&key(a)));
}

fn started_ms(r: &Value) -> Option<i64> {
    r["startedAt"]
        .as_str()
        .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
        .map(|t| t.timestamp_millis())
}

/// `1h02m`, `3m05s`, `42s`.
fn span(ms: i64) -> String {
    let s = (ms / 1000).max(0);
    match s {
        s if s >= 3600 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        s if s >= 60 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{s}s"),
    }
}

/// The table as text (a header line, column titles, one line per sandbox).
pub fn table(rows: &[Value], now_ms: i64) -> String {
    let running = rows.iter().filter(|r| r["state"] == "running").count();
    let cpu: f64 = rows
        .iter()
        .filter_map(|r| r["metrics"]["cpuUsedPct"].as_f64())
        .sum();
    let mut out = format!(
        "{} sandboxes ({running} running, {} paused), CPU {cpu:.1}% in all\n\n",
        rows.len(),
        rows.len() - running
    );
    out.push_str(&format!(
        "{:<22} {:<20} {:<8} {:>6} {:>13} {:>13} {:>8} {:>8}\n",
        "ID", "TEMPLATE", "STATE", "CPU%", "MEM", "DISK", "AGE", "ENDS IN"
    ));
    for r in rows {
        let m = &r["metrics"];
        let cpu = m["cpuUsedPct"]
            .as_f64()
            .map(|c| format!("{c:.1}"))
            .unwrap_or_else(|| "-".into());
        let pair = |used: &str, total: &str| {
            if m.is_null() {
                "-".to_string()
            } else {
                format!("{}/{}", mib(&m[used]), mib(&m[total]))
            }
        };
        let age = started_ms(r)
            .map(|t| span(now_ms - t))
            .unwrap_or_else(|| "-".into());
        let ends = r["endAt"]
            .as_str()
            .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
            .map(|t| span(t.timestamp_millis() - now_ms))
            .unwrap_or_else(|| "-".into());
        out.push_str(&format!(
            "{:<22} {:<20} {:<8} {:>6} {:>13} {:>13} {:>8} {:>8}\n",
            r["sandboxID"].as_str().unwrap_or(""),
            r["templateID"].as_str().unwrap_or(""),
            r["state"].as_str().unwrap_or(""),
            cpu,
            pair("memUsed", "memTotal"),
            pair("diskUsed", "diskTotal"),
            age,
            ends
        ));
    }
    out
}

fn compact(rows: &[Value]) -> Value {
    let keys = [
        "sandboxID",
        "templateID",
        "state",
        "startedAt",
        "endAt",
        "cpuCount",
        "memoryMB",
        "diskSizeMB",
        "metadata",
        "metrics",
    ];
    Value::Array(
        rows.iter()
            .map(|r| {
                let mut o = serde_json::Map::new();
                for k in keys {
                    o.insert(k.into(), r[k].clone());
                }
                Value::Object(o)
            })
            .collect(),
    )
}

/// Leaves the alternate screen and shows the cursor again when dropped.
struct Screen;

impl Screen {
    fn enter() -> Screen {
        print!("\x1b[?1049h\x1b[?25l");
        let _ = std::io::stdout().flush();
        Screen
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        print!("\x1b[?25h\x1b[?1049l");
        let _ = std::io::stdout().flush();
    }
}

async fn run_async(a: Args) -> anyhow::Result<i32> {
    let client = a.conn.client()?;
    let live = !a.once && !a.json && std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut term = signal(SignalKind::terminate()).context("installing a signal handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing a signal handler")?;
    let mut hup = signal(SignalKind::hangup()).context("installing a signal handler")?;
    let _screen = live.then(Screen::enter);
    loop {
        let mut rows = rows(&client).await?;
        sort(&mut rows, a.sort);
        let now = chrono::Utc::now();
        if a.json {
            println!("{}", compact(&rows));
        } else {
            let text = table(&rows, now.timestamp_millis());
            if live {
                // Home, the table, then clear whatever the previous frame left below it.
                let stamp = now.format("%H:%M:%S");
                print!(
                    "\x1b[H\x1b[2Jkiln top, {stamp}: {}",
                    text.replace('\n', "\r\n")
                );
            } else {
                print!("{text}");
            }
        }
        let _ = std::io::stdout().flush();
        if a.once {
            return Ok(0);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs_f64(a.interval)) => {}
            _ = term.recv() => return Ok(0),
            _ = int.recv() => return Ok(0),
            _ = hup.recv() => return Ok(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn table_shows_state_cpu_and_memory() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-01-01T00:10:00Z")
            .unwrap()
            .timestamp_millis();
        let mut rows = vec![
            json!({"sandboxID": "idle", "templateID": "base", "state": "paused",
                   "startedAt": "2026-01-01T00:00:00Z", "endAt": "2026-01-01T01:10:00Z",
                   "metrics": null}),
            json!({"sandboxID": "busy", "templateID": "base", "state": "running",
                   "startedAt": "2026-01-01T00:09:18Z", "endAt": "2026-01-01T00:15:00Z",
                   "metrics": {"cpuUsedPct": 97.5, "memUsed": 64u64 << 20, "memTotal": 512u64 << 20,
                               "diskUsed": 10u64 << 20, "diskTotal": 2048u64 << 20}}),
        ];
        sort(&mut rows, SortBy::Cpu);
        let t = table(&rows, now);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("2 sandboxes (1 running, 1 paused), CPU 97.5%"));
        assert!(lines[3].starts_with("busy "), "{t}");
        assert!(
            lines[3].contains("97.5") && lines[3].contains("64M/512M"),
            "{t}"
        );
        assert!(
            lines[3].contains("42s") && lines[3].contains("5m00s"),
            "{t}"
        );
        assert!(
            lines[4].starts_with("idle ") && lines[4].contains("paused"),
            "{t}"
        );
        assert!(lines[4].contains("1h00m"), "{t}");
        sort(&mut rows, SortBy::Age);
        assert_eq!(rows[0]["sandboxID"], "idle");
    }

    #[test]
    fn spans_read_well() {
        assert_eq!(span(5_000), "5s");
        assert_eq!(span(185_000), "3m05s");
        assert_eq!(span(3_720_000), "1h02m");
        assert_eq!(span(-10), "0s");
    }
}
