//! `kiln template import FILE`: an image from a tarball, either an OCI image layout
//! (`oci-layout`, `index.json`, `blobs/sha256/…`; what `docker save` writes since Docker 25 and
//! `skopeo copy … oci-archive:` writes) or the classic `docker save` layout (`manifest.json`
//! naming a config and `<id>/layer.tar` files). The tarball may itself be gzip- or
//! zstd-compressed. It is read once: blobs go straight into the blob cache (OCI blobs checked
//! against their names), small metadata files are kept in memory.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::blobs::Blobs;
use super::image::{pair_layers, parse_config, Image};
use super::unpack::open_compressed;
use super::OciError;

/// Metadata files larger than this are not kept in memory.
const MAX_META: u64 = 4 << 20;

/// What the tarball held, by path inside it.
#[derive(Default)]
struct Contents {
    /// Small files' bytes.
    small: HashMap<PathBuf, Vec<u8>>,
    /// Digests of files stored in the blob cache.
    stored: HashMap<PathBuf, String>,
    /// Symlinks (classic `docker save` links duplicate layers), target made relative to the top.
    links: HashMap<PathBuf, PathBuf>,
}

impl Contents {
    fn follow(&self, p: &Path) -> PathBuf {
        let mut p = normal(p);
        for _ in 0..16 {
            match self.links.get(&p) {
                Some(t) => p = t.clone(),
                None => break,
            }
        }
        p
    }

    fn bytes(&self, blobs: &Blobs, p: &Path) -> Result<Vec<u8>, OciError> {
        let p = self.follow(p);
        if let Some(b) = self.small.get(&p) {
            return Ok(b.clone());
        }
        if let Some(d) = self.stored.get(&p) {
            let path = blobs.path(d)?;
            return std::fs::read(&path)
                .map_err(|e| OciError::io(format!("reading {}", path.display()), e));
        }
        Err(OciError::Invalid(format!(
            "the archive has no {}",
            p.display()
        )))
    }

    fn blob_bytes(&self, blobs: &Blobs, digest: &str) -> Result<Vec<u8>, OciError> {
        let hex = super::blobs::digest_hex(digest)?;
        self.bytes(blobs, &Path::new("blobs/sha256").join(hex))
    }
}

fn normal(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(s) => out.push(s),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    out
}

/// Reads the tarball at `file` into `blobs` and returns the image it holds.
pub fn import(blobs: &Blobs, file: &Path) -> Result<Image, OciError> {
    let label = format!(
        "import:{}",
        file.file_name().unwrap_or_default().to_string_lossy()
    );
    let (reader, _) = open_compressed(file)?;
    let mut archive = tar::Archive::new(reader);
    let mut c = Contents::default();
    let read_err = |e| OciError::io(format!("reading {}", file.display()), e);
    for entry in archive.entries().map_err(read_err)? {
        let mut entry = entry.map_err(read_err)?;
        let path = normal(&entry.path().map_err(read_err)?);
        match entry.header().entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => {}
            tar::EntryType::Symlink => {
                if let Ok(Some(t)) = entry.link_name() {
                    let base = path.parent().unwrap_or(Path::new("")).to_path_buf();
                    c.links.insert(path, normal(&base.join(t)));
                }
                continue;
            }
            _ => continue,
        }
        let size = entry.size();
        let name = path.to_string_lossy().to_string();
        let is_meta = matches!(
            name.as_str(),
            "manifest.json" | "index.json" | "oci-layout" | "repositories"
        ) || (name.ends_with(".json") && !name.starts_with("blobs/"));
        if is_meta && size > MAX_META {
            return Err(OciError::Invalid(format!(
                "{label}: {name} is {size} bytes, too large for image metadata"
            )));
        }
        if is_meta || size <= MAX_META {
            let mut buf = Vec::with_capacity(size as usize);
            std::io::copy(&mut entry, &mut buf).map_err(read_err)?;
            if !is_meta {
                let mut w = blobs.writer()?;
                w.write_all(&buf)
                    .map_err(|e| OciError::io("writing a blob", e))?;
                let d = claimed_digest(&name).unwrap_or_else(|| w.digest());
                w.commit(blobs, &d).map_err(|e| in_archive(e, &name))?;
                c.stored.insert(path.clone(), d);
            }
            c.small.insert(path, buf);
        } else {
            let mut w = blobs.writer()?;
            std::io::copy(&mut entry, &mut w).map_err(read_err)?;
            let d = claimed_digest(&name).unwrap_or_else(|| w.digest());
            w.commit(blobs, &d).map_err(|e| in_archive(e, &name))?;
            c.stored.insert(path, d);
        }
    }
    if c.small.contains_key(Path::new("index.json")) {
        from_oci_layout(blobs, &c, &label)
    } else if c.small.contains_key(Path::new("manifest.json")) {
        from_docker_save(blobs, &c, &label)
    } else {
        Err(OciError::Invalid(format!(
            "{} is neither an OCI image layout (no index.json) nor a `docker save` archive (no manifest.json)",
            file.display()
        )))
    }
}

