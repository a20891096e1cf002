//! vsock queue and socket event handling: TX packets from the guest, RX delivery to the guest,
//! the event queue (transport reset), and host socket readiness via the device's inner epoll.

use std::io::Write;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::{EpollEvent, EventSet};

use super::device::{flush_tx, ConnState, Vsock, HOST_BUF_ALLOC, MAX_PKT_PAYLOAD, QUEUE_SIZE};
use super::packet::*;
use crate::devices::virtio::{chain_descriptors, DeviceError, QueueCtx, VirtioDevice, TYPE_VSOCK};

const RXQ: usize = 0;
const TXQ: usize = 1;
const EVQ: usize = 2;
const EVENT_TRANSPORT_RESET: u32 = 0;

/// Reads `len` bytes from the readable descriptors starting at byte `skip`.
fn read_chain(
    mem: &GuestMemoryMmap,
    descs: &[(u64, u32, bool)],
    skip: usize,
    len: usize,
) -> Result<Vec<u8>, DeviceError> {
    let mut out = Vec::with_capacity(len);
    let mut pos = 0usize;
    for &(addr, dlen, w) in descs {
        if w {
            break;
        }
        let dlen = dlen as usize;
        if pos + dlen > skip && out.len() < len {
            let start = skip.saturating_sub(pos);
            let n = (dlen - start).min(len - out.len());
            let mut b = vec![0u8; n];
            mem.read_slice(&mut b, GuestAddress(addr).checked_add_u64(start as u64)?)
                .map_err(|_| DeviceError::GuestMemory)?;
            out.extend_from_slice(&b);
        }
        pos += dlen;
    }
    if out.len() < len {
        return Err(DeviceError::BadChain(
            "vsock packet shorter than its header says",
        ));
    }
    Ok(out)
}

trait CheckedAdd {
    fn checked_add_u64(self, v: u64) -> Result<GuestAddress, DeviceError>;
}
impl CheckedAdd for GuestAddress {
    fn checked_add_u64(self, v: u64) -> Result<GuestAddress, DeviceError> {
        self.0
            .checked_add(v)
            .map(GuestAddress)
            .ok_or(DeviceError::GuestMemory)
    }
}

/// Writes `data` across the writable descriptors; returns bytes written.
fn write_chain(
    mem: &GuestMemoryMmap,
    descs: &[(u64, u32, bool)],
    data: &[u8],
) -> Result<usize, DeviceError> {
    let mut done = 0usize;
    for &(addr, dlen, w) in descs {
        if !w || done == data.len() {
            continue;
        }
        let n = (dlen as usize).min(data.len() - done);
        mem.write_slice(&data[done..done + n], GuestAddress(addr))
            .map_err(|_| DeviceError::GuestMemory)?;
        done += n;
    }
    Ok(done)
}

fn writable_len(descs: &[(u64, u32, bool)]) -> usize {
    descs.iter().filter(|d| d.2).map(|d| d.1 as usize).sum()
}

