//! A sandbox record for tests that publish records of their own.

use std::collections::BTreeMap;

use kiln_server::store::{SandboxRecord, SandboxState};

/// Sandbox `id` of template `base` on the gVisor driver in `state`, team `default`.
pub fn sandbox(id: &str, state: SandboxState) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        template_id: "base".into(),
        alias: None,
        client_id: "kiln".into(),
        state,
        metadata: BTreeMap::new(),
        env_vars: BTreeMap::new(),
        cpu_count: 1,
        memory_mb: 256,
        disk_size_mb: 512,
        envd_token: Some("tok".into()),
        started_at_ms: 1000,
        end_at_ms: 2000,
        ended_at_ms: None,
        end_reason: None,
        auto_pause: false,
        driver: "gvisor".into(),
        pause_mode: None,
        auto_resume: false,
        auto_pause_memory: true,
        team: "default".into(),
        ingress: Default::default(),
    }
}
