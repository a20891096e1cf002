//! Shared support of the agent integration tests: start the real `kiln-agent` binary on a temp
//! Unix socket and a free TCP port, and talk raw HTTP and raw Connect envelopes to it.

#![allow(dead_code)] // each test file uses a different subset

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kiln_envd::{EnvdClient, RunOptions};

/// A running agent, killed on drop.
pub struct Agent {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub sock: PathBuf,
    pub port: u16,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `$KILN_AGENT_BIN` (e.g. the static build) or the binary of this package.
pub fn agent_bin() -> PathBuf {
    kiln_testkit::agent::from_env()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kiln-agent")))
}

/// Starts an agent and waits until it answers `/health` on its Unix socket.
pub async fn start() -> (Agent, EnvdClient) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let port = kiln_testkit::host::free_port();
    let child = Command::new(agent_bin())
        .args(["--port", &port.to_string(), "--listen-unix"])
        .arg(&sock)
        .env("KILN_AGENT_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn kiln-agent");
    let a = Agent {
        child,
        dir,
        sock,
        port,
    };
    let c = EnvdClient::unix(&a.sock);
    c.wait_ready(Duration::from_secs(10))
        .await
        .expect("agent ready");
    (a, c)
}

/// Run options with a 30 s deadline.
pub fn opts() -> RunOptions {
    RunOptions {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    }
}

/// One raw HTTP/1.1 request over the agent's Unix socket.
pub async fn raw(
    a: &Agent,
    method: &str,
    uri: &str,
    content_type: &str,
    body: &[u8],
) -> (u16, Vec<u8>) {
    raw_h(a, method, uri, content_type, &[], body).await
}

/// [`raw`] with extra headers.
pub async fn raw_h(
    a: &Agent,
    method: &str,
    uri: &str,
    content_type: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Vec<u8>) {
    let s = tokio::net::UnixStream::connect(&a.sock).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(s))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut b = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "x");
    if !content_type.is_empty() {
        b = b.header("content-type", content_type);
    }
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = tx
        .send_request(b.body(Full::new(Bytes::copy_from_slice(body))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, body.to_vec())
}

/// A Connect envelope built by hand (flags 0), independent of the framing under test.
pub fn envelope(msg: &[u8]) -> Vec<u8> {
    let mut env = vec![0u8];
    env.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    env.extend_from_slice(msg);
    env
}

/// Splits a body of JSON envelopes into (flags, message) pairs, by hand.
pub fn json_envelopes(mut rest: &[u8]) -> Vec<(u8, serde_json::Value)> {
    let mut out = Vec::new();
    while rest.len() >= 5 {
        let flags = rest[0];
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        out.push((flags, serde_json::from_slice(&rest[5..5 + len]).unwrap()));
        rest = &rest[5 + len..];
    }
    assert!(
        rest.is_empty(),
        "{} stray bytes after the envelopes",
        rest.len()
    );
    out
}

/// `decode_msg` on every prost message: decode or panic.
pub trait DecodeMsg: prost::Message + Default {
    fn decode_msg(b: Bytes) -> Self {
        Self::decode(b).expect("decode message")
    }
}
impl<T: prost::Message + Default> DecodeMsg for T {}
