//! Real namespaces, veths and nftables (needs root): the slot pool against a small test
//! "internet" on 198.51.100.0/24 in its own namespace. Nothing leaves this machine.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kiln_net::dns::DnsForwarder;
use kiln_net::egress::EgressProxy;
use kiln_net::netns::{connect_tcp, in_netns};
use kiln_net::observe::{DnsQuery, NetEvent, Observer};
use kiln_net::sni::client_hello;
use kiln_net::{host, EgressPolicy, NetConfig, Slot, SlotPool, GUEST_ADDR};

mod common;

use common::{root_or_skip, TestHosts};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The test internet: namespace `ktnet` behind host veth `ktnet0` (198.51.100.254/24).
fn internet() -> TestHosts {
    TestHosts::up(
        "ktnet",
        "ktnet0",
        "198.51.100.254/24",
        &["198.51.100.10/24", "198.51.100.11/24", "198.51.100.53/24"],
    )
}

/// A TCP server in `ns` answering every connection with `banner`.
async fn serve_banner(ns: &Path, at: SocketAddr, banner: &'static str) {
    let l: TcpListener = in_netns(ns, move || TcpListener::bind(at)).await.unwrap();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let _ = c.write_all(banner.as_bytes());
        }
    });
}

/// Connects from `ns` (the sandbox side, kernel stack) and reads the banner.
async fn fetch(ns: &Path, to: &str) -> Result<String, String> {
    let to: SocketAddr = to.parse().unwrap();
    let mut s = connect_tcp(ns, to, Duration::from_millis(700))
        .await
        .map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).map_err(|e| e.to_string())?;
    Ok(buf)
}

/// Connects from `ns`, sends `bytes`, reads until the peer closes ("" when refused by the
/// proxy).
async fn send(ns: &Path, to: &str, bytes: &[u8]) -> String {
    let to: SocketAddr = to.parse().unwrap();
    let mut s = connect_tcp(ns, to, Duration::from_secs(2)).await.unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(bytes).unwrap();
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf
}

type Events = Arc<std::sync::Mutex<Vec<NetEvent>>>;

/// An observer that keeps what it is told.
fn observer() -> (Events, Observer) {
    let events: Events = Arc::default();
    let e = events.clone();
    let o: Observer = Arc::new(move |ev| {
        e.lock().unwrap().push(ev);
        Box::pin(async {})
    });
    (events, o)
}

fn cfg(seed: &str, range: &str, pool_size: usize) -> NetConfig {
    NetConfig {
        range: range.parse().unwrap(),
        pool_size,
        prefix: host::prefix_for(seed),
        operator_allow: vec![],
        dns_upstreams: vec![],
        max_connections: 0,
        egress_mib_per_sec: 0,
        proxy_all_tcp: false,
    }
}

fn policy(internet: bool, allow: &[&str], deny: &[&str]) -> EgressPolicy {
    let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    EgressPolicy::from_lists(internet, &v(allow), &v(deny), &[]).unwrap()
}

fn leftovers(prefix: &str) -> Vec<String> {
    let mut v = Vec::new();
    for dir in ["/run/netns", "/sys/class/net"] {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(prefix) {
                v.push(n);
            }
        }
    }
    v
}

