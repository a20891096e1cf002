//! virtio-vsock for the test guest: packet headers, credit accounting, and the `vsock` test mode
//! (guest→host echo, then a host→guest echo server).

use crate::boot_info::*;
use crate::rt::*;
use crate::virtq::*;
// --- virtio-vsock -----------------------------------------------------------------------------

pub const HDR: usize = 44;
pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;
pub const RX_BUFS: usize = 8;
pub const GUEST_BUF_ALLOC: u32 = 64 * 1024;

#[derive(Clone, Copy, Default)]
pub struct Pkt {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub op: u16,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

pub struct Vsock {
    pub rx: Vq,
    pub tx: Vq,
    pub cid: u64,
    /// bytes consumed from the host per connection, and host credit
    pub fwd_cnt: u32,
    pub tx_cnt: u32,
    pub peer_buf_alloc: u32,
    pub peer_fwd_cnt: u32,
}

pub unsafe fn put_hdr(a: u64, p: &Pkt) {
    let b = core::slice::from_raw_parts_mut(a as *mut u8, HDR);
    b[0..8].copy_from_slice(&p.src_cid.to_le_bytes());
    b[8..16].copy_from_slice(&p.dst_cid.to_le_bytes());
    b[16..20].copy_from_slice(&p.src_port.to_le_bytes());
    b[20..24].copy_from_slice(&p.dst_port.to_le_bytes());
    b[24..28].copy_from_slice(&p.len.to_le_bytes());
    b[28..30].copy_from_slice(&1u16.to_le_bytes());
    b[30..32].copy_from_slice(&p.op.to_le_bytes());
    b[32..36].copy_from_slice(&0u32.to_le_bytes());
    b[36..40].copy_from_slice(&p.buf_alloc.to_le_bytes());
    b[40..44].copy_from_slice(&p.fwd_cnt.to_le_bytes());
}

pub unsafe fn get_hdr(a: u64) -> Pkt {
    let b = core::slice::from_raw_parts(a as *const u8, HDR);
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let u64_at = |o: usize| u32_at(o) as u64 | (u32_at(o + 4) as u64) << 32;
    Pkt {
        src_cid: u64_at(0),
        dst_cid: u64_at(8),
        src_port: u32_at(16),
        dst_port: u32_at(20),
        len: u32_at(24),
        op: u16::from_le_bytes([b[30], b[31]]),
        buf_alloc: u32_at(36),
        fwd_cnt: u32_at(40),
    }
}

impl Vsock {
    /// Posts RX buffer `i` (BUF[8+i], one page: header + up to 4052 payload bytes).
    pub unsafe fn post_rx(&mut self, i: usize) {
        self.rx.set_desc(i, buf(8 + i), 4096, F_WRITE, 0);
        self.rx.push(i as u16);
    }
    pub unsafe fn send(&mut self, mut p: Pkt, data: &[u8]) {
        p.src_cid = self.cid;
        p.dst_cid = 2;
        p.len = data.len() as u32;
        p.buf_alloc = GUEST_BUF_ALLOC;
        p.fwd_cnt = self.fwd_cnt;
        let a = buf(30);
        put_hdr(a, &p);
        memcpy((a + HDR as u64) as *mut u8, data.as_ptr(), data.len());
        self.tx.set_desc(0, a, (HDR + data.len()) as u32, 0, 0);
        self.tx.push(0);
        self.tx.notify();
        self.tx.wait();
        if p.op == OP_RW {
            self.tx_cnt = self.tx_cnt.wrapping_add(data.len() as u32);
        }
    }
    /// Waits for the next packet; returns it and the payload address. The buffer is re-posted
    /// by `done`.
    pub unsafe fn recv(&mut self) -> (Pkt, u64, usize) {
        let (id, _len) = self.rx.wait();
        let a = buf(8 + id as usize);
        let p = get_hdr(a);
        self.peer_buf_alloc = p.buf_alloc;
        self.peer_fwd_cnt = p.fwd_cnt;
        (p, a + HDR as u64, id as usize)
    }
    pub unsafe fn done(&mut self, id: usize) {
        self.post_rx(id);
        self.rx.notify();
    }
    pub fn peer_credit(&self) -> u32 {
        self.peer_buf_alloc.wrapping_sub(self.tx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }
}

pub unsafe fn vsock(boot: &Boot) -> ! {
    let Some(base) = find_virtio(boot.cmdline, 19) else {
        puts("no virtio-vsock\n");
        reset()
    };
    let mut vqs = [EMPTY_VQ, EMPTY_VQ, EMPTY_VQ];
    virtio_init(base, 0, &mut QUEUES[..3], &mut vqs);
    let [rx, tx, _ev] = vqs;
    let cid = rd64(base + 0x100);
    let mut v = Vsock { rx, tx, cid, fwd_cnt: 0, tx_cnt: 0, peer_buf_alloc: 0, peer_fwd_cnt: 0 };
    for i in 0..RX_BUFS {
        v.post_rx(i);
    }
    v.rx.notify();
    puts("vsock cid=");
    put_dec(cid);
    puts("\n");

    // guest -> host: connect to host port given on the cmdline, send a line, read the echo.
    let host_port = parse_num(find_arg(boot.cmdline, b"kiln.vsock_port").unwrap_or(b"5000")) as u32;
    let gport = 40000u32;
    v.send(Pkt { src_port: gport, dst_port: host_port, op: OP_REQUEST, ..Pkt::default() }, &[]);
    let (p, _, id) = v.recv();
    v.done(id);
    if p.op != OP_RESPONSE {
        puts("vsock g2h connect refused op=");
        put_dec(p.op as u64);
        puts("\n");
        reset();
    }
    puts("vsock g2h connected\n");
    v.send(Pkt { src_port: gport, dst_port: host_port, op: OP_RW, ..Pkt::default() }, b"ping-from-guest\n");
    let mut got = [0u8; 64];
    let mut n = 0;
    while n < 16 {
        let (p, data, id) = v.recv();
        if p.op == OP_RW && p.dst_port == gport {
            let l = (p.len as usize).min(64 - n);
            memcpy(got.as_mut_ptr().add(n), data as *const u8, l);
            n += l;
            v.fwd_cnt = v.fwd_cnt.wrapping_add(p.len);
        }
        v.done(id);
    }
    puts("vsock g2h echo: ");
    put_bytes(&got[..n]);
    v.send(Pkt { src_port: gport, dst_port: host_port, op: OP_SHUTDOWN, ..Pkt::default() }, &[]);

    // host -> guest: listen on port 1234, echo everything back until the host shuts down.
    v.fwd_cnt = 0;
    v.tx_cnt = 0;
    puts("vsock listening 1234\n");
    let mut peer_port = 0u32;
    let mut echoed = 0u64;
    loop {
        let (p, data, id) = v.recv();
        if p.dst_port != 1234 {
            v.done(id);
            continue;
        }
        match p.op {
            OP_REQUEST => {
                peer_port = p.src_port;
                v.done(id);
                v.fwd_cnt = 0;
                v.tx_cnt = 0;
                v.send(Pkt { src_port: 1234, dst_port: peer_port, op: OP_RESPONSE, ..Pkt::default() }, &[]);
                puts("vsock h2g accepted\n");
            }
            OP_RW => {
                let len = p.len as usize;
                let mut chunk = [0u8; 4096];
                memcpy(chunk.as_mut_ptr(), data as *const u8, len.min(4096));
                v.done(id);
                v.fwd_cnt = v.fwd_cnt.wrapping_add(p.len);
                // respect host credit before echoing
                while v.peer_credit() < len as u32 {
                    v.send(Pkt { src_port: 1234, dst_port: peer_port, op: OP_CREDIT_REQUEST, ..Pkt::default() }, &[]);
                    let (q, _, qid) = v.recv();
                    v.done(qid);
                    if q.op == OP_RST || q.op == OP_SHUTDOWN {
                        break;
                    }
                }
                v.send(Pkt { src_port: 1234, dst_port: peer_port, op: OP_RW, ..Pkt::default() }, &chunk[..len.min(4096)]);
                echoed += len as u64;
                // tell the host how much we consumed so it keeps sending
                v.send(Pkt { src_port: 1234, dst_port: peer_port, op: OP_CREDIT_UPDATE, ..Pkt::default() }, &[]);
            }
            OP_SHUTDOWN | OP_RST => {
                v.done(id);
                v.send(Pkt { src_port: 1234, dst_port: peer_port, op: OP_RST, ..Pkt::default() }, &[]);
                puts("vsock h2g done echoed=");
                put_dec(echoed);
                puts("\n");
                reset();
            }
            _ => v.done(id),
        }
    }
}
