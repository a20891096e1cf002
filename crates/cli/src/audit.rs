//! `kiln audit`: a sandbox's (or every sandbox's) audit records, followed live if asked, and
//! `kiln audit verify [ID]`, which checks the hash chains and names the first broken record.

use anyhow::Context;
use serde_json::Value;

use crate::client::Client;
use crate::sandbox::Conn;

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  kiln audit SANDBOX_ID --kind process,file\n  \
    kiln audit SANDBOX_ID --follow\n  kiln audit --kind api --since 2026-11-30T00:00:00Z\n  \
    kiln audit verify [SANDBOX_ID]\n  kiln audit scan --rules FILE [SANDBOX_ID] [--since T]"
)]
pub struct Args {
    /// `ID` (one sandbox; none: every sandbox), `verify [ID]`, or `scan [ID]` (with --rules).
    #[arg(value_name = "ID | verify [ID] | scan [ID]", num_args = 0..=2)]
    target: Vec<String>,
    /// Only these kinds: process, file, net, dns, lifecycle, api, syscall (comma-separated or
    /// repeated).
    #[arg(long, value_delimiter = ',')]
    kind: Vec<String>,
    /// From this time on (RFC 3339 or Unix ms).
    #[arg(long)]
    since: Option<String>,
    /// Before this time (RFC 3339 or Unix ms).
    #[arg(long)]
    until: Option<String>,
    /// At most this many records (default: all).
    #[arg(long)]
    limit: Option<usize>,
    /// Keep printing records as they are written.
    #[arg(long, short)]
    follow: bool,
    /// One JSON object per line, as the API sends them.
    #[arg(long)]
    json: bool,
    /// For `scan`: the rules file to replay the stored records through (`builtin`: the
    /// built-in pack).
    #[arg(long, value_name = "FILE")]
    rules: Option<std::path::PathBuf>,
    #[command(flatten)]
    conn: Conn,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(run_async(a))
}

fn enc(s: &str) -> String {
    kiln_envd::urlencode(s)
}

async fn run_async(a: Args) -> anyhow::Result<i32> {
    let client = a.conn.client()?;
    if a.target.first().map(String::as_str) == Some("verify") {
        return verify(&client, a.target.get(1).map(String::as_str), a.json).await;
    }
    if a.target.first().map(String::as_str) == Some("scan") {
        let rules = a
            .rules
            .as_ref()
            .context("kiln audit scan needs --rules FILE (or --rules builtin)")?;
        let id = a.target.get(1).map(String::as_str);
        let (since, until) = (a.since.as_deref(), a.until.as_deref());
        return crate::rules::scan(&client, rules, id, since, until, a.json).await;
    }
    anyhow::ensure!(
        a.target.len() <= 1,
        "expected one sandbox id, got {:?}",
        a.target
    );
    let base = match a.target.first() {
        Some(id) => format!("/sandboxes/{}/audit", enc(id)),
        None => "/audit".to_string(),
    };
    let mut q = Vec::new();
    if !a.kind.is_empty() {
        q.push(format!("kind={}", enc(&a.kind.join(","))));
    }
    if let Some(s) = &a.since {
        q.push(format!("since={}", enc(s)));
    }
    if let Some(s) = &a.until {
        q.push(format!("until={}", enc(s)));
    }
    if a.follow {
        q.push("follow=true".into());
        let mut resp = client
            .get_stream(&format!("{base}?{}", q.join("&")))
            .await?;
        let mut buf = Vec::new();
        let mut printed = 0usize;
        while let Some(chunk) = resp.chunk().await.context("reading the audit stream")? {
            buf.extend_from_slice(&chunk);
            while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let v: Value = serde_json::from_slice(&line).unwrap_or(Value::Null);
                print_record(&v, a.json);
                printed += 1;
                if a.limit.is_some_and(|l| printed >= l) {
                    return Ok(0);
                }
            }
        }
        return Ok(0);
    }
    let mut cursor = String::new();
    let mut printed = 0usize;
    loop {
        let mut page_q = q.clone();
        let want = a.limit.map(|l| l - printed).unwrap_or(1000).min(1000);
        page_q.push(format!("limit={want}"));
        if !cursor.is_empty() {
            page_q.push(format!("cursor={}", enc(&cursor)));
        }
        let v = client
            .get_json(&format!("{base}?{}", page_q.join("&")))
            .await?;
        let recs = v["records"].as_array().cloned().unwrap_or_default();
        for r in &recs {
            print_record(r, a.json);
        }
        printed += recs.len();
        cursor = v["nextCursor"].as_str().unwrap_or("").to_string();
        if recs.len() < want || a.limit.is_some_and(|l| printed >= l) || cursor.is_empty() {
            return Ok(0);
        }
    }
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// One line for a human: time, sandbox, seq, kind and what happened.
fn summary(r: &Value) -> String {
    let b = &r["body"];
    match r["kind"].as_str().unwrap_or("") {
        "process" => {
            let mut argv = vec![s(&b["cmd"])];
            if let Some(a) = b["args"].as_array() {
                argv.extend(a.iter().map(s));
            }
            match b["event"].as_str().unwrap_or("") {
                "end" => format!(
                    "end pid={} exit={} {}({} ms)",
                    s(&b["pid"]),
                    s(&b["exitCode"]),
                    b["signal"]
                        .as_str()
                        .map(|x| format!("signal={x} "))
                        .unwrap_or_default(),
                    s(&b["durationMs"])
                ),
                "start" => format!(
                    "start pid={} user={} pty={} {}",
                    s(&b["pid"]),
                    s(&b["user"]),
                    s(&b["pty"]),
                    argv.join(" ")
                ),
                ev => format!("{ev} {}", b),
            }
        }
        "file" => format!(
            "{} {} bytes={} {}",
            s(&b["op"]),
            s(&b["path"]),
            s(&b["bytes"]),
            s(&b["result"])
        ),
        "api" => format!(
            "{} {} → {} key={}",
            s(&b["method"]),
            s(&b["route"]),
            s(&b["status"]),
            s(&b["key"])
        ),
        "lifecycle" => format!("{} {}", s(&b["event"]), s(&b["detail"])),
        "net" => {
            let bytes = match b["event"].as_str() {
                Some("close") => format!(
                    " out={} in={} {} ms{}",
                    s(&b["bytesOut"]),
                    s(&b["bytesIn"]),
                    s(&b["durationMs"]),
                    b["error"]
                        .as_str()
                        .map(|e| format!(" error={e}"))
                        .unwrap_or_default()
                ),
                _ => String::new(),
            };
            let icmp = match (b["icmpType"].as_u64(), b["icmpCode"].as_u64()) {
                (Some(t), Some(c)) => format!(" icmp={t}/{c}"),
                _ => String::new(),
            };
            format!(
                "{} {} {} → {}{icmp} name={} rule={:?}{bytes}",
                s(&b["event"]),
                s(&b["proto"]),
                s(&b["src"]),
                s(&b["dst"]),
                s(&b["name"]),
                s(&b["rule"])
            )
        }
        "dns" => format!(
            "{} {} → {} {}",
            s(&b["type"]),
            s(&b["name"]),
            s(&b["rcode"]),
            b["answers"]
                .as_array()
                .map(|a| a.iter().map(s).collect::<Vec<_>>().join(","))
                .unwrap_or_default()
        ),
        "syscall" => {
            let what = match b["call"].as_str() {
                Some("connect") => s(&b["address"]),
                Some("execve" | "execveat") => b["argv"]
                    .as_array()
                    .map(|a| a.iter().map(s).collect::<Vec<_>>().join(" "))
                    .unwrap_or_default(),
                _ => s(&b["path"]),
            };
            let res = match b["errno"].as_i64() {
                Some(e) => format!(" errno={e}"),
                None => b["result"]
                    .as_i64()
                    .map(|r| format!(" = {r}"))
                    .unwrap_or_default(),
            };
            format!(
                "{} pid={} {} {what}{res}",
                s(&b["call"]),
                s(&b["pid"]),
                s(&b["process"])
            )
        }
        _ => b.to_string(),
    }
}

