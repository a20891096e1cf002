//! kiln-agent: the in-sandbox daemon, wire-compatible with E2B's envd.
//!
//! The binary serves envd's HTTP API and Connect services on TCP (default `:49983`), Unix
//! sockets and vsock ([`listen`]). A request goes [`router`] → [`auth`] → the process service
//! (`process_rpc`), the filesystem service (`fsrpc`) or `/files` (`files`), all sharing the
//! [`state::Agent`]. The client side is the `kiln-envd` crate.

pub mod auth;
pub mod bench;
pub mod cdp;
pub mod cmd_cgroups;
mod cmdfd;
pub mod computer;
pub mod control;
mod files;
pub mod forkbomb;
pub mod forward;
mod fs;
mod fsrpc;
pub mod fuzz;
pub mod interp;
pub mod kills;
mod launch;
pub mod limits;
pub mod listen;
pub mod metastore;
mod metrics;
pub use metrics::cpu_times;
pub mod pid1;
mod process;
mod process_rpc;
pub mod reaper;
pub mod relief;
mod reply;
pub mod router;
pub mod rpc;
pub mod state;
pub mod sudo;
mod trust;
mod users;
mod watch;
pub mod watchdog;

pub use files::signature as file_url_signature;
pub use kiln_proto::envd::ENVD_VERSION;
