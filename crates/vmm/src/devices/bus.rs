//! Port-I/O and MMIO dispatch from vCPU exits to devices by address range.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device reachable on a bus. `offset` is relative to the device's base address.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("bus range {base:#x}+{len:#x} overlaps an existing device")]
    Overlap { base: u64, len: u64 },
}

type Entry = (u64, Arc<Mutex<dyn BusDevice>>);

/// Address → device map. Accesses outside every device read as all-ones and are dropped, like
/// on real hardware, so a guest probing unknown addresses never reaches the VMM's error paths.
#[derive(Default, Clone)]
pub struct Bus {
    devices: BTreeMap<u64, Entry>,
}

impl Bus {
    pub fn insert(
        &mut self,
        base: u64,
        len: u64,
        dev: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<(), BusError> {
        let end = base
            .checked_add(len)
            .ok_or(BusError::Overlap { base, len })?;
        if let Some((b, (l, _))) = self.devices.range(..end).next_back() {
            if b + l > base {
                return Err(BusError::Overlap { base, len });
            }
        }
        self.devices.insert(base, (len, dev));
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(u64, &Arc<Mutex<dyn BusDevice>>)> {
        let (base, (len, dev)) = self.devices.range(..=addr).next_back()?;
        let off = addr - base;
        if off.checked_add(size as u64)? <= *len {
            Some((off, dev))
        } else {
            None
        }
    }

    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, dev)) => {
                dev.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .read(off, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, dev)) => {
                dev.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .write(off, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Mem([u8; 4]);
    impl BusDevice for Mem {
        fn read(&mut self, o: u64, d: &mut [u8]) {
            d.copy_from_slice(&self.0[o as usize..o as usize + d.len()]);
        }
        fn write(&mut self, o: u64, d: &[u8]) {
            self.0[o as usize..o as usize + d.len()].copy_from_slice(d);
        }
    }

    #[test]
    fn dispatch_bounds_and_overlap() {
        let mut bus = Bus::default();
        bus.insert(0x10, 4, Arc::new(Mutex::new(Mem([0; 4]))))
            .unwrap();
        assert!(bus
            .insert(0x12, 4, Arc::new(Mutex::new(Mem([0; 4]))))
            .is_err());
        assert!(bus
            .insert(0x0e, 4, Arc::new(Mutex::new(Mem([0; 4]))))
            .is_err());
        assert!(bus.write(0x12, &[7, 8]));
        let mut b = [0u8; 2];
        assert!(bus.read(0x12, &mut b));
        assert_eq!(b, [7, 8]);
        // straddling the end or unmapped: all-ones, not dispatched
        let mut b = [0u8; 4];
        assert!(!bus.read(0x12, &mut b));
        assert_eq!(b, [0xff; 4]);
        assert!(!bus.write(u64::MAX, &[1]));
    }
}
