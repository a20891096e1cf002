//! The virtio-rng device.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::metrics::RngMetrics;
use crate::devices::virtio::{DeviceError, MAX_REQUEST_BYTES};

pub const QUEUE_SIZE: u16 = 256;
/// Bytes handed out per request at most (the rest of the buffer stays unwritten).
pub const MAX_PER_REQUEST: usize = 64 * 1024;

#[derive(Default)]
pub struct Rng {
    pub metrics: RngMetrics,
}

/// Fills `buf` from getrandom(2).
pub fn host_random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`.
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

impl Rng {
    /// Fills the writable descriptors of one request; returns the number of bytes written.
    pub fn fill(
        &mut self,
        mem: &GuestMemoryMmap,
        descs: &[(u64, u32, bool)],
    ) -> Result<u32, DeviceError> {
        let mut total = 0usize;
        for &(addr, len, writable) in descs {
            if !writable {
                return Err(DeviceError::BadChain(
                    "virtio-rng buffers must be device-writable",
                ));
            }
            let n = (len as usize)
                .min(MAX_PER_REQUEST - total)
                .min(MAX_REQUEST_BYTES);
            if n == 0 {
                break;
            }
            let mut buf = vec![0u8; n];
            host_random(&mut buf)?;
            mem.write_slice(&buf, GuestAddress(addr))
                .map_err(|_| DeviceError::GuestMemory)?;
            total += n;
        }
        self.metrics.bytes += total as u64;
        self.metrics.requests += 1;
        Ok(total as u32)
    }
}
