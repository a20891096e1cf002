//! `kiln bench rich`: the rich templates in one run, with networking on (their services are
//! reached on sandbox ports):
//! - create → first `run_code("1+1")` result (code-interpreter-v1, port 49999) vs create → first
//!   `echo` output of the base template (the raw baseline of a sandbox that runs nothing extra);
//! - a desktop screenshot through the computer-use API (`GET /screenshot` on 49990) vs the
//!   E2B SDK's way (run `scrot`, read the file back through the agent), p50 and bytes; an
//!   action + screenshot round trip (`POST /actions`); create → the XFCE panel on screen;
//!   create → DevTools answering (browser);
//! - a CDP connect (GET /json/version, WebSocket handshake, `Browser.getVersion`) through kiln's
//!   proxy vs the same made directly to the sandbox port (no proxy);
//! - each template's image size and the time its last build took.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::stats::{percentiles, Percentiles};
use anyhow::{anyhow, bail, Context};
use kiln_server::templates::Templates;

use super::side::{params, side, Net, Side};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

#[derive(clap::Args)]
pub struct Args {
    /// Samples of each measurement (creates are the slow ones: about 1-3 s each).
    #[arg(long, default_value_t = 5)]
    n: usize,
    #[command(flatten)]
    rt: super::RuntimeArgs,
    /// Host-side range of the bench's network slots (outside the 10.200-10.254 a server picks from).
    #[arg(long, default_value = "10.150.0.0/24")]
    range: String,
}

const TEMPLATES: [&str; 4] = ["base", "code-interpreter-v1", "desktop", "browser"];

pub fn run(a: Args) -> anyhow::Result<i32> {
    let store = kiln_template::Store::open_default().context("opening the template store")?;
    println!("kiln bench rich: templates (image size, time of the build that made it):");
    for name in TEMPLATES {
        match store.lookup(name) {
            Ok(t) => println!(
                "  {name:<22} {:>7.0} MiB   built in {:>6.1} s   key {}",
                t.size_bytes as f64 / (1 << 20) as f64,
                t.build_secs,
                &t.key[..12.min(t.key.len())]
            ),
            Err(_) => bail!("template {name} is not built: run `kiln template build {name}`"),
        }
    }
    let templates: Arc<dyn Templates> = Arc::new(store);
    let work_root = a.rt.work_root()?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(bench(a, templates, work_root))
}

/// One HTTP/1.0 exchange on `io`; returns (status line, body).
async fn http<IO: AsyncRead + AsyncWrite + Unpin>(
    mut io: IO,
    head: &str,
    body: &[u8],
) -> anyhow::Result<(String, Vec<u8>)> {
    io.write_all(head.as_bytes()).await?;
    io.write_all(body).await?;
    let mut buf = Vec::new();
    io.read_to_end(&mut buf).await?;
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("no HTTP header in the answer"))?;
    let status = String::from_utf8_lossy(&buf[..buf.iter().position(|b| *b == b'\r').unwrap_or(0)])
        .into_owned();
    Ok((status, buf[end + 4..].to_vec()))
}

