//! i8042 keyboard controller at 0x60/0x64: only the CPU reset command (0xfe on 0x64), which
//! ends the VM (guest-triggered reset = VM exit, as in Firecracker).

use vm_superio::{I8042Device, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::bus::BusDevice;

pub const I8042_PORT: u64 = 0x60;
pub const I8042_LEN: u64 = 5;

pub struct ResetTrigger(pub EventFd);

impl Trigger for ResetTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

pub struct I8042 {
    dev: I8042Device<ResetTrigger>,
}

impl I8042 {
    pub fn new(reset: EventFd) -> Self {
        I8042 {
            dev: I8042Device::new(ResetTrigger(reset)),
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if data.len() == 1 {
            data[0] = self.dev.read(offset as u8);
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 {
            let _ = self.dev.write(offset as u8, data[0]);
        }
    }
}
