//! COPY archives: single-use upload tokens, the archives stored by hash per team, the check
//! that an archive names nothing outside itself, and the recomputation of the SDK's
//! `filesHash` from an archive (so a stored archive is known to be the one a step names).
//!
//! The SDK's hash (`e2b/template/utils.py: calculate_files_hash`) is SHA-256 over
//! `COPY <src> <dest>`, then per copied path in order: the path relative to the context
//! directory, `st_mode` in decimal, the size (not for directories), then the file's content
//! or the symlink's target. The archive holds the same paths in the same order, so the hash
//! is recomputed from its entries.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// How long an upload URL stays valid.
pub const TOKEN_TTL: Duration = Duration::from_secs(3600);

/// Why an archive is refused.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("the archive is not a readable tar: {0}")]
    Unreadable(String),
    #[error("the archive names {0:?}: absolute paths are refused")]
    Absolute(String),
    #[error("the archive names {0:?}: paths with '..' are refused")]
    DotDot(String),
    #[error("the archive's link {name:?} points at {target:?}, outside the copied files")]
    LinkOut { name: String, target: String },
    #[error("the archive holds more than {0} bytes of files")]
    TooBig(u64),
}

/// Whether `h` is a lowercase hex SHA-256 (what the SDK sends as `filesHash`).
pub fn is_hash(h: &str) -> bool {
    h.len() == 64
        && h.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// An upload the server agreed to take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upload {
    pub team: String,
    pub hash: String,
}

/// Single-use upload tokens (random, kept in memory: a URL dies with the server).
#[derive(Default)]
pub struct Tokens(Mutex<HashMap<String, (Upload, Instant)>>);

impl Tokens {
    /// A fresh token for uploading `hash` for `team`.
    pub fn issue(&self, up: Upload) -> String {
        let token = crate::auth::random_hex(24);
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, (_, at)| at.elapsed() < TOKEN_TTL);
        m.insert(token.clone(), (up, Instant::now()));
        token
    }

    /// Takes the token: its upload, once, while it is valid.
    pub fn take(&self, token: &str) -> Option<Upload> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (up, at) = m.remove(token)?;
        (at.elapsed() < TOKEN_TTL).then_some(up)
    }
}

/// Where the archives of `team` live under the files directory.
pub fn archive_path(dir: &Path, team: &str, hash: &str) -> PathBuf {
    dir.join(team).join(format!("{hash}.tar"))
}

/// A reader of the archive's tar stream (gunzipped when it is gzip).
fn tar_reader(path: &Path) -> Result<Box<dyn Read>, ArchiveError> {
    let mut f = std::fs::File::open(path).map_err(|e| ArchiveError::Unreadable(e.to_string()))?;
    let mut magic = [0u8; 2];
    let n = f
        .read(&mut magic)
        .map_err(|e| ArchiveError::Unreadable(e.to_string()))?;
    let f = std::fs::File::open(path).map_err(|e| ArchiveError::Unreadable(e.to_string()))?;
    Ok(if n == 2 && magic == [0x1f, 0x8b] {
        Box::new(flate2::read::GzDecoder::new(f))
    } else {
        Box::new(f)
    })
}

/// `p` without `./` parts, checked to be relative and free of `..`.
fn clean(p: &str) -> Result<PathBuf, ArchiveError> {
    let path = Path::new(p);
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => return Err(ArchiveError::DotDot(p.into())),
            Component::RootDir | Component::Prefix(_) => {
                return Err(ArchiveError::Absolute(p.into()))
            }
        }
    }
    Ok(out)
}

/// Whether the symlink `name` pointing at `target` stays inside the archive's root.
fn link_stays_inside(name: &Path, target: &str) -> bool {
    if target.starts_with('/') {
        return false;
    }
    let mut depth: i64 = name.components().count() as i64 - 1;
    for c in Path::new(target).components() {
        match c {
            Component::Normal(_) => depth += 1,
            Component::ParentDir => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            Component::CurDir => {}
            _ => return false,
        }
    }
    true
}

