//! Applying an image layer (a tar, plain, gzip or zstd) to a root filesystem directory, as an
//! overlay would have seen it: `.wh.NAME` deletes `NAME` from lower layers, `.wh..wh..opq`
//! hides everything lower layers put in its directory; markers are not extracted.
//!
//! Safety: entry names and hard-link targets with `..` (or absolute after the leading `/` is
//! dropped) are refused, as is a relative symlink whose target climbs above the root; every
//! parent directory is resolved inside the root ([`super::rootpath`]), and the entry itself is
//! never followed, so an absolute symlink is kept as a link but nothing is written through it.
//! Device nodes are skipped; owners, modes (setuid included), mtimes and `security.*` xattrs
//! are kept. The uncompressed stream's SHA-256 is checked against the config's `diff_id`.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, Read};
use std::os::unix::fs::{lchown, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};
use tar::EntryType;

use super::rootpath::{is_clean_relative, link_stays_inside, resolve, Resolve};
use super::OciError;

/// What applying one layer did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerStats {
    pub entries: u64,
    pub whiteouts: u64,
    pub opaque_dirs: u64,
    pub skipped_devices: u64,
    /// Uncompressed size.
    pub bytes: u64,
    /// `gzip`, `zstd` or `none`.
    pub compression: &'static str,
}

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

/// A reader that hashes and counts what passes through it.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
    len: u64,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
}

/// Opens a layer blob (or an image tarball), choosing the decompressor by its magic bytes.
pub(super) fn open_compressed(path: &Path) -> Result<(Box<dyn Read>, &'static str), OciError> {
    let mut f =
        File::open(path).map_err(|e| OciError::io(format!("opening {}", path.display()), e))?;
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match f.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => return Err(OciError::io(format!("reading {}", path.display()), e)),
        }
    }
    let head = io::Cursor::new(magic[..got].to_vec());
    let raw = BufReader::with_capacity(1 << 16, head.chain(f));
    Ok(match &magic[..got] {
        [0x1f, 0x8b, ..] => (Box::new(flate2::read::MultiGzDecoder::new(raw)), "gzip"),
        [0x28, 0xb5, 0x2f, 0xfd] => {
            let d = ruzstd::decoding::StreamingDecoder::new(raw)
                .map_err(|e| OciError::Invalid(format!("zstd layer {}: {e}", path.display())))?;
            (Box::new(d), "zstd")
        }
        _ => (Box::new(raw), "none"),
    })
}

/// Applies the layer blob at `blob` to `root`. `diff_id`, when given, is the expected SHA-256
/// of the uncompressed tar. `name` names the layer in errors.
pub fn apply_layer(
    root: &Path,
    blob: &Path,
    diff_id: Option<&str>,
    name: &str,
) -> Result<LayerStats, OciError> {
    let (reader, compression) = open_compressed(blob)?;
    let mut hashing = Hashing {
        inner: reader,
        hash: Sha256::new(),
        len: 0,
    };
    let mut stats = LayerStats {
        compression,
        ..Default::default()
    };
    {
        let mut archive = tar::Archive::new(&mut hashing);
        let mut ours: HashSet<PathBuf> = HashSet::new();
        let entries = archive
            .entries()
            .map_err(|e| OciError::io(format!("reading layer {name}"), e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| OciError::io(format!("reading layer {name}"), e))?;
            apply_entry(root, &mut entry, &mut ours, &mut stats, name)?;
        }
    }
    // The digest covers the whole stream, padding after the end-of-archive blocks included.
    io::copy(&mut hashing, &mut io::sink())
        .map_err(|e| OciError::io(format!("reading layer {name}"), e))?;
    stats.bytes = hashing.len;
    if let Some(expected) = diff_id {
        let actual = format!("sha256:{}", hex::encode(hashing.hash.finalize()));
        if actual != expected {
            return Err(OciError::DigestMismatch {
                what: format!("uncompressed layer {name} (diff_id)"),
                expected: expected.to_string(),
                actual,
            });
        }
    }
    Ok(stats)
}

/// The entry's path relative to the root (leading `/` and `./` dropped); `None` for the root.
fn entry_path(raw: &Path, layer: &str) -> Result<Option<PathBuf>, OciError> {
    let rel: PathBuf = raw
        .components()
        .filter(|c| !matches!(c, Component::RootDir | Component::CurDir))
        .collect();
    if !is_clean_relative(&rel) {
        return Err(unsafe_entry(layer, raw, "its path leaves the root (`..`)"));
    }
    Ok((!rel.as_os_str().is_empty()).then_some(rel))
}

