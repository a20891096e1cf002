//! Copy-on-write disk: reads come from the overlay for blocks the guest wrote, from the base
//! image otherwise; writes always go to the overlay (whole 4 KiB blocks, so a partial write first
//! copies the block from the base). The base image is opened read-only and never written.
//! Written blocks are tracked in a bitmap; on open it is rebuilt from the overlay's allocated
//! extents (SEEK_DATA/SEEK_HOLE), so the overlay file alone carries the state.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub const SECTOR: u64 = 512;
pub const BLOCK: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("disk image {path}: {err}")]
    Open { path: String, err: io::Error },
    #[error("disk image {path} is {len} bytes, not a multiple of 512: pad or convert the image")]
    NotSectorMultiple { path: String, len: u64 },
    #[error("disk image {path} is empty")]
    Empty { path: String },
    #[error(
        "overlay {path} is {len} bytes but the base image is {base}: it belongs to another image"
    )]
    OverlaySize { path: String, len: u64, base: u64 },
}

pub struct CowDisk {
    base: File,
    overlay: Option<File>,
    size: u64,
    written: Vec<u64>,
    pub read_only: bool,
    pub cow_copies: u64,
}

impl CowDisk {
    /// Opens `base` read-only and, unless `read_only`, `overlay` (created sparse if missing).
    pub fn open(base: &Path, overlay: Option<&Path>, read_only: bool) -> Result<Self, DiskError> {
        let bp = base.display().to_string();
        let b = File::open(base).map_err(|err| DiskError::Open {
            path: bp.clone(),
            err,
        })?;
        let size = b
            .metadata()
            .map_err(|err| DiskError::Open {
                path: bp.clone(),
                err,
            })?
            .len();
        if size == 0 {
            return Err(DiskError::Empty { path: bp });
        }
        if size % SECTOR != 0 {
            return Err(DiskError::NotSectorMultiple {
                path: bp,
                len: size,
            });
        }
        let blocks = size.div_ceil(BLOCK);
        let mut written = vec![0u64; blocks.div_ceil(64) as usize];
        let overlay = match (overlay, read_only) {
            (Some(p), false) => {
                let op = p.display().to_string();
                let o = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(p)
                    .map_err(|err| DiskError::Open {
                        path: op.clone(),
                        err,
                    })?;
                let len = o
                    .metadata()
                    .map_err(|err| DiskError::Open {
                        path: op.clone(),
                        err,
                    })?
                    .len();
                if len == 0 {
                    o.set_len(size).map_err(|err| DiskError::Open {
                        path: op.clone(),
                        err,
                    })?;
                } else if len != size {
                    return Err(DiskError::OverlaySize {
                        path: op,
                        len,
                        base: size,
                    });
                }
                for (s, e) in allocated(&o, size).map_err(|err| DiskError::Open {
                    path: op.clone(),
                    err,
                })? {
                    for blk in s / BLOCK..e.div_ceil(BLOCK) {
                        written[(blk / 64) as usize] |= 1 << (blk % 64);
                    }
                }
                Some(o)
            }
            _ => None,
        };
        Ok(CowDisk {
            base: b,
            read_only: read_only || overlay.is_none(),
            overlay,
            size,
            written,
            cow_copies: 0,
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    fn is_written(&self, blk: u64) -> bool {
        self.written
            .get((blk / 64) as usize)
            .is_some_and(|w| w >> (blk % 64) & 1 == 1)
    }

    /// Number of 4 KiB blocks present in the overlay.
    pub fn written_blocks(&self) -> u64 {
        self.written.iter().map(|w| w.count_ones() as u64).sum()
    }

    pub fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        check_range(off, buf.len(), self.size)?;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = off + done as u64;
            let blk = pos / BLOCK;
            let n = ((BLOCK - pos % BLOCK) as usize).min(buf.len() - done);
            let src = match &self.overlay {
                Some(o) if self.is_written(blk) => o,
                _ => &self.base,
            };
            src.read_exact_at(&mut buf[done..done + n], pos)?;
            done += n;
        }
        Ok(())
    }

    pub fn write_at(&mut self, buf: &[u8], off: u64) -> io::Result<()> {
        check_range(off, buf.len(), self.size)?;
        let Some(overlay) = self.overlay.as_ref() else {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "disk is read-only",
            ));
        };
        let mut done = 0usize;
        while done < buf.len() {
            let pos = off + done as u64;
            let blk = pos / BLOCK;
            let n = ((BLOCK - pos % BLOCK) as usize).min(buf.len() - done);
            let full = pos.is_multiple_of(BLOCK) && n as u64 == BLOCK;
            if !self.is_written(blk) && !full {
                // copy the block from the base first so the unwritten part stays intact
                let start = blk * BLOCK;
                let len = BLOCK.min(self.size - start) as usize;
                let mut tmp = vec![0u8; len];
                self.base.read_exact_at(&mut tmp, start)?;
                let rel = (pos - start) as usize;
                tmp[rel..rel + n].copy_from_slice(&buf[done..done + n]);
                overlay.write_all_at(&tmp, start)?;
                self.cow_copies += 1;
            } else {
                overlay.write_all_at(&buf[done..done + n], pos)?;
            }
            self.written[(blk / 64) as usize] |= 1 << (blk % 64);
            done += n;
        }
        Ok(())
    }

    pub fn flush(&self) -> io::Result<()> {
        match &self.overlay {
            Some(o) => o.sync_data(),
            None => Ok(()),
        }
    }
}

fn check_range(off: u64, len: usize, size: u64) -> io::Result<()> {
    match off.checked_add(len as u64) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "request beyond the end of the disk",
        )),
    }
}

/// Allocated (data) extents of a sparse file.
fn allocated(f: &File, size: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < size {
        // SAFETY: lseek on a valid, owned fd.
        let d = unsafe { libc::lseek(f.as_raw_fd(), pos, libc::SEEK_DATA) };
        if d < 0 {
            break;
        }
        // SAFETY: as above.
        let h = unsafe { libc::lseek(f.as_raw_fd(), d, libc::SEEK_HOLE) };
        if h <= d {
            break;
        }
        out.push((d as u64, (h as u64).min(size)));
        pos = h;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cow_reads_writes_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base");
        let ov = dir.path().join("ov");
        std::fs::write(&base, vec![7u8; 3 * 4096]).unwrap();
        let mut d = CowDisk::open(&base, Some(&ov), false).unwrap();
        d.write_at(&[1, 2, 3], 4096 + 10).unwrap();
        let mut b = vec![0u8; 4096];
        d.read_at(&mut b, 4096).unwrap();
        assert_eq!(&b[9..14], &[7, 1, 2, 3, 7]);
        assert_eq!(d.written_blocks(), 1);
        assert!(d.read_at(&mut b, 3 * 4096 - 100).is_err());
        drop(d);
        assert_eq!(std::fs::read(&base).unwrap(), vec![7u8; 3 * 4096]);
        let d = CowDisk::open(&base, Some(&ov), false).unwrap();
        assert_eq!(d.written_blocks(), 1);
        let mut b = [0u8; 3];
        d.read_at(&mut b, 4096 + 10).unwrap();
        assert_eq!(b, [1, 2, 3]);
        std::fs::write(dir.path().join("odd"), vec![0u8; 1000]).unwrap();
        assert!(matches!(
            CowDisk::open(&dir.path().join("odd"), None, true),
            Err(DiskError::NotSectorMultiple { len: 1000, .. })
        ));
        let mut ro = CowDisk::open(&base, Some(&ov), true).unwrap();
        assert!(ro.write_at(&[1], 0).is_err());
    }
}