fn entry_name(e: &tar::Entry<'_, impl Read>) -> Result<String, ArchiveError> {
    let raw = e.path_bytes();
    let s = String::from_utf8_lossy(&raw);
    let s = s.trim_end_matches('/');
    Ok(if s.is_empty() { ".".into() } else { s.into() })
}

fn link_name(e: &tar::Entry<'_, impl Read>) -> String {
    e.link_name_bytes()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Checks every entry of the archive at `path`: relative names without `..`, links that stay
/// inside, at most `max_bytes` of content. Returns the names of hard-link targets.
pub fn check_archive(path: &Path, max_bytes: u64) -> Result<HashSet<String>, ArchiveError> {
    let mut ar = tar::Archive::new(tar_reader(path)?);
    let mut total = 0u64;
    let mut hard_targets = HashSet::new();
    let unreadable = |e: std::io::Error| ArchiveError::Unreadable(e.to_string());
    for e in ar.entries().map_err(unreadable)? {
        let e = e.map_err(unreadable)?;
        let name = entry_name(&e)?;
        let cleaned = clean(&name)?;
        total += e.header().size().unwrap_or(0);
        if total > max_bytes {
            return Err(ArchiveError::TooBig(max_bytes));
        }
        match e.header().entry_type() {
            tar::EntryType::Symlink => {
                let target = link_name(&e);
                if !link_stays_inside(&cleaned, &target) {
                    return Err(ArchiveError::LinkOut { name, target });
                }
            }
            tar::EntryType::Link => {
                let target = link_name(&e);
                let t = clean(&target).map_err(|_| ArchiveError::LinkOut {
                    name: name.clone(),
                    target: target.clone(),
                })?;
                hard_targets.insert(t.to_string_lossy().into_owned());
            }
            _ => {}
        }
    }
    Ok(hard_targets)
}

/// The SDK's `filesHash` of a COPY of `src` to `dest` whose files are the archive at `path`
/// (checked with [`check_archive`] first).
pub fn files_hash(
    path: &Path,
    src: &str,
    dest: &str,
    max_bytes: u64,
) -> Result<String, ArchiveError> {
    let hard_targets = check_archive(path, max_bytes)?;
    let mut h = Sha256::new();
    h.update(format!("COPY {src} {dest}").as_bytes());
    let mut kept: HashMap<String, Vec<u8>> = HashMap::new();
    let mut ar = tar::Archive::new(tar_reader(path)?);
    let unreadable = |e: std::io::Error| ArchiveError::Unreadable(e.to_string());
    for e in ar.entries().map_err(unreadable)? {
        let mut e = e.map_err(unreadable)?;
        let name = entry_name(&e)?;
        let perm = e.header().mode().unwrap_or(0) & 0o7777;
        h.update(name.as_bytes());
        match e.header().entry_type() {
            tar::EntryType::Directory => {
                h.update((0o040000 | perm).to_string().as_bytes());
            }
            tar::EntryType::Symlink => {
                let target = link_name(&e);
                h.update((0o120000 | perm).to_string().as_bytes());
                h.update(target.len().to_string().as_bytes());
                h.update(target.as_bytes());
            }
            tar::EntryType::Link => {
                // A second name of a file: hashed as the file it names.
                let target = clean(&link_name(&e))?.to_string_lossy().into_owned();
                let content = kept.get(&target).cloned().unwrap_or_default();
                h.update((0o100000 | perm).to_string().as_bytes());
                h.update(content.len().to_string().as_bytes());
                h.update(&content);
            }
            _ => {
                h.update((0o100000 | perm).to_string().as_bytes());
                h.update(e.header().size().unwrap_or(0).to_string().as_bytes());
                let keep = hard_targets.contains(&clean(&name)?.to_string_lossy().into_owned());
                let mut saved = Vec::new();
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = e.read(&mut buf).map_err(unreadable)?;
                    if n == 0 {
                        break;
                    }
                    h.update(&buf[..n]);
                    if keep {
                        saved.extend_from_slice(&buf[..n]);
                    }
                }
                if keep {
                    kept.insert(clean(&name)?.to_string_lossy().into_owned(), saved);
                }
            }
        }
    }
    Ok(hex::encode(h.finalize()))
}