fn print_record(r: &Value, json: bool) {
    if json {
        println!("{r}");
    } else {
        println!(
            "{}  {}  #{:<4} {:<9} {}",
            s(&r["timestamp"]),
            s(&r["sandboxID"]),
            s(&r["seq"]),
            s(&r["kind"]),
            summary(r)
        );
    }
}

async fn verify(client: &Client, id: Option<&str>, json: bool) -> anyhow::Result<i32> {
    let path = match id {
        Some(id) => format!("/audit/verify?sandboxID={}", enc(id)),
        None => "/audit/verify".into(),
    };
    let v = client.get_json(&path).await?;
    if json {
        println!("{v}");
    } else {
        for c in v["chains"].as_array().cloned().unwrap_or_default() {
            if c["ok"].as_bool() == Some(true) {
                println!(
                    "ok      {}  {} records{}",
                    s(&c["sandboxID"]),
                    s(&c["records"]),
                    match c["pruned"].as_i64() {
                        Some(n) if n > 0 => format!(" ({n} pruned by retention, anchored)"),
                        _ => String::new(),
                    }
                );
            } else {
                println!(
                    "BROKEN  {}  at record {}: {}",
                    s(&c["sandboxID"]),
                    s(&c["firstBadSeq"]),
                    s(&c["reason"])
                );
            }
        }
    }
    Ok(if v["ok"].as_bool() == Some(true) {
        0
    } else {
        1
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_and_icmp_flows_read_as_tcp_connections_do() {
        let rec = |body: Value| serde_json::json!({"kind": "net", "body": body});
        let close = summary(&rec(serde_json::json!({"event": "close", "proto": "udp",
            "src": "169.254.0.21:40001", "dst": "198.51.100.177:7000", "name": null,
            "rule": "default", "bytesOut": 10, "bytesIn": 8, "durationMs": 3})));
        assert!(
            close.ends_with("close udp 169.254.0.21:40001 → 198.51.100.177:7000 name=- rule=\"default\" out=10 in=8 3 ms"),
            "{close}"
        );
        let deny = summary(&rec(serde_json::json!({"event": "deny", "proto": "icmp",
            "src": "169.254.0.21", "dst": "198.51.100.178", "name": null, "icmpType": 8,
            "icmpCode": 0, "icmpId": 1201, "rule": "denyOut 198.51.100.178"})));
        assert!(
            deny.ends_with("deny icmp 169.254.0.21 → 198.51.100.178 icmp=8/0 name=- rule=\"denyOut 198.51.100.178\""),
            "{deny}"
        );
    }
}
