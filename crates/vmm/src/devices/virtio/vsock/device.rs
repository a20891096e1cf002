//! The vsock device: connection table, host socket side and packet construction.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::metrics::VsockMetrics;
use super::packet::*;

pub const QUEUE_SIZE: u16 = 256;
/// Receive buffer the VMM advertises per connection (bytes from the guest it can hold).
pub const HOST_BUF_ALLOC: u32 = 256 * 1024;
/// Most bytes read from a host socket and held for the guest per connection.
pub const MAX_PENDING_RX: usize = 64 * 1024;
/// Largest payload accepted in one guest packet.
pub const MAX_PKT_PAYLOAD: u32 = 64 * 1024;

const TOKEN_LISTENER: u64 = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnState {
    /// Host connected and sent CONNECT; waiting for the guest's RESPONSE.
    Connecting,
    Established,
}

/// (host port, guest port)
pub type ConnKey = (u32, u32);

pub struct Conn {
    pub stream: UnixStream,
    pub token: u64,
    pub state: ConnState,
    /// Bytes from the guest not yet written to the host socket.
    pub tx_buf: Vec<u8>,
    /// Bytes from the host socket not yet delivered to the guest.
    pub rx_buf: Vec<u8>,
    /// Bytes from the guest written to the host socket (our fwd_cnt).
    pub fwd_cnt: u32,
    /// fwd_cnt last reported to the guest.
    pub fwd_cnt_sent: u32,
    /// Bytes sent to the guest.
    pub rx_cnt: u32,
    pub peer_buf_alloc: u32,
    pub peer_fwd_cnt: u32,
    pub host_eof: bool,
    /// SHUTDOWN was sent to the guest after the host side reached EOF.
    pub shutdown_sent: bool,
    pub interest: EventSet,
    /// Whether the socket is in the device's epoll set. A connection with nothing to wait for is
    /// removed from it, since epoll reports hang-ups even for an empty interest set.
    pub registered: bool,
}

impl Conn {
    fn new(stream: UnixStream, token: u64, state: ConnState) -> Self {
        Conn {
            stream,
            token,
            state,
            tx_buf: Vec::new(),
            rx_buf: Vec::new(),
            fwd_cnt: 0,
            fwd_cnt_sent: 0,
            rx_cnt: 0,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            host_eof: false,
            shutdown_sent: false,
            interest: EventSet::empty(),
            registered: false,
        }
    }

    /// Bytes the guest can still take on this connection.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = self.rx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }
}

/// A host socket that connected but has not completed `CONNECT <port>\n` yet.
pub struct Pending {
    pub stream: UnixStream,
    pub buf: Vec<u8>,
}

pub struct Vsock {
    pub cid: u64,
    pub uds: PathBuf,
    pub listener: UnixListener,
    pub epoll: Epoll,
    pub conns: HashMap<ConnKey, Conn>,
    pub tokens: HashMap<u64, ConnKey>,
    pub pending: HashMap<u64, Pending>,
    /// Control packets (no payload) waiting for a guest RX buffer.
    pub ctrl: VecDeque<Header>,
    next_token: u64,
    next_host_port: u32,
    /// A TRANSPORT_RESET event waits for a guest event buffer.
    pub reset_pending: bool,
    pub metrics: VsockMetrics,
}