impl Vsock {
    fn handle_tx(&mut self, h: Header, payload: Vec<u8>) {
        self.metrics.tx_packets += 1;
        if h.src_cid != self.cid || h.dst_cid != HOST_CID || h.type_ != TYPE_STREAM {
            if h.op != OP_RST {
                self.queue_rst_for(&h);
            }
            return;
        }
        let key = (h.dst_port, h.src_port);
        if let Some(c) = self.conns.get_mut(&key) {
            c.peer_buf_alloc = h.buf_alloc;
            c.peer_fwd_cnt = h.fwd_cnt;
        }
        match h.op {
            OP_REQUEST => self.guest_connect(&h),
            OP_RESPONSE => {
                let Some(c) = self.conns.get_mut(&key) else {
                    return self.queue_rst_for(&h);
                };
                if c.state == ConnState::Connecting && !c.host_eof {
                    c.state = ConnState::Established;
                    let line = format!("OK {}\n", key.0);
                    c.tx_buf.splice(0..0, line.into_bytes());
                    // the OK line is not guest data: do not count it in fwd_cnt
                    c.fwd_cnt = c
                        .fwd_cnt
                        .wrapping_sub(format!("OK {}\n", key.0).len() as u32);
                    let broken = flush_tx(c);
                    if broken {
                        self.queue_ctrl(key, OP_RST, 0);
                        self.remove_conn(key);
                        return;
                    }
                }
                self.set_interest(key);
            }
            OP_RW => {
                let Some(c) = self.conns.get_mut(&key) else {
                    return self.queue_rst_for(&h);
                };
                if c.state != ConnState::Established
                    || c.tx_buf.len() + payload.len() > HOST_BUF_ALLOC as usize
                {
                    // data before the connection is up, or beyond the credit we gave: reset
                    self.queue_ctrl(key, OP_RST, 0);
                    self.remove_conn(key);
                    return;
                }
                self.metrics.tx_bytes_from_guest += payload.len() as u64;
                c.tx_buf.extend_from_slice(&payload);
                let broken = flush_tx(c);
                if broken {
                    self.queue_ctrl(key, OP_RST, 0);
                    self.remove_conn(key);
                    return;
                }
                self.set_interest(key);
            }
            OP_CREDIT_UPDATE => self.set_interest(key),
            OP_CREDIT_REQUEST => {
                if self.conns.contains_key(&key) {
                    self.queue_ctrl(key, OP_CREDIT_UPDATE, 0);
                }
            }
            OP_SHUTDOWN => {
                if let Some(c) = self.conns.get_mut(&key) {
                    let _ = flush_tx(c);
                    let _ = c.stream.flush();
                    if h.flags & SHUTDOWN_SEND != 0 {
                        let _ = c.stream.shutdown(std::net::Shutdown::Write);
                    }
                    if h.flags & (SHUTDOWN_RCV | SHUTDOWN_SEND) == (SHUTDOWN_RCV | SHUTDOWN_SEND)
                        || h.flags == 0
                    {
                        self.queue_ctrl(key, OP_RST, 0);
                        self.remove_conn(key);
                    }
                }
            }
            OP_RST => self.remove_conn(key),
            _ => {
                self.metrics.errors += 1;
                self.queue_rst_for(&h);
            }
        }
    }

