//! `kiln events` and `kiln webhooks …`: clients of a running server's events and webhooks
//! APIs (see docs/observability.md).

use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};

use crate::sandbox::Conn;

#[derive(clap::Args)]
pub struct EventsArgs {
    #[command(flatten)]
    conn: Conn,
    /// Only this sandbox's events.
    #[arg(long)]
    sandbox: Option<String>,
    /// Only these types (comma-separated, e.g. `created,killed`).
    #[arg(long = "type")]
    kind: Option<String>,
    /// Start after this cursor (an event id).
    #[arg(long)]
    cursor: Option<String>,
    /// Keep polling for new events.
    #[arg(long, short)]
    follow: bool,
    /// Print one JSON object per line.
    #[arg(long)]
    json: bool,
}

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

pub fn events(a: EventsArgs) -> anyhow::Result<i32> {
    let c = a.conn.client()?;
    rt()?.block_on(async move {
        let mut cursor = a.cursor.clone().unwrap_or_default();
        loop {
            let mut path = format!("/events?limit=1000&cursor={cursor}");
            if let Some(s) = &a.sandbox {
                path.push_str(&format!("&sandboxId={s}"));
            }
            if let Some(k) = &a.kind {
                path.push_str(&format!("&type={k}"));
            }
            let page = c.call(Method::GET, &path, None).await?;
            let events = page["events"].as_array().cloned().unwrap_or_default();
            for e in &events {
                if a.json {
                    println!("{e}");
                } else {
                    println!(
                        "{} {} {:<22} {:<9} {}",
                        e["id"].as_str().unwrap_or(""),
                        e["timestamp"].as_str().unwrap_or(""),
                        e["sandboxID"].as_str().unwrap_or(""),
                        e["type"].as_str().unwrap_or(""),
                        e["detail"].as_str().unwrap_or("")
                    );
                }
            }
            if let Some(n) = page["nextCursor"].as_str() {
                cursor = n.to_string();
            }
            if events.len() < 1000 {
                if !a.follow {
                    return Ok(0);
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    })
}

#[derive(clap::Subcommand)]
pub enum WebhookCmd {
    /// Register a webhook; prints its id and signing secret (shown once).
    Add {
        #[command(flatten)]
        conn: Conn,
        /// Where deliveries are POSTed (http:// or https://).
        #[arg(value_name = "URL")]
        target: String,
        /// Event type to receive (repeatable; default: every lifecycle type; `*` for all).
        #[arg(long = "event")]
        events: Vec<String>,
        /// Signing secret (default: generated).
        #[arg(long)]
        secret: Option<String>,
    },
    /// List the webhooks.
    Ls {
        #[command(flatten)]
        conn: Conn,
        /// Print JSON, as the API sends it.
        #[arg(long)]
        json: bool,
    },
    /// Delete a webhook.
    Rm {
        #[command(flatten)]
        conn: Conn,
        id: String,
    },
    /// Send a test delivery and print how it went.
    Test {
        #[command(flatten)]
        conn: Conn,
        id: String,
    },
    /// Show a webhook's delivery log, newest first.
    Deliveries {
        #[command(flatten)]
        conn: Conn,
        id: String,
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Print JSON, as the API sends it.
        #[arg(long)]
        json: bool,
    },
}

fn delivery_line(d: &Value) -> String {
    format!(
        "{} {:<22} {:<9} attempts {} {}",
        d["id"].as_str().unwrap_or(""),
        d["type"].as_str().unwrap_or(""),
        d["status"].as_str().unwrap_or(""),
        d["attempts"],
        match (&d["lastStatusCode"], d["lastError"].as_str()) {
            (_, Some(e)) => e.to_string(),
            (Value::Number(n), None) => format!("answered {n}"),
            _ => String::new(),
        }
    )
}

pub fn webhooks(cmd: WebhookCmd) -> anyhow::Result<i32> {
    rt()?.block_on(async move {
        match cmd {
            WebhookCmd::Add {
                conn,
                target,
                events,
                secret,
            } => {
                let mut body = json!({ "url": target });
                if !events.is_empty() {
                    body["events"] = json!(events);
                }
                if let Some(s) = secret {
                    body["secret"] = json!(s);
                }
                let w = conn
                    .client()?
                    .call(Method::POST, "/webhooks", Some(body))
                    .await?;
                println!("{}", w["id"].as_str().unwrap_or(""));
                println!("secret: {}", w["secret"].as_str().unwrap_or(""));
            }
            WebhookCmd::Ls { conn, json } => {
                let list = conn.client()?.call(Method::GET, "/webhooks", None).await?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&list)?);
                    return Ok(0);
                }
                for w in list.as_array().into_iter().flatten() {
                    let events: Vec<&str> = w["events"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_str)
                        .collect();
                    println!(
                        "{} {} {}",
                        w["id"].as_str().unwrap_or(""),
                        w["url"].as_str().unwrap_or(""),
                        events.join(",")
                    );
                }
            }
            WebhookCmd::Rm { conn, id } => {
                conn.client()?
                    .call(Method::DELETE, &format!("/webhooks/{id}"), None)
                    .await?;
            }
            WebhookCmd::Test { conn, id } => {
                let d = conn
                    .client()?
                    .call(Method::POST, &format!("/webhooks/{id}/test"), None)
                    .await?;
                println!("{}", delivery_line(&d));
                if d["status"] != "delivered" {
                    return Ok(1);
                }
            }
            WebhookCmd::Deliveries {
                conn,
                id,
                limit,
                json,
            } => {
                let log = conn
                    .client()?
                    .call(
                        Method::GET,
                        &format!("/webhooks/{id}/deliveries?limit={limit}"),
                        None,
                    )
                    .await?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&log)?);
                    return Ok(0);
                }
                for d in log["deliveries"].as_array().into_iter().flatten() {
                    println!("{}", delivery_line(d));
                }
            }
        }
        Ok(0)
    })
}
