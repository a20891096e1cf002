//! The flow log: UDP (other than DNS to the forwarder) and ICMP leaving a sandbox, on record.
//!
//! These never pass a userspace proxy: the slot's ruleset decides them. With egress audited
//! ([`HostFacts::proxy_all_tcp`]) its verdicts go through two chains ([`crate::rules`]) that
//! log a let-out flow's *first* packet (marking its conntrack entry, so later packets skip the
//! log) and every dropped packet to NFLOG group [`LOG_GROUP`]. One netlink socket per sandbox,
//! opened in its router namespace (netlink is per namespace; the socket stays bound to the one
//! it was made in), reads those packets and the namespace's conntrack destroy events (with
//! `nf_conntrack_acct` on, they carry each flow's packets and bytes each way). A task per
//! sandbox waits on it through tokio; it ends, and the socket closes, when the [`FlowLog`] is
//! dropped. Userspace sees one message per new flow, per refused packet and per ended flow —
//! never the packets of a flow already let out.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use nix::sys::socket::{self, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType};
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use crate::nfnl::{self, Ended, Logged, Message, Tuple};
use crate::observe::{Flow, NetEvent, Observer, Slot};
use crate::policy::EgressPolicy;
use crate::rules::{FlowVerdict, HostFacts, FLOW_MARK, LOG_GROUP};
use crate::{io_err, Result};

/// Bytes of a packet NFLOG copies up: IPv4 header (with options) and the UDP/ICMP header.
const COPY: u32 = 96;
/// A refused flow is recorded again after this long.
const DENY_FOLD: Duration = Duration::from_secs(10);
/// Most flows remembered as open (a flood of new flows forgets the oldest half).
const MAX_OPEN: usize = 16384;
/// IPv4 header (without options) plus the UDP or ICMP header: not counted as payload.
const HEADERS: u64 = 28;

/// How long [`FlowLog::finish`] waits for the kernel's answer.
const FINISH_TIMEOUT: Duration = Duration::from_secs(2);

/// A running flow log; stops (and closes its socket) when dropped.
pub struct FlowLog {
    task: tokio::task::JoinHandle<()>,
    shared: Arc<Shared>,
    finish: Option<oneshot::Sender<oneshot::Sender<()>>>,
}

struct Shared {
    policy: RwLock<EgressPolicy>,
    facts: HostFacts,
    observer: Slot,
}

impl Drop for FlowLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FlowLog {
    /// Starts the flow log of the router namespace at `router_ns` (whose ruleset logs flows).
    pub async fn start(router_ns: &Path, policy: EgressPolicy, facts: HostFacts) -> Result<Self> {
        let fd = crate::netns::in_netns(router_ns, open_socket).await?;
        // SAFETY: the OwnedFd moves into the AsyncFd, so it stays open and the same for the
        // AsyncFd's whole life.
        let fd = unsafe { AsyncFd::register(fd) }
            .map_err(std::io::Error::from)
            .map_err(io_err("registering the flow log socket"))?;
        let shared = Arc::new(Shared {
            policy: RwLock::new(policy),
            facts,
            observer: Slot::default(),
        });
        let (finish, finish_rx) = oneshot::channel();
        let task = tokio::spawn(run(fd, shared.clone(), finish_rx));
        Ok(Self {
            task,
            shared,
            finish: Some(finish),
        })
    }

    /// Ends the flows still open (the sandbox is gone): deletes their conntrack entries, so
    /// each is recorded as closed with its bytes, and waits (briefly) until they are told.
    pub async fn finish(mut self) {
        let Some(tx) = self.finish.take() else {
            return;
        };
        let (done, wait) = oneshot::channel();
        if tx.send(done).is_ok() {
            let _ = tokio::time::timeout(FINISH_TIMEOUT, wait).await;
        }
    }

    pub fn set_observer(&self, o: Option<Observer>) {
        self.shared.observer.set(o);
    }

    /// Replaces the policy the records' rules are named from.
    pub fn set_policy(&self, p: EgressPolicy) {
        *self
            .shared
            .policy
            .write()
            .unwrap_or_else(|e| e.into_inner()) = p;
    }
}

fn write_sysctl(name: &str, value: &str) -> std::io::Result<()> {
    std::fs::write(Path::new("/proc/sys/net/netfilter").join(name), value)
}

