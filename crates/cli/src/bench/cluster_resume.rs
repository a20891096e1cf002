//! `kiln bench cluster`'s resume part: two real `kiln node`s sharing an S3-compatible bucket
//! (`--s3-endpoint`, `--s3-bucket`; credentials from `KILN_S3_ACCESS_KEY_ID` /
//! `KILN_S3_SECRET_ACCESS_KEY`) and one `kiln control`. Each sample is one sandbox made through
//! the control with `--resume-mib` MiB of random bytes in its memory (`/dev/shm`): paused
//! (the pause answers once its checkpoint is in the bucket), resumed on its own node (the
//! base: no copy), paused again, then its node drained so that the resume runs on the other
//! node, which fetches the checkpoint's chunks from the bucket. Both resumes are timed from
//! the connect request to the end of the first command after it; the fetch's MiB and MB/s
//! come from the sandbox's `checkpoint` events.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kiln_cluster::EtcdStore;
use kiln_envd::EnvdClient;
use serde_json::{json, Value};

use super::cluster_proc::{envd_via_control, kiln, listen_addr, Live, Proc};
use super::stats::{percentiles, Percentiles};
use crate::drivers::BenchRuntime;

const PREFIX: &str = "/kiln-bench-resume";

#[derive(Debug, Clone)]
pub(crate) struct ResumeReport {
    pub samples: usize,
    pub mib: u64,
    /// Pause through the API, the checkpoint's upload included.
    pub pause: Percentiles,
    pub same_node: Percentiles,
    pub other_node: Percentiles,
    /// Per sample: MiB fetched from the bucket, and its MB/s.
    pub fetched_mib: Vec<f64>,
    pub fetch_mb_s: Vec<f64>,
}

pub(crate) struct ResumeOptions {
    pub template: String,
    pub samples: usize,
    pub mib: u64,
    pub s3_endpoint: String,
    pub s3_bucket: String,
}

/// The two nodes, the control replica and the sandboxes made (killed on every way out).
pub(crate) struct Roles {
    nodes: [Proc; 2],
    control: Proc,
    addr: SocketAddr,
    api_key: String,
    http: reqwest::Client,
    etcd: EtcdStore,
    pub live: Live,
}

/// Starts both nodes (state in `<dir>/resume-a`, `<dir>/resume-b`) and the control.
pub(crate) async fn start(
    etcd: &str,
    dir: &Path,
    runtime: &BenchRuntime,
    secret: &str,
    o: &ResumeOptions,
) -> anyhow::Result<Roles> {
    let mut nodes = Vec::new();
    for name in ["resume-a", "resume-b"] {
        let mut cmd = kiln("node", etcd, PREFIX, secret)?;
        cmd.args(["--name", name, "--no-prepare", "--pool-off"])
            .arg("--state-dir")
            .arg(dir.join(name))
            .args(["--s3-endpoint", &o.s3_endpoint, "--s3-bucket", &o.s3_bucket])
            .args(runtime.serve_flags());
        let mut node = Proc::spawn(name, cmd, dir)?;
        node.wait_for("listening on http://", Duration::from_secs(120))
            .await
            .with_context(|| format!("starting node {name} (does the bucket exist?)"))?;
        nodes.push(node);
    }
    let mut cmd = kiln("control", etcd, PREFIX, secret)?;
    // The drained node's sandbox moves at the connect, not before it by the leader.
    cmd.args(["--replica", "bench-resume", "--no-drain-moves"]);
    let mut control = Proc::spawn("resume-control", cmd, dir)?;
    let line = control
        .wait_for("listening on http://", Duration::from_secs(60))
        .await?;
    let addr = listen_addr(&line)?;
    let api_key = control
        .wait_for("store it now):", Duration::from_secs(10))
        .await?;
    let Ok(nodes) = <[Proc; 2]>::try_from(nodes) else {
        bail!("two nodes were not started");
    };
    Ok(Roles {
        nodes,
        control,
        addr,
        api_key,
        http: reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(300))
            .build()?,
        etcd: EtcdStore::connect(&[etcd.to_string()], PREFIX).await?,
        live: Default::default(),
    })
}

impl Roles {
    /// The logs' tails, for an error message.
    pub fn tail(&self) -> String {
        let mut out = String::new();
        for p in self.nodes.iter().chain([&self.control]) {
            out += &format!("---- {} log (tail) ----\n{}\n", p.name, p.tail());
        }
        out
    }

    /// An E2B API call at the control; the status and the JSON answer (null when none).
    async fn call(&self, method: &str, path: &str, body: Value) -> anyhow::Result<(u16, Value)> {
        let url = format!("http://{}{path}", self.addr);
        let req = match method {
            "POST" if body.is_null() => self.http.post(url),
            "POST" => self.http.post(url).json(&body),
            "DELETE" => self.http.delete(url),
            _ => self.http.get(url),
        };
        let r = req.header("X-API-Key", &self.api_key).send().await?;
        let status = r.status().as_u16();
        let v = r.json().await.unwrap_or(Value::Null);
        Ok((status, v))
    }

