//! Client of kiln's REST API and of the envd API behind its proxy (used by `kiln sandbox` and
//! `kiln bench create`). Sandbox traffic goes to the same URL with the `E2b-Sandbox-Id` header.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use bytes::{Buf, BytesMut};
use futures::StreamExt;
use serde_json::{json, Value};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("request to {url} failed: {source}")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{status}: {message}")]
    Api { status: u16, message: String },
    #[error("bad answer from the server: {0}")]
    Protocol(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// A sandbox as returned by create/connect.
#[derive(Debug, Clone)]
pub struct SandboxRef {
    pub id: String,
    pub envd_token: Option<String>,
}

/// Options of [`Client::exec`].
#[derive(Debug, Clone, Default)]
pub struct ExecOptions {
    pub user: Option<String>,
    pub cwd: Option<String>,
    pub envs: BTreeMap<String, String>,
    /// Run in a PTY of this size (cols, rows).
    pub pty: Option<(u16, u16)>,
}

/// Output of a process, as it streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Started { pid: u32 },
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Pty(Vec<u8>),
    Exited { code: i32, error: Option<String> },
}

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
}

fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

fn unb64(v: &Value) -> Vec<u8> {
    v.as_str()
        .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
        .unwrap_or_default()
}

fn urlencode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Connect envelope: flags, big-endian length, message.
fn envelope(flags: u8, msg: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(5 + msg.len());
    v.push(flags);
    v.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    v.extend_from_slice(msg);
    v
}

