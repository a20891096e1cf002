//! Guest memory: one region backed by a memfd (`MAP_SHARED`) for a fresh VM, or by a snapshot's
//! memory file mapped `MAP_PRIVATE` for a restored VM (copy-on-write, lazily faulted: N forks of
//! one snapshot share every page none of them wrote).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap};

use crate::arch::layout::{MAX_MEM_BYTES, MIN_MEM_BYTES};

const PAGE: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("guest memory size {0} MiB is out of range ({min}..={max} MiB)", min = MIN_MEM_BYTES >> 20, max = MAX_MEM_BYTES >> 20)]
    BadSize(u64),
    #[error("creating the guest memory memfd failed: {0}")]
    Memfd(io::Error),
    #[error("mapping guest memory failed: {0}")]
    Mmap(String),
    #[error("snapshot memory file {path}: {err}")]
    File { path: String, err: io::Error },
    #[error("snapshot memory file {path} has {found} bytes, the snapshot needs {want}: it is truncated or belongs to another snapshot")]
    FileSize { path: String, found: u64, want: u64 },
    #[error("writing the memory snapshot failed: {0}")]
    Dump(io::Error),
}

/// Where the guest RAM lives.
pub enum Backing {
    /// Fresh VM: anonymous shared memfd.
    Memfd(File),
    /// Restored VM: private copy-on-write mapping of this file.
    Private(File),
}

pub struct GuestRam {
    pub mem: GuestMemoryMmap,
    pub size: u64,
    pub backing: Backing,
}

fn build_region(file: &File, size: u64, flags: i32) -> Result<GuestMemoryMmap, MemoryError> {
    let fo = FileOffset::new(file.try_clone().map_err(MemoryError::Memfd)?, 0);
    let region = MmapRegionBuilder::new(size as usize)
        .with_file_offset(fo)
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(flags | libc::MAP_NORESERVE)
        .build()
        .map_err(|e| MemoryError::Mmap(e.to_string()))?;
    let region = GuestRegionMmap::new(region, GuestAddress(0))
        .ok_or_else(|| MemoryError::Mmap("guest region overflows the address space".into()))?;
    GuestMemoryMmap::from_regions(vec![region]).map_err(|e| MemoryError::Mmap(e.to_string()))
}

fn check_size(size: u64) -> Result<(), MemoryError> {
    if !(MIN_MEM_BYTES..=MAX_MEM_BYTES).contains(&size) || !size.is_multiple_of(PAGE) {
        return Err(MemoryError::BadSize(size >> 20));
    }
    Ok(())
}

impl GuestRam {
    /// Fresh guest RAM of `size` bytes in a memfd.
    pub fn new_memfd(size: u64) -> Result<Self, MemoryError> {
        check_size(size)?;
        let name = c"kiln-guest-ram";
        // SAFETY: memfd_create with a valid NUL-terminated name; the returned fd is checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(MemoryError::Memfd(io::Error::last_os_error()));
        }
        // SAFETY: fd was just created and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size).map_err(MemoryError::Memfd)?;
        let mem = build_region(&file, size, libc::MAP_SHARED)?;
        Ok(GuestRam {
            mem,
            size,
            backing: Backing::Memfd(file),
        })
    }

    /// Guest RAM restored from a snapshot memory file, mapped private (copy-on-write).
    pub fn restore_private(path: &Path, size: u64) -> Result<Self, MemoryError> {
        check_size(size)?;
        let p = path.display().to_string();
        let file = File::open(path).map_err(|err| MemoryError::File {
            path: p.clone(),
            err,
        })?;
        let found = file
            .metadata()
            .map_err(|err| MemoryError::File {
                path: p.clone(),
                err,
            })?
            .len();
        if found != size {
            return Err(MemoryError::FileSize {
                path: p,
                found,
                want: size,
            });
        }
        let mem = build_region(&file, size, libc::MAP_PRIVATE)?;
        Ok(GuestRam {
            mem,
            size,
            backing: Backing::Private(file),
        })
    }

    /// Host address of guest physical address 0.
    pub fn host_addr(&self) -> *mut u8 {
        use vm_memory::{GuestAddress, GuestMemoryBackend};
        self.mem
            .get_host_address(GuestAddress(0))
            .unwrap_or(std::ptr::null_mut())
    }

    /// Writes guest RAM to `dst` as a sparse file (holes for pages never written). Must be called
    /// with all vCPUs paused and device queues quiescent.
    pub fn dump(&self, dst: &Path) -> Result<u64, MemoryError> {
        let out = File::create(dst).map_err(MemoryError::Dump)?;
        out.set_len(self.size).map_err(MemoryError::Dump)?;
        let mut written = 0u64;
        match &self.backing {
            Backing::Memfd(f) => {
                for (start, end) in data_ranges(f, self.size).map_err(MemoryError::Dump)? {
                    written += copy_range(f, &out, start, end).map_err(MemoryError::Dump)?;
                }
            }
            Backing::Private(f) => {
                // Pages still shared with the file: copy from the file. Pages this process wrote
                // (private anonymous per /proc/self/pagemap): copy from the mapping.
                for (start, end) in data_ranges(f, self.size).map_err(MemoryError::Dump)? {
                    written += copy_range(f, &out, start, end).map_err(MemoryError::Dump)?;
                }
                let dirty = self.private_dirty_pages().map_err(MemoryError::Dump)?;
                let base = self.host_addr();
                for page in dirty {
                    let off = page * PAGE;
                    // SAFETY: off + PAGE <= size (pagemap was read for the mapping's range only);
                    // vCPUs are paused so nobody writes the page while it is read.
                    let data = unsafe {
                        std::slice::from_raw_parts(base.add(off as usize), PAGE as usize)
                    };
                    out.write_all_at(data, off).map_err(MemoryError::Dump)?;
                    written += PAGE;
                }
            }
        }
        out.sync_all().map_err(MemoryError::Dump)?;
        Ok(written)
    }

    /// Page indexes that are present in this process as private anonymous pages (i.e. written
    /// after a `MAP_PRIVATE` restore).
    fn private_dirty_pages(&self) -> io::Result<Vec<u64>> {
        let pagemap = File::open("/proc/self/pagemap")?;
        let pages = self.size / PAGE;
        let base_vpn = self.host_addr() as u64 / PAGE;
        let mut out = Vec::new();
        let chunk = 4096u64;
        let mut buf = vec![0u8; (chunk * 8) as usize];
        let mut i = 0;
        while i < pages {
            let n = chunk.min(pages - i);
            let b = &mut buf[..(n * 8) as usize];
            pagemap.read_exact_at(b, (base_vpn + i) * 8)?;
            for (j, e) in b.chunks_exact(8).enumerate() {
                let v = u64::from_le_bytes(e.try_into().unwrap());
                let present = v >> 63 & 1 == 1;
                let swapped = v >> 62 & 1 == 1;
                let file_or_shared = v >> 61 & 1 == 1;
                if (present || swapped) && !file_or_shared {
                    out.push(i + j as u64);
                }
            }
            i += n;
        }
        Ok(out)
    }

    /// Bytes of guest RAM resident in this process (from /proc/self/smaps for the mapping).
    pub fn resident_bytes(&self) -> u64 {
        let start = self.host_addr() as u64;
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return 0;
        };
        let mut in_region = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, _)) = range.split_once('-') {
                    if a.chars().all(|c| c.is_ascii_hexdigit()) && !a.is_empty() {
                        in_region = u64::from_str_radix(a, 16).ok() == Some(start);
                        continue;
                    }
                }
            }
            if in_region {
                if let Some(v) = line.strip_prefix("Rss:") {
                    let kb: u64 = v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
                    return kb * 1024;
                }
            }
        }
        0
    }
}

