//! Where sandboxes' templates come from (the kiln-template store in production).

use std::collections::BTreeMap;
use std::path::PathBuf;

/// Why a template could not be looked up or listed.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(
        "invalid template id {0:?}: use 1-64 letters, digits, '-', '_' or '.' (optionally \
         followed by ':tag'), not starting with '.'"
    )]
    InvalidName(String),
    #[error("reading the template store: {0}")]
    Source(#[from] kiln_template::Error),
}

/// Checks a template name against kiln's grammar before anything builds a path from it.
pub fn check_name(name: &str) -> Result<(), TemplateError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && !name.contains("..")
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(TemplateError::InvalidName(name.to_string()))
    }
}

/// The parts of a built template the server uses.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateInfo {
    pub name: String,
    pub key: String,
    pub rootfs: PathBuf,
    /// ext4 image of the same tree (drivers that boot from a block device).
    pub image: Option<PathBuf>,
    pub user: String,
    pub workdir: String,
    pub env: BTreeMap<String, String>,
    /// Command started in the background (as `user`, in `workdir`) once the sandbox is up.
    pub start_cmd: Option<String>,
    /// Exits 0 once the start command is ready (E2B's `readyCmd`); a create waits for it.
    pub ready_cmd: Option<String>,
    /// Memory of the template's sandboxes in MiB (None: the server's default).
    pub memory_mb: Option<u32>,
    /// Writable disk of the template's sandboxes in MiB (None: the server's default).
    pub disk_mb: Option<u32>,
    pub built_at_unix: u64,
    pub size_bytes: u64,
}

/// A source of templates.
pub trait Templates: Send + Sync + 'static {
    /// The template named `name`; `Ok(None)` when there is none.
    fn lookup(&self, name: &str) -> Result<Option<TemplateInfo>, TemplateError>;
    fn list(&self) -> Result<Vec<TemplateInfo>, TemplateError>;
}

fn info(t: kiln_template::Template) -> TemplateInfo {
    TemplateInfo {
        name: t.name,
        key: t.key,
        image: t.ext4.is_file().then_some(t.ext4),
        rootfs: t.rootfs,
        user: t.user,
        workdir: t.workdir,
        env: t.env,
        start_cmd: t.start_cmd.filter(|c| !c.trim().is_empty()),
        ready_cmd: t.ready_cmd.filter(|c| !c.trim().is_empty()),
        memory_mb: t.memory_mb,
        disk_mb: t.disk_mb,
        built_at_unix: t.built_at_unix,
        size_bytes: t.size_bytes,
    }
}

impl Templates for kiln_template::Store {
    fn lookup(&self, name: &str) -> Result<Option<TemplateInfo>, TemplateError> {
        check_name(name)?;
        match kiln_template::Store::lookup(self, name) {
            Ok(t) => Ok(Some(info(t))),
            Err(kiln_template::Error::NotBuilt(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
    fn list(&self) -> Result<Vec<TemplateInfo>, TemplateError> {
        Ok(kiln_template::Store::list(self)?
            .into_iter()
            .map(info)
            .collect())
    }
}

/// A fixed set of templates (tests, and setups that assemble rootfs directories themselves).
#[derive(Debug, Clone, Default)]
pub struct FixedTemplates(pub Vec<TemplateInfo>);

impl Templates for FixedTemplates {
    fn lookup(&self, name: &str) -> Result<Option<TemplateInfo>, TemplateError> {
        Ok(self.0.iter().find(|t| t.name == name).cloned())
    }
    fn list(&self) -> Result<Vec<TemplateInfo>, TemplateError> {
        Ok(self.0.clone())
    }
}

/// Templates from `first`, then from `second` (e.g. the store plus extra rootfs directories).
pub struct Chain<A, B>(pub A, pub B);

impl<A: Templates, B: Templates> Templates for Chain<A, B> {
    fn lookup(&self, name: &str) -> Result<Option<TemplateInfo>, TemplateError> {
        match self.0.lookup(name)? {
            Some(t) => Ok(Some(t)),
            None => self.1.lookup(name),
        }
    }
    fn list(&self) -> Result<Vec<TemplateInfo>, TemplateError> {
        let mut v = self.0.list()?;
        v.extend(self.1.list()?);
        Ok(v)
    }
}

/// The build key of a bare rootfs directory: a hash of its path (the key never shows a path).
fn dir_key(dir: &std::path::Path) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(dir.as_os_str().as_encoded_bytes());
    format!("dir-{}", &hex::encode(digest)[..16])
}

/// A template made of a bare rootfs directory (`--template-dir NAME=DIR`): user `user`,
/// workdir `/home/user`, no extra env.
pub fn from_dir(name: &str, dir: &std::path::Path) -> TemplateInfo {
    TemplateInfo {
        name: name.to_string(),
        key: dir_key(dir),
        rootfs: dir.to_path_buf(),
        image: None,
        user: "user".into(),
        workdir: "/home/user".into(),
        env: BTreeMap::new(),
        start_cmd: None,
        ready_cmd: None,
        memory_mb: None,
        disk_mb: None,
        built_at_unix: 0,
        size_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_names_follow_the_grammar() {
        for ok in ["base", "code-interpreter-v1", "desktop", "my_tpl.v2", "A1"] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/run/kiln/x",
            "../etc",
            "a/b",
            ".hidden",
            "a..b",
            "with space",
            "nul\0",
            &"x".repeat(65),
        ] {
            assert!(
                matches!(check_name(bad), Err(TemplateError::InvalidName(_))),
                "{bad:?}"
            );
        }
    }
}
