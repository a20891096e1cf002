//! The content-addressed blob cache shared by every image template:
//! `<cache>/templates/.blobs/sha256/<hex>` holds compressed layers and configs exactly as the
//! registry (or an imported tarball) gave them. A blob is written to a temp file, its SHA-256
//! checked against the digest it claims, then renamed into place, so the cache never holds a
//! blob whose name is not its hash.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::OciError;

/// The blob cache under one directory.
#[derive(Debug, Clone)]
pub struct Blobs {
    dir: PathBuf,
    tmp: PathBuf,
}

/// Checks `digest` is `sha256:` + 64 lowercase hex digits and returns the hex part.
pub fn digest_hex(digest: &str) -> Result<&str, OciError> {
    match digest.strip_prefix("sha256:") {
        Some(h)
            if h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
        {
            Ok(h)
        }
        _ => Err(OciError::Invalid(format!(
            "digest {digest:?} is not a sha256 digest (only sha256 is supported)"
        ))),
    }
}

impl Blobs {
    /// The cache under `dir` (`<dir>/sha256/…`), with temp files in `tmp` (same filesystem).
    pub fn open(dir: impl Into<PathBuf>, tmp: impl Into<PathBuf>) -> Result<Blobs, OciError> {
        let dir = dir.into();
        let tmp = tmp.into();
        for d in [dir.join("sha256"), tmp.clone()] {
            std::fs::create_dir_all(&d)
                .map_err(|e| OciError::io(format!("creating {}", d.display()), e))?;
        }
        Ok(Blobs { dir, tmp })
    }

    /// Where the blob with this digest lives (whether or not it is present).
    pub fn path(&self, digest: &str) -> Result<PathBuf, OciError> {
        Ok(self.dir.join("sha256").join(digest_hex(digest)?))
    }

    pub fn has(&self, digest: &str) -> bool {
        self.path(digest).is_ok_and(|p| p.is_file())
    }

    /// A writer for a new blob; [`BlobWriter::commit`] checks it against its digest.
    pub fn writer(&self) -> Result<BlobWriter, OciError> {
        let file = tempfile::Builder::new()
            .prefix("blob-")
            .tempfile_in(&self.tmp)
            .map_err(|e| {
                OciError::io(format!("creating a temp file in {}", self.tmp.display()), e)
            })?;
        Ok(BlobWriter {
            file,
            hash: Sha256::new(),
            len: 0,
        })
    }

    /// Copies `src` into the cache; when `expected` is given the content must hash to it.
    /// Returns the digest.
    pub fn import_file(&self, src: &Path, expected: Option<&str>) -> Result<String, OciError> {
        if let Some(d) = expected {
            if self.has(d) {
                return Ok(d.to_string());
            }
        }
        let mut f =
            File::open(src).map_err(|e| OciError::io(format!("opening {}", src.display()), e))?;
        let mut w = self.writer()?;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = f
                .read(&mut buf)
                .map_err(|e| OciError::io(format!("reading {}", src.display()), e))?;
            if n == 0 {
                break;
            }
            w.write_all(&buf[..n])
                .map_err(|e| OciError::io("writing a blob", e))?;
        }
        let digest = expected.map_or_else(|| w.digest(), str::to_string);
        w.commit(self, &digest)?;
        Ok(digest)
    }

    /// Removes every blob `keep` returns false for; returns how many were removed.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) -> Result<Vec<PathBuf>, OciError> {
        let dir = self.dir.join("sha256");
        let mut removed = Vec::new();
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| OciError::io(format!("listing {}", dir.display()), e))?;
        for e in entries.flatten() {
            let digest = format!("sha256:{}", e.file_name().to_string_lossy());
            if !keep(&digest) && std::fs::remove_file(e.path()).is_ok() {
                removed.push(e.path());
            }
        }
        Ok(removed)
    }
}

/// A blob being written (see [`Blobs::writer`]).
pub struct BlobWriter {
    file: tempfile::NamedTempFile,
    hash: Sha256,
    len: u64,
}

impl Write for BlobWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

impl BlobWriter {
    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The digest of what was written so far.
    pub fn digest(&self) -> String {
        format!("sha256:{}", hex::encode(self.hash.clone().finalize()))
    }

    /// Checks the content against `digest` and moves it into the cache.
    pub fn commit(mut self, blobs: &Blobs, digest: &str) -> Result<PathBuf, OciError> {
        let dest = blobs.path(digest)?;
        let actual = self.digest();
        if actual != digest {
            return Err(OciError::DigestMismatch {
                what: "blob".into(),
                expected: digest.to_string(),
                actual,
            });
        }
        self.file
            .flush()
            .map_err(|e| OciError::io("flushing a blob", e))?;
        self.file
            .persist(&dest)
            .map_err(|e| OciError::io(format!("moving a blob to {}", dest.display()), e.error))?;
        Ok(dest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_are_named_by_their_hash_and_checked() {
        let t = tempfile::tempdir().unwrap();
        let b = Blobs::open(t.path().join("blobs"), t.path().join("tmp")).unwrap();
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(b"hello")));
        let mut w = b.writer().unwrap();
        w.write_all(b"hello").unwrap();
        assert_eq!(w.len(), 5);
        let p = w.commit(&b, &digest).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"hello");
        assert!(b.has(&digest));

        let wrong = format!("sha256:{}", "0".repeat(64));
        let mut w = b.writer().unwrap();
        w.write_all(b"other").unwrap();
        let e = w.commit(&b, &wrong).unwrap_err().to_string();
        assert!(e.contains("digest mismatch"), "{e}");
        assert!(
            !b.has(&wrong),
            "a blob that fails its digest must not be cached"
        );
        assert!(std::fs::read_dir(t.path().join("tmp"))
            .unwrap()
            .next()
            .is_none());

        assert!(digest_hex("sha256:abc").is_err());
        assert!(digest_hex(&format!("sha512:{}", "a".repeat(64))).is_err());
        assert!(b.path("sha256:../../etc/passwd").is_err());
    }

    #[test]
    fn retain_removes_unwanted_blobs() {
        let t = tempfile::tempdir().unwrap();
        let b = Blobs::open(t.path().join("blobs"), t.path().join("tmp")).unwrap();
        let src = t.path().join("f");
        std::fs::write(&src, b"x").unwrap();
        let d1 = b.import_file(&src, None).unwrap();
        std::fs::write(&src, b"y").unwrap();
        let d2 = b.import_file(&src, None).unwrap();
        let removed = b.retain(|d| d == d1).unwrap();
        assert_eq!(removed.len(), 1);
        assert!(b.has(&d1) && !b.has(&d2));
    }
}
