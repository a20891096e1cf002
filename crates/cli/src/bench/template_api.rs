//! What `kiln bench template` drives: an in-process kiln server's Template API and sandboxes
//! over HTTP (as the SDK does), and a loopback docker-registry with a 3-layer image pushed to
//! it through the distribution API (monolithic blob uploads, then the manifest).

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kiln_envd::{EnvdClient, RunOptions};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// The server's API as a client sees it.
pub(crate) struct Api {
    pub addr: SocketAddr,
    pub key: String,
    pub http: reqwest::Client,
}

/// A finished build: request to `ready`, and whether its step ran on a standing build
/// sandbox (its log says so).
pub(crate) struct Built {
    pub took: Duration,
    pub standing: bool,
}

/// A sandbox created through the API.
pub(crate) struct Sbx {
    pub id: String,
    pub envd: EnvdClient,
}

impl Api {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let mut r = self
            .http
            .request(method.clone(), format!("http://{}{path}", self.addr))
            .header("X-API-Key", &self.key);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await.with_context(|| format!("{method} {path}"))?;
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            bail!("{method} {path}: {status}: {text}");
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// Builds template `name` from `base` (a `fromTemplate`) with `steps` (RUN commands) and
    /// an optional start and ready command; returns how long it took, request to `ready`.
    pub async fn build(
        &self,
        name: &str,
        base: &str,
        steps: &[String],
        start: Option<(&str, &str)>,
        force: bool,
    ) -> anyhow::Result<Built> {
        let t = Instant::now();
        let made = self
            .call(
                reqwest::Method::POST,
                "/v3/templates",
                Some(json!({"name": name})),
            )
            .await?;
        let (tid, bid) = (
            made["templateID"].as_str().unwrap_or_default().to_string(),
            made["buildID"].as_str().unwrap_or_default().to_string(),
        );
        let mut spec = json!({
            "fromTemplate": base,
            "force": force,
            "steps": steps.iter().map(|c| json!({"type": "RUN", "args": [c]})).collect::<Vec<_>>(),
        });
        if let Some((s, r)) = start {
            spec["startCmd"] = json!(s);
            spec["readyCmd"] = json!(r);
        }
        self.call(
            reqwest::Method::POST,
            &format!("/v2/templates/{tid}/builds/{bid}"),
            Some(spec),
        )
        .await?;
        let status = |query: &'static str| {
            let path = format!("/templates/{tid}/builds/{bid}/status?{query}");
            async move { self.call(reqwest::Method::GET, &path, None).await }
        };
        loop {
            let st = status("limit=0").await?;
            match st["status"].as_str() {
                Some("ready") => {
                    let took = t.elapsed();
                    let logs = status("level=debug&limit=1000").await?;
                    let standing = logs["logEntries"].as_array().is_some_and(|l| {
                        l.iter().any(|e| {
                            e["message"]
                                .as_str()
                                .is_some_and(|m| m.contains(": standing on "))
                        })
                    });
                    return Ok(Built { took, standing });
                }
                Some("error") => bail!("build of {name} failed: {}", st["reason"]),
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// `Sandbox.create(template)`.
    pub async fn create(&self, template: &str) -> anyhow::Result<Sbx> {
        let v = self
            .call(
                reqwest::Method::POST,
                "/sandboxes",
                Some(json!({"templateID": template, "timeout": 300})),
            )
            .await?;
        let id = v["sandboxID"].as_str().unwrap_or_default().to_string();
        let envd = EnvdClient::tcp(self.addr)
            .with_header("host", self.addr.to_string())
            .with_header("e2b-sandbox-id", id.clone())
            .with_header("e2b-sandbox-port", kiln_proto::envd::ENVD_PORT.to_string())
            .with_access_token(v["envdAccessToken"].as_str().map(str::to_string));
        Ok(Sbx { id, envd })
    }

    pub async fn kill(&self, s: &Sbx) {
        let _ = self
            .call(
                reqwest::Method::DELETE,
                &format!("/sandboxes/{}", s.id),
                None,
            )
            .await;
    }

    /// `DELETE /templates/{name}` (its standing build sandbox stops with it).
    pub async fn delete_template(&self, name: &str) -> anyhow::Result<()> {
        self.call(reqwest::Method::DELETE, &format!("/templates/{name}"), None)
            .await
            .map(|_| ())
    }
}

impl Sbx {
    /// Runs `cmd` (`bash -l -c`) to its end: whether it exited 0.
    pub async fn run(&self, cmd: &str) -> anyhow::Result<bool> {
        let out = self
            .envd
            .run(
                cmd,
                RunOptions {
                    timeout: Some(Duration::from_secs(120)),
                    ..Default::default()
                },
            )
            .await?;
        Ok(out.exit_code == 0)
    }
}

/// A loopback docker-registry with filesystem storage; stopped on drop.
pub(crate) struct Registry {
    child: Child,
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Registry {
    pub fn start(under: &std::path::Path) -> anyhow::Result<Registry> {
        let dir = tempfile::Builder::new().prefix("reg").tempdir_in(under)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = format!("127.0.0.1:{port}");
        let cfg = dir.path().join("config.yml");
        std::fs::write(
            &cfg,
            format!(
                "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
                dir.path().join("data").display()
            ),
        )?;
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting docker-registry (Debian package docker-registry)")?;
        let t = Instant::now();
        while std::net::TcpStream::connect(&addr).is_err() {
            if t.elapsed() > Duration::from_secs(15) {
                bail!("docker-registry did not listen on {addr}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Registry {
            child,
            addr,
            _dir: dir,
        })
    }

    /// Pushes `repo:tag` with `layers` (uncompressed tar media type) and a config naming their
    /// diff ids; returns the layers' digests.
    pub async fn push(
        &self,
        repo: &str,
        tag: &str,
        layers: &[Vec<u8>],
    ) -> anyhow::Result<Vec<String>> {
        let http = reqwest::Client::new();
        let digest = |b: &[u8]| format!("sha256:{}", hex::encode(Sha256::digest(b)));
        let put_blob = |data: Vec<u8>| {
            let (http, d) = (http.clone(), digest(&data));
            let (addr, url) = (
                self.addr.clone(),
                format!("http://{}/v2/{repo}/blobs/uploads/", self.addr),
            );
            async move {
                let r = http.post(url).send().await?;
                let loc = r
                    .headers()
                    .get("location")
                    .and_then(|l| l.to_str().ok())
                    .map(str::to_string)
                    .with_context(|| format!("starting the upload of {d}: {}", r.status()))?;
                let loc = if loc.starts_with("http") {
                    loc
                } else {
                    format!("http://{addr}{loc}")
                };
                let sep = if loc.contains('?') { '&' } else { '?' };
                let r = http
                    .put(format!("{loc}{sep}digest={d}"))
                    .header("content-type", "application/octet-stream")
                    .body(data)
                    .send()
                    .await?;
                if r.status().as_u16() != 201 {
                    bail!("pushing blob {d}: {}", r.status());
                }
                Ok::<_, anyhow::Error>(d)
            }
        };
        let mut digests = Vec::new();
        for l in layers {
            digests.push(put_blob(l.clone()).await?);
        }
        let config = serde_json::to_vec(&json!({
            "architecture": "amd64", "os": "linux", "config": {},
            "rootfs": {"type": "layers", "diff_ids": digests},
        }))?;
        let config_len = config.len();
        let config_digest = put_blob(config).await?;
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest, "size": config_len},
            "layers": digests.iter().zip(layers).map(|(d, l)| json!({
                "mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": l.len()
            })).collect::<Vec<_>>(),
        });
        let r = http
            .put(format!("http://{}/v2/{repo}/manifests/{tag}", self.addr))
            .header("content-type", "application/vnd.oci.image.manifest.v1+json")
            .body(serde_json::to_vec(&manifest)?)
            .send()
            .await?;
        if r.status().as_u16() != 201 {
            bail!("pushing the manifest of {repo}:{tag}: {}", r.status());
        }
        Ok(digests)
    }

    /// The raw baseline of a pull: each blob fetched with plain HTTP GETs, one at a time,
    /// bytes counted and dropped. Returns the bytes fetched.
    pub async fn fetch_raw(&self, repo: &str, digests: &[String]) -> anyhow::Result<u64> {
        let http = reqwest::Client::new();
        let mut n = 0u64;
        for d in digests {
            let mut r = http
                .get(format!("http://{}/v2/{repo}/blobs/{d}", self.addr))
                .send()
                .await?
                .error_for_status()?;
            while let Some(c) = r.chunk().await? {
                n += c.len() as u64;
            }
        }
        Ok(n)
    }
}

/// `n` bytes no compressor shrinks (xorshift), as an image layer's content.
pub(crate) fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}
