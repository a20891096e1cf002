//! Isolation drivers as the server sees them: kiln-driver's traits and types (the [`Driver`]
//! core, its [`Checkpoint`] side, [`SandboxSpec`], [`DriverError`] …), re-exported so that
//! `kiln_server::driver::…` names them. The server never names a driver: the binary builds one
//! and hands it to [`crate::Server::prepare`].

pub use kiln_driver::*;
