//! 8250 UART at 0x3f8 (COM1, IRQ 4) on vm-superio; output goes to a log file, a pipe or stdout.

use std::io::Write;

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};

use crate::devices::bus::BusDevice;
use crate::devices::IrqLine;

pub const COM1_PORT: u64 = 0x3f8;
pub const COM1_IRQ: u32 = 4;

pub struct IrqTrigger(pub IrqLine);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.trigger();
        Ok(())
    }
}

/// Serial console output sink.
pub type SerialOut = Box<dyn Write + Send>;

pub struct SerialDevice {
    pub serial: Serial<IrqTrigger, NoEvents, SerialOut>,
    pub bytes_out: u64,
}

/// Snapshot state of the UART registers.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct SerialPersist {
    pub regs: [u8; 9],
    pub in_buffer: Vec<u8>,
}

impl SerialDevice {
    pub fn new(irq: IrqLine, out: SerialOut) -> Self {
        SerialDevice {
            serial: Serial::new(IrqTrigger(irq), out),
            bytes_out: 0,
        }
    }

    pub fn restore(irq: IrqLine, out: SerialOut, st: &SerialPersist) -> Self {
        let r = st.regs;
        let state = SerialState {
            baud_divisor_low: r[0],
            baud_divisor_high: r[1],
            interrupt_enable: r[2],
            interrupt_identification: r[3],
            line_control: r[4],
            line_status: r[5],
            modem_control: r[6],
            modem_status: r[7],
            scratch: r[8],
            in_buffer: st.in_buffer.clone(),
        };
        match Serial::from_state(&state, IrqTrigger(irq), NoEvents, out) {
            Ok(serial) => SerialDevice {
                serial,
                bytes_out: 0,
            },
            Err(_) => unreachable!("from_state only fails on an oversized input buffer"),
        }
    }

    pub fn save(&self) -> SerialPersist {
        let s = self.serial.state();
        SerialPersist {
            regs: [
                s.baud_divisor_low,
                s.baud_divisor_high,
                s.interrupt_enable,
                s.interrupt_identification,
                s.line_control,
                s.line_status,
                s.modem_control,
                s.modem_status,
                s.scratch,
            ],
            in_buffer: s.in_buffer.into_iter().take(64).collect(),
        }
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 && offset < 8 {
            data[0] = self.serial.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 && offset < 8 {
            if offset == 0 {
                self.bytes_out += 1;
            }
            // A failing sink (full disk, closed pipe) must not stop the guest.
            let _ = self.serial.write(offset as u8, data[0]);
            let _ = self.serial.writer_mut().flush();
        }
    }
}
