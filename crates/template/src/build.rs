//! The template builder: recipe → root filesystem directory + ext4 image, in two cached stages.
//!
//! 1. **base stage** (`.base/<recipe-hash>`): `mmdebstrap` of the recipe's Debian suite and
//!    packages, with each recipe step run as an mmdebstrap customize hook (so `/proc` and `/dev`
//!    are mounted for `run` steps). Keyed by the recipe alone.
//! 2. **template** (`<name>/<key>`): a hard-linked copy of the base stage plus kiln-agent at
//!    `/usr/bin/kiln-agent`, and `rootfs.ext4` made with `mkfs.ext4 -d` (no loop mounts). Keyed by
//!    recipe + agent binary + builder version, so a new agent costs seconds, not a debootstrap.
//!
//! Both stages are built under `.tmp/` and renamed into place; a failed build leaves nothing in
//! the cache and names the failing step with the tail of the full log.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::recipe::{Recipe, Step, BASE_RECIPE};
use crate::store::{remove_tree, Store, Template};
use crate::{io_err, Error, Result};

/// Bump when the builder's output for the same inputs changes.
const BUILDER_VERSION: &str = "kiln-template-builder-2";
/// Source of the preload library installed in every template (see the file's comment).
const COMPAT_SOURCE: &str = include_str!("../compat/kiln-compat.c");
/// Where the compat library lives inside every template.
pub const COMPAT_PATH_IN_ROOTFS: &str = "usr/lib/kiln/libkiln-compat.so";
/// Where the agent lives inside every template.
pub const AGENT_PATH_IN_ROOTFS: &str = "usr/bin/kiln-agent";
const STEP_MARKER: &str = "kiln-step:";

#[derive(Debug, Clone, Default)]
pub struct BuildOptions {
    /// kiln-agent binary to install; found automatically when `None` (see [`find_agent`]).
    pub agent: Option<PathBuf>,
    /// Rebuild even when the cache has this template.
    pub force: bool,
    /// No progress output (errors are still returned).
    pub quiet: bool,
    /// apt sources for mmdebstrap: a mirror URL or a sources file. Default: `KILN_DEBIAN_MIRROR`,
    /// else the host's own Debian sources file.
    pub mirror: Option<String>,
}

#[derive(Debug, Clone)]
pub struct BuildOutcome {
    pub template: Template,
    /// True when nothing was built because the cache already had it.
    pub cached: bool,
    /// True when the mmdebstrap stage came from the cache (only the agent layer was rebuilt).
    pub base_cached: bool,
    pub elapsed: Duration,
}

/// Builds the base template from the recipe compiled into this binary, unless it is cached.
pub fn ensure_base(store: &Store, opts: &BuildOptions) -> Result<Template> {
    let recipe = Recipe::parse(BASE_RECIPE, "templates/base.toml")?;
    Ok(build(store, &recipe, opts)?.template)
}

/// The cache key of a template: recipe, agent binary and builder version.
pub fn template_key(recipe_hash: &str, agent_sha256: &str) -> String {
    let mut h = Sha256::new();
    for part in [BUILDER_VERSION, COMPAT_SOURCE, recipe_hash, agent_sha256] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    hex::encode(h.finalize())
}

