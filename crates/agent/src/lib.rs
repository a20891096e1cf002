//! kiln-agent: the in-sandbox daemon, wire-compatible with E2B's envd.
//!
//! The binary serves envd's HTTP API and Connect services on TCP (default `:49983`), Unix
//! sockets and vsock. [`client::AgentClient`] is the Rust client the kiln server uses.

pub mod bench;
pub mod client;
mod files;
mod fs;
mod fsrpc;
mod metrics;
pub mod pid1;
mod process;
pub mod reaper;
pub mod rpc;
pub mod serve;
pub mod server;
mod users;
mod watch;

pub use client::{AgentClient, ClientError, RunOptions, RunOutput};
pub use files::signature as file_url_signature;
pub use kiln_proto::envd::ENVD_VERSION;
