//! What the egress proxy, the DNS forwarder and the flow log tell an observer (kiln's audit
//! log): each connection they let out or refuse, each DNS query they answer, each UDP or ICMP
//! flow the slot's ruleset lets out or drops. The proxy and the forwarder await the observer
//! before the traffic goes on (a connection's upstream connect, a DNS answer's delivery), so
//! what it records precedes what the sandbox sees next; the flow log hears of a packet as the
//! kernel passes it on.

use std::future::Future;
use std::net::SocketAddrV4;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

/// A connection through the egress proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conn {
    /// The sandbox's side (its own address and port).
    pub src: SocketAddrV4,
    /// Where the sandbox connected to.
    pub dst: SocketAddrV4,
    /// TLS SNI or HTTP `Host` of a connection to a web port, when it sent one.
    pub name: Option<String>,
    /// The rule that decided (see [`crate::policy::EgressPolicy::decide`]).
    pub rule: String,
}

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetEvent {
    /// A TCP connection was let out (recorded before its upstream connect).
    Connect(Conn),
    /// A TCP connection was refused (the sandbox's side is reset).
    Deny(Conn),
    /// A let-out connection ended: bytes each way, how long, and why if it failed.
    Close {
        conn: Conn,
        bytes_out: u64,
        bytes_in: u64,
        duration_ms: u64,
        error: Option<String>,
    },
    /// A DNS query the forwarder handled.
    Dns(DnsQuery),
    /// A UDP or ICMP flow was let out (its first packet, seen by the flow log).
    FlowOpen(Flow),
    /// A UDP or ICMP packet was dropped by the ruleset (once per flow every few seconds).
    FlowDeny(Flow),
    /// A let-out UDP or ICMP flow ended (conntrack forgot it): payload bytes and packets each
    /// way.
    FlowClose {
        flow: Flow,
        bytes_out: u64,
        bytes_in: u64,
        packets_out: u64,
        packets_in: u64,
        duration_ms: u64,
    },
}

/// A UDP or ICMP flow leaving a sandbox, as the slot's ruleset decided it ([`crate::flows`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flow {
    /// `udp` or `icmp`.
    pub proto: &'static str,
    pub src: std::net::Ipv4Addr,
    pub dst: std::net::Ipv4Addr,
    /// UDP ports (source, destination).
    pub ports: Option<(u16, u16)>,
    /// ICMP type, code and echo identifier.
    pub icmp: Option<(u8, u8, u16)>,
    /// The rule that decided, in the egress proxy's words (`default`, `denyOut <entry>` …).
    pub rule: String,
}

/// A DNS query and its outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsQuery {
    pub name: String,
    /// `A`, `AAAA`, `MX` … or the number.
    pub qtype: String,
    /// `udp` or `tcp`.
    pub transport: &'static str,
    /// `NOERROR`, `NXDOMAIN` … ; `None`: no upstream answered.
    pub rcode: Option<String>,
    /// The answer records: addresses (A/AAAA) and names (CNAME), in order.
    pub answers: Vec<String>,
}

pub type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Receives the events of one slot's proxy and forwarder.
pub type Observer = Arc<dyn Fn(NetEvent) -> BoxFuture + Send + Sync>;

/// An observer slot shared by a proxy's or forwarder's tasks (empty: nothing is observed).
#[derive(Clone, Default)]
pub(crate) struct Slot(Arc<RwLock<Option<Observer>>>);

impl Slot {
    pub(crate) fn set(&self, o: Option<Observer>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = o;
    }

    pub(crate) fn is_set(&self) -> bool {
        self.0.read().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Tells the observer, if any, and waits for it.
    pub(crate) async fn tell(&self, e: NetEvent) {
        let o = self.0.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(o) = o {
            o(e).await;
        }
    }
}