/// Builds `recipe` into `store` (or returns the cached template).
pub fn build(store: &Store, recipe: &Recipe, opts: &BuildOptions) -> Result<BuildOutcome> {
    let started = Instant::now();
    let agent = find_agent(opts.agent.as_deref())?;
    let agent_sha256 = sha256_file(&agent)?;
    let recipe_hash = recipe.content_hash();
    let key = template_key(&recipe_hash, &agent_sha256);
    let ui = Ui { quiet: opts.quiet };

    if !opts.force {
        if let Some(t) = store.get(&recipe.name, &key)? {
            // Make sure it is the current one too (cheap; a rebuilt older key may be current).
            let t = store.publish_existing(&t)?;
            ui.line(&format!(
                "template {} is cached ({}, key {})",
                t.name,
                t.dir.display(),
                &key[..12]
            ));
            return Ok(BuildOutcome {
                template: t,
                cached: true,
                base_cached: true,
                elapsed: started.elapsed(),
            });
        }
    }
    kiln_host::prereq::ensure(&[
        kiln_host::prereq::Tool {
            program: "mmdebstrap",
            package: "mmdebstrap",
            why: "building template root filesystems",
        },
        kiln_host::prereq::Tool {
            program: "mkfs.ext4",
            package: "e2fsprogs",
            why: "template ext4 images",
        },
    ])?;

    let log_path = store.log_path(&recipe.name, &key);
    let mut log = Log::create(&log_path)?;
    ui.line(&format!(
        "building template {} (key {}, log {})",
        recipe.name,
        &key[..12],
        log_path.display()
    ));

    let (base, base_cached) = base_stage(store, recipe, &recipe_hash, opts, &ui, &mut log)?;

    let staging = tempdir_in(&store.tmp_dir(), "template-")?;
    let result = (|| {
        let rootfs = staging.join("rootfs");
        let phase = ui.phase("install kiln-agent and compat library");
        let out = Command::new("cp")
            .arg("-al")
            .arg(&base)
            .arg(&rootfs)
            .output()
            .map_err(io_err("running cp"))?;
        if !out.status.success() {
            log.write(&out.stderr);
            return Err(log.failure("copying the base stage", &log_path));
        }
        install_agent(&agent, &rootfs)?;
        install_compat(&staging, &rootfs, &mut log)
            .map_err(|_| log.failure("building the compat preload library", &log_path))?;
        phase.done();

        let phase = ui.phase("ext4 image (mkfs.ext4 -d)");
        let size_bytes = tree_size(&rootfs);
        make_ext4(&rootfs, &staging.join("rootfs.ext4"), size_bytes, &mut log)
            .map_err(|_| log.failure("making the ext4 image", &log_path))?;
        phase.done();

        let defaults = recipe.defaults();
        let meta = Template {
            name: recipe.name.clone(),
            key: key.clone(),
            recipe_hash: recipe_hash.clone(),
            agent_sha256: agent_sha256.clone(),
            dir: PathBuf::new(),
            rootfs: PathBuf::new(),
            ext4: PathBuf::new(),
            user: defaults.user,
            workdir: defaults.workdir,
            env: defaults.env,
            start_cmd: recipe.start_cmd.clone().filter(|s| !s.trim().is_empty()),
            built_at_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            size_bytes,
            build_secs: started.elapsed().as_secs_f64(),
        };
        store.publish(&staging, &meta)
    })();
    if result.is_err() {
        remove_tree(&staging);
    }
    let template = result?;
    ui.line(&format!(
        "template {} built in {:.1}s: {}",
        template.name,
        started.elapsed().as_secs_f64(),
        template.dir.display()
    ));
    Ok(BuildOutcome {
        template,
        cached: false,
        base_cached,
        elapsed: started.elapsed(),
    })
}

impl Store {
    /// Makes an already-built template current again (used on cache hits).
    pub(crate) fn publish_existing(&self, t: &Template) -> Result<Template> {
        match self.lookup(&t.name) {
            Ok(cur) if cur.key == t.key => Ok(cur),
            _ => {
                self.set_current(&t.name, &t.key)?;
                self.lookup(&t.name)
            }
        }
    }
}

/// Stage 1: mmdebstrap + recipe steps, cached by recipe hash. Returns the rootfs directory and
/// whether it came from the cache.
fn base_stage(
    store: &Store,
    recipe: &Recipe,
    recipe_hash: &str,
    opts: &BuildOptions,
    ui: &Ui,
    log: &mut Log,
) -> Result<(PathBuf, bool)> {
    let done = store.base_dir(recipe_hash);
    if done.join("rootfs").is_dir() && !opts.force {
        ui.line("base stage cached (mmdebstrap and steps skipped)");
        return Ok((done.join("rootfs"), true));
    }
    let staging = tempdir_in(&store.tmp_dir(), "base-")?;
    let result = run_mmdebstrap(recipe, opts, &staging, ui, log);
    match result {
        Ok(()) => {
            remove_tree(&done);
            std::fs::rename(&staging, &done).map_err(io_err(format!(
                "moving {} to {}",
                staging.display(),
                done.display()
            )))?;
            Ok((done.join("rootfs"), false))
        }
        Err(e) => {
            remove_tree(&staging);
            Err(e)
        }
    }
}

