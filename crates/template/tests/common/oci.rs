//! Test images made by hand: tar layers (with whiteouts, opaque dirs and hostile entries),
//! gzip/zstd compression, and OCI image layouts (directories or tarballs) that skopeo pushes
//! to a registry or `kiln template import` reads.

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub const GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const TAR: &str = "application/vnd.oci.image.layer.v1.tar";

pub fn sha(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// A tar layer being written.
pub struct LayerTar {
    b: tar::Builder<Vec<u8>>,
}

impl Default for LayerTar {
    fn default() -> Self {
        Self::new()
    }
}

impl LayerTar {
    pub fn new() -> LayerTar {
        let mut b = tar::Builder::new(Vec::new());
        b.follow_symlinks(false);
        LayerTar { b }
    }

    fn header(kind: tar::EntryType, name: &str, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        // Written byte for byte, so hostile names (`..`, absolute) survive.
        let bytes = name.as_bytes();
        h.as_old_mut().name[..bytes.len()].copy_from_slice(bytes);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h
    }

    pub fn file(mut self, name: &str, content: &[u8], mode: u32) -> Self {
        let mut h = Self::header(tar::EntryType::Regular, name, mode, content.len() as u64);
        h.set_cksum();
        self.b.append(&h, content).unwrap();
        self
    }

    pub fn owned_file(mut self, name: &str, content: &[u8], mode: u32, uid: u64, gid: u64) -> Self {
        let mut h = Self::header(tar::EntryType::Regular, name, mode, content.len() as u64);
        h.set_uid(uid);
        h.set_gid(gid);
        h.set_cksum();
        self.b.append(&h, content).unwrap();
        self
    }

    pub fn dir(mut self, name: &str) -> Self {
        let mut h = Self::header(tar::EntryType::Directory, name, 0o755, 0);
        h.set_cksum();
        self.b.append(&h, &[][..]).unwrap();
        self
    }

    fn link(mut self, kind: tar::EntryType, name: &str, target: &str) -> Self {
        let mut h = Self::header(kind, name, 0o777, 0);
        let t = target.as_bytes();
        h.as_old_mut().linkname[..t.len()].copy_from_slice(t);
        h.set_cksum();
        self.b.append(&h, &[][..]).unwrap();
        self
    }

    pub fn symlink(self, name: &str, target: &str) -> Self {
        self.link(tar::EntryType::Symlink, name, target)
    }

    pub fn hardlink(self, name: &str, target: &str) -> Self {
        self.link(tar::EntryType::Link, name, target)
    }

    pub fn device(mut self, name: &str) -> Self {
        let mut h = Self::header(tar::EntryType::Char, name, 0o666, 0);
        h.set_device_major(1).unwrap();
        h.set_device_minor(3).unwrap();
        h.set_cksum();
        self.b.append(&h, &[][..]).unwrap();
        self
    }

    /// Adds `paths` (relative to `root`, recursively, symlinks kept) as they are on disk.
    pub fn tree(mut self, root: &Path, paths: &[&str]) -> Self {
        for p in paths {
            let src = root.join(p);
            let md = src
                .symlink_metadata()
                .unwrap_or_else(|e| panic!("{}: {e}", src.display()));
            if md.is_dir() {
                self.b.append_dir_all(p, &src).unwrap();
            } else {
                self.b.append_path_with_name(&src, p).unwrap();
            }
        }
        self
    }

    pub fn finish(self) -> Vec<u8> {
        self.b.into_inner().unwrap()
    }
}

pub fn gzip(tar: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(tar).unwrap();
    e.finish().unwrap()
}

pub fn zstd(tar: &[u8]) -> Vec<u8> {
    ruzstd::encoding::compress_to_vec(tar, ruzstd::encoding::CompressionLevel::Fastest)
}

/// A layer as it goes into an image: blob bytes, media type and the uncompressed digest.
pub struct Layer {
    pub blob: Vec<u8>,
    pub media_type: &'static str,
    pub diff_id: String,
}

impl Layer {
    pub fn gzip(tar: Vec<u8>) -> Layer {
        Layer {
            blob: gzip(&tar),
            media_type: GZIP,
            diff_id: sha(&tar),
        }
    }
    pub fn zstd(tar: Vec<u8>) -> Layer {
        Layer {
            blob: zstd(&tar),
            media_type: ZSTD,
            diff_id: sha(&tar),
        }
    }
    pub fn plain(tar: Vec<u8>) -> Layer {
        Layer {
            diff_id: sha(&tar),
            blob: tar,
            media_type: TAR,
        }
    }
}

/// The image config: architecture, env, workdir, user.
pub fn config(arch: &str, env: &[&str], workdir: &str, user: &str, layers: &[&Layer]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "architecture": arch,
        "os": "linux",
        "config": {"Env": env, "WorkingDir": workdir, "User": user, "Cmd": ["/bin/bash"]},
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>()},
    }))
    .unwrap()
}

/// An OCI image layout directory.
pub struct OciLayout {
    pub dir: PathBuf,
}

/// A descriptor of something written to the layout.
#[derive(Clone)]
pub struct Desc {
    pub media_type: String,
    pub digest: String,
    pub size: usize,
    pub platform: Option<(String, String)>,
}

impl Desc {
    fn json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({"mediaType": self.media_type, "digest": self.digest, "size": self.size});
        if let Some((os, arch)) = &self.platform {
            v["platform"] = serde_json::json!({"os": os, "architecture": arch});
        }
        v
    }
}

impl OciLayout {
    pub fn create(dir: &Path) -> OciLayout {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        OciLayout {
            dir: dir.to_path_buf(),
        }
    }

    pub fn blob(&self, bytes: &[u8], media_type: &str) -> Desc {
        let d = sha(bytes);
        std::fs::write(self.dir.join("blobs/sha256").join(&d[7..]), bytes).unwrap();
        Desc {
            media_type: media_type.into(),
            digest: d,
            size: bytes.len(),
            platform: None,
        }
    }

    /// Writes an image (config + layers + manifest); returns the manifest's descriptor.
    pub fn image(&self, config: &[u8], layers: &[&Layer], arch: &str) -> Desc {
        let c = self.blob(config, "application/vnd.oci.image.config.v1+json");
        let ls: Vec<_> = layers
            .iter()
            .map(|l| self.blob(&l.blob, l.media_type).json())
            .collect();
        let m = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": c.json(),
            "layers": ls,
        }))
        .unwrap();
        let mut d = self.blob(&m, "application/vnd.oci.image.manifest.v1+json");
        d.platform = Some(("linux".into(), arch.into()));
        d
    }

    /// An image index (manifest list) of `manifests`.
    pub fn index(&self, manifests: &[Desc]) -> Desc {
        let m = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": manifests.iter().map(Desc::json).collect::<Vec<_>>(),
        }))
        .unwrap();
        self.blob(&m, "application/vnd.oci.image.index.v1+json")
    }

    /// Tags `desc` as `tag` in the layout's `index.json` (replacing earlier tags).
    pub fn tag(&self, desc: &Desc, tag: &str) {
        let mut d = desc.json();
        d["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": tag});
        if let Some(p) = d.as_object_mut() {
            p.remove("platform");
        }
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [d]});
        std::fs::write(
            self.dir.join("index.json"),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
    }

    /// The layout as a tarball at `out`.
    pub fn tarball(&self, out: &Path) {
        let mut b = tar::Builder::new(std::fs::File::create(out).unwrap());
        b.append_dir_all(".", &self.dir).unwrap();
        b.finish().unwrap();
    }
}
