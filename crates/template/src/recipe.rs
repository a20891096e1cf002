//! Template recipes: small declarative TOML files kept in the repo (`templates/<name>.toml`).
//!
//! ```toml
//! name = "base"
//! start_cmd = ""                        # optional: started in the sandbox after the agent
//! ready_cmd = ""                        # optional: exits 0 once the start command is ready
//! memory_mb = 2048                      # optional: its sandboxes' memory (server default if absent)
//! disk_mb = 4096                        # optional: its sandboxes' writable disk (server default if absent)
//!
//! [from]                                # like a Dockerfile's FROM, but built from packages
//! debian = "bookworm"
//! variant = "minbase"
//! packages = ["bash", "python3"]
//!
//! [[steps]]                             # ordered, like Dockerfile instructions
//! run = "useradd -m -u 1000 user"       # RUN
//! [[steps]]
//! file = { path = "/etc/motd", content = "hi\n", mode = "0644" }   # COPY of inline content
//! [[steps]]
//! env = { LANG = "C.UTF-8" }            # ENV: for later steps and for the sandbox
//! [[steps]]
//! user = "user"                         # USER: later steps run as this user; sandbox default
//! [[steps]]
//! workdir = "/home/user"                # WORKDIR: later steps' cwd; sandbox default
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The recipe of the base template, compiled into the binary so `kiln serve` can build it anywhere.
pub const BASE_RECIPE: &str = include_str!("../../../templates/base.toml");

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Template name: lowercase letters, digits and `-`.
    pub name: String,
    pub from: From,
    #[serde(default)]
    pub steps: Vec<Step>,
    /// Command started inside the sandbox after the agent is up (E2B's start command).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    /// Command that exits 0 once the start command is ready (E2B's `readyCmd`): a create
    /// returns only after it succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    /// Memory of the template's sandboxes in MiB (E2B's `memoryMB`); the server's default when
    /// absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u32>,
    /// Writable disk of the template's sandboxes in MiB (E2B's `diskSizeMB`); the server's
    /// default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct From {
    /// Debian suite, e.g. `bookworm`.
    pub debian: String,
    /// mmdebstrap variant (`minbase`, `essential`, `apt`, `required`, `important`, `standard`).
    #[serde(default = "default_variant")]
    pub variant: String,
    #[serde(default)]
    pub packages: Vec<String>,
}