/// Data (non-hole) ranges of `f` within `0..size`, via SEEK_DATA/SEEK_HOLE.
fn data_ranges(f: &File, size: u64) -> io::Result<Vec<(u64, u64)>> {
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < size {
        // SAFETY: lseek on a valid fd; errors are checked.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let end = (hole as u64).min(size);
        if data as u64 >= end {
            break;
        }
        out.push((data as u64, end));
        pos = hole;
    }
    Ok(out)
}

/// Copies `start..end` of `src` to the same offsets of `dst`, skipping all-zero pages.
fn copy_range(src: &File, dst: &File, start: u64, end: u64) -> io::Result<u64> {
    let mut buf = vec![0u8; 1 << 20];
    let mut off = start;
    let mut written = 0;
    while off < end {
        let n = ((end - off) as usize).min(buf.len());
        src.read_exact_at(&mut buf[..n], off)?;
        for (i, page) in buf[..n].chunks(PAGE as usize).enumerate() {
            if page.iter().any(|&b| b != 0) {
                dst.write_all_at(page, off + (i as u64) * PAGE)?;
                written += page.len() as u64;
            }
        }
        off += n as u64;
    }
    Ok(written)
}

/// Shared handle to guest RAM for devices.
pub type SharedMem = Arc<GuestMemoryMmap>;

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn dump_and_private_restore_are_copy_on_write() {
        let dir = tempfile::tempdir().unwrap();
        let ram = GuestRam::new_memfd(8 << 20).unwrap();
        ram.mem
            .write_obj(0xdead_beef_u64, GuestAddress(0x1000))
            .unwrap();
        let snap = dir.path().join("mem");
        ram.dump(&snap).unwrap();
        let a = GuestRam::restore_private(&snap, 8 << 20).unwrap();
        let b = GuestRam::restore_private(&snap, 8 << 20).unwrap();
        assert_eq!(
            a.mem.read_obj::<u64>(GuestAddress(0x1000)).unwrap(),
            0xdead_beef
        );
        a.mem.write_obj(1u64, GuestAddress(0x1000)).unwrap();
        assert_eq!(
            b.mem.read_obj::<u64>(GuestAddress(0x1000)).unwrap(),
            0xdead_beef
        );
        // a dump of a restored VM contains its own writes, the file does not
        let snap2 = dir.path().join("mem2");
        a.dump(&snap2).unwrap();
        let c = GuestRam::restore_private(&snap2, 8 << 20).unwrap();
        assert_eq!(c.mem.read_obj::<u64>(GuestAddress(0x1000)).unwrap(), 1);
        let d = GuestRam::restore_private(&snap, 8 << 20).unwrap();
        assert_eq!(
            d.mem.read_obj::<u64>(GuestAddress(0x1000)).unwrap(),
            0xdead_beef
        );
        assert!(matches!(
            GuestRam::restore_private(&snap, 16 << 20),
            Err(MemoryError::FileSize { .. })
        ));
    }
}
