//! The audited egress part of `kiln bench audit`: TCP from a sandbox to a test host, with the
//! audit log off (the sandbox's connections go out through NAT only) vs on (every connection
//! passes kiln's egress proxy, which splices it with `splice(2)`), and on with the proxy's copy
//! loop instead of splice (what splice saves). The test host lives in its own namespace behind
//! a host veth on 198.51.100.240/29 (nothing leaves this machine); a `python3` client in each
//! sandbox measures connect + 1-byte exchange + close latency, one bulk download, and a UDP
//! round trip from a new socket each time (a new flow: with audit on, the flow log records
//! each). Rounds interleave the three modes (ABC ABC …) so machine noise hits them alike.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use super::served::Side;
use super::stats::median;

const NS: &str = "kbaudit";
const HOST_SIDE: &str = "198.51.100.241/29";
const TEST_HOST: &str = "198.51.100.242";
const ECHO_PORT: u16 = 9000;
const BULK_PORT: u16 = 9001;
const UDP_PORT: u16 = 9002;

/// The in-sandbox client: `n` connect + 1-byte exchange + close, one download of `size`
/// bytes, then `n` UDP round trips each from a new socket; prints `p50_ms mb_per_s bytes
/// udp_p50_ms`.
const CLIENT: &str = r#"
import socket, sys, time
h, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
lat = []
for _ in range(n):
    t = time.perf_counter()
    s = socket.create_connection((h, 9000))
    s.sendall(b"x")
    assert s.recv(1) == b"x"
    s.close()
    lat.append(time.perf_counter() - t)
lat.sort()
s = socket.create_connection((h, 9001))
s.sendall(b"%d\n" % size)
buf = memoryview(bytearray(1 << 20))
got, t = 0, time.perf_counter()
while True:
    k = s.recv_into(buf)
    if not k:
        break
    got += k
d = time.perf_counter() - t
udp = []
for _ in range(n):
    t = time.perf_counter()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(5)
    u.sendto(b"x", (h, 9002))
    assert u.recv(1) == b"x"
    u.close()
    udp.append(time.perf_counter() - t)