impl Vsock {
    /// Binds the VM's hybrid socket at `uds` (an existing socket file is replaced).
    pub fn new(cid: u64, uds: &Path) -> std::io::Result<Self> {
        if uds.exists() {
            std::fs::remove_file(uds)?;
        }
        let listener = UnixListener::bind(uds)?;
        listener.set_nonblocking(true)?;
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_LISTENER),
        )?;
        Ok(Vsock {
            cid,
            uds: uds.to_path_buf(),
            listener,
            epoll,
            conns: HashMap::new(),
            tokens: HashMap::new(),
            pending: HashMap::new(),
            ctrl: VecDeque::new(),
            next_token: 1,
            next_host_port: 1 << 30,
            reset_pending: false,
            metrics: VsockMetrics::default(),
        })
    }

    pub fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    fn token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    /// Header for a packet from the host side of `key`.
    pub fn hdr(&self, key: ConnKey, op: u16) -> Header {
        let fwd = self.conns.get(&key).map(|c| c.fwd_cnt).unwrap_or(0);
        Header {
            src_cid: HOST_CID,
            dst_cid: self.cid,
            src_port: key.0,
            dst_port: key.1,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: HOST_BUF_ALLOC,
            fwd_cnt: fwd,
        }
    }

    pub fn queue_ctrl(&mut self, key: ConnKey, op: u16, flags: u32) {
        let mut h = self.hdr(key, op);
        h.flags = flags;
        if op == OP_RST {
            self.metrics.resets_sent += 1;
        }
        if let Some(c) = self.conns.get_mut(&key) {
            c.fwd_cnt_sent = c.fwd_cnt;
        }
        self.ctrl.push_back(h);
    }

    /// RST for a packet that matches no connection.
    pub fn queue_rst_for(&mut self, h: &Header) {
        self.metrics.resets_sent += 1;
        self.ctrl.push_back(Header {
            src_cid: HOST_CID,
            dst_cid: self.cid,
            src_port: h.dst_port,
            dst_port: h.src_port,
            type_: TYPE_STREAM,
            op: OP_RST,
            buf_alloc: HOST_BUF_ALLOC,
            ..Default::default()
        });
    }

    pub fn set_interest(&mut self, key: ConnKey) {
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        let mut want = EventSet::empty();
        let established = c.state == ConnState::Established;
        if established
            && !c.host_eof
            && c.rx_buf.len() < MAX_PENDING_RX
            && c.peer_credit() > c.rx_buf.len() as u32
        {
            want |= EventSet::IN;
        }
        if !c.tx_buf.is_empty() {
            want |= EventSet::OUT;
        }
        let fd = c.stream.as_raw_fd();
        if want.is_empty() {
            if c.registered {
                let _ = self
                    .epoll
                    .ctl(ControlOperation::Delete, fd, EpollEvent::default());
                c.registered = false;
            }
        } else if !c.registered {
            c.registered = self
                .epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(want, c.token))
                .is_ok();
        } else if want != c.interest {
            let _ = self
                .epoll
                .ctl(ControlOperation::Modify, fd, EpollEvent::new(want, c.token));
        }
        c.interest = want;
    }

    fn add_conn(&mut self, key: ConnKey, conn: Conn) -> bool {
        self.tokens.insert(conn.token, key);
        self.conns.insert(key, conn);
        self.set_interest(key);
        true
    }

    pub fn remove_conn(&mut self, key: ConnKey) {
        if let Some(mut c) = self.conns.remove(&key) {
            if !c.tx_buf.is_empty() {
                // Hand the host what the guest already sent before closing (bounded wait).
                let _ = c.stream.set_nonblocking(false);
                let _ = c
                    .stream
                    .set_write_timeout(Some(std::time::Duration::from_secs(2)));
                let _ = c.stream.write_all(&c.tx_buf);
            }
            if c.registered {
                let _ = self.epoll.ctl(
                    ControlOperation::Delete,
                    c.stream.as_raw_fd(),
                    EpollEvent::default(),
                );
            }
            self.tokens.remove(&c.token);
        }
    }

    /// Drops every connection (transport reset).
    pub fn reset_all(&mut self) {
        let keys: Vec<ConnKey> = self.conns.keys().copied().collect();
        for k in keys {
            self.remove_conn(k);
        }
        for (_, p) in self.pending.drain() {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                p.stream.as_raw_fd(),
                EpollEvent::default(),
            );
        }
        self.ctrl.clear();
    }

    /// Guest asked to connect to host port `h.dst_port`: connect to `<uds>_<port>`.
    pub fn guest_connect(&mut self, h: &Header) {
        let key = (h.dst_port, h.src_port);
        if self.conns.contains_key(&key) {
            self.queue_rst_for(h);
            return;
        }
        let path = PathBuf::from(format!("{}_{}", self.uds.display(), h.dst_port));
        match UnixStream::connect(&path).and_then(|s| s.set_nonblocking(true).map(|_| s)) {
            Ok(stream) => {
                let token = self.token();
                let mut c = Conn::new(stream, token, ConnState::Established);
                c.peer_buf_alloc = h.buf_alloc;
                c.peer_fwd_cnt = h.fwd_cnt;
                if self.add_conn(key, c) {
                    self.metrics.guest_connections += 1;
                    self.queue_ctrl(key, OP_RESPONSE, 0);
                    self.set_interest(key);
                } else {
                    self.queue_rst_for(h);
                }
            }
            Err(_) => {
                self.metrics.connect_failures += 1;
                self.queue_rst_for(h);
            }
        }
    }

    /// Accepts host connections on the listener.
    pub fn accept_host(&mut self) {
        while let Ok((stream, _)) = self.listener.accept() {
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let token = self.token();
            if self
                .epoll
                .ctl(
                    ControlOperation::Add,
                    stream.as_raw_fd(),
                    EpollEvent::new(EventSet::IN, token),
                )
                .is_ok()
            {
                self.pending.insert(
                    token,
                    Pending {
                        stream,
                        buf: Vec::new(),
                    },
                );
            }
        }
    }

    /// Reads the `CONNECT <port>\n` line of a pending host connection.
    pub fn pending_readable(&mut self, token: u64) {
        let Some(p) = self.pending.get_mut(&token) else {
            return;
        };
        let mut b = [0u8; 64];
        let mut closed = false;
        loop {
            match p.stream.read(&mut b) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => {
                    p.buf.extend_from_slice(&b[..n]);
                    if p.buf.contains(&b'\n') || p.buf.len() > 64 {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    closed = true;
                    break;
                }
            }
        }
        let Some(nl) = p.buf.iter().position(|&c| c == b'\n') else {
            if closed || p.buf.len() > 64 {
                if let Some(p) = self.pending.remove(&token) {
                    let _ = self.epoll.ctl(
                        ControlOperation::Delete,
                        p.stream.as_raw_fd(),
                        EpollEvent::default(),
                    );
                }
            }
            return;
        };
        let Some(mut p) = self.pending.remove(&token) else {
            return;
        };
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            p.stream.as_raw_fd(),
            EpollEvent::default(),
        );
        let line = String::from_utf8_lossy(&p.buf[..nl]).to_string();
        let rest = p.buf.split_off(nl + 1);
        let port = line
            .strip_prefix("CONNECT ")
            .and_then(|s| s.trim().parse::<u32>().ok());
        let Some(port) = port else {
            let _ = p.stream.write_all(b"ERR expected CONNECT <port>\n");
            return;
        };
        self.next_host_port = self.next_host_port.wrapping_add(1).max(1 << 30);
        let key = (self.next_host_port, port);
        let mut c = Conn::new(p.stream, self.token(), ConnState::Connecting);
        c.rx_buf = rest;
        if self.add_conn(key, c) {
            self.metrics.host_connections += 1;
            self.queue_ctrl(key, OP_REQUEST, 0);
        }
    }

    /// Moves bytes between a connection's host socket and its buffers.
    pub fn conn_io(&mut self, token: u64, events: EventSet) {
        let Some(&key) = self.tokens.get(&token) else {
            return;
        };
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        let mut broken = false;
        if events.contains(EventSet::OUT) || !c.tx_buf.is_empty() {
            broken |= flush_tx(c);
        }
        if events.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::READ_HANG_UP)
            && c.state == ConnState::Established
        {
            let room =
                (MAX_PENDING_RX - c.rx_buf.len().min(MAX_PENDING_RX)).min(c.peer_credit() as usize);
            if room > 0 {
                let mut b = vec![0u8; room.min(64 * 1024)];
                match c.stream.read(&mut b) {
                    Ok(0) => c.host_eof = true,
                    Ok(n) => c.rx_buf.extend_from_slice(&b[..n]),
                    Err(e)
                        if e.kind() == ErrorKind::WouldBlock
                            || e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => broken = true,
                }
            }
        }
        let eof_now = c.host_eof && c.rx_buf.is_empty() && !c.shutdown_sent;
        let credit_due = c.fwd_cnt.wrapping_sub(c.fwd_cnt_sent) >= HOST_BUF_ALLOC / 4;
        if broken {
            self.queue_ctrl(key, OP_RST, 0);
            self.remove_conn(key);
            return;
        }
        if eof_now {
            self.queue_ctrl(key, OP_SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND);
            if let Some(c) = self.conns.get_mut(&key) {
                c.shutdown_sent = true;
            }
        } else if credit_due {
            self.queue_ctrl(key, OP_CREDIT_UPDATE, 0);
        }
        self.set_interest(key);
    }
}

/// Writes buffered guest bytes to the host socket; returns true if the socket is broken.
pub fn flush_tx(c: &mut Conn) -> bool {
    while !c.tx_buf.is_empty() {
        match c.stream.write(&c.tx_buf) {
            Ok(0) => return true,
            Ok(n) => {
                c.tx_buf.drain(..n);
                c.fwd_cnt = c.fwd_cnt.wrapping_add(n as u32);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return true,
        }
    }
    false
}
