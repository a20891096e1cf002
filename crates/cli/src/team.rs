//! `kiln team set|show|list`: per-team quotas, working on the server's state database directly
//! (a running server reads them at each create).

use std::path::PathBuf;

use anyhow::Context;
use kiln_server::store::{AccessStore, TeamRecord};

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Set a team's quotas (unset ones use the server's `--team-*` defaults; `none` clears one).
    Set {
        team: String,
        /// Sandboxes (running, paused or being created) the team may have at once.
        #[arg(long)]
        max_sandboxes: Option<Limit>,
        /// Largest sandbox timeout, seconds.
        #[arg(long)]
        max_timeout: Option<Limit>,
        /// Creates accepted per minute.
        #[arg(long)]
        creates_per_minute: Option<Limit>,
        /// Volumes the team may hold.
        #[arg(long)]
        max_volumes: Option<Limit>,
        #[arg(long)]
        state_dir: Option<PathBuf>,
    },
    /// Teams with quotas of their own, and the teams of API keys.
    List {
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Print JSON (`null` quotas use the server's defaults).
        #[arg(long)]
        json: bool,
    },
}

/// A quota value on the command line: a number, or `none` to clear it.
#[derive(Debug, Clone, Copy)]
pub struct Limit(Option<u64>);

impl std::str::FromStr for Limit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "none" {
            return Ok(Limit(None));
        }
        s.parse::<u64>()
            .map(|n| Limit(Some(n)))
            .map_err(|_| format!("{s:?}: expected a number or `none`"))
    }
}

fn show(v: Option<u64>) -> String {
    v.map(|n| n.to_string()).unwrap_or_else(|| "default".into())
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
        Cmd::Set {
            team,
            max_sandboxes,
            max_timeout,
            creates_per_minute,
            max_volumes,
            state_dir,
        } => {
            kiln_server::tenancy::check_team_name(&team)?;
            let store = crate::keys::open(state_dir)?;
            let mut t = store.get_team(&team).await?.unwrap_or(TeamRecord {
                name: team.clone(),
                created_at_ms: kiln_server::store::now_ms(),
                ..Default::default()
            });
            let small = |l: Limit| -> anyhow::Result<Option<u32>> {
                l.0.map(u32::try_from)
                    .transpose()
                    .context("the value is too large")
            };
            if let Some(l) = max_sandboxes {
                t.max_sandboxes = small(l)?;
            }
            if let Some(l) = max_timeout {
                t.max_timeout_secs = l.0;
            }
            if let Some(l) = creates_per_minute {
                t.creates_per_minute = small(l)?;
            }
            if let Some(l) = max_volumes {
                t.max_volumes = small(l)?;
            }
            store.upsert_team(&t).await?;
            println!(
                "team {team}: max sandboxes {}, max timeout {}, creates per minute {}, \
                 max volumes {}",
                show(t.max_sandboxes.map(u64::from)),
                show(t.max_timeout_secs),
                show(t.creates_per_minute.map(u64::from)),
                show(t.max_volumes.map(u64::from))
            );
            Ok(0)
        }
        Cmd::List { state_dir, json } => {
            let store = crate::keys::open(state_dir)?;
            let teams = store.list_teams().await?;
            let keys = store.list_keys().await?;
            let mut names: Vec<String> = teams.iter().map(|t| t.name.clone()).collect();
            names.extend(keys.iter().map(|k| k.team.clone()));
            names.sort();
            names.dedup();
            if json {
                let list: Vec<serde_json::Value> = names
                    .iter()
                    .map(|n| {
                        let t = teams.iter().find(|t| &t.name == n);
                        serde_json::json!({
                            "team": n,
                            "activeKeys": keys.iter().filter(|k| &k.team == n && k.revoked_at_ms.is_none()).count(),
                            "maxSandboxes": t.and_then(|t| t.max_sandboxes),
                            "maxTimeoutSecs": t.and_then(|t| t.max_timeout_secs),
                            "createsPerMinute": t.and_then(|t| t.creates_per_minute),
                            "maxVolumes": t.and_then(|t| t.max_volumes),
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(0);
            }
            println!(
                "{:<24} {:>6} {:>13} {:>12} {:>14} {:>11}",
                "TEAM", "KEYS", "MAX SANDBOXES", "MAX TIMEOUT", "CREATES/MIN", "MAX VOLUMES"
            );
            for n in names {
                let t = teams.iter().find(|t| t.name == n);
                let active = keys
                    .iter()
                    .filter(|k| k.team == n && k.revoked_at_ms.is_none())
                    .count();
                println!(
                    "{:<24} {:>6} {:>13} {:>12} {:>14} {:>11}",
                    n,
                    active,
                    show(t.and_then(|t| t.max_sandboxes).map(u64::from)),
                    show(t.and_then(|t| t.max_timeout_secs)),
                    show(t.and_then(|t| t.creates_per_minute).map(u64::from)),
                    show(t.and_then(|t| t.max_volumes).map(u64::from))
                );
            }
            Ok(0)
        }
    }
}
