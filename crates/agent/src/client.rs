//! Transitional shim: the envd client now lives in `kiln-envd`. These names keep the kiln server
//! compiling until it switches to `kiln_envd` directly.

pub use kiln_envd::*;

/// Former name of [`kiln_envd::EnvdClient`].
pub type AgentClient = EnvdClient;
/// Former name of [`kiln_envd::EnvdError`].
pub type ClientError = EnvdError;