udp.sort()
print("%.4f %.1f %d %.4f" % (lat[n // 2] * 1e3, got / d / 1e6, got, udp[n // 2] * 1e3))
"#;

/// The test host: a namespace with a TCP echo (one byte) and a bulk sender; removed on drop.
pub(crate) struct TestHost;

/// Runs `ip ARGS`, failing with its stderr.
pub(crate) fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl TestHost {
    pub(crate) async fn up() -> anyhow::Result<Self> {
        Self::down();
        let me = TestHost;
        ip(&["netns", "add", NS])?;
        let peer = [
            "link", "add", "kbaudit0", "type", "veth", "peer", "name", "eth0",
        ];
        ip(&[&peer[..], &["netns", NS]].concat())?;
        ip(&["addr", "add", HOST_SIDE, "dev", "kbaudit0"])?;
        ip(&["link", "set", "kbaudit0", "up"])?;
        ip(&[
            "-n",
            NS,
            "addr",
            "add",
            &format!("{TEST_HOST}/29"),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", NS, "link", "set", "eth0", "up"])?;
        ip(&["-n", NS, "link", "set", "lo", "up"])?;
        let gw = HOST_SIDE.split('/').next().unwrap_or_default();
        ip(&["-n", NS, "route", "add", "default", "via", gw])?;
        let ns = PathBuf::from("/run/netns").join(NS);
        let at: SocketAddr = format!("{TEST_HOST}:{UDP_PORT}").parse()?;
        let u = kiln_net::netns::in_netns(&ns, move || {
            let u = std::net::UdpSocket::bind(at)?;
            u.set_nonblocking(true)?;
            Ok(u)
        })
        .await?;
        let u = tokio::net::UdpSocket::from_std(u)?;
        tokio::spawn(async move {
            let mut b = [0u8; 64];
            while let Ok((n, from)) = u.recv_from(&mut b).await {
                let _ = u.send_to(&b[..n], from).await;
            }
        });
        for port in [ECHO_PORT, BULK_PORT] {
            let at: SocketAddr = format!("{TEST_HOST}:{port}").parse()?;
            let l = kiln_net::netns::in_netns(&ns, move || {
                let l = std::net::TcpListener::bind(at)?;
                l.set_nonblocking(true)?;
                Ok(l)
            })
            .await?;
            let l = tokio::net::TcpListener::from_std(l)?;
            tokio::spawn(async move {
                while let Ok((s, _)) = l.accept().await {
                    tokio::spawn(async move {
                        let _ = if port == ECHO_PORT {
                            echo(s).await
                        } else {
                            bulk(s).await
                        };
                    });
                }
            });
        }
        Ok(me)
    }

    fn down() {
        let _ = Command::new("ip").args(["netns", "del", NS]).output();
        let _ = Command::new("ip")
            .args(["link", "del", "kbaudit0"])
            .output();
    }
}

impl Drop for TestHost {
    fn drop(&mut self) {
        Self::down();
    }
}

async fn echo(mut s: tokio::net::TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await?;
    s.write_all(&b).await
}

async fn bulk(s: tokio::net::TcpStream) -> std::io::Result<()> {
    let mut s = BufReader::new(s);
    let mut line = String::new();
    s.read_line(&mut line).await?;
    let mut left: u64 = line.trim().parse().unwrap_or(0);
    let chunk = vec![0u8; 1 << 20];
    while left > 0 {
        let k = left.min(chunk.len() as u64) as usize;
        s.get_mut().write_all(&chunk[..k]).await?;
        left -= k as u64;
    }
    s.get_mut().shutdown().await
}

/// One run of the client in `side`'s sandbox: (connect p50 ms, MB/s, UDP new-flow p50 ms).
async fn client(side: &Side, n: usize, size: u64) -> anyhow::Result<(f64, f64, f64)> {
    let agent = side
        .manager
        .agent(&side.sandbox.id, side.sandbox.envd_token.clone());
    let cmd = format!("python3 -c '{CLIENT}' {TEST_HOST} {n} {size}");
    let out = agent
        .run(
            &cmd,
            kiln_envd::RunOptions {
                timeout: Some(Duration::from_secs(120)),
                ..Default::default()
            },
        )
        .await?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<f64> = text
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    if out.exit_code != 0 || v.len() != 4 || v[2] as u64 != size {
        bail!(
            "egress client in the audit-{} sandbox: exit {}: {} {}",
            side.name,
            out.exit_code,
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok((v[0], v[1], v[3]))
}

/// Measures and prints the egress rows. `sides[0]` is the audit-on side, `sides[1]` off.
pub(crate) async fn measure(
    sides: &[Side],
    rounds: usize,
    connects: usize,
    mib: usize,
) -> anyhow::Result<()> {
    let _host = TestHost::up().await.context("setting up the test host")?;
    let size = (mib as u64) << 20;
    // Modes: audited with splice, audited with the copy loop, not audited.
    let modes: [(&str, usize, bool); 3] = [
        ("on, splice", 0, true),
        ("on, copy loop", 0, false),
        ("off (no proxy)", 1, true),
    ];
    for &(_, k, splice) in &modes {
        kiln_net::relay::set_splice(splice);
        client(&sides[k], 5, 1 << 20).await?;
    }
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut mbs: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut udp: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for i in 0..rounds {
        for j in 0..modes.len() {
            let m = (i + j) % modes.len();
            let (_, k, splice) = modes[m];
            kiln_net::relay::set_splice(splice);
            let (l, t, u) = client(&sides[k], connects, size).await?;
            lat[m].push(l);
            mbs[m].push(t);
            udp[m].push(u);
        }
    }
    kiln_net::relay::set_splice(true);
    // Per-round ratios against the unaudited mode of the same round.
    let ratio = |a: &[f64], b: &[f64]| -> f64 {
        let mut r: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
        median(&mut r)
    };
    println!(
        "  egress to a test host ({rounds} rounds of {connects} connects, one {mib} MiB \
         download and {connects} new UDP flows per mode, interleaved; medians of the rounds; \
         the copy-loop mode differs from splice only in TCP):"
    );
    println!(
        "  {:<22} {:>12} {:>10} {:>10} {:>10} {:>14} {:>10}",
        "", "connect p50", "vs off", "MB/s", "vs off", "UDP flow p50", "vs off"
    );
    for (m, (name, _, _)) in modes.iter().enumerate() {
        println!(
            "  {:<22} {:>9.2} ms {:>9.2}x {:>10.0} {:>9.2}x {:>11.2} ms {:>9.2}x",
            name,
            median(&mut lat[m].clone()),
            ratio(&lat[m], &lat[2]),
            median(&mut mbs[m].clone()),
            ratio(&mbs[m], &mbs[2]),
            median(&mut udp[m].clone()),
            ratio(&udp[m], &udp[2]),
        );
    }
    Ok(())
}