fn unsafe_entry(layer: &str, path: &Path, why: &str) -> OciError {
    OciError::Unsafe {
        layer: layer.to_string(),
        entry: path.display().to_string(),
        why: why.to_string(),
    }
}

fn apply_entry<R: Read>(
    root: &Path,
    entry: &mut tar::Entry<'_, R>,
    ours: &mut HashSet<PathBuf>,
    stats: &mut LayerStats,
    layer: &str,
) -> Result<(), OciError> {
    let kind = entry.header().entry_type();
    if matches!(
        kind,
        EntryType::XGlobalHeader
            | EntryType::XHeader
            | EntryType::GNULongName
            | EntryType::GNULongLink
    ) {
        return Ok(());
    }
    let raw = entry
        .path()
        .map_err(|e| OciError::io(format!("reading layer {layer}"), e))?
        .into_owned();
    let Some(rel) = entry_path(&raw, layer)? else {
        return Ok(());
    };
    stats.entries += 1;
    let name = rel
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .to_string();
    let parent_rel = rel.parent().unwrap_or(Path::new("")).to_path_buf();
    let io_at = |what: &str| {
        let what = format!("{what} /{} (layer {layer})", rel.display());
        move |e| OciError::io(what, e)
    };

    if name == OPAQUE {
        stats.opaque_dirs += 1;
        let dir = resolve(
            root,
            &parent_rel,
            Resolve {
                follow_last: true,
                create_parents: true,
            },
        )?;
        if dir.is_dir() {
            clear_lower(&dir, &parent_rel, ours).map_err(io_at("clearing opaque directory"))?;
        }
        return Ok(());
    }
    if let Some(hidden) = name.strip_prefix(WHITEOUT) {
        stats.whiteouts += 1;
        let target_rel = parent_rel.join(hidden);
        if hidden.is_empty() || hidden == ".." || ours.contains(&target_rel) {
            return Ok(());
        }
        let target = match resolve(
            root,
            &target_rel,
            Resolve {
                follow_last: false,
                create_parents: false,
            },
        ) {
            Ok(t) => t,
            Err(_) => return Ok(()), // nothing below to hide
        };
        remove_any(&target).map_err(io_at("applying whiteout for"))?;
        return Ok(());
    }

    // Parents resolved (and created) inside the root; the entry itself never followed.
    let dest = resolve(
        root,
        &rel,
        Resolve {
            follow_last: false,
            create_parents: true,
        },
    )?;
    record(ours, &rel);
    let header = entry.header();
    let (uid, gid) = (
        header.uid().unwrap_or(0) as u32,
        header.gid().unwrap_or(0) as u32,
    );
    let mode = header.mode().unwrap_or(0o644) & 0o7777;
    let mtime = header.mtime().ok();
    match kind {
        EntryType::Directory => {
            let is_dir = dest.symlink_metadata().is_ok_and(|m| m.is_dir());
            if !is_dir {
                remove_any(&dest).map_err(io_at("replacing"))?;
                std::fs::create_dir(&dest).map_err(io_at("creating directory"))?;
            }
            lchown(&dest, Some(uid), Some(gid)).map_err(io_at("chown"))?;
            std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(mode))
                .map_err(io_at("chmod"))?;
        }
        EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
            remove_any(&dest).map_err(io_at("replacing"))?;
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .mode(0o600)
                .open(&dest)
                .map_err(io_at("creating"))?;
            io::copy(entry, &mut f).map_err(io_at("writing"))?;
            lchown(&dest, Some(uid), Some(gid)).map_err(io_at("chown"))?;
            // After chown, which clears setuid/setgid bits.
            f.set_permissions(std::fs::Permissions::from_mode(mode))
                .map_err(io_at("chmod"))?;
            if let Some(t) = mtime {
                let _ = f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t));
            }
            set_xattrs(entry, &dest);
        }
        EntryType::Symlink => {
            let target = entry
                .link_name()
                .map_err(io_at("reading link of"))?
                .ok_or_else(|| unsafe_entry(layer, &raw, "a symlink without a target"))?
                .into_owned();
            if !link_stays_inside(&parent_rel, &target) {
                return Err(unsafe_entry(
                    layer,
                    &raw,
                    &format!(
                        "its symlink target {} leads out of the root",
                        target.display()
                    ),
                ));
            }
            remove_any(&dest).map_err(io_at("replacing"))?;
            std::os::unix::fs::symlink(&target, &dest).map_err(io_at("creating symlink"))?;
            lchown(&dest, Some(uid), Some(gid)).map_err(io_at("chown"))?;
        }
        EntryType::Link => {
            let target_raw = entry
                .link_name()
                .map_err(io_at("reading link of"))?
                .ok_or_else(|| unsafe_entry(layer, &raw, "a hard link without a target"))?
                .into_owned();
            let Some(target_rel) = entry_path(&target_raw, layer).map_err(|_| {
                unsafe_entry(
                    layer,
                    &raw,
                    &format!(
                        "its hard link target {} leaves the root",
                        target_raw.display()
                    ),
                )
            })?
            else {
                return Err(unsafe_entry(layer, &raw, "a hard link to the root"));
            };
            let src = resolve(
                root,
                &target_rel,
                Resolve {
                    follow_last: false,
                    create_parents: false,
                },
            )
            .map_err(|_| {
                unsafe_entry(
                    layer,
                    &raw,
                    &format!(
                        "its hard link target /{} does not exist",
                        target_rel.display()
                    ),
                )
            })?;
            if src.symlink_metadata().is_ok_and(|m| m.is_dir()) {
                return Err(unsafe_entry(layer, &raw, "a hard link to a directory"));
            }
            if src != dest {
                remove_any(&dest).map_err(io_at("replacing"))?;
                std::fs::hard_link(&src, &dest).map_err(io_at("creating hard link"))?;
            }
        }
        EntryType::Fifo => {
            remove_any(&dest).map_err(io_at("replacing"))?;
            let c =
                std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(dest.as_os_str()))
                    .map_err(|_| unsafe_entry(layer, &raw, "a NUL in its name"))?;
            // SAFETY: `c` is a valid NUL-terminated path; mkfifo only reads it.
            if unsafe { libc::mkfifo(c.as_ptr(), mode) } != 0 {
                return Err(io_at("creating fifo")(io::Error::last_os_error()));
            }
            lchown(&dest, Some(uid), Some(gid)).map_err(io_at("chown"))?;
        }
        EntryType::Char | EntryType::Block => stats.skipped_devices += 1,
        _ => {
            tracing::debug!(
                "layer {layer}: skipping /{} of type {kind:?}",
                rel.display()
            );
        }
    }
    Ok(())
}