/// Single-quotes `s` for `sh`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn default_mirror(opts: &BuildOptions) -> Option<String> {
    if let Some(m) = opts.mirror.clone() {
        return Some(m);
    }
    if let Ok(m) = std::env::var("KILN_DEBIAN_MIRROR") {
        if !m.is_empty() {
            return Some(m);
        }
    }
    [
        "/etc/apt/sources.list.d/debian.sources",
        "/etc/apt/sources.list",
    ]
    .iter()
    .find(|p| {
        std::fs::read_to_string(p)
            .map(|t| {
                t.lines()
                    .any(|l| !l.trim_start().starts_with('#') && l.contains("debian"))
            })
            .unwrap_or(false)
    })
    .map(|p| p.to_string())
}

/// Writes the per-step scripts and runs mmdebstrap with one customize hook per step.
fn run_mmdebstrap(
    recipe: &Recipe,
    opts: &BuildOptions,
    staging: &Path,
    ui: &Ui,
    log: &mut Log,
) -> Result<()> {
    let steps_dir = staging.join("steps");
    std::fs::create_dir_all(&steps_dir).map_err(io_err("creating step dir"))?;
    let rootfs = staging.join("rootfs");

    let mut hooks: Vec<String> = Vec::new();
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let mut user = "root".to_string();
    let mut workdir = "/".to_string();
    for (i, step) in recipe.steps.iter().enumerate() {
        let n = i + 1;
        let marker = format!("echo {STEP_MARKER}{n}");
        let hook = match step {
            Step::Run(cmd) => {
                let mut script = String::from("set -e\n");
                for (k, v) in &env {
                    script.push_str(&format!("export {k}={}\n", sh_quote(v)));
                }
                script.push_str(&format!("cd {}\n{cmd}\n", sh_quote(&workdir)));
                let file = steps_dir.join(format!("step-{n}.sh"));
                std::fs::write(&file, script).map_err(io_err("writing step script"))?;
                let run_as = if user == "root" {
                    String::new()
                } else {
                    format!("runuser -u {} -- ", sh_quote(&user))
                };
                format!(
                    "{marker}; mkdir -p \"$1/.kiln-build\" && cp {} \"$1/.kiln-build/step.sh\" && chmod 0755 \"$1/.kiln-build\" \"$1/.kiln-build/step.sh\" && chroot \"$1\" {run_as}/bin/sh -e /.kiln-build/step.sh",
                    sh_quote(&file.display().to_string())
                )
            }
            Step::File(f) => {
                let file = steps_dir.join(format!("file-{n}"));
                std::fs::write(&file, &f.content).map_err(io_err("writing file step"))?;
                format!(
                    "{marker}; install -D -m {} {} \"$1\"{}",
                    f.mode.as_deref().unwrap_or("0644"),
                    sh_quote(&file.display().to_string()),
                    sh_quote(&f.path)
                )
            }
            Step::Env(e) => {
                env.extend(e.clone());
                marker
            }
            Step::User(u) => {
                user = u.clone();
                format!("{marker}; chroot \"$1\" id -u {} >/dev/null", sh_quote(u))
            }
            Step::Workdir(w) => {
                workdir = w.clone();
                format!("{marker}; mkdir -p \"$1\"{}", sh_quote(w))
            }
        };
        hooks.push(hook);
    }
    hooks.push("rm -rf \"$1/.kiln-build\"".into());

    let mut cmd = Command::new("mmdebstrap");
    cmd.arg(format!("--variant={}", recipe.from.variant));
    if !recipe.from.packages.is_empty() {
        cmd.arg(format!("--include={}", recipe.from.packages.join(",")));
    }
    for h in &hooks {
        cmd.arg(format!("--customize-hook={h}"));
    }
    cmd.arg(&recipe.from.debian).arg(&rootfs);
    if let Some(m) = default_mirror(opts) {
        cmd.arg(m);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    log.line(&format!("$ {cmd:?}"));

    let total = recipe.steps.len();
    let mut phase = ui.phase(&format!(
        "mmdebstrap {} ({}, {} packages)",
        recipe.from.debian,
        recipe.from.variant,
        recipe.from.packages.len()
    ));
    let mut current = format!("mmdebstrap of {} with its packages", recipe.from.debian);
    let mut child = cmd.spawn().map_err(io_err("starting mmdebstrap"))?;
    // Merge stdout and stderr into one ordered stream via a channel.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let mut readers = Vec::new();
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(|l| l.ok()) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        }));
    }
    drop(tx);
    for line in rx {
        log.line(&line);
        if let Some(n) = line.strip_prefix(STEP_MARKER) {
            if let Ok(n) = n.trim().parse::<usize>() {
                phase.done();
                let desc = recipe.steps[n - 1].describe();
                current = format!("step {n}/{total}: {desc}");
                phase = ui.phase(&current);
            }
        } else {
            phase.message(&line);
        }
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child.wait().map_err(io_err("waiting for mmdebstrap"))?;
    if !status.success() {
        phase.fail();
        log.line(&format!("mmdebstrap exited with {status}"));
        return Err(log.failure(&current, &log.path.clone()));
    }
    phase.done();
    Ok(())
}