fn in_archive(e: OciError, name: &str) -> OciError {
    match e {
        OciError::DigestMismatch {
            expected, actual, ..
        } => OciError::DigestMismatch {
            what: format!("{name} in the archive"),
            expected,
            actual,
        },
        other => other,
    }
}

/// `blobs/sha256/<hex>` claims its digest by its name.
fn claimed_digest(name: &str) -> Option<String> {
    let hex = name.strip_prefix("blobs/sha256/")?;
    Some(format!("sha256:{hex}"))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    #[serde(default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    size: i64,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize)]
struct Platform {
    #[serde(default)]
    os: String,
    #[serde(default)]
    architecture: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Manifest {
    #[serde(default)]
    media_type: String,
    #[serde(default)]
    manifests: Vec<Descriptor>,
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

fn is_index(m: &Manifest) -> bool {
    m.media_type.contains("index")
        || m.media_type.contains("manifest.list")
        || (m.config.is_none() && !m.manifests.is_empty())
}

/// Picks the linux/amd64 entry of an index (or its only entry).
fn pick(list: &[Descriptor], label: &str) -> Result<String, OciError> {
    let amd64 = list.iter().find(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
    });
    match (amd64, list) {
        (Some(d), _) => Ok(d.digest.clone()),
        (None, [only]) if only.platform.is_none() => Ok(only.digest.clone()),
        _ => Err(OciError::Invalid(format!(
            "{label}: the image index has no linux/amd64 image"
        ))),
    }
}

fn from_oci_layout(blobs: &Blobs, c: &Contents, label: &str) -> Result<Image, OciError> {
    let parse = |b: &[u8], what: &str| -> Result<Manifest, OciError> {
        serde_json::from_slice(b)
            .map_err(|e| OciError::Invalid(format!("{label}: {what} is not valid: {e}")))
    };
    let index = parse(&c.small[Path::new("index.json")], "index.json")?;
    let mut digest = pick(&index.manifests, label)?;
    let mut manifest = parse(&c.blob_bytes(blobs, &digest)?, &digest)?;
    for _ in 0..4 {
        if !is_index(&manifest) {
            break;
        }
        digest = pick(&manifest.manifests, label)?;
        manifest = parse(&c.blob_bytes(blobs, &digest)?, &digest)?;
    }
    let config_desc = manifest
        .config
        .ok_or_else(|| OciError::Invalid(format!("{label}: manifest {digest} has no config")))?;
    let config = c.blob_bytes(blobs, &config_desc.digest)?;
    let parsed = parse_config(&config, label)?;
    for l in &manifest.layers {
        if !blobs.has(&l.digest) {
            return Err(OciError::Invalid(format!(
                "{label}: the archive lacks layer {}",
                l.digest
            )));
        }
    }
    let layers = pair_layers(
        manifest
            .layers
            .into_iter()
            .map(|l| (l.digest, l.media_type, l.size.max(0) as u64))
            .collect(),
        &parsed.diff_ids,
        label,
    )?;
    Ok(Image {
        source: label.to_string(),
        digest,
        config_digest: config_desc.digest,
        layers,
        config: parsed.run,
        with_credentials: false,
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SaveEntry {
    config: String,
    #[serde(default)]
    layers: Vec<String>,
}

fn from_docker_save(blobs: &Blobs, c: &Contents, label: &str) -> Result<Image, OciError> {
    let entries: Vec<SaveEntry> = serde_json::from_slice(&c.small[Path::new("manifest.json")])
        .map_err(|e| OciError::Invalid(format!("{label}: manifest.json is not valid: {e}")))?;
    let entry = match entries.as_slice() {
        [one] => one,
        [] => {
            return Err(OciError::Invalid(format!(
                "{label}: manifest.json lists no image"
            )))
        }
        _ => {
            return Err(OciError::Invalid(format!(
                "{label}: the archive holds {} images; save one image per file",
                entries.len()
            )))
        }
    };
    let config = c.bytes(blobs, Path::new(&entry.config))?;
    let config_digest = format!("sha256:{}", hex::encode(Sha256::digest(&config)));
    let parsed = parse_config(&config, label)?;
    let mut layers = Vec::new();
    for l in &entry.layers {
        let p = c.follow(Path::new(l));
        let d = c
            .stored
            .get(&p)
            .ok_or_else(|| OciError::Invalid(format!("{label}: the archive lacks layer {l}")))?;
        let size = blobs.path(d)?.metadata().map(|m| m.len()).unwrap_or(0);
        layers.push((d.clone(), String::new(), size));
    }
    let layers = pair_layers(layers, &parsed.diff_ids, label)?;
    Ok(Image {
        source: label.to_string(),
        digest: config_digest.clone(),
        config_digest,
        layers,
        config: parsed.run,
        with_credentials: false,
    })
}