impl Client {
    pub fn new(base: &str, api_key: Option<String>) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|source| ClientError::Http {
                url: base.to_string(),
                source,
            })?;
        Ok(Self {
            http,
            base: base.trim_end_matches('/').to_string(),
            api_key,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn api(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Result<Value> {
        let url = self.url(path);
        let mut req = self.http.request(method, &url);
        if let Some(k) = &self.api_key {
            req = req.header("X-API-Key", k);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.map_err(|source| ClientError::Http {
            url: url.clone(),
            source,
        })?;
        let status = resp.status().as_u16();
        let text = resp
            .text()
            .await
            .map_err(|source| ClientError::Http { url, source })?;
        let v: Value = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        if status >= 300 {
            let message = v["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string());
            return Err(ClientError::Api { status, message });
        }
        Ok(v)
    }

    pub async fn create(
        &self,
        template: &str,
        timeout_secs: Option<u64>,
        metadata: &BTreeMap<String, String>,
        envs: &BTreeMap<String, String>,
    ) -> Result<SandboxRef> {
        let mut body = json!({"templateID": template, "metadata": metadata, "envVars": envs});
        if let Some(t) = timeout_secs {
            body["timeout"] = json!(t);
        }
        let v = self
            .api(reqwest::Method::POST, "/sandboxes", Some(body))
            .await?;
        Self::sandbox_ref(&v)
    }

    fn sandbox_ref(v: &Value) -> Result<SandboxRef> {
        Ok(SandboxRef {
            id: v["sandboxID"]
                .as_str()
                .ok_or_else(|| ClientError::Protocol(format!("no sandboxID in {v}")))?
                .to_string(),
            envd_token: v["envdAccessToken"].as_str().map(str::to_string),
        })
    }

    /// Connects to a running sandbox (extending its life to at least `timeout_secs`).
    pub async fn connect(&self, id: &str, timeout_secs: Option<u64>) -> Result<SandboxRef> {
        let body = timeout_secs
            .map(|t| json!({"timeout": t}))
            .unwrap_or(json!({}));
        let v = self
            .api(
                reqwest::Method::POST,
                &format!("/sandboxes/{}/connect", urlencode(id)),
                Some(body),
            )
            .await?;
        Self::sandbox_ref(&v)
    }

    pub async fn list(&self) -> Result<Vec<Value>> {
        match self.api(reqwest::Method::GET, "/sandboxes", None).await? {
            Value::Array(v) => Ok(v),
            other => Err(ClientError::Protocol(format!(
                "expected a list, got {other}"
            ))),
        }
    }

    /// A running sandbox's details (includes its envd access token).
    pub async fn info(&self, id: &str) -> Result<Value> {
        self.api(
            reqwest::Method::GET,
            &format!("/sandboxes/{}", urlencode(id)),
            None,
        )
        .await
    }

    /// A handle for envd calls to a running sandbox.
    pub async fn sandbox(&self, id: &str) -> Result<SandboxRef> {
        let v = self.info(id).await?;
        Self::sandbox_ref(&v)
    }

    pub async fn kill(&self, id: &str) -> Result<()> {
        self.api(
            reqwest::Method::DELETE,
            &format!("/sandboxes/{}", urlencode(id)),
            None,
        )
        .await
        .map(|_| ())
    }

    fn envd(
        &self,
        sbx: &SandboxRef,
        method: reqwest::Method,
        path: &str,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .request(method, self.url(path))
            .header("E2b-Sandbox-Id", &sbx.id)
            .header("E2b-Sandbox-Port", kiln_proto::envd::ENVD_PORT.to_string());
        if let Some(t) = &sbx.envd_token {
            req = req.header("X-Access-Token", t);
        }
        req
    }

    async fn envd_check(resp: reqwest::Response, url: &str) -> Result<reqwest::Response> {
        let status = resp.status().as_u16();
        if status >= 300 {
            let text = resp.text().await.map_err(|source| ClientError::Http {
                url: url.to_string(),
                source,
            })?;
            let message = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v["message"].as_str().map(str::to_string))
                .unwrap_or(text);
            return Err(ClientError::Api { status, message });
        }
        Ok(resp)
    }

    /// Starts `cmd` (through `/bin/bash -l -c`) and calls `on_event` for each event until it
    /// exits; returns the exit code.
    pub async fn exec(
        &self,
        sbx: &SandboxRef,
        cmd: &str,
        opts: &ExecOptions,
        mut on_event: impl FnMut(ExecEvent),
    ) -> Result<i32> {
        let mut process = json!({
            "cmd": "/bin/bash",
            "args": ["-l", "-c", cmd],
            "envs": opts.envs,
        });
        if let Some(cwd) = &opts.cwd {
            process["cwd"] = json!(cwd);
        }
        let mut msg = json!({"process": process});
        if let Some((cols, rows)) = opts.pty {
            msg["pty"] = json!({"size": {"cols": cols, "rows": rows}});
        }
        let body = envelope(0, msg.to_string().as_bytes());
        let mut req = self
            .envd(sbx, reqwest::Method::POST, "/process.Process/Start")
            .header("Content-Type", "application/connect+json")
            .header("Connect-Protocol-Version", "1")
            .body(body);
        if let Some(u) = &opts.user {
            req = req.header(
                "Authorization",
                format!("Basic {}", b64(format!("{u}:").as_bytes())),
            );
        }
        let url = self.url("/process.Process/Start");
        let resp = req.send().await.map_err(|source| ClientError::Http {
            url: url.clone(),
            source,
        })?;
        let resp = Self::envd_check(resp, &url).await?;
        let mut stream = resp.bytes_stream();
        let mut buf = BytesMut::new();
        let mut code: Option<i32> = None;
        loop {
            while buf.len() >= 5 {
                let flags = buf[0];
                let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                if buf.len() < 5 + len {
                    break;
                }
                buf.advance(5);
                let frame = buf.split_to(len);
                let v: Value = serde_json::from_slice(&frame)
                    .map_err(|e| ClientError::Protocol(format!("bad stream message: {e}")))?;
                if flags & kiln_proto::connect::FLAG_END_STREAM != 0 {
                    if let Some(err) = v.get("error") {
                        if code.is_none() {
                            return Err(ClientError::Api {
                                status: 500,
                                message: format!(
                                    "{}: {}",
                                    err["code"].as_str().unwrap_or("unknown"),
                                    err["message"].as_str().unwrap_or("")
                                ),
                            });
                        }
                    }
                    return code.ok_or_else(|| {
                        ClientError::Protocol("stream ended without an exit event".into())
                    });
                }
                let ev = &v["event"];
                if let Some(s) = ev.get("start") {
                    on_event(ExecEvent::Started {
                        pid: s["pid"].as_u64().unwrap_or(0) as u32,
                    });
                } else if let Some(d) = ev.get("data") {
                    if d.get("stdout").is_some() {
                        on_event(ExecEvent::Stdout(unb64(&d["stdout"])));
                    } else if d.get("stderr").is_some() {
                        on_event(ExecEvent::Stderr(unb64(&d["stderr"])));
                    } else if d.get("pty").is_some() {
                        on_event(ExecEvent::Pty(unb64(&d["pty"])));
                    }
                } else if let Some(e) = ev.get("end") {
                    // proto3 JSON omits zero values: a missing exitCode is 0.
                    let c = e["exitCode"].as_i64().unwrap_or(0) as i32;
                    code = Some(c);
                    on_event(ExecEvent::Exited {
                        code: c,
                        error: e["error"].as_str().map(str::to_string),
                    });
                }
            }
            match stream.next().await {
                Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                Some(Err(source)) => return Err(ClientError::Http { url, source }),
                None => {
                    return code.ok_or_else(|| {
                        ClientError::Protocol("stream ended without an exit event".into())
                    })
                }
            }
        }
    }

    async fn unary(&self, sbx: &SandboxRef, method: &str, msg: Value) -> Result<Value> {
        let path = format!("/process.Process/{method}");
        let url = self.url(&path);
        let resp = self
            .envd(sbx, reqwest::Method::POST, &path)
            .header("Content-Type", "application/json")
            .header("Connect-Protocol-Version", "1")
            .body(msg.to_string())
            .send()
            .await
            .map_err(|source| ClientError::Http {
                url: url.clone(),
                source,
            })?;
        let resp = Self::envd_check(resp, &url).await?;
        resp.json()
            .await
            .map_err(|source| ClientError::Http { url, source })
    }

    /// Sends bytes to a PTY process.
    pub async fn send_pty_input(&self, sbx: &SandboxRef, pid: u32, data: &[u8]) -> Result<()> {
        self.unary(
            sbx,
            "SendInput",
            json!({"process": {"pid": pid}, "input": {"pty": b64(data)}}),
        )
        .await
        .map(|_| ())
    }

    pub async fn resize_pty(&self, sbx: &SandboxRef, pid: u32, cols: u16, rows: u16) -> Result<()> {
        self.unary(
            sbx,
            "Update",
            json!({"process": {"pid": pid}, "pty": {"size": {"cols": cols, "rows": rows}}}),
        )
        .await
        .map(|_| ())
    }

    /// Writes a file in the sandbox (octet-stream upload).
    pub async fn upload(
        &self,
        sbx: &SandboxRef,
        path: &str,
        data: Vec<u8>,
        user: Option<&str>,
    ) -> Result<()> {
        let mut p = format!("/files?path={}", urlencode(path));
        if let Some(u) = user {
            p.push_str(&format!("&username={}", urlencode(u)));
        }
        let url = self.url(&p);
        let resp = self
            .envd(sbx, reqwest::Method::POST, &p)
            .header("Content-Type", "application/octet-stream")
            .body(data)
            .send()
            .await
            .map_err(|source| ClientError::Http {
                url: url.clone(),
                source,
            })?;
        Self::envd_check(resp, &url).await.map(|_| ())
    }

    /// Reads a file from the sandbox.
    pub async fn download(
        &self,
        sbx: &SandboxRef,
        path: &str,
        user: Option<&str>,
    ) -> Result<Vec<u8>> {
        let mut p = format!("/files?path={}", urlencode(path));
        if let Some(u) = user {
            p.push_str(&format!("&username={}", urlencode(u)));
        }
        let url = self.url(&p);
        let resp = self
            .envd(sbx, reqwest::Method::GET, &p)
            .send()
            .await
            .map_err(|source| ClientError::Http {
                url: url.clone(),
                source,
            })?;
        let resp = Self::envd_check(resp, &url).await?;
        Ok(resp
            .bytes()
            .await
            .map_err(|source| ClientError::Http { url, source })?
            .to_vec())
    }
}

/// Puts the terminal on `fd` in raw mode until the guard is dropped.
pub struct RawMode {
    fd: i32,
    saved: libc::termios,
}

impl RawMode {
    pub fn enable(fd: i32) -> std::io::Result<Self> {
        // SAFETY: termios is plain data; tcgetattr fills it and reports errors via its result.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `t` is a valid, writable termios.
        if unsafe { libc::tcgetattr(fd, &mut t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let saved = t;
        // SAFETY: `t` is a valid termios obtained from tcgetattr.
        unsafe { libc::cfmakeraw(&mut t) };
        // SAFETY: `t` is valid; fd is the caller's terminal.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { fd, saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: restores the attributes saved by `enable` on the same fd.
        unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved) };
    }
}

/// The size (cols, rows) of the terminal on `fd`, if it is one.
pub fn terminal_size(fd: i32) -> Option<(u16, u16)> {
    // SAFETY: winsize is plain data filled by the ioctl.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes a winsize into the valid pointer.
    let rc = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_col > 0).then_some((ws.ws_col, ws.ws_row))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_and_urlencode() {
        assert_eq!(envelope(2, b"{}"), vec![2, 0, 0, 0, 2, b'{', b'}']);
        assert_eq!(urlencode("/a b/c&d"), "/a%20b/c%26d");
        assert_eq!(unb64(&json!(b64(b"hi"))), b"hi");
    }
}
