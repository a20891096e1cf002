//! `kiln sandbox show` and `kiln sandbox logs [--follow]`: one sandbox's details and its log
//! (lifecycle events and the agent's console) from a running server's REST API.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::Value;

use crate::client::{Client, ClientError};

/// How often `logs --follow` asks for new lines.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

fn enc(id: &str) -> String {
    kiln_envd::urlencode(id)
}

/// Human size of a byte count.
pub fn mib(bytes: &Value) -> String {
    match bytes.as_u64() {
        Some(b) => format!("{}M", b >> 20),
        None => "-".into(),
    }
}

/// The newest metrics sample of `id` (None before the first one).
pub async fn latest_metrics(client: &Client, id: &str) -> Result<Option<Value>, ClientError> {
    let v = client
        .get_json(&format!("/sandboxes/metrics?sandbox_ids={}", enc(id)))
        .await?;
    Ok(v["sandboxes"].get(id).cloned().filter(|m| !m.is_null()))
}

pub async fn show(client: &Client, id: &str, json: bool) -> anyhow::Result<i32> {
    let mut v = client.get_json(&format!("/sandboxes/{}", enc(id))).await?;
    let metrics = latest_metrics(client, id).await?;
    if json {
        if let Some(m) = metrics {
            v["metrics"] = m;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    let s = |k: &str| match &v[k] {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    println!("id          {}", s("sandboxID"));
    println!("template    {}", s("templateID"));
    println!("state       {}", s("state"));
    println!("started     {}", s("startedAt"));
    println!("ends        {}", s("endAt"));
    println!(
        "resources   {} CPU, {} MiB memory, {} MiB disk",
        s("cpuCount"),
        s("memoryMB"),
        s("diskSizeMB")
    );
    println!("internet    {}", s("allowInternetAccess"));
    if let Some(n) = v.get("network").filter(|n| !n.is_null()) {
        println!("network     {n}");
    }
    if let Some(md) = v["metadata"].as_object().filter(|m| !m.is_empty()) {
        let kv: Vec<String> = md
            .iter()
            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
            .collect();
        println!("metadata    {}", kv.join(","));
    }
    if let Some(m) = metrics {
        println!(
            "usage       CPU {:.1}%, memory {} of {}, disk {} of {} (at {})",
            m["cpuUsedPct"].as_f64().unwrap_or(0.0),
            mib(&m["memUsed"]),
            mib(&m["memTotal"]),
            mib(&m["diskUsed"]),
            mib(&m["diskTotal"]),
            m["timestamp"].as_str().unwrap_or("")
        );
    }
    Ok(0)
}

/// What of a log page is new since the last one: lifecycle events are told apart by time and
/// text, console lines (stamped with the time of the request) by where the last page's lines
/// reappear.
#[derive(Default)]
struct LogCursor {
    events: HashSet<(String, String)>,
    console: Vec<String>,
}

fn is_console(e: &Value) -> bool {
    e["fields"]["source"] == "agent"
}

impl LogCursor {
    /// The entries of `page` not seen before, in order (events first, then console lines).
    fn fresh(&mut self, page: &[Value]) -> Vec<Value> {
        let mut out = Vec::new();
        let mut console = Vec::new();
        let mut console_entries = Vec::new();
        for e in page {
            let msg = e["message"].as_str().unwrap_or("").to_string();
            if is_console(e) {
                console.push(msg);
                console_entries.push(e.clone());
            } else {
                let ts = e["timestamp"].as_str().unwrap_or("").to_string();
                if self.events.insert((ts, msg)) {
                    out.push(e.clone());
                }
            }
        }
        let seen = overlap(&self.console, &console);
        out.extend(console_entries.into_iter().skip(seen));
        self.console = console;
        out
    }
}

/// The length of the longest suffix of `old` that `new` starts with.
fn overlap(old: &[String], new: &[String]) -> usize {
    (0..=old.len().min(new.len()))
        .rev()
        .find(|&k| old[old.len() - k..] == new[..k])
        .unwrap_or(0)
}

fn print_entry(e: &Value, json: bool) {
    if json {
        println!("{e}");
    } else if is_console(e) {
        println!("agent: {}", e["message"].as_str().unwrap_or(""));
    } else {
        println!(
            "{} {}",
            e["timestamp"].as_str().unwrap_or(""),
            e["message"].as_str().unwrap_or("")
        );
    }
}

pub async fn logs(client: &Client, id: &str, follow: bool, json: bool) -> anyhow::Result<i32> {
    let path = format!("/v2/sandboxes/{}/logs", enc(id));
    let mut cursor = LogCursor::default();
    loop {
        let page = client.get_json(&path).await?;
        let entries = page["logs"].as_array().cloned().unwrap_or_default();
        for e in cursor.fresh(&entries) {
            print_entry(&e, json);
        }
        if !follow {
            return Ok(0);
        }
        // The sandbox is gone (killed, timed out, died): its last events are printed above.
        match client.get_json(&format!("/sandboxes/{}", enc(id))).await {
            Err(ClientError::Api { status: 404, .. }) => {
                let page = client.get_json(&path).await?;
                let entries = page["logs"].as_array().cloned().unwrap_or_default();
                for e in cursor.fresh(&entries) {
                    print_entry(&e, json);
                }
                return Ok(0);
            }
            Err(e) => return Err(e.into()),
            Ok(_) => {}
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn overlap_finds_where_the_last_page_reappears() {
        assert_eq!(overlap(&s(&[]), &s(&["a"])), 0);
        assert_eq!(overlap(&s(&["a", "b"]), &s(&["a", "b", "c"])), 2);
        // The tail window moved on by one line.
        assert_eq!(overlap(&s(&["a", "b", "c"]), &s(&["b", "c", "d"])), 2);
        assert_eq!(overlap(&s(&["a"]), &s(&["x", "y"])), 0);
    }

    #[test]
    fn fresh_entries_are_printed_once() {
        let ev =
            |ts: &str, m: &str| json!({"timestamp": ts, "message": m, "fields": {"event": "x"}});
        let con =
            |m: &str| json!({"timestamp": "now", "message": m, "fields": {"source": "agent"}});
        let mut c = LogCursor::default();
        let first = c.fresh(&[ev("t1", "created: base"), con("boot")]);
        assert_eq!(first.len(), 2);
        let second = c.fresh(&[
            ev("t1", "created: base"),
            ev("t2", "killed: by request"),
            con("boot"),
            con("more"),
        ]);
        let msgs: Vec<&str> = second
            .iter()
            .map(|e| e["message"].as_str().unwrap())
            .collect();
        assert_eq!(msgs, ["killed: by request", "more"]);
        assert!(c.fresh(&[ev("t1", "created: base")]).is_empty());
    }
}
