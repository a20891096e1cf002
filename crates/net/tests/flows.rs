//! Real namespaces and nftables (needs root): the flow log records UDP and ICMP leaving a
//! slot's sandbox namespace — let out and refused, with the rule, and with payload bytes each
//! way when a let-out flow ends (by conntrack's timeout, or by [`FlowLog::finish`]), QUIC under
//! domain rules refused as `quic` — against a test host on 198.51.100.168/29 in a namespace of
//! its own; slots in 10.165.0.0/24. The sandbox side is the kernel's stack (gVisor's is tested
//! through the server: tests/sdk/server/test_server_audit_flows.py).

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use kiln_net::flows::FlowLog;
use kiln_net::netns::in_netns;
use kiln_net::observe::{Flow, NetEvent, Observer};
use kiln_net::{host, EgressPolicy, NetConfig, SlotPool, GUEST_ADDR};
use nix::sys::socket::{self, MsgFlags, SockFlag, SockProtocol, SockType};

mod common;

use common::{root_or_skip, sh, TestHosts};

const NS: &str = "ktflow";
const HOST_VETH: &str = "ktflow0";
const OK_HOST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 169);
const DENIED_HOST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 170);

/// The test hosts: namespace `ktflow` behind host veth `ktflow0` (198.51.100.174/29).
fn hosts() -> TestHosts {
    TestHosts::up(
        NS,
        HOST_VETH,
        "198.51.100.174/29",
        &["198.51.100.169/29", "198.51.100.170/29"],
    )
}

type Events = Arc<std::sync::Mutex<Vec<NetEvent>>>;

fn observer() -> (Events, Observer) {
    let events: Events = Arc::default();
    let e = events.clone();
    let o: Observer = Arc::new(move |ev| {
        e.lock().unwrap().push(ev);
        Box::pin(async {})
    });
    (events, o)
}

/// An ICMP echo request (type 8) with identifier `id`, sequence `seq` and `data`.
fn echo(id: u16, seq: u16, data: &[u8]) -> Vec<u8> {
    let mut m = vec![8, 0, 0, 0];
    m.extend(id.to_be_bytes());
    m.extend(seq.to_be_bytes());
    m.extend(data);
    let mut sum: u32 = m
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    m[2..4].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    m
}

/// Sends `count` pings to `to` from a raw socket; returns how many replies came back.
fn ping(s: &OwnedFd, to: Ipv4Addr, id: u16, count: u16) -> usize {
    let addr = nix::libc::sockaddr_in {
        sin_family: nix::libc::AF_INET as nix::libc::sa_family_t,
        sin_port: 0,
        sin_addr: nix::libc::in_addr {
            s_addr: u32::from(to).to_be(),
        },
        sin_zero: [0; 8],
    };
    let mut replies = 0;
    for seq in 0..count {
        let m = echo(id, seq, b"kilnping");
        // SAFETY: `m` and `addr` are live for the call and their lengths are passed with them.
        let rc = unsafe {
            nix::libc::sendto(
                s.as_raw_fd(),
                m.as_ptr().cast(),
                m.len(),
                0,
                (&addr as *const nix::libc::sockaddr_in).cast(),
                std::mem::size_of::<nix::libc::sockaddr_in>() as nix::libc::socklen_t,
            )
        };
        assert_eq!(rc, m.len() as isize, "{}", std::io::Error::last_os_error());
        let mut buf = [0u8; 256];
        // A raw socket sees the IP header; an echo reply (type 0) with our id.
        while let Ok(n) = socket::recv(s.as_raw_fd(), &mut buf, MsgFlags::empty()) {
            let ihl = usize::from(buf[0] & 0xf) * 4;
            if n >= ihl + 8 && buf[ihl] == 0 && buf[ihl + 4..ihl + 6] == id.to_be_bytes() {
                replies += 1;
                break;
            }
        }
    }
    replies
}

fn flow(proto: &'static str, dst: Ipv4Addr, ports: Option<(u16, u16)>, rule: &str) -> Flow {
    Flow {
        proto,
        src: GUEST_ADDR,
        dst,
        ports,
        icmp: (proto == "icmp").then_some((8, 0, 0x4b1)),
        rule: rule.into(),
    }
}

