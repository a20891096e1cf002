//! `kiln bench net`: what sandbox networking costs, in one run:
//! - create p50 with networking (a pooled slot, the runtime's own network stack) vs without
//!   (`--network=none`), interleaved;
//! - an HTTP request to a server inside a sandbox through kiln's proxy vs the same request made
//!   directly from the sandbox's router namespace (no proxy), p50 latency and throughput;
//! - an HTTPS GET on a kept-alive connection through `network.rules` interception (kiln's CA,
//!   a header injected from a secret) vs the same GET without a rule (through a plain TCP
//!   relay, as the egress proxy carries it) and straight to the upstream, on loopback
//!   ([`kiln_net::intercept::bench`]);
//! - the same from inside a sandbox to a host of the bench's own test internet, a name with a
//!   rule vs another name of the same host without one ([`super::net_rules`]).
//!
//! The networked side uses its own host range (`--range`) so the bench can run next to a
//! server.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::stats::{percentiles, Percentiles};
use anyhow::{anyhow, bail, Context};
use kiln_server::templates::Templates;

use super::side::{params, side, Net, Side};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(clap::Args)]
pub struct Args {
    /// Template to start sandboxes from.
    #[arg(long, default_value = "base")]
    template: String,
    /// Creates of each kind (with and without networking).
    #[arg(long, default_value_t = 20)]
    n: usize,
    /// HTTP requests of each kind (proxied and direct).
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Size of the file fetched for throughput, MiB.
    #[arg(long, default_value_t = 16)]
    blob_mib: usize,
    /// Pause between create samples, ms (lets the pool rebuild the slot just used, as it
    /// does between real requests; 0 measures creates racing the refill).
    #[arg(long, default_value_t = 500)]
    gap_ms: u64,
    /// Only the loopback interception rows (no sandboxes).
    #[arg(long)]
    https_only: bool,
    #[command(flatten)]
    rt: super::RuntimeArgs,
    /// Host-side range of the bench's network slots.
    #[arg(long, default_value = "10.149.0.0/24")]
    range: String,
}

const PORT: u16 = 8000;

pub fn run(a: Args) -> anyhow::Result<i32> {
    let store = kiln_template::Store::open_default().context("opening the template store")?;
    let templates: Arc<dyn Templates> = Arc::new(store);
    let work_root = a.rt.work_root()?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(bench(a, templates, work_root))
}

async fn timed_create(s: &Side, template: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let rec = s.manager.create(params(template)).await?;
    let took = t.elapsed();
    s.manager.kill(&rec.id, "bench").await?;
    Ok(took)
}

/// `GET path` over HTTP/1.0 on `io`; returns the body length.
async fn get_direct(s: &Side, id: &str, path: &str) -> anyhow::Result<usize> {
    let mut io = s.driver.connect(id, PORT).await?;
    io.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    io.read_to_end(&mut buf).await?;
    let head_end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("no HTTP header in the answer"))?;
    if !buf.starts_with(b"HTTP/1.0 200") {
        bail!(
            "direct request: {}",
            String::from_utf8_lossy(&buf[..head_end])
        );
    }
    Ok(buf.len() - head_end - 4)
}

async fn get_proxied(
    client: &reqwest::Client,
    url: &str,
    id: &str,
    path: &str,
) -> anyhow::Result<usize> {
    let r = client
        .get(format!("{url}{path}"))
        .header("E2b-Sandbox-Id", id)
        .header("E2b-Sandbox-Port", PORT.to_string())
        .send()
        .await?;
    if !r.status().is_success() {
        bail!("proxied request: {}", r.status());
    }
    Ok(r.bytes().await?.len())
}

fn row(name: &str, p: &Percentiles, base: &Percentiles) {
    println!(
        "  {name:<40} n={:<4} p50 {:>8.3} ms   p99 {:>8.3} ms   p50 ratio {:>5.2}x",
        p.n,
        p.p50_ms,
        p.p99_ms,
        p.p50_ms / base.p50_ms
    );
}

