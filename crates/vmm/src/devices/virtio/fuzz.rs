//! Fuzz harness for virtio queue handling: one input drives a virtio-mmio transport with a block,
//! rng or vsock device through a driver handshake whose queue geometry comes from the input, a
//! guest memory image from the input, and a sequence of guest actions (ring and memory writes,
//! register writes and reads, queue notifications, host socket events).
//!
//! Used by the `cargo fuzz` target `virtio_queue` in `fuzz/` and by `tests/virtio_fuzz.rs` (a fixed
//! corpus plus bounded random inputs on stable Rust). Checked on every input: no panic, no access
//! outside guest memory (vm-memory bounds every access), the block device's base image never
//! changes, and a driver reset afterwards returns the transport to its initial state.
//!
//! Input layout: `kind, log2(queue size), desc page, avail page, used page, feature mask,
//! image length (u16 LE), image bytes, then operations` (see [`Op`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::block::{Block, CowDisk};
use super::mmio::MmioTransport;
use super::rng::Rng;
use super::vsock::Vsock;
use super::{Interrupt, VirtioDevice};
use crate::devices::bus::BusDevice;
use crate::devices::IrqLine;

/// Guest memory of a fuzz run.
pub const MEM_SIZE: usize = 64 << 10;
/// Size of the block device's base image.
pub const DISK_SIZE: usize = 64 << 10;
const MAX_OPS: usize = 512;

/// What a run observed (for tests asserting the harness reaches real request processing).
#[derive(Default, Clone, PartialEq)]
pub struct Outcome {
    /// Used ring index of each queue after the run.
    pub used_idx: Vec<u16>,
    /// The transport's status register after the run.
    pub status: u32,
    /// Device failures the transport counted (each stops the device until a reset).
    pub errors: u64,
    /// The device's own counters (rejected requests are in its `errors`).
    pub metrics: serde_json::Value,
    /// Guest memory after the run.
    pub memory: Vec<u8>,
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outcome")
            .field("used_idx", &self.used_idx)
            .field("status", &self.status)
            .field("errors", &self.errors)
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

/// Guest actions, one per operation byte (`byte % 6`), each followed by its arguments.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    /// `q`: notify queue `q` (as the ioeventfd would).
    Notify = 0,
    /// `off: u16, val: u16`: write guest memory.
    Poke = 1,
    /// `reg: u8, val: u32`: write transport register `reg * 4` (config space from 0x100).
    WriteReg = 2,
    /// `reg: u8`: read transport register `reg * 4`.
    ReadReg = 3,
    /// host socket readiness (vsock).
    HostEvent = 4,
    /// `head: u16`: make descriptor `head` available on the last configured queue.
    Avail = 5,
}

/// Scratch files of the devices (block base image and overlay, vsock socket).
pub struct Harness {
    dir: PathBuf,
    base: Vec<u8>,
}

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | u32::from(self.u16()) << 16
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
}