/// Records `rel` and its ancestors as written by the current layer.
fn record(ours: &mut HashSet<PathBuf>, rel: &Path) {
    let mut p = Some(rel);
    while let Some(q) = p {
        if q.as_os_str().is_empty() || !ours.insert(q.to_path_buf()) {
            break;
        }
        p = q.parent();
    }
}

/// Opaque directory: removes what lower layers put under `dir` (this layer's entries stay).
fn clear_lower(dir: &Path, rel: &Path, ours: &HashSet<PathBuf>) -> io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let child_rel = rel.join(e.file_name());
        if ours.contains(&child_rel) {
            if e.file_type()?.is_dir() {
                clear_lower(&e.path(), &child_rel, ours)?;
            }
        } else {
            remove_any(&e.path())?;
        }
    }
    Ok(())
}

/// Removes a file, link or whole directory tree; a missing path is fine.
fn remove_any(p: &Path) -> io::Result<()> {
    match p.symlink_metadata() {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// `security.*` and `user.*` extended attributes from PAX headers (`SCHILY.xattr.NAME`).
fn set_xattrs<R: Read>(entry: &mut tar::Entry<'_, R>, dest: &Path) {
    let Ok(Some(exts)) = entry.pax_extensions() else {
        return;
    };
    for ext in exts.flatten() {
        let Ok(key) = ext.key() else { continue };
        let Some(attr) = key.strip_prefix("SCHILY.xattr.") else {
            continue;
        };
        if !(attr.starts_with("security.") || attr.starts_with("user.")) {
            continue;
        }
        let (Ok(path), Ok(name)) = (
            std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(dest.as_os_str())),
            std::ffi::CString::new(attr),
        ) else {
            continue;
        };
        let value = ext.value_bytes();
        // SAFETY: both strings are NUL-terminated; the value pointer and length describe a live
        // slice; lsetxattr does not keep any of them.
        let rc = unsafe {
            libc::lsetxattr(
                path.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc != 0 {
            tracing::debug!(
                "xattr {attr} on {}: {}",
                dest.display(),
                io::Error::last_os_error()
            );
        }
    }
}
