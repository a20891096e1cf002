//! The little of nfnetlink that the flow log needs, read and written by hand: NFLOG packets
//! (`nfnetlink_log`: the first bytes of a packet an nftables `log group` rule matched, and the
//! rule's prefix) and conntrack destroy events (`ctnetlink`: a flow's tuple, mark and byte
//! counters when the kernel forgets it). Layouts: `linux/netlink.h`, `linux/netfilter/
//! nfnetlink.h`, `nfnetlink_log.h`, `nfnetlink_conntrack.h`.

use std::net::Ipv4Addr;

/// `NETLINK_NETFILTER`.
pub const NETLINK_NETFILTER: i32 = 12;
/// Multicast group of conntrack destroy events (`NFNLGRP_CONNTRACK_DESTROY`), as a bind mask.
pub const GROUP_CT_DESTROY: u32 = 1 << (3 - 1);

const NLMSG_HDRLEN: usize = 16;
const NFGEN_LEN: usize = 4;
const NLMSG_ERROR: u16 = 2;
const SUBSYS_CTNETLINK: u16 = 1;
const SUBSYS_ULOG: u16 = 4;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NFULNL_MSG_PACKET: u16 = 0;
const NFULNL_MSG_CONFIG: u16 = 1;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_UDP: u8 = 17;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn be16(b: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(..2)?.try_into().ok()?))
}

fn be32(b: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(..4)?.try_into().ok()?))
}

fn be64(b: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(..8)?.try_into().ok()?))
}

fn ip(b: &[u8]) -> Option<Ipv4Addr> {
    let a: [u8; 4] = b.get(..4)?.try_into().ok()?;
    Some(Ipv4Addr::from(a))
}

/// The netlink messages of one datagram: `(type, flags-free payload)`.
pub fn messages(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = ne32(buf)? as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            return None;
        }
        let ty = u16::from_ne_bytes(buf[4..6].try_into().ok()?);
        let payload = &buf[NLMSG_HDRLEN..len];
        buf = buf.get(align4(len)..).unwrap_or(&[]);
        Some((ty, payload))
    })
}

fn ne32(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
}

/// The attributes in `buf`: `(type without the nested/byte-order flags, value)`.
pub fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = u16::from_ne_bytes(buf.get(..2)?.try_into().ok()?) as usize;
        let ty = u16::from_ne_bytes(buf.get(2..4)?.try_into().ok()?) & 0x3fff;
        if len < 4 || len > buf.len() {
            return None;
        }
        let v = &buf[4..len];
        buf = buf.get(align4(len)..).unwrap_or(&[]);
        Some((ty, v))
    })
}

fn attr(buf: &[u8], want: u16) -> Option<&[u8]> {
    attrs(buf).find(|(t, _)| *t == want).map(|(_, v)| v)
}

/// A flow's identity as conntrack and the packet both give it: protocol, addresses, and the
/// UDP ports or the ICMP echo identifier (`sport`; `dport` 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tuple {
    pub proto: u8,
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
}

/// A packet an nftables `log group` rule passed up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logged {
    pub prefix: String,
    pub tuple: Tuple,
    /// ICMP type and code.
    pub icmp: Option<(u8, u8)>,
}

/// A flow conntrack forgot, with its counters (`nf_conntrack_acct`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub tuple: Tuple,
    pub icmp: Option<(u8, u8)>,
    pub mark: u32,
    /// Packets and bytes (whole IP packets) from the originator, then from the replier.
    pub orig: (u64, u64),
    pub reply: (u64, u64),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Logged(Logged),
    Ended(Ended),
    /// An error answer (a negative errno; 0 is an acknowledgement).
    Error(i32),
    Other,
}

/// Reads one netlink message.
pub fn parse(ty: u16, payload: &[u8]) -> Message {
    if ty == NLMSG_ERROR {
        let code = payload
            .get(..4)
            .and_then(|b| b.try_into().ok())
            .map(i32::from_ne_bytes);
        return Message::Error(code.unwrap_or(-1));
    }
    let Some(body) = payload.get(NFGEN_LEN..) else {
        return Message::Other;
    };
    let r = match (ty >> 8, ty & 0xff) {
        (SUBSYS_ULOG, NFULNL_MSG_PACKET) => logged(body).map(Message::Logged),
        (SUBSYS_CTNETLINK, IPCTNL_MSG_CT_DELETE) => ended(body).map(Message::Ended),
        _ => None,
    };
    r.unwrap_or(Message::Other)
}

const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;

fn logged(body: &[u8]) -> Option<Logged> {
    let prefix = attr(body, NFULA_PREFIX)?;
    let prefix = prefix.split(|b| *b == 0).next().unwrap_or(&[]);
    let (tuple, icmp) = packet(attr(body, NFULA_PAYLOAD)?)?;
    Some(Logged {
        prefix: String::from_utf8_lossy(prefix).into_owned(),
        tuple,
        icmp,
    })
}

