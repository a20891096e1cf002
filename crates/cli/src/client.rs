//! Client of a kiln server: its REST API (reqwest) and, through its envd proxy, the agent of a
//! sandbox (`kiln-envd` over TCP to the server with the `E2b-Sandbox-Id`/`E2b-Sandbox-Port`
//! headers and the sandbox's envd access token).

use std::collections::BTreeMap;
use std::time::Duration;

use kiln_envd::{EnvdClient, EnvdError, ProcessEvent};
use serde_json::{json, Value};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The whole cause chain is in the message (and no `source`), so `{e}` and `{e:#}` both
    /// say it once.
    #[error("request to {url} failed: {}", causes(error))]
    Http { url: String, error: reqwest::Error },
    #[error("{status}: {message}")]
    Api { status: u16, message: String },
    #[error("bad answer from the server: {0}")]
    Protocol(String),
    #[error("server URL {url}: {message}")]
    Url { url: String, message: String },
    #[error("{0}")]
    Envd(#[from] EnvdError),
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// `e` and its causes, joined by ": ", a cause repeating the previous one's text said once.
fn causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut last = out.clone();
    let mut next = e.source();
    while let Some(c) = next {
        let text = c.to_string();
        if text != last {
            out.push_str(": ");
            out.push_str(&text);
        }
        last = text;
        next = c.source();
    }
    out
}

/// A sandbox as returned by create or get.
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

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
}