async fn bench(a: Args, templates: Arc<dyn Templates>, work_root: PathBuf) -> anyhow::Result<i32> {
    if a.https_only {
        https_rows(&a, &work_root).await?;
        return Ok(0);
    }
    let runtime = a.rt.resolve()?;
    let plain = side(&work_root, "n", &runtime, None, &templates)?;
    let net = Net {
        range: &a.range,
        pool_size: 4,
    };
    let net = side(&work_root, "n", &runtime, Some(net), &templates)?;
    // Warm-up (and let the pool fill).
    timed_create(&plain, &a.template).await?;
    timed_create(&net, &a.template).await?;
    eprintln!("create: {} × with networking, {} × without …", a.n, a.n);
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..a.n {
        without.push(timed_create(&plain, &a.template).await?);
        with.push(timed_create(&net, &a.template).await?);
        tokio::time::sleep(Duration::from_millis(a.gap_ms)).await;
    }

    // A server inside a networked sandbox.
    let rec = net.manager.create(params(&a.template)).await?;
    let id = rec.id.clone();
    let agent = net.manager.agent(&id, None);
    let setup = format!(
        "mkdir -p /tmp/www && head -c 100 /dev/zero > /tmp/www/small && \
         head -c {} /dev/zero > /tmp/www/blob",
        a.blob_mib << 20
    );
    let out = agent
        .run(
            &setup,
            kiln_envd::RunOptions {
                timeout: Some(Duration::from_secs(60)),
                ..Default::default()
            },
        )
        .await?;
    if out.exit_code != 0 {
        bail!("preparing files: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut server = agent
        .start(
            &kiln_envd::bash_request(
                &format!("exec python3 -m http.server {PORT} --directory /tmp/www"),
                Default::default(),
                None,
                None,
            ),
            None,
        )
        .await?;
    tokio::spawn(async move { while let Ok(Some(_)) = server.next_event().await {} });
    let deadline = Instant::now() + Duration::from_secs(30);
    while get_direct(&net, &id, "/small").await.is_err() {
        if Instant::now() > deadline {
            bail!("the in-sandbox server did not come up");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // kiln's API and proxy on a local port.
    let state = Arc::new(kiln_server::api::AppState::new(
        net.manager.clone(),
        kiln_server::api::ApiConfig {
            domain: kiln_server::DEFAULT_DOMAIN.into(),
            metrics_token: None,
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let app = kiln_server::front::router(state);
    tokio::spawn(async move { axum_serve(listener, app).await });
    let client = reqwest::Client::new();

    eprintln!("http: {} × small GET proxied and direct …", a.requests);
    let (mut proxied, mut direct) = (Vec::new(), Vec::new());
    for _ in 0..a.requests {
        let t = Instant::now();
        get_proxied(&client, &url, &id, "/small").await?;
        proxied.push(t.elapsed());
        let t = Instant::now();
        get_direct(&net, &id, "/small").await?;
        direct.push(t.elapsed());
    }
    let tp = |d: Duration| (a.blob_mib as f64) / d.as_secs_f64();
    let (mut tp_proxied, mut tp_direct) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        let n = get_proxied(&client, &url, &id, "/blob").await?;
        tp_proxied.push(tp(t.elapsed()));
        let t = Instant::now();
        let m = get_direct(&net, &id, "/blob").await?;
        tp_direct.push(tp(t.elapsed()));
        if n != a.blob_mib << 20 || m != n {
            bail!("blob sizes: proxied {n}, direct {m}");
        }
    }
    let median = super::stats::median;
    let (tpp, tpd) = (median(&mut tp_proxied), median(&mut tp_direct));
    let _ = net.manager.kill(&id, "bench").await;
    eprintln!(
        "https from a sandbox: {} × small GET with and without a rule …",
        a.requests
    );
    let (in_rule, in_plain) =
        super::net_rules::measure(&net, &a.template, a.requests, &work_root).await?;
    net.driver.shutdown().await;

    let (w, wo) = (percentiles(&with), percentiles(&without));
    println!(
        "kiln bench net ({}, template {}):",
        runtime.label(),
        a.template
    );
    row("create, no network (baseline)", &wo, &wo);
    row("create, with network", &w, &wo);
    println!(
        "  create p50 cost of networking: {:+.1} ms (target: at most +10 ms)",
        w.p50_ms - wo.p50_ms
    );
    let (p, d) = (percentiles(&proxied), percentiles(&direct));
    row("GET 100 B, direct from the namespace", &d, &d);
    row("GET 100 B, through kiln's proxy", &p, &d);
    println!(
        "  GET {} MiB throughput: direct {:.0} MiB/s, proxied {:.0} MiB/s (ratio {:.2}x)",
        a.blob_mib,
        tpd,
        tpp,
        tpp / tpd
    );
    super::net_rules::print_rows(&in_rule, &in_plain);
    https_rows(&a, &work_root).await?;
    Ok(0)
}

/// The loopback interception bench ([`kiln_net::intercept::bench`]) and its rows.
async fn https_rows(a: &Args, work_root: &std::path::Path) -> anyhow::Result<()> {
    eprintln!(
        "https: {} × small GET, keep-alive, direct and intercepted (loopback) …",
        a.requests
    );
    let dir = tempfile::tempdir_in(work_root).context("a directory for the bench's CAs")?;
    let https = kiln_net::intercept::bench::measure(dir.path(), a.requests)
        .await
        .map_err(|e| anyhow!("interception bench: {e}"))?;
    let hd = percentiles(&https.direct);
    let (hr, hi) = (percentiles(&https.relayed), percentiles(&https.intercepted));
    row("HTTPS GET 100 B, keep-alive (loopback)", &hd, &hd);
    row("HTTPS GET, relayed (no rule)", &hr, &hd);
    row("HTTPS GET, network.rules interception", &hi, &hd);
    println!(
        "  interception p50 vs the same request without a rule: {:.2}x (target: at most 1.3x)",
        hi.p50_ms / hr.p50_ms
    );
    Ok(())
}

async fn axum_serve(listener: tokio::net::TcpListener, app: axum::Router) {
    if let Err(e) = axum::serve(listener, app).await {
        eprintln!("bench proxy: {e}");
    }
}