    fn process_tx(&mut self, q: &mut Queue, mem: &GuestMemoryMmap) -> Result<bool, DeviceError> {
        let mut used = false;
        while let Some(chain) = q.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let descs = chain_descriptors(chain);
            match read_chain(mem, &descs, 0, HDR_LEN) {
                Ok(hb) => {
                    let hb: [u8; HDR_LEN] =
                        hb.try_into().map_err(|_| DeviceError::BadChain("header"))?;
                    let h = Header::from_bytes(&hb);
                    if h.len > MAX_PKT_PAYLOAD {
                        self.metrics.errors += 1;
                        self.queue_rst_for(&h);
                    } else {
                        match read_chain(mem, &descs, HDR_LEN, h.len as usize) {
                            Ok(payload) => self.handle_tx(h, payload),
                            Err(_) => {
                                self.metrics.errors += 1;
                                self.queue_rst_for(&h);
                            }
                        }
                    }
                }
                Err(_) => self.metrics.errors += 1,
            }
            q.add_used(mem, head, 0)
                .map_err(|_| DeviceError::BadChain("used ring not writable"))?;
            used = true;
        }
        Ok(used)
    }

    /// Fills guest RX buffers with control packets first, then connection data within credit.
    fn deliver_rx(&mut self, q: &mut Queue, mem: &GuestMemoryMmap) -> Result<bool, DeviceError> {
        let mut used = false;
        loop {
            let data_key = if self.ctrl.is_empty() {
                self.conns
                    .iter()
                    .find(|(_, c)| {
                        c.state == ConnState::Established
                            && !c.rx_buf.is_empty()
                            && c.peer_credit() > 0
                    })
                    .map(|(k, _)| *k)
            } else {
                None
            };
            if self.ctrl.is_empty() && data_key.is_none() {
                break;
            }
            let Some(chain) = q.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let descs = chain_descriptors(chain);
            let room = writable_len(&descs);
            let mut written = 0;
            if room < HDR_LEN {
                self.metrics.errors += 1;
            } else if let Some(h) = self.ctrl.pop_front() {
                written = write_chain(mem, &descs, &h.to_bytes())?;
                self.metrics.rx_packets += 1;
            } else if let Some(key) = data_key {
                let mut h = self.hdr(key, OP_RW);
                let Some(c) = self.conns.get_mut(&key) else {
                    continue;
                };
                let n = c
                    .rx_buf
                    .len()
                    .min(c.peer_credit() as usize)
                    .min(room - HDR_LEN);
                h.len = n as u32;
                let mut pkt = h.to_bytes().to_vec();
                pkt.extend_from_slice(&c.rx_buf[..n]);
                written = write_chain(mem, &descs, &pkt)?;
                c.rx_buf.drain(..n);
                c.rx_cnt = c.rx_cnt.wrapping_add(n as u32);
                c.fwd_cnt_sent = c.fwd_cnt;
                self.metrics.rx_bytes_to_guest += n as u64;
                self.metrics.rx_packets += 1;
                let eof = c.host_eof && c.rx_buf.is_empty() && !c.shutdown_sent;
                if eof {
                    c.shutdown_sent = true;
                    self.queue_ctrl(key, OP_SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND);
                }
                self.set_interest(key);
            }
            q.add_used(mem, head, written as u32)
                .map_err(|_| DeviceError::BadChain("used ring not writable"))?;
            used = true;
        }
        Ok(used)
    }

    fn deliver_event(&mut self, q: &mut Queue, mem: &GuestMemoryMmap) -> Result<bool, DeviceError> {
        if !self.reset_pending {
            return Ok(false);
        }
        let Some(chain) = q.pop_descriptor_chain(mem) else {
            return Ok(false);
        };
        let head = chain.head_index();
        let descs = chain_descriptors(chain);
        let n = write_chain(mem, &descs, &EVENT_TRANSPORT_RESET.to_le_bytes())?;
        q.add_used(mem, head, n as u32)
            .map_err(|_| DeviceError::BadChain("used ring not writable"))?;
        self.reset_pending = false;
        self.metrics.transport_resets += 1;
        Ok(true)
    }

    fn pump(&mut self, ctx: &mut QueueCtx) -> Result<(), DeviceError> {
        let mem = ctx.mem;
        if ctx.queues.len() < 3 {
            return Err(DeviceError::QueueNotReady(2));
        }
        if ctx.queues[TXQ].ready() && self.process_tx(&mut ctx.queues[TXQ], mem)? {
            ctx.used = true;
        }
        if ctx.queues[RXQ].ready() && self.deliver_rx(&mut ctx.queues[RXQ], mem)? {
            ctx.used = true;
        }
        if ctx.queues[EVQ].ready() && self.deliver_event(&mut ctx.queues[EVQ], mem)? {
            ctx.used = true;
        }
        Ok(())
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        TYPE_VSOCK
    }
    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE; 3]
    }
    fn features(&self) -> u64 {
        0
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let cfg = self.cid.to_le_bytes();
        data.fill(0);
        let off = offset as usize;
        if off < cfg.len() {
            let n = data.len().min(cfg.len() - off);
            data[..n].copy_from_slice(&cfg[off..off + n]);
        }
    }
    fn reset(&mut self) {
        self.reset_all();
    }
    fn activate(&mut self, ctx: &mut QueueCtx) -> Result<(), DeviceError> {
        self.pump(ctx)
    }
    fn queue_event(&mut self, _q: usize, ctx: &mut QueueCtx) -> Result<(), DeviceError> {
        self.pump(ctx)
    }
    fn host_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.epoll_fd())
    }
    fn host_event_idle(&mut self) {
        // The driver is not running: no connection can be served. Drop them all and refuse new
        // ones, so the readiness that woke us is consumed.
        self.reset_all();
        while let Ok((s, _)) = self.listener.accept() {
            drop(s);
        }
    }
    fn host_event(&mut self, ctx: &mut QueueCtx) -> Result<(), DeviceError> {
        let mut events = vec![EpollEvent::default(); 32];
        let n = self.epoll.wait(0, &mut events).unwrap_or(0);
        for ev in events.iter().take(n) {
            let tok = ev.data();
            let set = EventSet::from_bits_truncate(ev.events);
            if tok == 0 {
                self.accept_host();
            } else if self.pending.contains_key(&tok) {
                self.pending_readable(tok);
            } else {
                self.conn_io(tok, set);
            }
        }
        self.pump(ctx)
    }
    fn restored(&mut self, ctx: &mut QueueCtx) -> Result<(), DeviceError> {
        self.reset_all();
        self.reset_pending = true;
        self.pump(ctx)
    }
    fn metrics(&self) -> serde_json::Value {
        let mut m = serde_json::to_value(&self.metrics).unwrap_or_default();
        m["open_connections"] = self.conns.len().into();
        m
    }
    fn save(&self) -> serde_json::Value {
        serde_json::to_value(super::persist::VsockPersist { cid: self.cid }).unwrap_or_default()
    }
}
