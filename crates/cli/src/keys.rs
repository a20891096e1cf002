//! `kiln keys create|list|revoke`: API keys, working on the server's state database directly.

use std::path::PathBuf;

use anyhow::Context;
use kiln_server::store::{SqliteStore, StateStore};

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Create a key and print it (it is shown only this once).
    Create {
        /// A name to recognise the key by.
        #[arg(long, default_value = "cli")]
        name: String,
        /// The team the key acts for: it sees only that team's sandboxes and snapshots.
        #[arg(long, default_value = kiln_server::tenancy::DEFAULT_TEAM)]
        team: String,
        #[arg(long)]
        state_dir: Option<PathBuf>,
    },
    /// List keys (ids, names, prefixes; never the keys themselves).
    List {
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id (see `kiln keys list`).
    Revoke {
        id: String,
        #[arg(long)]
        state_dir: Option<PathBuf>,
    },
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
        } => {
            kiln_server::tenancy::check_team_name(&team)?;
            let store = open(state_dir)?;
            let k = kiln_server::auth::create_team_key(&store, &name, &team).await?;
            println!("{}", k.secret);
            eprintln!(
                "kiln: created key {} ({name}, team {team}); it is shown only this once",
                k.record.id
            );
            Ok(0)
        }
        Cmd::List { state_dir, json } => {
            let store = open(state_dir)?;
            if json {
                let keys: Vec<serde_json::Value> = store
                    .list_keys()
                    .await?
                    .iter()
                    .map(|k| {
                        serde_json::json!({
                            "id": k.id, "name": k.name, "team": k.team, "prefix": k.prefix,
                            "createdAtMs": k.created_at_ms, "lastUsedMs": k.last_used_ms,
                            "revokedAtMs": k.revoked_at_ms,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&keys)?);
                return Ok(0);
            }
            println!(
                "{:<18} {:<16} {:<16} {:<12} {:<20} {:<20} STATUS",
                "ID", "NAME", "TEAM", "PREFIX", "CREATED", "LAST USED"
            );
            for k in store.list_keys().await? {
                let status = if k.revoked_at_ms.is_some() {
                    "revoked"
                } else {
                    "active"
                };
                println!(
                    "{:<18} {:<16} {:<16} {:<12} {:<20} {:<20} {status}",
                    k.id,
                    k.name,
                    k.team,
                    format!("{}…", k.prefix),
                    when(Some(k.created_at_ms)),
                    when(k.last_used_ms)
                );
            }
            Ok(0)
        }
        Cmd::Revoke { id, state_dir } => {
            let store = open(state_dir)?;
            if store.revoke_key(&id).await? {
                println!("revoked {id}");
                Ok(0)
            } else {
                eprintln!("kiln: no active key with id {id} (see `kiln keys list`)");
                Ok(1)
            }
        }
    }
}
