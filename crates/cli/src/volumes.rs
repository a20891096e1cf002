//! `kiln volumes create|list|rm`: the caller's team's volumes on a running kiln server
//! (`/volumes`). `create` prints the volume's content token (the `e2b` SDK's `Volume` uses it
//! for the volume's files).

use reqwest::Method;
use serde_json::{json, Value};

use crate::sandbox::Conn;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Create a volume (letters, digits and hyphens); prints its id, name and token.
    Create {
        #[command(flatten)]
        conn: Conn,
        name: String,
    },
    /// List the team's volumes (ids and names).
    #[command(alias = "ls")]
    List {
        #[command(flatten)]
        conn: Conn,
    },
    /// Delete a volume and its data (refused while a sandbox mounts it).
    #[command(alias = "delete")]
    Rm {
        #[command(flatten)]
        conn: Conn,
        /// Volume name or id.
        volume: String,
    },
}

fn field<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or("")
}

/// A volume name or id as a path segment (names and ids are letters, digits, `-` and `_`;
/// anything else is `%`-encoded).
fn segment(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

pub fn run(c: Cmd) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match c {
            Cmd::Create { conn, name } => {
                let v = conn
                    .client()?
                    .call(Method::POST, "/volumes", Some(json!({ "name": name })))
                    .await?;
                println!(
                    "{}\t{}\t{}",
                    field(&v, "volumeID"),
                    field(&v, "name"),
                    field(&v, "token")
                );
            }
            Cmd::List { conn } => {
                let all = conn.client()?.call(Method::GET, "/volumes", None).await?;
                for v in all.as_array().into_iter().flatten() {
                    println!("{}\t{}", field(v, "volumeID"), field(v, "name"));
                }
            }
            Cmd::Rm { conn, volume } => {
                let path = format!("/volumes/{}", segment(&volume));
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
        assert_eq!(super::segment("vol_1-x"), "vol_1-x");
    }
}