/// Whether `rel` (a path relative to the context) matches a `.dockerignore` pattern: `*` and
/// `?` within one path part, `**` across parts; a pattern names its whole subtree.
pub fn ignored(rel: &str, patterns: &[String]) -> bool {
    fn glob(p: &[u8], s: &[u8]) -> bool {
        match (p.first(), s.first()) {
            (None, _) => s.is_empty() || s[0] == b'/',
            (Some(b'*'), _) if p.get(1) == Some(&b'*') => {
                let rest = p[2..].strip_prefix(b"/").unwrap_or(&p[2..]);
                (0..=s.len()).any(|i| glob(rest, &s[i..]))
            }
            (Some(b'*'), _) => (0..=s.len())
                .take_while(|&i| i == 0 || s[i - 1] != b'/')
                .any(|i| glob(&p[1..], &s[i..])),
            (Some(b'?'), Some(c)) if *c != b'/' => glob(&p[1..], &s[1..]),
            (Some(a), Some(b)) if a == b => glob(&p[1..], &s[1..]),
            _ => false,
        }
    }
    patterns
        .iter()
        .map(|p| p.trim().trim_start_matches("./").trim_start_matches('/'))
        .filter(|p| !p.is_empty() && !p.starts_with('#') && !p.starts_with('!'))
        .any(|p| glob(p.trim_end_matches('/').as_bytes(), rel.as_bytes()))
}

