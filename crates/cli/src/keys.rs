//! `kiln keys create|list|revoke`: API keys. With an API key (`--api-key`, `KILN_API_KEY`,
//! `E2B_API_KEY`) they go through a running server's `/api-keys`, scoped to that key's team
//! as the API scopes it (another team's keys only for the operator's team, `default`); with
//! `--state-dir`, or with no key at all (the host's first steps), they work on the state
//! database directly.

use std::path::PathBuf;

use anyhow::Context;
use kiln_server::store::{AccessStore, SqliteStore};
use reqwest::Method;
use serde_json::{json, Value};

use crate::client::segment;
use crate::sandbox::Conn;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Create a key and print it (it is shown only this once).
    Create {
        /// A name to recognise the key by.
        #[arg(long, default_value = "cli")]
        name: String,
        /// The team the key acts for: it sees only that team's sandboxes and snapshots
        /// (default: the team of the key used, or `default` on the state database).
        #[arg(long)]
        team: Option<String>,
        /// Work on this state directory's database instead of a server's API.
        #[arg(long)]
        state_dir: Option<PathBuf>,
        #[command(flatten)]
        conn: Conn,
    },
    /// List keys (ids, names, prefixes; never the keys themselves).
    List {
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Only this team's keys (through the API: the operator's team may name any).
        #[arg(long)]
        team: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: Conn,
    },
    /// Revoke a key by id (see `kiln keys list`).
    Revoke {
        id: String,
        #[arg(long)]
        state_dir: Option<PathBuf>,
        #[command(flatten)]
        conn: Conn,
    },
}

/// Where a `kiln keys` command works: a server's API, or a state database.
enum Target {
    Api(crate::client::Client),
    Db(SqliteStore),
}

fn target(state_dir: Option<PathBuf>, conn: &Conn) -> anyhow::Result<Target> {
    if state_dir.is_none() && conn.has_key() {
        return Ok(Target::Api(conn.client()?));
    }
    Ok(Target::Db(open(state_dir)?))
}

/// One key as `kiln keys list` prints it.
struct Row {
    id: String,
    name: String,
    team: String,
    prefix: String,
    created: String,
    last_used: String,
    revoked: bool,
}

/// The API's time (RFC 3339) as the local listing prints it.
fn api_time(v: &Value) -> String {
    v.as_str()
        .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
        .map(|t| when(Some(t.timestamp_millis())))
        .unwrap_or_else(|| "-".into())
}

fn print_rows(rows: &[Row]) {
    println!(
        "{:<18} {:<16} {:<16} {:<12} {:<20} {:<20} STATUS",
        "ID", "NAME", "TEAM", "PREFIX", "CREATED", "LAST USED"
    );
    for k in rows {
        println!(
            "{:<18} {:<16} {:<16} {:<12} {:<20} {:<20} {}",
            k.id,
            k.name,
            k.team,
            format!("{}…", k.prefix),
            k.created,
            k.last_used,
            if k.revoked { "revoked" } else { "active" }
        );
    }
}

pub(crate) fn open(state_dir: Option<PathBuf>) -> anyhow::Result<SqliteStore> {
    let dir = state_dir.unwrap_or_else(kiln_host::paths::state_dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    SqliteStore::open(&dir.join("kiln.db")).context("opening the state database")
}

pub(crate) fn when(ms: Option<i64>) -> String {
    ms.and_then(chrono::DateTime::from_timestamp_millis)
        .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_else(|| "-".into())
}

pub fn run(c: Cmd) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(run_async(c))
}

async fn run_async(c: Cmd) -> anyhow::Result<i32> {
    match c {
        Cmd::Create {
            name,
            team,
            state_dir,
            conn,
        } => {
            if let Some(t) = &team {
                kiln_server::tenancy::check_team_name(t)?;
            }
            let (id, secret, team) = match target(state_dir, &conn)? {
                Target::Api(client) => {
                    let mut body = json!({ "name": name });
                    if let Some(t) = &team {
                        body["team"] = json!(t);
                    }
                    let v = client.call(Method::POST, "/api-keys", Some(body)).await?;
                    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
                    (s("id"), s("key"), s("team"))
                }
                Target::Db(store) => {
                    let team = team.unwrap_or_else(|| kiln_server::tenancy::DEFAULT_TEAM.into());
                    let k = kiln_server::auth::create_team_key(&store, &name, &team).await?;
                    (k.record.id, k.secret, team)
                }
            };
            anyhow::ensure!(
                secret.starts_with("e2b_"),
                "the server's answer carries no key"
            );
            println!("{secret}");
            eprintln!("kiln: created key {id} ({name}, team {team}); it is shown only this once");
            Ok(0)
        }
        Cmd::List {
            state_dir,
            team,
            json,
            conn,
        } => {
            let (rows, as_json) = match target(state_dir, &conn)? {
                Target::Api(client) => {
                    let path = match &team {
                        Some(t) => format!("/api-keys?team={}", segment(t)),
                        None => "/api-keys".into(),
                    };
                    let v = client.get_json(&path).await?;
                    let list = v.as_array().cloned().unwrap_or_default();
                    let rows = list
                        .iter()
                        .map(|k| Row {
                            id: k["id"].as_str().unwrap_or_default().into(),
                            name: k["name"].as_str().unwrap_or_default().into(),
                            team: k["team"].as_str().unwrap_or_default().into(),
                            prefix: k["prefix"].as_str().unwrap_or_default().into(),
                            created: api_time(&k["createdAt"]),
                            last_used: api_time(&k["lastUsed"]),
                            revoked: !k["revokedAt"].is_null(),
                        })
                        .collect::<Vec<_>>();
                    (rows, Value::Array(list))
                }
                Target::Db(store) => {
                    let keys = store.list_keys().await?;
                    let keys = keys
                        .into_iter()
                        .filter(|k| team.as_ref().is_none_or(|t| &k.team == t));
                    let mut rows = Vec::new();
                    let mut list = Vec::new();
                    for k in keys {
                        list.push(json!({
                            "id": k.id, "name": k.name, "team": k.team, "prefix": k.prefix,
                            "createdAtMs": k.created_at_ms, "lastUsedMs": k.last_used_ms,
                            "revokedAtMs": k.revoked_at_ms,
                        }));
                        rows.push(Row {
                            created: when(Some(k.created_at_ms)),
                            last_used: when(k.last_used_ms),
                            revoked: k.revoked_at_ms.is_some(),
                            id: k.id,
                            name: k.name,
                            team: k.team,
                            prefix: k.prefix,
                        });
                    }
                    (rows, Value::Array(list))
                }
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&as_json)?);
            } else {
                print_rows(&rows);
            }
            Ok(0)
        }
        Cmd::Revoke {
            id,
            state_dir,
            conn,
        } => match target(state_dir, &conn)? {
            Target::Api(client) => {
                let path = format!("/api-keys/{}", segment(&id));
                match client.call(Method::DELETE, &path, None).await {
                    Ok(_) => {
                        println!("revoked {id}");
                        Ok(0)
                    }
                    Err(crate::client::ClientError::Api { status, message }) => {
                        eprintln!("kiln: {status}: {message}");
                        Ok(1)
                    }
                    Err(e) => Err(e.into()),
                }
            }
            Target::Db(store) => {
                if store.revoke_key(&id).await? {
                    println!("revoked {id}");
                    Ok(0)
                } else {
                    eprintln!("kiln: no active key with id {id} (see `kiln keys list`)");
                    Ok(1)
                }
            }
        },
    }
}
