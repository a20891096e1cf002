//! Where kiln keeps things.
//!
//! As root: `/var/lib/kiln/cache` and `/var/lib/kiln/state`. Otherwise the XDG directories
//! (`$XDG_CACHE_HOME/kiln`, `$XDG_STATE_HOME/kiln`, falling back to `~/.cache/kiln` and
//! `~/.local/state/kiln`). `KILN_CACHE_DIR` and `KILN_STATE_DIR` override both.

use std::path::PathBuf;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"))
}

fn env_dir(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Cache directory: templates, images, anything that can be rebuilt from the repo.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = env_dir("KILN_CACHE_DIR") {
        return p;
    }
    if is_root() {
        return PathBuf::from("/var/lib/kiln/cache");
    }
    env_dir("XDG_CACHE_HOME")
        .unwrap_or_else(|| home().join(".cache"))
        .join("kiln")
}

/// State directory: the SQLite database, per-sandbox writable layers, sockets.
pub fn state_dir() -> PathBuf {
    if let Some(p) = env_dir("KILN_STATE_DIR") {
        return p;
    }
    if is_root() {
        return PathBuf::from("/var/lib/kiln/state");
    }
    env_dir("XDG_STATE_HOME")
        .unwrap_or_else(|| home().join(".local/state"))
        .join("kiln")
}

/// Directory holding built templates (inside the cache dir).
pub fn templates_dir() -> PathBuf {
    cache_dir().join("templates")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_win() {
        // Only this test touches these variables in this process.
        std::env::set_var("KILN_CACHE_DIR", "/x/cache");
        std::env::set_var("KILN_STATE_DIR", "/x/state");
        assert_eq!(cache_dir(), PathBuf::from("/x/cache"));
        assert_eq!(state_dir(), PathBuf::from("/x/state"));
        assert_eq!(templates_dir(), PathBuf::from("/x/cache/templates"));
        std::env::remove_var("KILN_CACHE_DIR");
        std::env::remove_var("KILN_STATE_DIR");
        assert!(cache_dir().ends_with("kiln") || cache_dir().ends_with("cache"));
    }
}
