//! The virtio-blk device: config space and request execution.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::disk::{CowDisk, SECTOR};
use super::metrics::BlockMetrics;
use crate::devices::virtio::{DeviceError, MAX_REQUEST_BYTES};

pub const F_RO: u64 = 1 << 5;
pub const F_FLUSH: u64 = 1 << 9;

pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;

pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;

pub const QUEUE_SIZE: u16 = 256;

pub struct Block {
    pub disk: CowDisk,
    pub id: String,
    pub metrics: BlockMetrics,
}

impl Block {
    pub fn new(disk: CowDisk, id: &str) -> Self {
        Block {
            disk,
            id: id.to_string(),
            metrics: BlockMetrics::default(),
        }
    }

    pub fn capacity_sectors(&self) -> u64 {
        self.disk.size() / SECTOR
    }

    pub fn config_bytes(&self) -> [u8; 8] {
        self.capacity_sectors().to_le_bytes()
    }

    /// Executes one request given as (addr, len, writable) descriptors. Returns the number of
    /// bytes written into guest buffers (for the used ring), or an error for a chain so broken
    /// that no status byte can be written.
    pub fn execute(
        &mut self,
        mem: &GuestMemoryMmap,
        descs: &[(u64, u32, bool)],
    ) -> Result<u32, DeviceError> {
        if descs.len() < 2 {
            return Err(DeviceError::BadChain(
                "block request needs a header and a status descriptor",
            ));
        }
        let (haddr, hlen, hw) = descs[0];
        let (saddr, slen, sw) = descs[descs.len() - 1];
        if hw || hlen < 16 {
            return Err(DeviceError::BadChain(
                "block request header must be a 16-byte readable buffer",
            ));
        }
        if !sw || slen < 1 {
            return Err(DeviceError::BadChain(
                "block status must be a writable byte",
            ));
        }
        let mut hdr = [0u8; 16];
        mem.read_slice(&mut hdr, GuestAddress(haddr))
            .map_err(|_| DeviceError::GuestMemory)?;
        let typ = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
        let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap());
        let data = &descs[1..descs.len() - 1];
        let (status, written) = self.do_request(mem, typ, sector, data);
        if status != S_OK {
            self.metrics.errors += 1;
        }
        mem.write_obj(status, GuestAddress(saddr))
            .map_err(|_| DeviceError::GuestMemory)?;
        Ok(written + 1)
    }

    fn do_request(
        &mut self,
        mem: &GuestMemoryMmap,
        typ: u32,
        sector: u64,
        data: &[(u64, u32, bool)],
    ) -> (u8, u32) {
        let total: u64 = data.iter().map(|d| d.1 as u64).sum();
        if total > MAX_REQUEST_BYTES as u64 {
            return (S_IOERR, 0);
        }
        let Some(off) = sector.checked_mul(SECTOR) else {
            return (S_IOERR, 0);
        };
        match typ {
            T_IN => {
                if data.iter().any(|d| !d.2)
                    || off.checked_add(total).is_none_or(|e| e > self.disk.size())
                {
                    return (S_IOERR, 0);
                }
                let mut pos = off;
                let mut written = 0u32;
                for &(addr, len, _) in data {
                    let mut buf = vec![0u8; len as usize];
                    if self.disk.read_at(&mut buf, pos).is_err() {
                        return (S_IOERR, written);
                    }
                    if mem.write_slice(&buf, GuestAddress(addr)).is_err() {
                        return (S_IOERR, written);
                    }
                    pos += len as u64;
                    written += len;
                }
                self.metrics.reads += 1;
                self.metrics.read_bytes += total;
                (S_OK, written)
            }
            T_OUT => {
                if self.disk.read_only {
                    return (S_IOERR, 0);
                }
                if data.iter().any(|d| d.2)
                    || off.checked_add(total).is_none_or(|e| e > self.disk.size())
                {
                    return (S_IOERR, 0);
                }
                let mut pos = off;
                for &(addr, len, _) in data {
                    let mut buf = vec![0u8; len as usize];
                    if mem.read_slice(&mut buf, GuestAddress(addr)).is_err() {
                        return (S_IOERR, 0);
                    }
                    if self.disk.write_at(&buf, pos).is_err() {
                        return (S_IOERR, 0);
                    }
                    pos += len as u64;
                }
                self.metrics.writes += 1;
                self.metrics.write_bytes += total;
                (S_OK, 0)
            }
            T_FLUSH => {
                self.metrics.flushes += 1;
                match self.disk.flush() {
                    Ok(()) => (S_OK, 0),
                    Err(_) => (S_IOERR, 0),
                }
            }
            T_GET_ID => {
                let Some(&(addr, len, true)) = data.first() else {
                    return (S_IOERR, 0);
                };
                let mut id = [0u8; 20];
                let n = self.id.len().min(20);
                id[..n].copy_from_slice(&self.id.as_bytes()[..n]);
                let n = (len as usize).min(20);
                if mem.write_slice(&id[..n], GuestAddress(addr)).is_err() {
                    return (S_IOERR, 0);
                }
                (S_OK, n as u32)
            }
            _ => (S_UNSUPP, 0),
        }
    }
}
