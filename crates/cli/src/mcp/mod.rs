//! `kiln mcp`: an MCP (Model Context Protocol) server exposing kiln sandboxes as tools and
//! their files as resources, over stdio (the default, for clients that spawn it) or streamable
//! HTTP (`--http ADDR`). Built on rmcp, the official Rust SDK; it is a client of a kiln
//! server's REST and envd APIs like the rest of the CLI. See docs/mcp.md.
//!
//! - `server.rs`: the rmcp `ServerHandler` (info, tools, resources)
//! - `tools.rs`: the tool catalog and dispatch; `args.rs`: argument parsing and tool errors
//! - `ctx.rs`: a call's kiln client and progress notifications
//! - `lifecycle.rs`, `exec.rs`, `files.rs`, `code.rs`, `desktop.rs`: the tools
//! - `http.rs`: the streamable HTTP transport and its API key check

mod args;
mod code;
mod ctx;
mod desktop;
mod exec;
mod files;
mod http;
mod lifecycle;
mod server;
mod tools;

use std::net::SocketAddr;

use anyhow::Context;
use rmcp::ServiceExt;

use crate::sandbox::Conn;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    kiln mcp                               # stdio, for clients that spawn it\n  \
    kiln mcp --http 127.0.0.1:8765         # streamable HTTP at http://127.0.0.1:8765/mcp\n\n\
    Over stdio the tools act with KILN_API_KEY (or E2B_API_KEY, --api-key); over HTTP each \
    client sends its own kiln API key as `Authorization: Bearer <key>`.")]
pub struct Args {
    #[command(flatten)]
    conn: Conn,
    /// Serve streamable HTTP on this address (path /mcp) instead of stdio.
    #[arg(long, value_name = "ADDR")]
    http: Option<SocketAddr>,
    /// Another Host name HTTP clients may use (besides localhost and the listen address;
    /// the check guards against DNS rebinding). Repeatable.
    #[arg(long = "allow-host", value_name = "HOST", requires = "http")]
    allow_hosts: Vec<String>,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async move {
        let client = a.conn.client()?;
        match a.http {
            Some(addr) => http::serve(addr, client, a.allow_hosts).await?,
            None => {
                let service = server::KilnMcp::new(client)
                    .serve(rmcp::transport::stdio())
                    .await
                    .context("starting MCP over stdio")?;
                service.waiting().await.context("serving MCP over stdio")?;
            }
        }
        Ok(0)
    })
}