async fn wait_for(events: &Events, n: usize, secs: u64) -> Vec<NetEvent> {
    for _ in 0..secs * 10 {
        if events.lock().unwrap().len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    events.lock().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_and_icmp_flows_are_recorded() {
    if !root_or_skip() {
        return;
    }
    let hosts = hosts();
    // A UDP server answering every datagram with "pong".
    let srv: UdpSocket = in_netns(&hosts.path(), || UdpSocket::bind("198.51.100.169:7000"))
        .await
        .unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((_, from)) = srv.recv_from(&mut buf) {
            let _ = srv.send_to(b"pong", from);
        }
    });

    let cfg = NetConfig {
        range: "10.165.0.0/24".parse().unwrap(),
        pool_size: 1,
        prefix: host::prefix_for("net-flows"),
        operator_allow: vec![],
        dns_upstreams: vec![],
        max_connections: 0,
        egress_mib_per_sec: 0,
        proxy_all_tcp: true,
    };
    let prefix = cfg.prefix.clone();
    let pool = SlotPool::start(cfg, &[]).await.unwrap();
    let p = EgressPolicy::from_lists(true, &[], &["198.51.100.170".into()], &[]).unwrap();
    let slot = pool.acquire(&p).await.unwrap();
    let router = slot.router_ns_path();
    // Short conntrack timeouts in this slot, so the flows end within the test.
    let r = slot.router_ns();
    for s in [
        "net.netfilter.nf_conntrack_udp_timeout=2",
        "net.netfilter.nf_conntrack_udp_timeout_stream=2",
        "net.netfilter.nf_conntrack_icmp_timeout=2",
    ] {
        sh(&["ip", "netns", "exec", &r, "sysctl", "-q", "-w", s]);
    }
    let log = FlowLog::start(&router, p.clone(), pool.host_facts().clone())
        .await
        .unwrap();
    let (events, obs) = observer();
    log.set_observer(Some(obs));

    let sa = slot.sandbox_ns_path();
    let u: UdpSocket = in_netns(&sa, || UdpSocket::bind("0.0.0.0:40001"))
        .await
        .unwrap();
    u.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut buf = [0u8; 64];
    for _ in 0..2 {
        u.send_to(b"hello", "198.51.100.169:7000").unwrap();
        assert_eq!(u.recv(&mut buf).unwrap(), 4);
    }
    // Refused: three datagrams, one record.
    for _ in 0..3 {
        u.send_to(b"hello", "198.51.100.170:7000").unwrap();
    }
    let raw: OwnedFd = in_netns(&sa, || {
        socket::socket(
            socket::AddressFamily::Inet,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::Icmp,
        )
        .map_err(Into::into)
    })
    .await
    .unwrap();
    let timeout = nix::sys::time::TimeVal::new(1, 0);
    socket::setsockopt(&raw, socket::sockopt::ReceiveTimeout, &timeout).unwrap();
    assert_eq!(ping(&raw, OK_HOST, 0x4b1, 3), 3);
    assert_eq!(ping(&raw, DENIED_HOST, 0x4b1, 2), 0);
    // An address denied whatever the policy: the slot range (the host's side of it).
    u.send_to(b"x", SocketAddr::from((slot.host_addr, 9)))
        .unwrap();

    let udp_ok = flow("udp", OK_HOST, Some((40001, 7000)), "default");
    let udp_no = flow(
        "udp",
        DENIED_HOST,
        Some((40001, 7000)),
        "denyOut 198.51.100.170",
    );
    let icmp_ok = flow("icmp", OK_HOST, None, "default");
    let icmp_no = flow("icmp", DENIED_HOST, None, "denyOut 198.51.100.170");
    let host_no = flow("udp", slot.host_addr, Some((40001, 9)), "host");
    let got = wait_for(&events, 5, 5).await;
    assert_eq!(
        got[..5],
        [
            NetEvent::FlowOpen(udp_ok.clone()),
            NetEvent::FlowDeny(udp_no),
            NetEvent::FlowOpen(icmp_ok.clone()),
            NetEvent::FlowDeny(icmp_no),
            NetEvent::FlowDeny(host_no),
        ]
    );
    // The two let-out flows end (conntrack times them out): payload bytes and packets.
    let got = wait_for(&events, 7, 90).await;
    let mut closes: Vec<(Flow, u64, u64, u64, u64)> = got[5..]
        .iter()
        .map(|e| match e {
            NetEvent::FlowClose {
                flow,
                bytes_out,
                bytes_in,
                packets_out,
                packets_in,
                ..
            } => (
                flow.clone(),
                *bytes_out,
                *bytes_in,
                *packets_out,
                *packets_in,
            ),
            other => panic!("{other:?}"),
        })
        .collect();
    closes.sort_by_key(|c| c.0.proto);
    assert_eq!(
        closes,
        vec![(icmp_ok, 3 * 8, 3 * 8, 3, 3), (udp_ok, 2 * 5, 2 * 4, 2, 2)]
    );
    // Under domain rules, UDP to the TLS ports (QUIC, which cannot be named) is dropped: "quic".
    let p = EgressPolicy::from_lists(true, &["a.test".into()], &[], &[]).unwrap();
    pool.set_policy(&slot, &p).await.unwrap();
    log.set_policy(p);
    u.send_to(b"quic", "198.51.100.169:443").unwrap();
    assert_eq!(
        wait_for(&events, 8, 5).await[7],
        NetEvent::FlowDeny(flow("udp", OK_HOST, Some((40001, 443)), "quic"))
    );
    // A flow still open when the sandbox goes: finishing the log ends it, with its bytes.
    let u2: UdpSocket = in_netns(&sa, || UdpSocket::bind("0.0.0.0:40002"))
        .await
        .unwrap();
    u2.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    u2.send_to(b"last", "198.51.100.169:7000").unwrap();
    assert_eq!(u2.recv(&mut buf).unwrap(), 4);
    let last = flow("udp", OK_HOST, Some((40002, 7000)), "default");
    assert_eq!(
        wait_for(&events, 9, 5).await[8],
        NetEvent::FlowOpen(last.clone())
    );
    // A server restart: the old log goes (its socket with it, or the new one could not bind
    // the log group); the new one still ends the flow the old one saw start.
    drop(log);
    // (Dropping aborts its task; the runtime drops the task, and closes the socket, soon after.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = FlowLog::start(&router, EgressPolicy::default(), pool.host_facts().clone())
        .await
        .unwrap();
    let (after, obs) = observer();
    log.set_observer(Some(obs));
    let t = std::time::Instant::now();
    log.finish().await;
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(events.lock().unwrap().len(), 9);
    let got = after.lock().unwrap().clone();
    assert_eq!(
        got,
        vec![NetEvent::FlowClose {
            flow: last,
            bytes_out: 4,
            bytes_in: 4,
            packets_out: 1,
            packets_in: 1,
            duration_ms: 0,
        }]
    );
    pool.release(slot).await;
    pool.shutdown().await;
    host::remove_table(&prefix).await.unwrap();
    let left: Vec<String> = std::fs::read_dir("/run/netns")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
