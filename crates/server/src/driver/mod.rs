//! Isolation drivers as the server sees them: kiln-driver's traits and types (the [`Driver`]
//! core, its [`Checkpoint`] side, [`SandboxSpec`], [`DriverError`] …), re-exported so that
//! `kiln_server::driver::…` names them. [`factory::build`] picks the driver from configuration.

pub mod factory;
pub mod gvisor;
pub mod microvm;

pub use factory::{build, DriverConfig, DriverKind};
pub use kiln_driver::*;
