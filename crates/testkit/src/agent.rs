//! The kiln-agent binary under test.

use std::path::PathBuf;

/// `KILN_AGENT_BIN` when set (scripts/test.sh points it at the static build).
pub fn from_env() -> Option<PathBuf> {
    std::env::var_os("KILN_AGENT_BIN")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The kiln-agent binary: `KILN_AGENT_BIN`, which must exist. Panics with how to build it
/// otherwise (a sandbox test cannot run without an agent to install).
pub fn bin() -> PathBuf {
    let p = from_env().unwrap_or_else(|| {
        panic!(
            "KILN_AGENT_BIN is not set: build the static agent (RUSTFLAGS=\"-C target-feature=+crt-static\" \
             cargo build --release -p kiln-agent --target x86_64-unknown-linux-gnu) and point \
             KILN_AGENT_BIN at it (scripts/test.sh does)"
        )
    });
    assert!(p.is_file(), "KILN_AGENT_BIN={} does not exist", p.display());
    p
}
