//! A sandbox record for tests that publish records of their own.

use kiln_server::store::{SandboxRecord, SandboxState};

/// Sandbox `id` of template `base` on the gVisor driver in `state`, team `default`.
pub fn sandbox(id: &str, state: SandboxState) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        client_id: "kiln".into(),
        state,
        memory_mb: 256,
        disk_size_mb: 512,
        envd_token: Some("tok".into()),
        started_at_ms: 1000,
        end_at_ms: 2000,
        driver: "gvisor".into(),
        team: "default".into(),
        ..Default::default()
    }
}
