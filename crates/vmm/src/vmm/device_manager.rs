//! Device manager: creates the legacy devices (8250 serial, i8042) and the configured virtio-mmio
//! devices, places them on the port/MMIO buses and wires their interrupts and queue
//! notifications to KVM (irqfd / ioeventfd).

use std::sync::{Arc, Mutex};

use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::{ioe, VmmError};
use crate::arch::layout::{IRQ_BASE, MMIO_BASE, MMIO_DEV_SIZE};
use crate::config::VmConfig;
use crate::devices::bus::Bus;
use crate::devices::legacy::i8042::{I8042, I8042_LEN, I8042_PORT};
use crate::devices::legacy::serial::{SerialDevice, COM1_IRQ, COM1_PORT};
use crate::devices::virtio::block::{Block, CowDisk};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::rng::Rng;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::{Interrupt, VirtioDevice};
use crate::devices::IrqLine;
use crate::vstate::vm::Vm;

/// The devices of one VM, wired to KVM.
pub(super) struct Devices {
    pub pio: Bus,
    pub mmio: Bus,
    pub serial: Arc<Mutex<SerialDevice>>,
    pub transports: Vec<Arc<Mutex<MmioTransport>>>,
    /// Written by the i8042 when the guest resets the machine.
    pub reset_evt: EventFd,
    /// `virtio_mmio.device=` arguments announcing the virtio devices to the guest kernel.
    pub cmdline_devices: String,
}

/// Creates the devices of `config` (legacy + virtio) and wires them to KVM.
pub(super) fn build_devices(
    vm: &Vm,
    mem: &GuestMemoryMmap,
    config: &VmConfig,
    serial: impl FnOnce(IrqLine) -> SerialDevice,
) -> Result<Devices, VmmError> {
    let mut pio = Bus::default();
    let mut mmio = Bus::default();
    let com1 = IrqLine::new(COM1_IRQ).map_err(ioe("eventfd"))?;
    vm.register_irqfd(&com1.evt, COM1_IRQ)?;
    let serial = Arc::new(Mutex::new(serial(com1)));
    pio.insert(COM1_PORT, 8, serial.clone())
        .map_err(|e| VmmError::Config(e.to_string()))?;
    let reset_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(ioe("eventfd"))?;
    let i8042 = Arc::new(Mutex::new(I8042::new(
        reset_evt.try_clone().map_err(ioe("eventfd"))?,
    )));
    pio.insert(I8042_PORT, I8042_LEN, i8042)
        .map_err(|e| VmmError::Config(e.to_string()))?;

    let mut devs: Vec<Box<dyn VirtioDevice>> = Vec::new();
    if let Some(d) = &config.disk {
        let disk = CowDisk::open(&d.base, d.overlay.as_deref(), d.read_only)?;
        devs.push(Box::new(Block::new(disk, "kiln-disk0")));
    }
    if let Some(v) = &config.vsock {
        devs.push(Box::new(
            Vsock::new(v.cid, &v.uds).map_err(ioe(format!("vsock socket {}", v.uds.display())))?,
        ));
    }
    if config.rng {
        devs.push(Box::new(Rng::default()));
    }
    let shared = Arc::new(mem.clone());
    let mut transports = Vec::new();
    let mut cmdline_devices = String::new();
    for (i, dev) in devs.into_iter().enumerate() {
        let base = MMIO_BASE + i as u64 * MMIO_DEV_SIZE;
        let irq = IRQ_BASE + i as u32;
        let line = IrqLine::new(irq).map_err(ioe("eventfd"))?;
        vm.register_irqfd(&line.evt, irq)?;
        let t = MmioTransport::new(dev, shared.clone(), Interrupt { line, status: 0 })
            .map_err(ioe("eventfd"))?;
        for (q, evt) in t.queue_evts.iter().enumerate() {
            vm.register_ioevent(evt, base + 0x50, q as u32)?;
        }
        let t = Arc::new(Mutex::new(t));
        mmio.insert(base, MMIO_DEV_SIZE, t.clone())
            .map_err(|e| VmmError::Config(e.to_string()))?;
        transports.push(t);
        cmdline_devices.push_str(&format!(" virtio_mmio.device=4K@{base:#x}:{irq}"));
    }
    Ok(Devices {
        pio,
        mmio,
        serial,
        transports,
        reset_evt,
        cmdline_devices,
    })
}