impl Harness {
    /// Prepares the scratch files in `dir` (an existing, writable directory).
    pub fn new(dir: &Path) -> std::io::Result<Self> {
        let base: Vec<u8> = (0..DISK_SIZE).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.join("base.img"), &base)?;
        Ok(Harness {
            dir: dir.to_path_buf(),
            base,
        })
    }

    fn device(&self, kind: u8) -> Box<dyn VirtioDevice> {
        match kind % 3 {
            0 => {
                let overlay = self.dir.join("overlay");
                let _ = std::fs::remove_file(&overlay);
                let disk = CowDisk::open(&self.dir.join("base.img"), Some(&overlay), false)
                    .expect("fuzz disk");
                Box::new(Block::new(disk, "fuzz"))
            }
            1 => Box::new(Rng::default()),
            _ => Box::new(Vsock::new(3, &self.dir.join("vsock")).expect("fuzz vsock")),
        }
    }

    /// Runs one input. Panics when an invariant breaks.
    pub fn run(&self, data: &[u8]) -> Outcome {
        let mut input = Input(data);
        let kind = input.u8();
        let qsize = 1u32 << (input.u8() % 9);
        let desc = u64::from(input.u8()) << 8;
        let avail = u64::from(input.u8()) << 8;
        let used = u64::from(input.u8()) << 8;
        let feature_mask = u32::from(input.u8());
        let image_len = usize::from(input.u16()).min(MEM_SIZE);
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)])
            .expect("fuzz guest memory");
        mem.write_slice(input.take(image_len), GuestAddress(0))
            .expect("image fits");
        let mem = Arc::new(mem);
        let irq = IrqLine::new(5).expect("eventfd");
        let mut t = MmioTransport::new(
            self.device(kind),
            mem.clone(),
            Interrupt {
                line: irq,
                status: 0,
            },
        )
        .expect("transport");
        let nq = t.queues.len();
        let w = |t: &mut MmioTransport, off: u64, v: u32| t.write(off, &v.to_le_bytes());
        // The driver handshake, with the input's geometry and features.
        w(&mut t, 0x70, 1);
        w(&mut t, 0x70, 3);
        w(&mut t, 0x14, 0);
        let mut f = [0u8; 4];
        t.read(0x10, &mut f);
        w(&mut t, 0x24, 0);
        w(&mut t, 0x20, u32::from_le_bytes(f) & feature_mask);
        w(&mut t, 0x24, 1);
        w(&mut t, 0x20, 1);
        w(&mut t, 0x70, 0xb);
        for q in 0..nq as u64 {
            w(&mut t, 0x30, q as u32);
            w(&mut t, 0x38, qsize);
            let stride = q * 0x1000;
            for (reg, addr) in [(0x80, desc), (0x90, avail), (0xa0, used)] {
                let a = (addr + stride) % MEM_SIZE as u64;
                w(&mut t, reg, a as u32);
                w(&mut t, reg + 4, 0);
            }
            w(&mut t, 0x44, 1);
        }
        w(&mut t, 0x70, 0xf);
        let last_q = nq.saturating_sub(1) as u64;
        let mut avail_idx = 0u16;
        for _ in 0..MAX_OPS {
            if input.0.is_empty() {
                break;
            }
            match input.u8() % 6 {
                0 => {
                    let q = usize::from(input.u8()) % (nq + 1);
                    t.queue_event(q);
                }
                1 => {
                    let off = u64::from(input.u16()) % (MEM_SIZE as u64 - 1);
                    let _ = mem.write_obj(input.u16(), GuestAddress(off));
                }
                2 => {
                    let reg = u64::from(input.u8()) * 4;
                    let v = input.u32();
                    w(&mut t, reg, v);
                }
                3 => {
                    let mut b = [0u8; 4];
                    t.read(u64::from(input.u8()) * 4, &mut b);
                }
                4 => t.host_event(),
                _ => {
                    let head = input.u16();
                    let ring = (avail + last_q * 0x1000) % MEM_SIZE as u64;
                    let slot = ring + 4 + 2 * u64::from(avail_idx % qsize as u16);
                    let _ = mem.write_obj(head, GuestAddress(slot % (MEM_SIZE as u64 - 1)));
                    avail_idx = avail_idx.wrapping_add(1);
                    let _ = mem.write_obj(avail_idx, GuestAddress(ring + 2));
                    t.queue_event(last_q as usize);
                }
            }
        }
        if kind % 3 == 0 {
            let now = std::fs::read(self.dir.join("base.img")).expect("base image");
            assert!(now == self.base, "the block device wrote to its base image");
        }
        let used_idx: Vec<u16> = t.save().queues.iter().map(|q| q.next_used).collect();
        let r = |t: &mut MmioTransport, off: u64| {
            let mut b = [0u8; 4];
            t.read(off, &mut b);
            u32::from_le_bytes(b)
        };
        let outcome = Outcome {
            used_idx,
            status: r(&mut t, 0x70),
            errors: t.errors,
            metrics: t.device.metrics(),
            memory: {
                let mut m = vec![0u8; MEM_SIZE];
                mem.read_slice(&mut m, GuestAddress(0))
                    .expect("guest memory");
                m
            },
        };
        // Whatever the guest did, a reset brings the device back to its initial state.
        w(&mut t, 0x70, 0);
        assert_eq!(r(&mut t, 0x70), 0, "status after reset");
        for q in 0..nq as u32 {
            w(&mut t, 0x30, q);
            assert_eq!(r(&mut t, 0x44), 0, "queue {q} still ready after reset");
        }
        outcome
    }
}
