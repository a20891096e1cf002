//! Test support shared by kiln's integration tests (a dev-dependency only, never published).
//!
//! - [`skip`]: the one skip policy. A test that needs something this host may lack (root, runsc,
//!   KVM, a tool, a Python module) asks [`needs`]; when something is missing the test fails
//!   naming it, unless `KILN_ALLOW_SKIPS=1` turns that into a visible `SKIP <test>: <why>` line
//!   and the test returns. A missing prerequisite is never a silent pass.
//! - [`host`]: what the guards look at (`which`, root, runsc, `/dev/kvm`), free loopback ports,
//!   and what a test leaves behind (mounts under a directory, processes naming an id).
//! - [`agent`]: the kiln-agent binary under test (`KILN_AGENT_BIN`).
//! - [`rootfs`]: a minimal template rootfs (the agent, bash, a few coreutils, with their
//!   shared libraries).
//!
//! What only one crate's tests use (the server's `Rig`, the VMM's argument builder, the
//! cluster's etcd members) stays in that crate's `tests/`.

pub mod agent;
pub mod host;
pub mod rootfs;
pub mod skip;

pub use skip::{needs, skips_allowed, Needs};
