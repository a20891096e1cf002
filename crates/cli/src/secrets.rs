//! `kiln secrets create|update|list|rm`: the caller's team's secrets on a running kiln server
//! (`/secrets`). A value is read from standard input unless `--value` gives it, so it need not
//! appear in the shell's history or the process list; no command prints one (the server never
//! answers one).

use std::io::Read;

use anyhow::Context;
use reqwest::Method;
use serde_json::{json, Value};

use crate::client::segment;
use crate::sandbox::Conn;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Create a secret; its value comes from standard input (or `--value`).
    Create {
        #[command(flatten)]
        conn: Conn,
        name: String,
        /// The value (default: read from standard input, one trailing newline dropped).
        #[arg(long)]
        value: Option<String>,
        /// Metadata entry KEY=VALUE (repeatable).
        #[arg(long = "meta", value_name = "KEY=VALUE")]
        meta: Vec<String>,
    },
    /// Give a secret a new value (its next version), from standard input (or `--value`).
    Update {
        #[command(flatten)]
        conn: Conn,
        /// Secret name or id.
        secret: String,
        #[arg(long)]
        value: Option<String>,
    },
    /// List the team's secrets (names, ids, versions; never values).
    #[command(alias = "ls")]
    List {
        #[command(flatten)]
        conn: Conn,
    },
    /// Delete a secret (every version).
    Rm {
        #[command(flatten)]
        conn: Conn,
        /// Secret name or id.
        secret: String,
    },
}

fn value_of(given: Option<String>) -> anyhow::Result<String> {
    if let Some(v) = given {
        return Ok(v);
    }
    let mut v = String::new();
    std::io::stdin()
        .read_to_string(&mut v)
        .context("reading the secret's value from standard input")?;
    if v.ends_with('\n') {
        v.pop();
        if v.ends_with('\r') {
            v.pop();
        }
    }
    Ok(v)
}

fn line(s: &Value) -> String {
    format!(
        "{}\t{}\tv{}\t{}",
        s["secretID"].as_str().unwrap_or(""),
        s["name"].as_str().unwrap_or(""),
        s["currentVersion"].as_i64().unwrap_or(0),
        s["updatedAt"].as_str().unwrap_or("")
    )
}

pub fn run(c: Cmd) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match c {
            Cmd::Create {
                conn,
                name,
                value,
                meta,
            } => {
                let mut metadata = serde_json::Map::new();
                for m in meta {
                    let (k, v) = m
                        .split_once('=')
                        .with_context(|| format!("--meta {m:?}: expected KEY=VALUE"))?;
                    metadata.insert(k.into(), v.into());
                }
                let body = json!({"name": name, "value": value_of(value)?, "metadata": metadata});
                let s = conn
                    .client()?
                    .call(Method::POST, "/secrets", Some(body))
                    .await?;
                println!("{}", line(&s));
            }
            Cmd::Update {
                conn,
                secret,
                value,
            } => {
                let body = json!({"value": value_of(value)?});
                let path = format!("/secrets/{}", segment(&secret));
                let s = conn.client()?.call(Method::POST, &path, Some(body)).await?;
                println!("{}", line(&s));
            }
            Cmd::List { conn } => {
                let client = conn.client()?;
                let mut token: Option<String> = None;
                loop {
                    let mut path = "/secrets?limit=100".to_string();
                    if let Some(t) = &token {
                        path.push_str(&format!("&nextToken={}", segment(t)));
                    }
                    let resp = client.get_stream(&path).await?;
                    token = resp
                        .headers()
                        .get("x-next-token")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string);
                    let page: Value = resp.json().await.context("reading the secrets list")?;
                    for s in page.as_array().into_iter().flatten() {
                        println!("{}", line(s));
                    }
                    if token.is_none() {
                        break;
                    }
                }
            }
            Cmd::Rm { conn, secret } => {
                let path = format!("/secrets/{}", segment(&secret));
                conn.client()?.call(Method::DELETE, &path, None).await?;
            }
        }
        Ok(0)
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(super::segment("a b/c"), "a%20b%2Fc");
        assert_eq!(super::segment("svc-key.1"), "svc-key.1");
    }
}