async fn run_code(s: &Side, id: &str) -> anyhow::Result<bool> {
    let io = match s.driver.connect(id, 49999).await {
        Ok(io) => io,
        Err(_) => return Ok(false),
    };
    let body = br#"{"code": "1+1"}"#;
    let head = format!(
        "POST /execute HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let Ok((status, out)) = http(io, &head, body).await else {
        return Ok(false);
    };
    Ok(status.contains(" 200") && String::from_utf8_lossy(&out).contains(r#""text":"2""#))
}

/// Polls `cond` (an expression that awaits) until it holds, for at most `secs`.
macro_rules! until {
    ($what:expr, $secs:expr, $cond:expr) => {{
        let deadline = Instant::now() + Duration::from_secs($secs);
        loop {
            if $cond {
                break;
            }
            if Instant::now() > deadline {
                bail!("timed out waiting for {}", $what);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }};
}

async fn sh(s: &Side, id: &str, cmd: &str) -> anyhow::Result<Vec<u8>> {
    let out = s
        .manager
        .agent(id, None)
        .run(
            cmd,
            kiln_envd::RunOptions {
                timeout: Some(Duration::from_secs(60)),
                ..Default::default()
            },
        )
        .await?;
    if out.exit_code != 0 {
        bail!("`{cmd}`: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

async fn background(s: &Side, id: &str, cmd: &str) -> anyhow::Result<()> {
    let mut p = s
        .manager
        .agent(id, None)
        .start(
            &kiln_envd::bash_request(cmd, Default::default(), None, None),
            None,
        )
        .await?;
    tokio::spawn(async move { while let Ok(Some(_)) = p.next_event().await {} });
    Ok(())
}

async fn shot(s: &Side, id: &str) -> anyhow::Result<Vec<u8>> {
    let io = s.driver.connect(id, 49990).await?;
    let (st, body) = http(
        io,
        "GET /screenshot HTTP/1.0\r\nHost: localhost\r\n\r\n",
        b"",
    )
    .await?;
    if !st.contains(" 200") {
        bail!("screenshot: {st}");
    }
    Ok(body)
}

/// One `POST /actions` round trip: a mouse move and the screenshot after it.
async fn act(s: &Side, id: &str, x: u32, y: u32) -> anyhow::Result<usize> {
    let io = s.driver.connect(id, 49990).await?;
    let body = format!(
        r#"{{"actions": [{{"action": "mouse_move", "coordinate": [{x}, {y}]}}], "screenshot": true}}"#
    );
    let head = format!(
        "POST /actions HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let (st, out) = http(io, &head, body.as_bytes()).await?;
    if !st.contains(" 200") {
        bail!("actions: {st}");
    }
    Ok(out.len())
}

/// Create → the XFCE panel on screen: the desktop's session started as the SDK starts it
/// (Xvfb, then `startxfce4`). Returns the sandbox id and the time.
async fn desktop_up(s: &Side) -> anyhow::Result<(String, Duration)> {
    let t = Instant::now();
    let d = s.manager.create(params("desktop")).await?;
    background(
        s,
        &d.id,
        "exec Xvfb :0 -ac -screen 0 1024x768x24 -nolisten tcp",
    )
    .await?;
    until!(
        "Xvfb",
        30,
        sh(s, &d.id, "DISPLAY=:0 xdpyinfo >/dev/null").await.is_ok()
    );
    background(s, &d.id, "DISPLAY=:0 exec startxfce4").await?;
    until!(
        "the XFCE panel",
        120,
        sh(
            s,
            &d.id,
            "DISPLAY=:0 xdotool search --onlyvisible --class xfce4-panel >/dev/null"
        )
        .await
        .is_ok()
    );
    Ok((d.id, t.elapsed()))
}

/// GET /json/version through kiln's proxy (`via`: its address and routing headers) or directly
/// to the sandbox port; returns the path of the browser's WebSocket URL.
async fn version(
    s: &Side,
    id: &str,
    via: Option<(std::net::SocketAddr, &str)>,
) -> anyhow::Result<String> {
    let (st, body) = match via {
        Some((addr, route)) => {
            let head = format!("GET /json/version HTTP/1.0\r\nHost: {addr}\r\n{route}\r\n");
            http(tokio::net::TcpStream::connect(addr).await?, &head, b"").await?
        }
        None => {
            let head = "GET /json/version HTTP/1.0\r\nHost: localhost\r\n\r\n";
            http(s.driver.connect(id, 9222).await?, head, b"").await?
        }
    };
    if !st.contains(" 200") {
        bail!("/json/version: {st}");
    }
    let v: serde_json::Value = serde_json::from_slice(&body)?;
    let ws = v["webSocketDebuggerUrl"].as_str().unwrap_or_default();
    let path = ws.find("/devtools/").map(|i| ws[i..].to_string());
    path.ok_or_else(|| anyhow!("no webSocketDebuggerUrl in {v}"))
}

/// The 90th percentile (nearest rank) of `samples`, in milliseconds.
fn p90_ms(samples: &[Duration]) -> f64 {
    let mut v: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n => v[((0.9 * n as f64).ceil() as usize).clamp(1, n) - 1],
    }
}

fn row(name: &str, p: &Percentiles, base: &Percentiles) {
    println!(
        "  {name:<46} n={:<3} p50 {:>8.1} ms   p99 {:>8.1} ms   p50 ratio {:>5.2}x",
        p.n,
        p.p50_ms,
        p.p99_ms,
        p.p50_ms / base.p50_ms
    );
}

/// A WebSocket handshake and one CDP call (`Browser.getVersion`) on `io`.
async fn cdp_call<IO: AsyncRead + AsyncWrite + Unpin>(
    mut io: IO,
    path: &str,
    extra: &str,
) -> anyhow::Result<()> {
    io.write_all(
        format!(
            "GET {path} HTTP/1.1\r\nHost: localhost\r\n{extra}Upgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        .as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = io.read(&mut chunk).await?;
        if n == 0 {
            bail!("WebSocket handshake: connection closed");
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    if !buf.starts_with(b"HTTP/1.1 101") {
        bail!("WebSocket handshake: {}", String::from_utf8_lossy(&buf));
    }
    let msg = br#"{"id":1,"method":"Browser.getVersion"}"#;
    let mask = [1u8, 2, 3, 4];
    let mut frame = vec![0x81, 0x80 | msg.len() as u8];
    frame.extend_from_slice(&mask);
    frame.extend(msg.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    io.write_all(&frame).await?;
    let mut got = buf[buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(0) + 4..].to_vec();
    while !String::from_utf8_lossy(&got).contains("\"id\":1") {
        let n = io.read(&mut chunk).await?;
        if n == 0 {
            bail!("CDP: connection closed before the answer");
        }
        got.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}

async fn bench(a: Args, templates: Arc<dyn Templates>, work_root: PathBuf) -> anyhow::Result<i32> {
    let runtime = a.rt.resolve()?;
    let net = Net {
        range: &a.range,
        pool_size: 2,
    };
    let s = side(&work_root, "r", &runtime, Some(net), &templates)?;

    // Create → first result.
    let (mut echo, mut code) = (Vec::new(), Vec::new());
    for i in 0..=a.n {
        let t = Instant::now();
        let rec = s.manager.create(params("base")).await?;
        sh(&s, &rec.id, "echo ready").await?;
        let took = t.elapsed();
        s.manager.kill(&rec.id, "bench").await?;
        let t = Instant::now();
        let ci = s.manager.create(params("code-interpreter-v1")).await?;
        until!("run_code(\"1+1\")", 120, run_code(&s, &ci.id).await?);
        let took_ci = t.elapsed();
        s.manager.kill(&ci.id, "bench").await?;
        if i > 0 {
            // The first round warms caches.
            echo.push(took);
            code.push(took_ci);
        }
    }

    // Create → panel on screen (the last desktop stays for the screenshots).
    let mut panel = Vec::new();
    let mut d = String::new();
    for i in 0..a.n.clamp(1, 3) {
        let (id, took) = desktop_up(&s).await?;
        panel.push(took);
        if i + 1 < a.n.clamp(1, 3) {
            s.manager.kill(&id, "bench").await?;
        } else {
            d = id;
        }
    }
    until!("the computer-use API", 60, shot(&s, &d).await.is_ok());
    let (mut api, mut sdk, mut acts, mut bytes) = (Vec::new(), Vec::new(), Vec::new(), 0usize);
    for i in 0..a.n.max(5) * 4 {
        let t = Instant::now();
        act(&s, &d, 200 + (i as u32 % 50) * 4, 300).await?;
        acts.push(t.elapsed());
        let t = Instant::now();
        bytes = shot(&s, &d).await?.len();
        api.push(t.elapsed());
        let t = Instant::now();
        let out = sh(
            &s,
            &d,
            "DISPLAY=:0 scrot --pointer -o /tmp/b.png && cat /tmp/b.png && rm /tmp/b.png",
        )
        .await?;
        sdk.push(t.elapsed());
        if out.len() < 100 {
            bail!("scrot produced {} bytes", out.len());
        }
    }
    s.manager.kill(&d, "bench").await?;

    // Create → DevTools answering (the last browser stays for the CDP rows).
    let mut cdp_up = Vec::new();
    let mut b = None;
    for i in 0..a.n.clamp(1, 3) {
        let t = Instant::now();
        let rec = s.manager.create(params("browser")).await?;
        until!("DevTools", 60, version(&s, &rec.id, None).await.is_ok());
        cdp_up.push(t.elapsed());
        if i + 1 < a.n.clamp(1, 3) {
            s.manager.kill(&rec.id, "bench").await?;
        } else {
            b = Some(rec);
        }
    }
    let b = b.ok_or_else(|| anyhow!("no browser sandbox"))?;

    // CDP connect, through kiln's proxy and direct.
    let state = Arc::new(kiln_server::api::AppState::new(
        s.manager.clone(),
        kiln_server::api::ApiConfig {
            domain: kiln_server::DEFAULT_DOMAIN.into(),
            metrics_token: None,
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let proxy_addr = listener.local_addr()?;
    let app = kiln_server::front::router(state);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let route = format!("E2b-Sandbox-Id: {}\r\nE2b-Sandbox-Port: 9222\r\n", b.id);
    until!("DevTools", 60, version(&s, &b.id, None).await.is_ok());
    let (mut via, mut direct) = (Vec::new(), Vec::new());
    for _ in 0..a.n.max(5) * 2 {
        let t = Instant::now();
        let p = version(&s, &b.id, Some((proxy_addr, &route))).await?;
        cdp_call(
            tokio::net::TcpStream::connect(proxy_addr).await?,
            &p,
            &route,
        )
        .await?;
        via.push(t.elapsed());
        let t = Instant::now();
        let p = version(&s, &b.id, None).await?;
        cdp_call(s.driver.connect(&b.id, 9222).await?, &p, "").await?;
        direct.push(t.elapsed());
    }
    s.manager.kill(&b.id, "bench").await?;
    s.driver.shutdown().await;

    println!("kiln bench rich ({}, networking on):", runtime.label());
    let (e, c) = (percentiles(&echo), percentiles(&code));
    row("create → first echo, base (baseline)", &e, &e);
    row("create → first run_code(\"1+1\") result", &c, &e);
    row(
        "create → XFCE panel on screen (desktop)",
        &percentiles(&panel),
        &e,
    );
    row(
        "create → DevTools answering (browser)",
        &percentiles(&cdp_up),
        &e,
    );
    let (sd, ap) = (percentiles(&sdk), percentiles(&api));
    row("screenshot 1024x768, scrot + read via agent", &sd, &sd);
    row("screenshot 1024x768, GET /screenshot (49990)", &ap, &sd);
    row(
        "mouse move + screenshot, POST /actions",
        &percentiles(&acts),
        &sd,
    );
    println!(
        "  mouse move + screenshot, POST /actions: p90 {:.1} ms (target: p50 ≤ 150 ms at 1024x768)",
        p90_ms(&acts)
    );
    println!("  screenshot PNG size: {bytes} bytes");
    let (di, vi) = (percentiles(&direct), percentiles(&via));
    row("CDP connect + Browser.getVersion, direct", &di, &di);
    row("CDP connect + Browser.getVersion, via proxy", &vi, &di);
    Ok(0)
}
