//! `kiln sandbox …`: a client of a running kiln server's REST API (and of the sandbox agents
//! behind its proxy).

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::{bail, Context};
use kiln_envd::ProcessEvent;

use crate::client::{Client, ExecOptions};

#[derive(clap::Args, Clone)]
pub struct Conn {
    /// Server URL (default: KILN_URL, then E2B_API_URL, then http://127.0.0.1:3000).
    #[arg(long, global = true)]
    url: Option<String>,
    /// API key (default: KILN_API_KEY, then E2B_API_KEY).
    #[arg(long, global = true)]
    api_key: Option<String>,
}

impl Conn {
    /// Whether an API key is given (`--api-key` or the environment).
    pub fn has_key(&self) -> bool {
        self.api_key.is_some()
            || ["KILN_API_KEY", "E2B_API_KEY"]
                .iter()
                .any(|v| std::env::var(v).is_ok_and(|k| !k.trim().is_empty()))
    }

    pub fn client(&self) -> anyhow::Result<Client> {
        let env = |a: &str, b: &str| std::env::var(a).or_else(|_| std::env::var(b)).ok();
        let url = self
            .url
            .clone()
            .or_else(|| env("KILN_URL", "E2B_API_URL"))
            .unwrap_or_else(|| "http://127.0.0.1:3000".into());
        let key = self
            .api_key
            .clone()
            .or_else(|| env("KILN_API_KEY", "E2B_API_KEY"));
        Ok(Client::new(&url, key)?)
    }
}