fn install_agent(agent: &Path, rootfs: &Path) -> Result<()> {
    let dest = rootfs.join(AGENT_PATH_IN_ROOTFS);
    // The base stage is hard-linked: replace the entry, never write through a shared inode.
    let _ = std::fs::remove_file(&dest);
    std::fs::copy(agent, &dest).map_err(io_err(format!(
        "copying {} to {}",
        agent.display(),
        dest.display()
    )))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755))
        .map_err(io_err("chmod kiln-agent"))?;
    Ok(())
}

/// Compiles the compat preload library with the host C compiler (freestanding: it links against
/// nothing) and registers it in `/etc/ld.so.preload`.
fn install_compat(staging: &Path, rootfs: &Path, log: &mut Log) -> std::result::Result<(), ()> {
    let src = staging.join("kiln-compat.c");
    std::fs::write(&src, COMPAT_SOURCE).map_err(|e| log.line(&format!("write source: {e}")))?;
    let dest = rootfs.join(COMPAT_PATH_IN_ROOTFS);
    if let Some(dir) = dest.parent() {
        std::fs::create_dir_all(dir).map_err(|e| log.line(&format!("mkdir: {e}")))?;
    }
    let _ = std::fs::remove_file(&dest);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-shared", "-fPIC", "-nostdlib", "-O2", "-Wall", "-o"])
        .arg(&dest)
        .arg(&src)
        .output()
        .map_err(|e| log.line(&format!("running {cc} (install gcc): {e}")))?;
    log.write(&out.stdout);
    log.write(&out.stderr);
    let _ = std::fs::remove_file(&src);
    if !out.status.success() {
        log.line(&format!("{cc} exited with {}", out.status));
        return Err(());
    }
    let preload = rootfs.join("etc/ld.so.preload");
    let mut lines = std::fs::read_to_string(&preload).unwrap_or_default();
    let entry = format!("/{COMPAT_PATH_IN_ROOTFS}");
    if !lines.lines().any(|l| l.trim() == entry) {
        lines.push_str(&entry);
        lines.push('\n');
    }
    // Replace, never write through: the base stage is hard-linked.
    let _ = std::fs::remove_file(&preload);
    std::fs::write(&preload, lines).map_err(|e| log.line(&format!("write ld.so.preload: {e}")))
}

/// Bytes used by a tree (hard links counted once).
fn tree_size(root: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(md) = e.path().symlink_metadata() else {
                continue;
            };
            if md.is_dir() {
                stack.push(e.path());
            }
            if seen.insert((md.dev(), md.ino())) {
                total += md.blocks() * 512;
            }
        }
    }
    total
}

