//! `kiln bench agent`: exec round trip and file transfer throughput against a kiln-agent on
//! loopback, plus its idle RSS, each next to a raw baseline measured in the same run.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::BodyExt;

use kiln_envd::EnvdClient;
use kiln_proto::process as pb;

/// Benchmark settings.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// kiln-agent binary to start.
    pub agent_bin: PathBuf,
    /// Exec round trips to time.
    pub iterations: usize,
    /// Transfer size in MiB.
    pub size_mib: usize,
}

/// Results (all durations in milliseconds, throughputs in MB/s = 10^6 bytes/s).
#[derive(Debug, Clone)]
pub struct BenchReport {
    pub exec_p50_ms: f64,
    pub exec_p99_ms: f64,
    pub raw_exec_p50_ms: f64,
    pub raw_exec_p99_ms: f64,
    pub upload_mbps: f64,
    pub download_mbps: f64,
    pub raw_tcp_mbps: f64,
    pub idle_rss_kib: u64,
    pub idle_rss_after_kib: u64,
}

struct Guard(Child);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Raw loopback TCP copy of `bytes` (MB/s).
fn raw_tcp(bytes: usize) -> anyhow::Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut s, _) = l.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0;
        loop {
            let r = s.read(&mut buf)?;
            if r == 0 {
                return Ok(n);
            }
            n += r;
        }
    });
    let chunk = vec![7u8; 1 << 20];
    let start = Instant::now();
    let mut s = TcpStream::connect(addr)?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len());
        s.write_all(&chunk[..n])?;
        left -= n;
    }
    drop(s);
    let got = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader thread panicked"))??;
    anyhow::ensure!(got == bytes, "raw TCP copy lost data ({got} of {bytes})");
    Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e6)
}

/// Run the benchmark.
pub fn run(opts: &BenchOptions) -> anyhow::Result<BenchReport> {
    let dir = std::env::temp_dir().join(format!("kiln-bench-agent-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = Command::new(&opts.agent_bin)
        .args(["--port", &port.to_string()])
        .env("KILN_AGENT_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| {
            format!(
                "start {} (build it or pass --agent-bin)",
                opts.agent_bin.display()
            )
        })?;
    let agent = Guard(child);
    let pid = agent.0.id();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let client = EnvdClient::tcp(addr);
    let result = rt.block_on(async {
        client
            .wait_ready(Duration::from_secs(10))
            .await
            .context("agent did not become ready")?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let idle_rss_kib = rss_kib(pid);

        // exec round trip: Start /bin/true and read to the end event
        let req = pb::StartRequest {
            process: Some(pb::ProcessConfig {
                cmd: "/bin/true".into(),
                ..Default::default()
            }),
            stdin: Some(false),
            ..Default::default()
        };
        let mut agent_times = Vec::with_capacity(opts.iterations);
        for i in 0..opts.iterations + 10 {
            let t = Instant::now();
            let mut st = client
                .server_stream("/process.Process/Start", &req, None, None, None)
                .await?;
            while st.next_message().await?.is_some() {}
            if i >= 10 {
                agent_times.push(t.elapsed().as_secs_f64() * 1000.0);
            }
        }
        let mut raw_times = Vec::with_capacity(opts.iterations);
        for i in 0..opts.iterations + 10 {
            let t = Instant::now();
            let st = Command::new("/bin/true").status()?;
            anyhow::ensure!(st.success(), "/bin/true failed");
            if i >= 10 {
                raw_times.push(t.elapsed().as_secs_f64() * 1000.0);
            }
        }
        agent_times.sort_by(f64::total_cmp);
        raw_times.sort_by(f64::total_cmp);

        // upload: stream size_mib chunks of 1 MiB (not held in memory as a whole)
        let bytes = opts.size_mib << 20;
        let path = dir.join("bench.bin");
        let chunk = Bytes::from(vec![0x5au8; 1 << 20]);
        let n = opts.size_mib;
        let stream = futures::stream::iter(
            (0..n).map(move |_| Ok::<_, std::io::Error>(hyper::body::Frame::data(chunk.clone()))),
        );
        let body = http_body_util::StreamBody::new(stream);
        let t = Instant::now();
        client
            .write_file_body(path.to_str().unwrap_or_default(), body, None)
            .await?;
        let upload_mbps = bytes as f64 / t.elapsed().as_secs_f64() / 1e6;

        let t = Instant::now();
        let mut body = client
            .read_file_stream(path.to_str().unwrap_or_default(), None)
            .await?;
        let mut got = 0usize;
        while let Some(f) = body.frame().await {
            if let Ok(d) = f?.into_data() {
                got += d.len();
            }
        }
        let download_mbps = bytes as f64 / t.elapsed().as_secs_f64() / 1e6;
        anyhow::ensure!(got == bytes, "download returned {got} of {bytes} bytes");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let idle_rss_after_kib = rss_kib(pid);
        let raw_tcp_mbps = raw_tcp(bytes)?;
        Ok(BenchReport {
            exec_p50_ms: percentile(&agent_times, 0.5),
            exec_p99_ms: percentile(&agent_times, 0.99),
            raw_exec_p50_ms: percentile(&raw_times, 0.5),
            raw_exec_p99_ms: percentile(&raw_times, 0.99),
            upload_mbps,
            download_mbps,
            raw_tcp_mbps,
            idle_rss_kib,
            idle_rss_after_kib,
        })
    });
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

impl BenchReport {
    /// Human-readable report with ratios and target checks.
    pub fn render(&self) -> String {
        let ok = |b: bool| if b { "ok" } else { "MISSED" };
        format!(
            "kiln-agent benchmark (loopback)\n\
             exec /bin/true round trip: p50 {:.3} ms  p99 {:.3} ms   (raw fork+exec p50 {:.3} ms p99 {:.3} ms; ratio p50 {:.2}x)  target p50 <= 2 ms: {}\n\
             upload:   {:.0} MB/s   (raw loopback TCP {:.0} MB/s; ratio {:.2})  target >= 500 MB/s: {}\n\
             download: {:.0} MB/s   (raw loopback TCP {:.0} MB/s; ratio {:.2})  target >= 500 MB/s: {}\n\
             agent RSS idle: {:.1} MiB at start, {:.1} MiB after the run  target <= 15 MiB: {}\n",
            self.exec_p50_ms,
            self.exec_p99_ms,
            self.raw_exec_p50_ms,
            self.raw_exec_p99_ms,
            self.exec_p50_ms / self.raw_exec_p50_ms.max(1e-9),
            ok(self.exec_p50_ms <= 2.0),
            self.upload_mbps,
            self.raw_tcp_mbps,
            self.upload_mbps / self.raw_tcp_mbps.max(1e-9),
            ok(self.upload_mbps >= 500.0),
            self.download_mbps,
            self.raw_tcp_mbps,
            self.download_mbps / self.raw_tcp_mbps.max(1e-9),
            ok(self.download_mbps >= 500.0),
            self.idle_rss_kib as f64 / 1024.0,
            self.idle_rss_after_kib as f64 / 1024.0,
            ok(self.idle_rss_kib.max(self.idle_rss_after_kib) <= 15 * 1024),
        )
    }

    /// Whether every target was met.
    pub fn targets_met(&self) -> bool {
        self.exec_p50_ms <= 2.0
            && self.upload_mbps >= 500.0
            && self.download_mbps >= 500.0
            && self.idle_rss_kib.max(self.idle_rss_after_kib) <= 15 * 1024
    }
}