async fn wait_clean(prefix: &str) {
    for _ in 0..100 {
        if leftovers(prefix).is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("left behind: {:?}", leftovers(prefix));
}

fn host_table_exists(prefix: &str) -> bool {
    let out = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).contains(&host::host_table(prefix))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_policy_ingress_and_dns() {
    if !root_or_skip() {
        return;
    }
    let _g = SERIAL.lock().await;
    let test_net = internet();
    let inet = test_net.path();
    serve_banner(&inet, "198.51.100.10:80".parse().unwrap(), "ten").await;
    serve_banner(&inet, "198.51.100.11:80".parse().unwrap(), "eleven").await;

    let c = cfg("slots-egress", "10.132.0.0/24", 2);
    let prefix = c.prefix.clone();
    let pool = SlotPool::start(c, &[]).await.unwrap();
    let a: Slot = pool.acquire(&EgressPolicy::default()).await.unwrap();
    let b: Slot = pool.acquire(&EgressPolicy::default()).await.unwrap();
    assert_ne!(a.slot_addr, b.slot_addr);
    let sa = a.sandbox_ns_path();

    // Default: internet on.
    assert_eq!(fetch(&sa, "198.51.100.10:80").await.unwrap(), "ten");
    // Always denied: the host's own addresses, the slot's host side, another sandbox.
    assert!(fetch(&sa, "198.51.100.254:22").await.is_err());
    assert!(fetch(&sa, &format!("{}:80", a.host_addr)).await.is_err());
    serve_banner(
        &b.sandbox_ns_path(),
        SocketAddr::from((GUEST_ADDR, 7000)),
        "b",
    )
    .await;
    assert!(fetch(&sa, &format!("{}:7000", b.slot_addr)).await.is_err());
    // ...even with everything allowed.
    pool.set_policy(&a, &policy(true, &["0.0.0.0/0"], &[]))
        .await
        .unwrap();
    assert!(fetch(&sa, &format!("{}:7000", b.slot_addr)).await.is_err());
    assert!(fetch(&sa, "198.51.100.254:22").await.is_err());
    assert_eq!(fetch(&sa, "198.51.100.11:80").await.unwrap(), "eleven");

    // Internet off denies all; allowOut beats it.
    pool.set_policy(&a, &policy(false, &[], &[])).await.unwrap();
    assert!(fetch(&sa, "198.51.100.10:80").await.is_err());
    pool.set_policy(&a, &policy(false, &["198.51.100.10"], &[]))
        .await
        .unwrap();
    assert_eq!(fetch(&sa, "198.51.100.10:80").await.unwrap(), "ten");
    assert!(fetch(&sa, "198.51.100.11:80").await.is_err());
    // denyOut by CIDR; allow beats deny.
    pool.set_policy(&a, &policy(true, &[], &["198.51.100.0/24"]))
        .await
        .unwrap();
    assert!(fetch(&sa, "198.51.100.10:80").await.is_err());
    pool.set_policy(
        &a,
        &policy(true, &["198.51.100.11/32"], &["198.51.100.0/24"]),
    )
    .await
    .unwrap();
    assert_eq!(fetch(&sa, "198.51.100.11:80").await.unwrap(), "eleven");
    assert!(fetch(&sa, "198.51.100.10:80").await.is_err());

    // Ingress: from the router namespace to the guest address, and from the host to the
    // slot's unique address.
    serve_banner(&sa, SocketAddr::from((GUEST_ADDR, 8080)), "inside").await;
    assert_eq!(
        fetch(&a.router_ns_path(), &format!("{GUEST_ADDR}:8080"))
            .await
            .unwrap(),
        "inside"
    );
    let mut s = std::net::TcpStream::connect_timeout(
        &SocketAddr::from((a.slot_addr, 8080)),
        Duration::from_secs(1),
    )
    .unwrap();
    let mut got = String::new();
    s.read_to_string(&mut got).unwrap();
    assert_eq!(got, "inside");

    // DNS: a test resolver in the internet, the forwarder on the gateway address.
    let dns: UdpSocket = in_netns(&inet, || UdpSocket::bind("198.51.100.53:53"))
        .await
        .unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((n, from)) = dns.recv_from(&mut buf) {
            let mut answer = buf[..n].to_vec();
            answer[2] |= 0x80; // QR: a response
            answer.extend_from_slice(b"kiln-test");
            let _ = dns.send_to(&answer, from);
        }
    });
    let fwd = DnsForwarder::start(&a.router_ns_path(), vec![Ipv4Addr::new(198, 51, 100, 53)])
        .await
        .unwrap();
    // Its observer (kiln's audit log) hears of every query, with the outcome.
    let (events, obs) = observer();
    fwd.set_observer(Some(obs));
    let q: UdpSocket = in_netns(&sa, || UdpSocket::bind("0.0.0.0:0"))
        .await
        .unwrap();
    q.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut query = vec![0xab, 0xcd, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    query.extend([
        4, b'h', b'o', b's', b't', 4, b't', b'e', b's', b't', 0, 0, 1, 0, 1,
    ]);
    q.send_to(&query, "169.254.0.22:53").unwrap();
    let mut buf = [0u8; 512];
    let n = q.recv(&mut buf).unwrap();
    assert_eq!(&buf[..2], &[0xab, 0xcd]);
    assert!(buf[..n].ends_with(b"kiln-test"));
    assert_eq!(fwd.queries(), vec!["host.test".to_string()]);
    // Over TCP too (a resolver retries there when an answer is truncated).
    let tcp_dns: TcpListener = in_netns(&inet, || TcpListener::bind("198.51.100.53:53"))
        .await
        .unwrap();
    std::thread::spawn(move || {
        for mut c in tcp_dns.incoming().flatten() {
            let mut len = [0u8; 2];
            if c.read_exact(&mut len).is_err() {
                continue;
            }
            let mut msg = vec![0u8; u16::from_be_bytes(len) as usize];
            c.read_exact(&mut msg).unwrap();
            msg[2] |= 0x80;
            msg.extend_from_slice(b"kiln-tcp");
            let mut out = (msg.len() as u16).to_be_bytes().to_vec();
            out.extend(msg);
            let _ = c.write_all(&out);
        }
    });
    let mut t = connect_tcp(
        &sa,
        "169.254.0.22:53".parse().unwrap(),
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    t.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut framed = (query.len() as u16).to_be_bytes().to_vec();
    framed.extend(&query);
    t.write_all(&framed).unwrap();
    let mut len = [0u8; 2];
    t.read_exact(&mut len).unwrap();
    let mut answer = vec![0u8; u16::from_be_bytes(len) as usize];
    t.read_exact(&mut answer).unwrap();
    assert_eq!(&answer[..2], &[0xab, 0xcd]);
    assert!(answer.ends_with(b"kiln-tcp"));
    assert_eq!(fwd.queries().len(), 2);
    let dns = |transport| {
        NetEvent::Dns(DnsQuery {
            name: "host.test".into(),
            qtype: "A".into(),
            transport,
            rcode: Some("NOERROR".into()),
            answers: vec![],
        })
    };
    assert_eq!(*events.lock().unwrap(), vec![dns("udp"), dns("tcp")]);
    drop(fwd);

    // Domain rules: connections to the web ports go through the egress proxy, named by Host
    // (port 80) or TLS SNI (443); the address is still checked against the always-denied
    // ranges after a name matched.
    serve_banner(&inet, "198.51.100.10:443".parse().unwrap(), "ten-tls").await;
    let p = policy(true, &["a.test", "*.ok.test", "evil.test"], &["0.0.0.0/0"]);
    let proxy = EgressProxy::start(&a.router_ns_path(), p.clone(), pool.host_facts().clone())
        .await
        .unwrap();
    pool.set_policy(&a, &p).await.unwrap();
    let (events, obs) = observer();
    proxy.set_observer(Some(obs));
    let host = |h: &str| format!("GET / HTTP/1.0\r\nHost: {h}\r\n\r\n").into_bytes();
    assert_eq!(send(&sa, "198.51.100.10:80", &host("a.test")).await, "ten");
    // Told of the decision (with the rule) and of the end (with bytes each way).
    for _ in 0..100 {
        if events.lock().unwrap().len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    {
        let ev = events.lock().unwrap();
        let NetEvent::Connect(c) = &ev[0] else {
            panic!("{ev:?}")
        };
        assert_eq!(c.dst.to_string(), "198.51.100.10:80");
        assert_eq!(
            (c.name.as_deref(), c.rule.as_str()),
            (Some("a.test"), "allowOut a.test")
        );
        let NetEvent::Close {
            bytes_out,
            bytes_in,
            ..
        } = &ev[1]
        else {
            panic!("{ev:?}")
        };
        // (The banner server closes without reading: a reset may end it; counted anyway.)
        assert_eq!((*bytes_out, *bytes_in), (host("a.test").len() as u64, 3));
    }
    assert_eq!(send(&sa, "198.51.100.10:80", &host("b.test")).await, "");
    assert!(
        events.lock().unwrap().iter().any(|e| matches!(e,
        NetEvent::Deny(c) if c.name.as_deref() == Some("b.test") && c.rule == "denyOut 0.0.0.0/0"))
    );
    assert_eq!(
        send(&sa, "198.51.100.10:443", &client_hello("a.test")).await,
        "ten-tls"
    );
    assert_eq!(
        send(&sa, "198.51.100.10:443", &client_hello("b.test")).await,
        ""
    );
    // Other ports: CIDR rules only (denied here).
    serve_banner(&inet, "198.51.100.10:8443".parse().unwrap(), "ten-8443").await;
    assert!(fetch(&sa, "198.51.100.10:8443").await.is_err());
    // A name that matches cannot reach the host or a private address.
    assert_eq!(send(&sa, "198.51.100.254:80", &host("evil.test")).await, "");
    // Updates reach the proxy.
    let p = policy(true, &["b.test"], &["0.0.0.0/0"]);
    proxy.set_policy(p.clone());
    pool.set_policy(&a, &p).await.unwrap();
    assert_eq!(
        send(&sa, "198.51.100.10:443", &client_hello("b.test")).await,
        "ten-tls"
    );
    assert_eq!(
        send(&sa, "198.51.100.10:443", &client_hello("a.test")).await,
        ""
    );
    drop(proxy);

    pool.release(a).await;
    pool.release(b).await;
    pool.shutdown().await;
    host::remove_table(&prefix).await.unwrap();
    wait_clean(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_release_cycles_and_restart_leave_nothing_behind() {
    if !root_or_skip() {
        return;
    }
    let _g = SERIAL.lock().await;
    // The 1,000 cycles (about a minute); KILN_NET_CYCLES=N for a shorter or longer run.
    let cycles: usize = std::env::var("KILN_NET_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let c = cfg("slots-cycles", "10.133.0.0/24", 2);
    let prefix = c.prefix.clone();
    let pool: Arc<SlotPool> = SlotPool::start(c.clone(), &[]).await.unwrap();
    let t = std::time::Instant::now();
    for i in 0..cycles {
        let p = if i % 2 == 0 {
            EgressPolicy::default()
        } else {
            policy(false, &["198.51.100.0/24"], &[])
        };
        let s = pool.acquire(&p).await.unwrap();
        assert!(s.sandbox_ns_path().exists());
        pool.release(s).await;
    }
    eprintln!("{cycles} acquire/release cycles in {:?}", t.elapsed());
    // A crash: slots leased and never released, the pool dropped.
    let leaked = pool.acquire(&EgressPolicy::default()).await.unwrap();
    assert!(leaked.sandbox_ns_path().exists());
    // (Let the refill finish first, so no slot is built after the restart's cleanup.)
    while pool.ready() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(pool);
    // The next start of the same pool removes them (keeping only what it is told live
    // sandboxes use)...
    let pool = SlotPool::start(c.clone(), &[]).await.unwrap();
    assert!(!leaked.sandbox_ns_path().exists());
    let leaked = pool.acquire(&EgressPolicy::default()).await.unwrap();
    while pool.ready() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...and so does another server's pool on the same range once this one is dead (its lock
    // released), while a live pool's range is refused.
    let other = cfg("slots-cycles-other", "10.133.0.0/24", 1);
    let err = SlotPool::start(other.clone(), &[])
        .await
        .err()
        .expect("live pool's range");
    assert!(
        err.to_string().contains("overlaps the host's route"),
        "{err}"
    );
    drop(pool);
    let pool = SlotPool::start(other.clone(), &[]).await.unwrap();
    assert!(!leaked.sandbox_ns_path().exists());
    assert!(!host_table_exists(&prefix));
    pool.shutdown().await;
    drop(pool);
    host::remove_table(&other.prefix).await.unwrap();
    wait_clean(&other.prefix).await;
    for i in host::leftover_indices(&prefix) {
        host::remove_slot(&prefix, i).await.unwrap();
    }
    host::remove_table(&prefix).await.unwrap();
    wait_clean(&prefix).await;
    assert!(!host_table_exists(&prefix));
    // The range is checked against the host's routes.
    let overlapping = cfg("slots-overlap", "198.51.100.0/25", 1);
    let _inet = internet();
    let err = SlotPool::start(overlapping, &[])
        .await
        .err()
        .expect("overlap refused");
    assert!(
        err.to_string().contains("overlaps the host's route"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cap_and_bandwidth_cap_rules_load_and_hold() {
    if !root_or_skip() {
        return;
    }
    let _g = SERIAL.lock().await;
    let inet = internet();
    // A server that keeps every connection open.
    let at: SocketAddr = "198.51.100.10:9000".parse().unwrap();
    let l: TcpListener = in_netns(&inet.path(), move || TcpListener::bind(at))
        .await
        .unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming().flatten() {
            held.push(c);
        }
    });
    let mut c = cfg("slots-caps", "10.134.0.0/24", 1);
    c.max_connections = 3;
    c.egress_mib_per_sec = 50;
    let prefix = c.prefix.clone();
    let pool = SlotPool::start(c, &[]).await.unwrap();
    let a = pool.acquire(&EgressPolicy::default()).await.unwrap();
    let ns = a.sandbox_ns_path();
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(connect_tcp(&ns, at, Duration::from_secs(2)).await.unwrap());
    }
    assert!(
        connect_tcp(&ns, at, Duration::from_millis(700))
            .await
            .is_err(),
        "a fourth connection got through a cap of 3"
    );
    drop(open);
    pool.release(a).await;
    pool.shutdown().await;
    host::remove_table(&prefix).await.unwrap();
    wait_clean(&prefix).await;
}