fn make_ext4(rootfs: &Path, image: &Path, used: u64, log: &mut Log) -> std::result::Result<(), ()> {
    // Room for metadata plus 1 GiB of free space; the file is sparse, so this costs nothing.
    let size = (used + used / 4 + (1 << 30)).div_ceil(1 << 20) << 20;
    let f = File::create(image).map_err(|e| log.line(&format!("create image: {e}")))?;
    f.set_len(size)
        .map_err(|e| log.line(&format!("size image: {e}")))?;
    drop(f);
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "kiln-root", "-d"])
        .arg(rootfs)
        .arg(image)
        .output()
        .map_err(|e| log.line(&format!("running mkfs.ext4: {e}")))?;
    log.write(&out.stdout);
    log.write(&out.stderr);
    if out.status.success() {
        Ok(())
    } else {
        log.line(&format!("mkfs.ext4 exited with {}", out.status));
        Err(())
    }
}

fn tempdir_in(parent: &Path, prefix: &str) -> Result<PathBuf> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(parent)
        .map(tempfile::TempDir::keep)
        .map_err(io_err(format!(
            "creating a temp dir in {}",
            parent.display()
        )))
}

pub(crate) fn sha256_file(p: &Path) -> Result<String> {
    let mut f = File::open(p).map_err(io_err(format!("opening {}", p.display())))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(io_err(format!("reading {}", p.display())))?;
    Ok(hex::encode(h.finalize()))
}