/// In the router namespace: turns conntrack accounting and events on, opens the socket,
/// joins the destroy events and binds the log group.
fn open_socket() -> std::io::Result<OwnedFd> {
    write_sysctl("nf_conntrack_acct", "1")?;
    write_sysctl("nf_conntrack_events", "1")?;
    let fd = socket::socket(
        socket::AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkNetFilter,
    )?;
    // Room for bursts of new flows (past `rmem_max`: kiln runs as root), else what is allowed.
    if socket::setsockopt(&fd, socket::sockopt::RcvBufForce, &(4 << 20)).is_err() {
        let _ = socket::setsockopt(&fd, socket::sockopt::RcvBuf, &(4 << 20));
    }
    socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, nfnl::GROUP_CT_DESTROY))?;
    let timeout = nix::sys::time::TimeVal::new(2, 0);
    socket::setsockopt(&fd, socket::sockopt::ReceiveTimeout, &timeout)?;
    socket::send(
        fd.as_raw_fd(),
        &nfnl::bind_log_group(LOG_GROUP, COPY, 1),
        MsgFlags::empty(),
    )?;
    let mut buf = vec![0u8; 8192];
    'ack: loop {
        let n = socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        for (ty, p) in nfnl::messages(&buf[..n]) {
            match nfnl::parse(ty, p) {
                Message::Error(0) => break 'ack,
                Message::Error(e) => return Err(std::io::Error::from_raw_os_error(-e)),
                _ => {}
            }
        }
    }
    let flags = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL)?;
    let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(flags))?;
    Ok(fd)
}

async fn run(
    fd: AsyncFd<OwnedFd>,
    shared: Arc<Shared>,
    mut finish: oneshot::Receiver<oneshot::Sender<()>>,
) {
    let mut state = State::default();
    let mut buf = vec![0u8; 64 * 1024];
    // Set once the flush is sent: told when the kernel acknowledges it.
    let mut finishing: Option<oneshot::Sender<()>> = None;
    loop {
        let ready = tokio::select! {
            r = fd.readable() => r,
            done = &mut finish, if finishing.is_none() => {
                let Ok(done) = done else { return };
                let req = nfnl::flush_marked(FLOW_MARK, FLUSH_SEQ);
                if socket::send(fd.as_raw_fd(), &req, MsgFlags::empty()).is_err() {
                    return;
                }
                finishing = Some(done);
                continue;
            }
        };
        let Ok(mut guard) = ready else {
            return;
        };
        let got = guard.try_io(|fd| {
            socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(Into::into)
        });
        let n = match got {
            Err(_would_block) => continue,
            Ok(Ok(n)) => n,
            Ok(Err(e)) if e.raw_os_error() == Some(nix::libc::ENOBUFS) => {
                tracing::warn!("flow log: the kernel dropped events (receive queue full)");
                continue;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "flow log: reading its socket; it stops");
                return;
            }
        };
        let now = Instant::now();
        let mut acked = false;
        let events: Vec<NetEvent> = nfnl::messages(&buf[..n])
            .filter_map(|(ty, p)| match nfnl::parse(ty, p) {
                Message::Error(_) => {
                    acked = true;
                    None
                }
                m => state.event(m, &shared, now),
            })
            .collect();
        for e in events {
            shared.observer.tell(e).await;
        }
        if acked && finishing.is_some() {
            // The destroy events of the flush came before its acknowledgement.
            if let Some(done) = finishing.take() {
                let _ = done.send(());
            }
            return;
        }
    }
}

const FLUSH_SEQ: u32 = 2;

/// What the reader remembers: flows let out (until they end) and refusals recently recorded.
#[derive(Default)]
struct State {
    open: HashMap<Tuple, (Flow, Instant)>,
    denied: HashMap<Tuple, Instant>,
}

impl State {
    fn event(&mut self, m: Message, shared: &Shared, now: Instant) -> Option<NetEvent> {
        match m {
            Message::Logged(l) => self.logged(l, shared, now),
            Message::Ended(e) if e.mark == FLOW_MARK => Some(self.ended(e, shared, now)),
            _ => None,
        }
    }

    fn logged(&mut self, l: Logged, shared: &Shared, now: Instant) -> Option<NetEvent> {
        let verdict = FlowVerdict::from_prefix(&l.prefix)?;
        let flow = flow(&l.tuple, l.icmp, rule(shared, verdict, l.tuple.dst));
        if verdict == FlowVerdict::Allow {
            if self.open.len() >= MAX_OPEN {
                let mut ages: Vec<Instant> = self.open.values().map(|(_, t)| *t).collect();
                ages.sort_unstable();
                let cut = ages[ages.len() / 2];
                self.open.retain(|_, (_, t)| *t > cut);
            }
            self.open.insert(l.tuple, (flow.clone(), now));
            return Some(NetEvent::FlowOpen(flow));
        }
        self.denied
            .retain(|_, t| now.duration_since(*t) < DENY_FOLD);
        if self.denied.contains_key(&l.tuple) {
            return None;
        }
        self.denied.insert(l.tuple, now);
        Some(NetEvent::FlowDeny(flow))
    }