fn default_variant() -> String {
    "minbase".into()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Step {
    Run(String),
    File(FileStep),
    Env(BTreeMap<String, String>),
    User(String),
    Workdir(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileStep {
    /// Absolute path inside the template.
    pub path: String,
    pub content: String,
    /// Octal permission bits, e.g. "0644" (default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
}

impl Step {
    /// One line naming the step, used in progress output and build errors.
    pub fn describe(&self) -> String {
        let short = |s: &str| {
            let line = s.lines().next().unwrap_or("");
            if line.len() > 60 || s.lines().count() > 1 {
                format!("{}…", &line[..line.floor_char_boundary_compat(60)])
            } else {
                line.to_string()
            }
        };
        match self {
            Step::Run(cmd) => format!("run `{}`", short(cmd)),
            Step::File(f) => format!("file {}", f.path),
            Step::Env(e) => format!("env {}", e.keys().cloned().collect::<Vec<_>>().join(", ")),
            Step::User(u) => format!("user {u}"),
            Step::Workdir(w) => format!("workdir {w}"),
        }
    }
}

trait FloorCharBoundary {
    fn floor_char_boundary_compat(&self, i: usize) -> usize;
}

impl FloorCharBoundary for str {
    fn floor_char_boundary_compat(&self, i: usize) -> usize {
        let mut i = i.min(self.len());
        while !self.is_char_boundary(i) {
            i -= 1;
        }
        i
    }
}

/// What a built template needs to know at sandbox start: the effect of all env/user/workdir steps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Defaults {
    pub user: String,
    pub workdir: String,
    pub env: BTreeMap<String, String>,
}

impl Recipe {
    /// Parses and validates a recipe; `origin` names the file in error messages.
    pub fn parse(text: &str, origin: &str) -> Result<Recipe> {
        let err = |msg: String| Error::Recipe {
            path: origin.to_string(),
            msg,
        };
        let recipe: Recipe = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        recipe.validate().map_err(err)?;
        Ok(recipe)
    }

    /// Reads and parses a recipe file.
    pub fn load(path: &Path) -> Result<Recipe> {
        let text = std::fs::read_to_string(path)
            .map_err(crate::io_err(format!("reading recipe {}", path.display())))?;
        Recipe::parse(&text, &path.display().to_string())
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 64
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !self.name.starts_with('-');
        if !name_ok {
            return Err(format!(
                "name {:?} is invalid: use 1-64 lowercase letters, digits and '-'",
                self.name
            ));
        }
        let word = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"+-.:_~".contains(&b))
        };
        if !word(&self.from.debian) {
            return Err(format!(
                "from.debian {:?} is not a suite name",
                self.from.debian
            ));
        }
        const VARIANTS: &[&str] = &[
            "extract",
            "custom",
            "essential",
            "apt",
            "required",
            "minbase",
            "buildd",
            "important",
            "debootstrap",
            "standard",
        ];
        if !VARIANTS.contains(&self.from.variant.as_str()) {
            return Err(format!(
                "from.variant {:?} is not one of {}",
                self.from.variant,
                VARIANTS.join(", ")
            ));
        }
        for p in &self.from.packages {
            if !word(p) {
                return Err(format!("package name {p:?} is invalid"));
            }
        }
        for (i, step) in self.steps.iter().enumerate() {
            let n = i + 1;
            match step {
                Step::Run(cmd) if cmd.trim().is_empty() => {
                    return Err(format!("step {n}: run command is empty"))
                }
                Step::File(f) => {
                    if !f.path.starts_with('/') || f.path.split('/').any(|c| c == "..") {
                        return Err(format!(
                            "step {n}: file path {:?} must be absolute and must not contain '..'",
                            f.path
                        ));
                    }
                    if let Some(m) = &f.mode {
                        if u32::from_str_radix(m, 8).map_or(true, |v| v > 0o7777) {
                            return Err(format!(
                                "step {n}: file mode {m:?} is not octal like \"0644\""
                            ));
                        }
                    }
                }
                Step::Env(e) => {
                    for k in e.keys() {
                        let ok = !k.is_empty()
                            && !k.starts_with(|c: char| c.is_ascii_digit())
                            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
                        if !ok {
                            return Err(format!("step {n}: env name {k:?} is invalid"));
                        }
                    }
                }
                Step::User(u) if !word(u) => {
                    return Err(format!("step {n}: user {u:?} is invalid"))
                }
                Step::Workdir(w) if !w.starts_with('/') => {
                    return Err(format!("step {n}: workdir {w:?} must be absolute"))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The sandbox defaults after all steps (root and `/` unless a step says otherwise).
    pub fn defaults(&self) -> Defaults {
        let mut d = Defaults {
            user: "root".into(),
            workdir: "/".into(),
            env: BTreeMap::new(),
        };
        for step in &self.steps {
            match step {
                Step::Env(e) => d.env.extend(e.clone()),
                Step::User(u) => d.user = u.clone(),
                Step::Workdir(w) => d.workdir = w.clone(),
                _ => {}
            }
        }
        d
    }

    /// A stable hash of everything that determines the built root filesystem (not formatting or
    /// comments of the file).
    pub fn content_hash(&self) -> String {
        use sha2::{Digest, Sha256};
        let canonical = serde_json::to_vec(self).expect("recipe serializes");
        hex::encode(Sha256::digest(canonical))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "t1"
[from]
debian = "bookworm"
packages = ["bash", "python3"]
[[steps]]
run = "echo hi"
[[steps]]
file = { path = "/etc/x", content = "x\n", mode = "0600" }
[[steps]]
env = { A = "1" }
[[steps]]
user = "user"
[[steps]]
workdir = "/home/user"
"#;

    #[test]
    fn parses_all_step_kinds_and_defaults() {
        let r = Recipe::parse(GOOD, "good.toml").unwrap();
        assert_eq!(r.from.variant, "minbase");
        assert_eq!(r.steps.len(), 5);
        assert!(matches!(&r.steps[0], Step::Run(c) if c == "echo hi"));
        let d = r.defaults();
        assert_eq!(d.user, "user");
        assert_eq!(d.workdir, "/home/user");
        assert_eq!(d.env.get("A").map(String::as_str), Some("1"));
    }

    #[test]
    fn base_recipe_is_valid() {
        let r = Recipe::parse(BASE_RECIPE, "base.toml").unwrap();
        assert_eq!(r.name, "base");
        let d = r.defaults();
        assert_eq!(d.user, "user");
        assert_eq!(d.workdir, "/home/user");
        for p in ["bash", "python3", "sudo", "curl", "git", "ca-certificates"] {
            assert!(r.from.packages.iter().any(|x| x == p), "base lacks {p}");
        }
    }

    fn parse_err(text: &str) -> String {
        Recipe::parse(text, "bad.toml").unwrap_err().to_string()
    }

    #[test]
    fn syntax_error_names_file_and_line() {
        let e = parse_err("name = \"x\"\n[from\ndebian = \"bookworm\"\n");
        assert!(e.starts_with("recipe bad.toml:"), "{e}");
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn unknown_step_and_field_are_rejected() {
        let e = parse_err("name = \"x\"\n[from]\ndebian = \"bookworm\"\n[[steps]]\ncopy = \"a\"\n");
        assert!(e.contains("unknown variant `copy`"), "{e}");
        let e = parse_err("name = \"x\"\nbogus = 1\n[from]\ndebian = \"bookworm\"\n");
        assert!(e.contains("unknown field `bogus`"), "{e}");
    }

    #[test]
    fn missing_from_is_rejected() {
        let e = parse_err("name = \"x\"\n");
        assert!(e.contains("missing field `from`"), "{e}");
    }

    #[test]
    fn invalid_values_are_rejected_with_reason() {
        let base = "[from]\ndebian = \"bookworm\"\n";
        assert!(parse_err(&format!("name = \"Bad Name\"\n{base}"))
            .contains("name \"Bad Name\" is invalid"));
        assert!(
            parse_err("name = \"x\"\n[from]\ndebian = \"bookworm\"\nvariant = \"huge\"\n")
                .contains("from.variant")
        );
        assert!(
            parse_err("name = \"x\"\n[from]\ndebian = \"bookworm\"\npackages = [\"a b\"]\n")
                .contains("package name \"a b\"")
        );
        let e = parse_err(&format!(
            "name = \"x\"\n{base}[[steps]]\nfile = {{ path = \"/a/../etc/shadow\", content = \"\" }}\n"
        ));
        assert!(e.contains("step 1: file path"), "{e}");
        let e = parse_err(&format!(
            "name = \"x\"\n{base}[[steps]]\nfile = {{ path = \"/a\", content = \"\", mode = \"999\" }}\n"
        ));
        assert!(e.contains("file mode"), "{e}");
        let e = parse_err(&format!("name = \"x\"\n{base}[[steps]]\nrun = \"  \"\n"));
        assert!(e.contains("step 1: run command is empty"), "{e}");
        let e = parse_err(&format!(
            "name = \"x\"\n{base}[[steps]]\nworkdir = \"rel\"\n"
        ));
        assert!(e.contains("must be absolute"), "{e}");
        let e = parse_err(&format!(
            "name = \"x\"\n{base}[[steps]]\nenv = {{ \"1A\" = \"v\" }}\n"
        ));
        assert!(e.contains("env name"), "{e}");
    }

    #[test]
    fn memory_is_optional_and_leaves_other_hashes_alone() {
        let plain = Recipe::parse(GOOD, "t.toml").unwrap();
        assert_eq!(plain.memory_mb, None);
        let sized = Recipe::parse(
            &GOOD.replacen("name = \"t1\"", "name = \"t1\"\nmemory_mb = 2048", 1),
            "t.toml",
        )
        .unwrap();
        assert_eq!(sized.memory_mb, Some(2048));
        assert_ne!(plain.content_hash(), sized.content_hash());
        // Without the field, a recipe hashes as before the field existed.
        let json = serde_json::to_string(&plain).unwrap();
        assert!(!json.contains("memory_mb"), "{json}");
        assert!(!json.contains("disk_mb"), "{json}");
        let disk = Recipe::parse(
            &GOOD.replacen("name = \"t1\"", "name = \"t1\"\ndisk_mb = 4096", 1),
            "t.toml",
        )
        .unwrap();
        assert_eq!(disk.disk_mb, Some(4096));
    }

    #[test]
    fn hash_ignores_formatting_but_not_content() {
        let a = Recipe::parse(GOOD, "a").unwrap();
        let reformatted = format!("# a comment\n{}\n\n", GOOD.replace(" = ", "="));
        let b = Recipe::parse(&reformatted, "b").unwrap();
        assert_eq!(a.content_hash(), b.content_hash());
        let c = Recipe::parse(&GOOD.replace("echo hi", "echo ho"), "c").unwrap();
        assert_ne!(a.content_hash(), c.content_hash());
        let d = Recipe::parse(&GOOD.replace("\"python3\"", "\"python3\", \"less\""), "d").unwrap();
        assert_ne!(a.content_hash(), d.content_hash());
    }
}