    async fn create(&self, template: &str) -> anyhow::Result<(String, String)> {
        let body = json!({"templateID": template, "timeout": 600, "secure": true});
        let (status, v) = self.call("POST", "/sandboxes", body).await?;
        if status != 201 {
            bail!("create through the control: {status} {v}");
        }
        let id = v["sandboxID"].as_str().context("no sandboxID")?.to_string();
        self.live.add(&id);
        Ok((id, v["envdAccessToken"].as_str().unwrap_or("").to_string()))
    }

    async fn pause(&self, id: &str) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let (status, v) = self
            .call("POST", &format!("/sandboxes/{id}/pause"), Value::Null)
            .await?;
        if status != 204 {
            bail!("pausing {id}: {status} {v}");
        }
        Ok(t.elapsed())
    }

    /// Connect → the end of the first command after it.
    async fn resume(&self, id: &str, token: &str) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let (status, v) = self
            .call(
                "POST",
                &format!("/sandboxes/{id}/connect"),
                json!({"timeout": 600}),
            )
            .await?;
        if !(200..300).contains(&status) {
            bail!("resuming {id}: {status} {v}");
        }
        super::served::exec(&self.envd(id, token), "/bin/true", &[]).await?;
        Ok(t.elapsed())
    }

    pub async fn kill(&self, id: &str) -> anyhow::Result<()> {
        let (status, v) = self
            .call("DELETE", &format!("/sandboxes/{id}"), Value::Null)
            .await?;
        self.live.remove(id);
        if status != 204 && status != 404 {
            bail!("killing {id}: {status} {v}");
        }
        Ok(())
    }

    /// Kills every sandbox made and not killed yet (errors are reported, not returned).
    pub async fn kill_all(&self) {
        self.live.kill_all(async |id| self.kill(id).await).await;
    }

    fn envd(&self, id: &str, token: &str) -> EnvdClient {
        envd_via_control(self.addr, id, token)
    }

    async fn owner(&self, id: &str) -> anyhow::Result<String> {
        self.etcd.owner_of(id).await?.context("no owner recorded")
    }

    /// The MiB fetched and the MB/s of the sandbox's latest fetch from the bucket.
    async fn last_fetch(&self, id: &str) -> anyhow::Result<(f64, f64)> {
        let (_, v) = self
            .call(
                "GET",
                &format!("/sandboxes/{id}/events?type=checkpoint&limit=1000"),
                Value::Null,
            )
            .await?;
        let events = v["events"].as_array().cloned().unwrap_or_default();
        events
            .iter()
            .rev()
            .filter_map(|e| e["detail"].as_str())
            .find_map(parse_fetch)
            .context("no `checkpoint fetched` event")
    }
}

/// (MiB fetched, MB/s) of a `checkpoint fetched from object storage: X MiB fetched in N ms
/// (Y MB/s), …` event.
fn parse_fetch(detail: &str) -> Option<(f64, f64)> {
    let rest = detail.strip_prefix("checkpoint fetched from object storage: ")?;
    let mib = rest.split(" MiB fetched").next()?.trim().parse().ok()?;
    let rate = rest
        .split_once('(')?
        .1
        .split(" MB/s")
        .next()?
        .trim()
        .parse()
        .ok()?;
    Some((mib, rate))
}

/// Runs the resume part on started roles.
pub(crate) async fn run(r: &Roles, o: &ResumeOptions) -> anyhow::Result<ResumeReport> {
    let fill = format!("head -c {}M /dev/urandom > /dev/shm/bench-blob", o.mib);
    let (mut pauses, mut same, mut other) = (Vec::new(), Vec::new(), Vec::new());
    let (mut fetched, mut rates) = (Vec::new(), Vec::new());
    eprintln!(
        "resume: {} sandboxes with {} MiB in memory, each resumed on its node and on the other …",
        o.samples, o.mib
    );
    for _ in 0..o.samples {
        let (id, token) = r.create(&o.template).await?;
        super::served::exec(&r.envd(&id, &token), "/bin/sh", &["-c", &fill]).await?;
        pauses.push(r.pause(&id).await?);
        same.push(r.resume(&id, &token).await?);
        pauses.push(r.pause(&id).await?);
        let from = r.owner(&id).await?;
        r.etcd.drain_node(&from).await?;
        // The control's view follows the mark through its watch.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let moved = r.resume(&id, &token).await;
        r.etcd.undrain_node(&from).await?;
        other.push(moved?);
        let to = r.owner(&id).await?;
        if to == from {
            bail!("sandbox {id} resumed on its drained node {from}, not on the other");
        }
        let (mib, rate) = r.last_fetch(&id).await?;
        fetched.push(mib);
        rates.push(rate);
        r.kill(&id).await?;
    }
    Ok(ResumeReport {
        samples: o.samples,
        mib: o.mib,
        pause: percentiles(&pauses),
        same_node: percentiles(&same),
        other_node: percentiles(&other),
        fetched_mib: fetched,
        fetch_mb_s: rates,
    })
}

#[cfg(test)]
mod tests {
    use super::parse_fetch;

    #[test]
    fn a_fetch_event_gives_its_mib_and_rate() {
        let d = "checkpoint fetched from object storage: 41.5 MiB fetched in 388 ms (107.0 MB/s), \
                 2.0 MiB from the chunk cache or repeated chunks";
        assert_eq!(parse_fetch(d), Some((41.5, 107.0)));
        assert_eq!(parse_fetch("checkpoint in object storage: 3 files"), None);
    }
}