fn parse_kv(items: &[String], what: &str) -> anyhow::Result<BTreeMap<String, String>> {
    items
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .with_context(|| format!("{what} {kv:?}: expected KEY=VALUE"))
        })
        .collect()
}

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Create a sandbox and print its id.
    Create {
        #[command(flatten)]
        conn: Conn,
        /// Template name.
        #[arg(default_value = "base")]
        template: String,
        /// Seconds until the sandbox is killed (server default: 300).
        #[arg(long)]
        timeout: Option<u64>,
        /// Metadata KEY=VALUE (repeatable).
        #[arg(long = "metadata", short = 'm')]
        metadata: Vec<String>,
        /// Environment variable KEY=VALUE (repeatable).
        #[arg(long = "env", short = 'e')]
        env: Vec<String>,
    },
    /// List running sandboxes.
    Ls {
        #[command(flatten)]
        conn: Conn,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run a command in a sandbox, streaming its output; exits with the command's code.
    Exec {
        #[command(flatten)]
        conn: Conn,
        id: String,
        /// Run as this user (default: the template's user).
        #[arg(long, short)]
        user: Option<String>,
        /// Working directory.
        #[arg(long)]
        cwd: Option<String>,
        /// Environment variable KEY=VALUE (repeatable).
        #[arg(long = "env", short = 'e')]
        env: Vec<String>,
        /// The command (run by bash -l -c).
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Interactive shell (a PTY) in a sandbox.
    Shell {
        #[command(flatten)]
        conn: Conn,
        id: String,
        #[arg(long, short)]
        user: Option<String>,
    },
    /// A sandbox's details (template, state, resources, times, network).
    Show {
        #[command(flatten)]
        conn: Conn,
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// A sandbox's log: lifecycle events and its agent's console (`--follow` to keep watching).
    Logs {
        #[command(flatten)]
        conn: Conn,
        id: String,
        /// Keep printing new lines as they come.
        #[arg(long, short)]
        follow: bool,
        /// One JSON object per line, as the API sends them.
        #[arg(long)]
        json: bool,
    },
    /// Copy a file to or from a sandbox: `cp LOCAL ID:PATH` or `cp ID:PATH LOCAL`.
    Cp {
        #[command(flatten)]
        conn: Conn,
        src: String,
        dst: String,
        #[arg(long, short)]
        user: Option<String>,
    },
    /// Kill sandboxes.
    Kill {
        #[command(flatten)]
        conn: Conn,
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

pub fn run(c: Cmd) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(run_async(c))
}

fn remote(s: &str) -> Option<(&str, &str)> {
    let (id, path) = s.split_once(':')?;
    (!id.is_empty() && !id.contains('/') && path.starts_with('/')).then_some((id, path))
}

async fn run_async(c: Cmd) -> anyhow::Result<i32> {
    match c {
        Cmd::Create {
            conn,
            template,
            timeout,
            metadata,
            env,
        } => {
            let client = conn.client()?;
            let s = client
                .create(
                    &template,
                    timeout,
                    &parse_kv(&metadata, "--metadata")?,
                    &parse_kv(&env, "--env")?,
                )
                .await?;
            println!("{}", s.id);
            Ok(0)
        }
        Cmd::Ls { conn, json } => {
            let list = conn.client()?.list().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(0);
            }
            println!(
                "{:<22} {:<12} {:<26} {:<26} METADATA",
                "ID", "TEMPLATE", "STARTED", "ENDS"
            );
            for s in list {
                let md = s["metadata"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                    .unwrap_or_default();
                println!(
                    "{:<22} {:<12} {:<26} {:<26} {md}",
                    s["sandboxID"].as_str().unwrap_or(""),
                    s["templateID"].as_str().unwrap_or(""),
                    s["startedAt"].as_str().unwrap_or(""),
                    s["endAt"].as_str().unwrap_or("")
                );
            }
            Ok(0)
        }
        Cmd::Exec {
            conn,
            id,
            user,
            cwd,
            env,
            command,
        } => {
            let client = conn.client()?;
            let sbx = client.sandbox(&id).await?;
            let opts = ExecOptions {
                user,
                cwd,
                envs: parse_kv(&env, "--env")?,
                pty: None,
            };
            let cmd = command.join(" ");
            let code = client
                .exec(&sbx, &cmd, &opts, |ev| match ev {
                    ProcessEvent::Stdout(d) | ProcessEvent::Pty(d) => {
                        let mut o = std::io::stdout().lock();
                        let _ = o.write_all(&d);
                        let _ = o.flush();
                    }
                    ProcessEvent::Stderr(d) => {
                        let mut e = std::io::stderr().lock();
                        let _ = e.write_all(&d);
                        let _ = e.flush();
                    }
                    _ => {}
                })
                .await?;
            Ok(code)
        }
        Cmd::Shell { conn, id, user } => crate::shell::run(conn.client()?, &id, user).await,
        Cmd::Show { conn, id, json } => crate::sandbox_info::show(&conn.client()?, &id, json).await,
        Cmd::Logs {
            conn,
            id,
            follow,
            json,
        } => crate::sandbox_info::logs(&conn.client()?, &id, follow, json).await,
        Cmd::Cp {
            conn,
            src,
            dst,
            user,
        } => {
            let client = conn.client()?;
            match (remote(&src), remote(&dst)) {
                (None, Some((id, path))) => {
                    let data = std::fs::read(&src).with_context(|| format!("reading {src}"))?;
                    let sbx = client.sandbox(id).await?;
                    client.upload(&sbx, path, data, user.as_deref()).await?;
                }
                (Some((id, path)), None) => {
                    let sbx = client.sandbox(id).await?;
                    let data = client.download(&sbx, path, user.as_deref()).await?;
                    if dst == "-" {
                        std::io::stdout().write_all(&data)?;
                    } else {
                        std::fs::write(&dst, data).with_context(|| format!("writing {dst}"))?;
                    }
                }
                _ => bail!("exactly one of SRC and DST must be a sandbox path ID:/absolute/path"),
            }
            Ok(0)
        }
        Cmd::Kill { conn, ids } => {
            let client = conn.client()?;
            let mut code = 0;
            for id in ids {
                match client.kill(&id).await {
                    Ok(()) => println!("killed {id}"),
                    Err(e) => {
                        eprintln!("kiln: {id}: {e}");
                        code = 1;
                    }
                }
            }
            Ok(code)
        }
    }
}