/// Writes the archive of a COPY of `src` (a file or directory under `context`): `src` and
/// everything under it, parents first, names relative to `context`, links kept as links, what
/// `ignore` (`.dockerignore` lines) matches left out. `kiln template build -f` uploads it.
pub fn write_archive(
    context: &Path,
    src: &str,
    ignore: &[String],
    out: impl std::io::Write,
) -> std::io::Result<()> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    let rel = clean(src).map_err(|e| bad(format!("COPY {src}: {e}")))?;
    if rel.as_os_str().is_empty() {
        return Err(bad(format!(
            "COPY {src}: name a file or directory of the context"
        )));
    }
    let mut b = tar::Builder::new(out);
    b.follow_symlinks(false);
    let mut todo = vec![rel];
    while let Some(r) = todo.pop() {
        let name = r.to_string_lossy().into_owned();
        if ignored(&name, ignore) {
            continue;
        }
        let full = context.join(&r);
        let meta = std::fs::symlink_metadata(&full)
            .map_err(|e| bad(format!("COPY {src}: {name}: {e}")))?;
        b.append_path_with_name(&full, &r)?;
        if meta.is_dir() {
            let mut kids: Vec<PathBuf> = std::fs::read_dir(&full)?
                .map(|e| e.map(|e| r.join(e.file_name())))
                .collect::<std::io::Result<_>>()?;
            kids.sort();
            todo.extend(kids.into_iter().rev());
        }
    }
    b.into_inner()?.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(entries: &[(&str, tar::EntryType, &[u8], &str)]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut b = tar::Builder::new(f.reopen().unwrap());
        for (name, kind, data, link) in entries {
            let mut h = tar::Header::new_ustar();
            h.set_entry_type(*kind);
            h.set_mode(if *kind == tar::EntryType::Directory {
                0o755
            } else {
                0o644
            });
            h.set_size(data.len() as u64);
            // Raw names: the builder's own checks would refuse the bad ones.
            h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
            if !link.is_empty() {
                h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
            }
            h.set_cksum();
            b.append(&h, *data).unwrap();
        }
        b.finish().unwrap();
        f
    }

    #[test]
    fn archives_naming_outside_paths_are_refused() {
        use tar::EntryType::*;
        let ok = tar_of(&[
            ("d/", Directory, b"", ""),
            ("d/a", Regular, b"hi", ""),
            ("d/l", Symlink, b"", "a"),
        ]);
        assert!(check_archive(ok.path(), 1 << 20).is_ok());
        let dotdot = tar_of(&[("../x", Regular, b"hi", "")]);
        assert!(matches!(
            check_archive(dotdot.path(), 1 << 20),
            Err(ArchiveError::DotDot(_))
        ));
        let abs = tar_of(&[("/etc/x", Regular, b"hi", "")]);
        assert!(matches!(
            check_archive(abs.path(), 1 << 20),
            Err(ArchiveError::Absolute(_))
        ));
        let out = tar_of(&[("d/l", Symlink, b"", "../../etc/passwd")]);
        assert!(matches!(
            check_archive(out.path(), 1 << 20),
            Err(ArchiveError::LinkOut { .. })
        ));
        let abs_link = tar_of(&[("l", Symlink, b"", "/etc/passwd")]);
        assert!(check_archive(abs_link.path(), 1 << 20).is_err());
        let big = tar_of(&[("a", Regular, &[0u8; 100], "")]);
        assert!(matches!(
            check_archive(big.path(), 10),
            Err(ArchiveError::TooBig(10))
        ));
    }

    #[test]
    fn the_hash_follows_the_sdk() {
        use tar::EntryType::*;
        let t = tar_of(&[("d/", Directory, b"", ""), ("d/a", Regular, b"hi", "")]);
        let mut h = Sha256::new();
        h.update(b"COPY d /app");
        h.update(b"d");
        h.update((0o040755).to_string().as_bytes());
        h.update(b"d/a");
        h.update((0o100644).to_string().as_bytes());
        h.update(b"2");
        h.update(b"hi");
        assert_eq!(
            files_hash(t.path(), "d", "/app", 1 << 20).unwrap(),
            hex::encode(h.finalize())
        );
        assert!(is_hash(&"a".repeat(64)) && !is_hash("../x"));
    }

    #[test]
    fn archives_made_for_a_copy_pass_the_checks() {
        let ctx = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(ctx.path().join("app/sub")).unwrap();
        std::fs::write(ctx.path().join("app/a.py"), "a").unwrap();
        std::fs::write(ctx.path().join("app/sub/b.txt"), "b").unwrap();
        std::fs::write(ctx.path().join("app/secret.txt"), "s").unwrap();
        std::os::unix::fs::symlink("a.py", ctx.path().join("app/l")).unwrap();
        let out = tempfile::NamedTempFile::new().unwrap();
        let ignore = vec!["app/secret.txt".to_string(), "# c".into()];
        write_archive(ctx.path(), "./app/", &ignore, out.reopen().unwrap()).unwrap();
        check_archive(out.path(), 1 << 20).unwrap();
        let mut names = Vec::new();
        let mut ar = tar::Archive::new(std::fs::File::open(out.path()).unwrap());
        for e in ar.entries().unwrap() {
            names.push(e.unwrap().path().unwrap().display().to_string());
        }
        assert_eq!(
            names,
            ["app", "app/a.py", "app/l", "app/sub", "app/sub/b.txt"]
        );
        assert!(files_hash(out.path(), "app", "/x", 1 << 20).is_ok());
        assert!(write_archive(ctx.path(), "../x", &[], std::io::sink()).is_err());
    }

    #[test]
    fn dockerignore_patterns() {
        let p = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(ignored("app/secret.txt", &p(&["app/secret.txt"])));
        assert!(ignored("node_modules/x/y", &p(&["node_modules"])));
        assert!(ignored("app/x.log", &p(&["app/*.log"])));
        assert!(!ignored("app/sub/x.log", &p(&["app/*.log"])));
        assert!(ignored("app/sub/x.log", &p(&["**/*.log"])));
        assert!(!ignored(
            "app/main.py",
            &p(&["app/secret.txt", "!app/main.py"])
        ));
    }
}