/// The tuple of an IPv4 packet carrying UDP or ICMP.
pub fn packet(p: &[u8]) -> Option<(Tuple, Option<(u8, u8)>)> {
    let first = *p.first()?;
    if first >> 4 != 4 {
        return None;
    }
    let l4 = p.get(usize::from(first & 0xf) * 4..)?;
    let (proto, src, dst) = (*p.get(9)?, ip(p.get(12..)?)?, ip(p.get(16..)?)?);
    let t = |sport, dport| Tuple {
        proto,
        src,
        dst,
        sport,
        dport,
    };
    match proto {
        IPPROTO_UDP => Some((t(be16(l4)?, be16(l4.get(2..)?)?), None)),
        IPPROTO_ICMP => Some((t(be16(l4.get(4..)?)?, 0), Some((*l4.first()?, *l4.get(1)?)))),
        _ => None,
    }
}

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_MARK: u16 = 8;
const CTA_COUNTERS_ORIG: u16 = 9;
const CTA_COUNTERS_REPLY: u16 = 10;

fn ended(body: &[u8]) -> Option<Ended> {
    let orig = attr(body, CTA_TUPLE_ORIG)?;
    let ips = attr(orig, 1)?;
    let pr = attr(orig, 2)?;
    let proto = *attr(pr, 1)?.first()?;
    let port = |t| attr(pr, t).and_then(be16).unwrap_or(0);
    let (sport, dport, icmp) = match proto {
        IPPROTO_ICMP => (
            port(4),
            0,
            Some((*attr(pr, 5)?.first()?, *attr(pr, 6)?.first()?)),
        ),
        _ => (port(2), port(3), None),
    };
    let counters = |t| {
        attr(body, t)
            .and_then(|c| Some((be64(attr(c, 1)?)?, be64(attr(c, 2)?)?)))
            .unwrap_or((0, 0))
    };
    Some(Ended {
        tuple: Tuple {
            proto,
            src: ip(attr(ips, 1)?)?,
            dst: ip(attr(ips, 2)?)?,
            sport,
            dport,
        },
        icmp,
        mark: attr(body, CTA_MARK).and_then(be32).unwrap_or(0),
        orig: counters(CTA_COUNTERS_ORIG),
        reply: counters(CTA_COUNTERS_REPLY),
    })
}

fn push_attr(out: &mut Vec<u8>, ty: u16, v: &[u8]) {
    out.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&ty.to_ne_bytes());
    out.extend_from_slice(v);
    out.resize(align4(out.len()), 0);
}

/// The NFLOG configuration request binding this socket to `group`: whole packets up to
/// `copy` bytes, each sent at once (queue threshold 1) rather than batched for a second.
pub fn bind_log_group(group: u16, copy: u32, seq: u32) -> Vec<u8> {
    let mut m = vec![0u8; NLMSG_HDRLEN];
    m.extend_from_slice(&[nix::libc::AF_INET as u8, 0]);
    m.extend_from_slice(&group.to_be_bytes());
    // NFULA_CFG_CMD: NFULNL_CFG_CMD_BIND.
    push_attr(&mut m, 1, &[1]);
    // NFULA_CFG_MODE: copy range (be32), NFULNL_COPY_PACKET, padding.
    let mut mode = copy.to_be_bytes().to_vec();
    mode.extend_from_slice(&[2, 0]);
    push_attr(&mut m, 2, &mode);
    // NFULA_CFG_QTHRESH.
    push_attr(&mut m, 5, &1u32.to_be_bytes());
    let len = m.len() as u32;
    m[..4].copy_from_slice(&len.to_ne_bytes());
    m[4..6].copy_from_slice(&((SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG).to_ne_bytes());
    m[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    m
}

/// The ctnetlink request deleting every IPv4 conntrack entry whose mark is `mark` (each
/// deletion is a destroy event, with counters).
pub fn flush_marked(mark: u32, seq: u32) -> Vec<u8> {
    let mut m = vec![0u8; NLMSG_HDRLEN];
    m.extend_from_slice(&[nix::libc::AF_INET as u8, 0, 0, 0]);
    push_attr(&mut m, CTA_MARK, &mark.to_be_bytes());
    // CTA_MARK_MASK.
    push_attr(&mut m, 21, &u32::MAX.to_be_bytes());
    let len = m.len() as u32;
    m[..4].copy_from_slice(&len.to_ne_bytes());
    m[4..6].copy_from_slice(&((SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE).to_ne_bytes());
    m[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    m
}

#[cfg(test)]
#[path = "nfnl_tests.rs"]
mod tests;
