//! The API-level tests: the REST API, audit log, console, edges (limits, TLS, HTTP/2) and
//! observation endpoints through the real router and SQLite store; one test streams an upload
//! through a real gVisor sandbox.
//!
//! One test binary (one link of kiln-server) per concern; each module is one former
//! `tests/<name>.rs`.

#[path = "../common/mod.rs"]
mod common;

mod api;
mod audit_log;
mod console;
mod console_access;
mod edge;
mod edge_tls;
mod observe;
