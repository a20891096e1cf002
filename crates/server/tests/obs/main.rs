//! The observation and tenancy tests with real gVisor sandboxes: alerts, metrics history and
//! the sampler, lifecycle events, teams' quotas and audit searches.
//!
//! One test binary (one link of kiln-server) per concern; each module is one former
//! `tests/<name>.rs`.

#[path = "../common/mod.rs"]
mod common;

mod alerts;
mod metrics_history;
mod observe_gvisor;
mod sampler_mem_total;
mod sampler_runsc;
mod tenancy;
mod tenancy_audit;
