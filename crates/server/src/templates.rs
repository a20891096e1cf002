//! Where sandboxes' templates come from (the kiln-template store in production).

use std::collections::BTreeMap;
use std::path::PathBuf;

/// The parts of a built template the server uses.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateInfo {
    pub name: String,
    pub key: String,
    pub rootfs: PathBuf,
    pub user: String,
    pub workdir: String,
    pub env: BTreeMap<String, String>,
    /// Command started in the background (as `user`, in `workdir`) once the sandbox is up.
    pub start_cmd: Option<String>,
    pub built_at_unix: u64,
    pub size_bytes: u64,
}

/// A source of templates.
pub trait Templates: Send + Sync + 'static {
    /// The template named `name`; `Ok(None)` when there is none.
    fn lookup(&self, name: &str) -> Result<Option<TemplateInfo>, String>;
    fn list(&self) -> Result<Vec<TemplateInfo>, String>;
}

fn info(t: kiln_template::Template) -> TemplateInfo {
    TemplateInfo {
        name: t.name,
        key: t.key,
        rootfs: t.rootfs,
        user: t.user,
        workdir: t.workdir,
        env: t.env,
        start_cmd: t.start_cmd.filter(|c| !c.trim().is_empty()),
        built_at_unix: t.built_at_unix,
        size_bytes: t.size_bytes,
    }
}

impl Templates for kiln_template::Store {
    fn lookup(&self, name: &str) -> Result<Option<TemplateInfo>, String> {
        match kiln_template::Store::lookup(self, name) {
            Ok(t) => Ok(Some(info(t))),
            Err(kiln_template::Error::NotBuilt(_)) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }
    fn list(&self) -> Result<Vec<TemplateInfo>, String> {
        kiln_template::Store::list(self)
            .map(|v| v.into_iter().map(info).collect())
            .map_err(|e| e.to_string())
    }
}

/// A fixed set of templates (tests, and setups that assemble rootfs directories themselves).
#[derive(Debug, Clone, Default)]
pub struct FixedTemplates(pub Vec<TemplateInfo>);

impl Templates for FixedTemplates {
    fn lookup(&self, name: &str) -> Result<Option<TemplateInfo>, String> {
        Ok(self.0.iter().find(|t| t.name == name).cloned())
    }
    fn list(&self) -> Result<Vec<TemplateInfo>, String> {
        Ok(self.0.clone())
    }
}

/// Templates from `first`, then from `second` (e.g. the store plus extra rootfs directories).
pub struct Chain<A, B>(pub A, pub B);

impl<A: Templates, B: Templates> Templates for Chain<A, B> {
    fn lookup(&self, name: &str) -> Result<Option<TemplateInfo>, String> {
        match self.0.lookup(name)? {
            Some(t) => Ok(Some(t)),
            None => self.1.lookup(name),
        }
    }
    fn list(&self) -> Result<Vec<TemplateInfo>, String> {
        let mut v = self.0.list()?;
        v.extend(self.1.list()?);
        Ok(v)
    }
}

/// A template made of a bare rootfs directory (`--template-dir NAME=DIR`): user `user`,
/// workdir `/home/user`, no extra env.
pub fn from_dir(name: &str, dir: &std::path::Path) -> TemplateInfo {
    TemplateInfo {
        name: name.to_string(),
        key: format!("dir-{}", dir.display()),
        rootfs: dir.to_path_buf(),
        user: "user".into(),
        workdir: "/home/user".into(),
        env: BTreeMap::new(),
        start_cmd: None,
        built_at_unix: 0,
        size_bytes: 0,
    }
}