    fn ended(&mut self, e: Ended, shared: &Shared, now: Instant) -> NetEvent {
        let (flow, duration_ms) = match self.open.remove(&e.tuple) {
            Some((f, t)) => (f, now.duration_since(t).as_millis() as u64),
            // Let out before this reader started (a restarted server).
            None => (
                flow(
                    &e.tuple,
                    e.icmp,
                    rule(shared, FlowVerdict::Allow, e.tuple.dst),
                ),
                0,
            ),
        };
        let payload = |(packets, bytes): (u64, u64)| bytes.saturating_sub(packets * HEADERS);
        NetEvent::FlowClose {
            flow,
            bytes_out: payload(e.orig),
            bytes_in: payload(e.reply),
            packets_out: e.orig.0,
            packets_in: e.reply.0,
            duration_ms,
        }
    }
}

fn flow(t: &Tuple, icmp: Option<(u8, u8)>, rule: String) -> Flow {
    let is_icmp = t.proto == nfnl::IPPROTO_ICMP;
    Flow {
        proto: if is_icmp { "icmp" } else { "udp" },
        src: t.src,
        dst: t.dst,
        ports: (!is_icmp).then_some((t.sport, t.dport)),
        icmp: icmp.map(|(ty, code)| (ty, code, t.sport)),
        rule,
    }
}

/// The rule behind a verdict, in the egress proxy's words.
fn rule(shared: &Shared, verdict: FlowVerdict, dst: Ipv4Addr) -> String {
    if verdict == FlowVerdict::Quic {
        return "quic".into();
    }
    if let Some(r) = crate::egress::always_denied(&shared.facts, dst) {
        return r;
    }
    let p = shared.policy.read().unwrap_or_else(|e| e.into_inner());
    p.decide(None, dst).1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GUEST_ADDR;

    fn shared(p: EgressPolicy) -> Shared {
        Shared {
            policy: RwLock::new(p),
            facts: HostFacts {
                host_deny: vec!["10.165.0.0/24".parse().unwrap()],
                ..HostFacts::default()
            },
            observer: Slot::default(),
        }
    }

    fn udp(dst: [u8; 4], sport: u16) -> Tuple {
        Tuple {
            proto: nfnl::IPPROTO_UDP,
            src: GUEST_ADDR,
            dst: Ipv4Addr::from(dst),
            sport,
            dport: 9,
        }
    }

    #[test]
    fn flows_open_fold_refusals_and_close_with_payload_bytes() {
        let p = EgressPolicy::from_lists(true, &[], &["198.51.100.0/24".into()], &[]).unwrap();
        let sh = shared(p);
        let mut st = State::default();
        let t0 = Instant::now();
        let log = |prefix: &str, tuple| {
            Message::Logged(Logged {
                prefix: prefix.into(),
                tuple,
                icmp: None,
            })
        };
        let open = st.event(log("kiln allow", udp([192, 0, 2, 99], 5000)), &sh, t0);
        let Some(NetEvent::FlowOpen(f)) = open else {
            panic!("{open:?}")
        };
        assert_eq!(
            (f.proto, f.ports, f.rule.as_str()),
            ("udp", Some((5000, 9)), "default")
        );
        let deny = st.event(log("kiln deny", udp([198, 51, 100, 9], 5001)), &sh, t0);
        assert!(
            matches!(deny, Some(NetEvent::FlowDeny(ref f)) if f.rule == "denyOut 198.51.100.0/24")
        );
        // The same refused flow again soon: folded; later: recorded again.
        assert!(st
            .event(log("kiln deny", udp([198, 51, 100, 9], 5001)), &sh, t0)
            .is_none());
        let later = t0 + DENY_FOLD + Duration::from_millis(1);
        assert!(st
            .event(log("kiln deny", udp([198, 51, 100, 9], 5001)), &sh, later)
            .is_some());
        let host = st.event(log("kiln deny", udp([10, 165, 0, 3], 5002)), &sh, t0);
        assert!(matches!(host, Some(NetEvent::FlowDeny(ref f)) if f.rule == "host"));
        let ended = Ended {
            tuple: udp([192, 0, 2, 99], 5000),
            icmp: None,
            mark: FLOW_MARK,
            orig: (2, 2 * 28 + 10),
            reply: (1, 28 + 4),
        };
        let close = st.event(
            Message::Ended(ended.clone()),
            &sh,
            t0 + Duration::from_millis(40),
        );
        let Some(NetEvent::FlowClose {
            flow,
            bytes_out,
            bytes_in,
            packets_out,
            packets_in,
            duration_ms,
        }) = close
        else {
            panic!("{close:?}")
        };
        assert_eq!(flow.rule, "default");
        assert_eq!(
            (bytes_out, bytes_in, packets_out, packets_in, duration_ms),
            (10, 4, 2, 1, 40)
        );
        // Another flow's end (no mark: not one the ruleset logged) is not a record.
        let other = Ended { mark: 0, ..ended };
        assert!(st.event(Message::Ended(other), &sh, t0).is_none());
        assert!(st.open.is_empty());
    }
}