impl Client {
    pub fn new(base: &str, api_key: Option<String>) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|error| ClientError::Http {
                url: base.to_string(),
                error,
            })?;
        Ok(Self {
            http,
            base: base.trim_end_matches('/').to_string(),
            api_key,
        })
    }

    /// The same server with another API key (sharing the connection pool).
    pub fn with_key(&self, api_key: Option<String>) -> Client {
        Client {
            http: self.http.clone(),
            base: self.base.clone(),
            api_key,
        }
    }

    /// A request to `path` on port `port` of sandbox `id`, through the server's routing
    /// (`E2b-Sandbox-Id`/`E2b-Sandbox-Port`).
    pub fn port_request(
        &self,
        method: reqwest::Method,
        id: &str,
        port: u16,
        path: &str,
    ) -> reqwest::RequestBuilder {
        self.http
            .request(method, self.url(path))
            .header("e2b-sandbox-id", id)
            .header("e2b-sandbox-port", port.to_string())
    }

    /// `POST /sandboxes` with a body the caller built (network options and all).
    pub async fn create_from(&self, body: Value) -> Result<SandboxRef> {
        let v = self
            .api(reqwest::Method::POST, "/sandboxes", Some(body))
            .await?;
        sandbox_ref(&v)
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// One REST call; a JSON answer (Null when empty) or the server's error message.
    async fn api(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Result<Value> {
        let url = self.url(path);
        let mut req = self.http.request(method, &url);
        if let Some(k) = &self.api_key {
            req = req.header("X-API-Key", k);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.map_err(|error| ClientError::Http {
            url: url.clone(),
            error,
        })?;
        let status = resp.status().as_u16();
        let text = resp
            .text()
            .await
            .map_err(|error| ClientError::Http { url, error })?;
        let v = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        if status >= 300 {
            let message = match v["message"].as_str() {
                Some(m) => m.to_string(),
                None => v.to_string(),
            };
            return Err(ClientError::Api { status, message });
        }
        Ok(v)
    }

    /// One REST call by method and path (`kiln events`, `kiln webhooks`).
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value> {
        self.api(method, path, body).await
    }

    /// `GET path`: the JSON answer or the server's error.
    pub async fn get_json(&self, path: &str) -> Result<Value> {
        self.api(reqwest::Method::GET, path, None).await
    }

    /// `GET path` as a stream (the caller reads the body as it arrives).
    pub async fn get_stream(&self, path: &str) -> Result<reqwest::Response> {
        let url = self.url(path);
        let mut req = self.http.get(&url);
        if let Some(k) = &self.api_key {
            req = req.header("X-API-Key", k);
        }
        let resp = req
            .send()
            .await
            .map_err(|error| ClientError::Http { url, error })?;
        if !resp.status().is_success() {
            let status = resp.status().as_u16();
            let text = resp.text().await.unwrap_or_default();
            let message = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v["message"].as_str().map(str::to_string))
                .unwrap_or(text);
            return Err(ClientError::Api { status, message });
        }
        Ok(resp)
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
        sandbox_ref(&v)
    }

    pub async fn list(&self) -> Result<Vec<Value>> {
        match self.api(reqwest::Method::GET, "/sandboxes", None).await? {
            Value::Array(v) => Ok(v),
            other => Err(ClientError::Protocol(format!(
                "expected a list, got {other}"
            ))),
        }
    }

    /// A running sandbox (with its envd access token), for envd calls.
    pub async fn sandbox(&self, id: &str) -> Result<SandboxRef> {
        let path = format!("/sandboxes/{}", kiln_envd::urlencode(id));
        sandbox_ref(&self.api(reqwest::Method::GET, &path, None).await?)
    }

    pub async fn kill(&self, id: &str) -> Result<()> {
        let path = format!("/sandboxes/{}", kiln_envd::urlencode(id));
        self.api(reqwest::Method::DELETE, &path, None)
            .await
            .map(|_| ())
    }

    /// The envd client of a sandbox, through the server's proxy.
    pub async fn envd(&self, sbx: &SandboxRef) -> Result<EnvdClient> {
        let bad = |message: &str| ClientError::Url {
            url: self.base.clone(),
            message: message.to_string(),
        };
        let url = reqwest::Url::parse(&self.base).map_err(|e| bad(&e.to_string()))?;
        if url.scheme() != "http" {
            return Err(bad("only http:// servers are supported"));
        }
        let host = url.host_str().ok_or_else(|| bad("no host"))?;
        let port = url.port_or_known_default().unwrap_or(80);
        // host_str() keeps the brackets of an IPv6 literal, so this parses as a socket address.
        let authority = format!("{host}:{port}");
        let addr = tokio::net::lookup_host(authority.as_str())
            .await
            .map_err(|e| bad(&e.to_string()))?
            .next()
            .ok_or_else(|| bad("the host name has no address"))?;
        Ok(EnvdClient::tcp(addr)
            .with_header("host", authority)
            .with_header("e2b-sandbox-id", sbx.id.clone())
            .with_header("e2b-sandbox-port", kiln_proto::envd::ENVD_PORT.to_string())
            .with_access_token(sbx.envd_token.clone()))
    }

    /// Starts `cmd` (through `/bin/bash -l -c`) and calls `on_event` for each event until it
    /// exits; returns the exit code.
    pub async fn exec(
        &self,
        sbx: &SandboxRef,
        cmd: &str,
        opts: &ExecOptions,
        mut on_event: impl FnMut(ProcessEvent),
    ) -> Result<i32> {
        let envd = self.envd(sbx).await?;
        let envs = opts.envs.clone().into_iter().collect();
        let req = kiln_envd::bash_request(cmd, envs, opts.cwd.clone(), opts.pty);
        let mut events = envd.start(&req, opts.user.as_deref()).await?;
        while let Some(ev) = events.next_event().await? {
            let exited = match ev {
                ProcessEvent::Exited { code, .. } => Some(code),
                _ => None,
            };
            on_event(ev);
            if let Some(code) = exited {
                return Ok(code);
            }
        }
        Err(ClientError::Protocol(
            "stream ended without an exit event".into(),
        ))
    }

    /// Writes a file in the sandbox.
    pub async fn upload(
        &self,
        sbx: &SandboxRef,
        path: &str,
        data: Vec<u8>,
        user: Option<&str>,
    ) -> Result<()> {
        Ok(self.envd(sbx).await?.write_file(path, data, user).await?)
    }

    /// Reads a file from the sandbox.
    pub async fn download(
        &self,
        sbx: &SandboxRef,
        path: &str,
        user: Option<&str>,
    ) -> Result<Vec<u8>> {
        Ok(self.envd(sbx).await?.read_file(path, user).await?)
    }
}

fn sandbox_ref(v: &Value) -> Result<SandboxRef> {
    let id = v["sandboxID"]
        .as_str()
        .ok_or_else(|| ClientError::Protocol(format!("no sandboxID in {v}")))?;
    Ok(SandboxRef {
        id: id.to_string(),
        envd_token: v["envdAccessToken"].as_str().map(str::to_string),
    })
}

/// `%`-encodes a path segment or query value of a REST call: everything but the unreserved
/// characters, so a `/` stays inside its segment.
pub fn segment(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ref_reads_id_and_token() {
        let r = sandbox_ref(&json!({"sandboxID": "abc", "envdAccessToken": "t"})).unwrap();
        assert_eq!((r.id.as_str(), r.envd_token.as_deref()), ("abc", Some("t")));
        let r = sandbox_ref(&json!({"sandboxID": "abc"})).unwrap();
        assert_eq!(r.envd_token, None);
        assert!(matches!(
            sandbox_ref(&json!({})),
            Err(ClientError::Protocol(_))
        ));
    }

    #[tokio::test]
    async fn a_failed_request_says_its_cause_once() {
        // A port nothing listens on (bound, then closed).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}/x");
        let error = reqwest::get(&url).await.unwrap_err();
        let e = ClientError::Http { url, error };
        let (plain, alt) = (e.to_string(), format!("{:#}", anyhow::Error::from(e)));
        assert_eq!(plain, alt);
        assert!(plain.contains("refused"), "{plain}");
        assert_eq!(plain.matches("error sending request").count(), 1, "{plain}");
    }

    #[tokio::test]
    async fn envd_client_targets_the_server_address() {
        let c = Client::new("http://127.0.0.1:3999/", None).unwrap();
        let sbx = SandboxRef {
            id: "abc".into(),
            envd_token: None,
        };
        assert_eq!(c.envd(&sbx).await.unwrap().describe(), "tcp:127.0.0.1:3999");
        let c = Client::new("https://127.0.0.1:3999", None).unwrap();
        assert!(matches!(c.envd(&sbx).await, Err(ClientError::Url { .. })));
    }
}