/// Finds the kiln-agent binary to install: `explicit`, else `$KILN_AGENT_BIN`, else next to the
/// running executable or in the cargo target dir's static build. It must be statically linked,
/// because it runs inside root filesystems whose libc kiln does not control.
pub fn find_agent(explicit: Option<&Path>) -> Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = explicit {
        candidates.push(p.to_path_buf());
    } else if let Some(p) = std::env::var_os("KILN_AGENT_BIN").filter(|v| !v.is_empty()) {
        candidates.push(PathBuf::from(p));
    } else if let Ok(exe) = std::env::current_exe() {
        let mut dir = exe.parent().map(Path::to_path_buf);
        // target/<profile>/kiln, or target/<profile>/deps/<test> for tests.
        for _ in 0..3 {
            let Some(d) = dir else { break };
            candidates.push(d.join("kiln-agent"));
            for profile in ["release", "debug"] {
                candidates.push(
                    d.join("x86_64-unknown-linux-gnu")
                        .join(profile)
                        .join("kiln-agent"),
                );
            }
            dir = d.parent().map(Path::to_path_buf);
        }
    }
    let build_cmd = "RUSTFLAGS='-C target-feature=+crt-static' cargo build --release -p kiln-agent --target x86_64-unknown-linux-gnu";
    let mut dynamic = None;
    for c in &candidates {
        if !c.is_file() {
            continue;
        }
        match is_static_elf(c) {
            Ok(true) => return Ok(c.clone()),
            Ok(false) => dynamic = Some(c.clone()),
            Err(e) => {
                return Err(Error::Agent(format!(
                    "{} is not a readable ELF binary ({e})",
                    c.display()
                )))
            }
        }
    }
    if let Some(d) = dynamic {
        return Err(Error::Agent(format!(
            "{} is dynamically linked; templates need a static agent. Build it with:\n    {build_cmd}",
            d.display()
        )));
    }
    Err(Error::Agent(format!(
        "not found (looked at: {}). Build it with:\n    {build_cmd}\nor set KILN_AGENT_BIN",
        candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// True when the ELF file has no program interpreter (PT_INTERP), i.e. is statically linked.
pub fn is_static_elf(p: &Path) -> std::io::Result<bool> {
    let data = std::fs::read(p)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a 64-bit ELF file");
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 {
        return Err(bad());
    }
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(data[0x20..0x28].try_into().map_err(|_| bad())?) as usize;
    let phentsize = u16_at(0x36);
    let phnum = u16_at(0x38);
    for i in 0..phnum {
        let off = phoff + i * phentsize;
        let Some(ph) = data.get(off..off + 4) else {
            return Err(bad());
        };
        if u32::from_le_bytes(ph.try_into().map_err(|_| bad())?) == 3 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The full build log.
struct Log {
    file: File,
    path: PathBuf,
    tail: std::collections::VecDeque<String>,
}

impl Log {
    fn create(path: &Path) -> Result<Log> {
        let file = File::create(path).map_err(io_err(format!("creating {}", path.display())))?;
        Ok(Log {
            file,
            path: path.to_path_buf(),
            tail: Default::default(),
        })
    }

    fn line(&mut self, l: &str) {
        let _ = writeln!(self.file, "{l}");
        self.tail.push_back(l.to_string());
        if self.tail.len() > 25 {
            self.tail.pop_front();
        }
    }

    fn write(&mut self, bytes: &[u8]) {
        for l in String::from_utf8_lossy(bytes).lines() {
            self.line(l);
        }
    }

    fn failure(&self, step: &str, path: &Path) -> Error {
        Error::BuildFailed {
            step: step.to_string(),
            log: path.display().to_string(),
            tail: self
                .tail
                .iter()
                .map(|l| format!("    {l}"))
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// Progress output: a spinner per phase with elapsed time on a terminal, plain lines elsewhere.
struct Ui {
    quiet: bool,
}

struct Phase {
    bar: Option<ProgressBar>,
    name: String,
    started: Instant,
    quiet: bool,
}

impl Ui {
    fn line(&self, s: &str) {
        if !self.quiet {
            eprintln!("{s}");
        }
    }

    fn phase(&self, name: &str) -> Phase {
        let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let bar = (!self.quiet && tty).then(|| {
            let b = ProgressBar::new_spinner();
            b.set_style(
                ProgressStyle::with_template("  {spinner} {prefix} [{elapsed}] {wide_msg}")
                    .expect("valid template"),
            );
            b.set_prefix(name.to_string());
            b.enable_steady_tick(Duration::from_millis(120));
            b
        });
        if !self.quiet && !tty {
            eprintln!("  … {name}");
        }
        Phase {
            bar,
            name: name.to_string(),
            started: Instant::now(),
            quiet: self.quiet,
        }
    }
}

impl Phase {
    fn message(&self, m: &str) {
        if let Some(b) = &self.bar {
            b.set_message(m.chars().take(100).collect::<String>());
        }
    }

    fn finish(&mut self, mark: &str) {
        let line = format!(
            "  {mark} {} ({:.1}s)",
            self.name,
            self.started.elapsed().as_secs_f64()
        );
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        if !self.quiet {
            eprintln!("{line}");
        }
    }

    fn done(mut self) {
        self.finish("✓");
    }

    fn fail(mut self) {
        self.finish("✗");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_depends_on_recipe_and_agent() {
        let a = template_key("r1", "a1");
        assert_eq!(a, template_key("r1", "a1"));
        assert_ne!(a, template_key("r2", "a1"));
        assert_ne!(a, template_key("r1", "a2"));
        // No ambiguity from concatenation.
        assert_ne!(template_key("r1a", "1"), template_key("r1", "a1"));
    }

    #[test]
    fn sh_quote_survives_quotes() {
        assert_eq!(sh_quote("a'b"), r"'a'\''b'");
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("printf %s {}", sh_quote("it's $HOME `x`")))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "it's $HOME `x`");
    }

    #[test]
    fn static_check_tells_static_from_dynamic() {
        // /bin/sh on any Debian is dynamically linked.
        assert!(!is_static_elf(Path::new("/bin/sh")).unwrap());
        let t = tempfile::tempdir().unwrap();
        let junk = t.path().join("junk");
        std::fs::write(&junk, b"#!/bin/sh\n").unwrap();
        assert!(is_static_elf(&junk).is_err());
        let e = find_agent(Some(Path::new("/bin/sh")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dynamically linked") && e.contains("crt-static"),
            "{e}"
        );
        let e = find_agent(Some(&t.path().join("missing")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not found"), "{e}");
    }
}
