//! `kiln-agent cdp`: the DevTools front of the `browser` and `desktop` templates.
//!
//! Chromium binds its DevTools endpoint to 127.0.0.1 whatever `--remote-debugging-address`
//! says, answers only requests whose `Host` is `localhost` or an IP address (DNS-rebinding
//! protection), and names itself `ws://localhost:<port>/devtools/...` in `/json/version` and
//! `/json/list`. This shim listens on the sandbox's port (9222), forwards every connection to
//! Chromium with `Host: localhost:<port>`, and rewrites the `/json*` answers so that their WebSocket
//! URLs name the public host the client used: `X-Forwarded-Host` (set by kiln's sandbox proxy)
//! or else the request's `Host`. WebSocket upgrades and everything else pass through as bytes.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The port clients use.
pub const PORT: u16 = 9222;
const HEAD_LIMIT: usize = 64 << 10;
const JSON_LIMIT: usize = 8 << 20;

/// Bind and serve forever, forwarding to Chromium at `upstream`.
pub async fn serve(addr: SocketAddr, upstream: SocketAddr) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("bind {addr}"))?;
    tracing::info!(
        "DevTools front listening on {} for {upstream}",
        listener.local_addr()?
    );
    loop {
        match listener.accept().await {
            Ok((s, _)) => {
                tokio::spawn(async move {
                    if let Err(e) = conn(s, upstream).await {
                        tracing::debug!("cdp connection: {e:#}");
                    }
                });
            }
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// A parsed request head.
#[derive(Debug, PartialEq, Eq)]
pub struct Head {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
}

impl Head {
    pub fn parse(raw: &[u8]) -> Option<Head> {
        let text = std::str::from_utf8(raw).ok()?;
        let mut lines = text.split("\r\n");
        let mut first = lines.next()?.split(' ');
        let method = first.next()?.to_string();
        let path = first.next()?.to_string();
        let headers = lines
            .filter(|l| !l.is_empty())
            .filter_map(|l| {
                let (k, v) = l.split_once(':')?;
                Some((k.trim().to_string(), v.trim().to_string()))
            })
            .collect();
        Some(Head {
            method,
            path,
            headers,
        })
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The head sent to Chromium: `Host: localhost:<port>` (Chromium names itself after it),
    /// forwarding headers dropped, and (for the JSON endpoints, which are answered in one
    /// response) `Connection: close`.
    pub fn upstream(&self, port: u16, close: bool) -> Vec<u8> {
        let mut out = format!(
            "{} {} HTTP/1.1\r\nHost: localhost:{port}\r\n",
            self.method, self.path
        );
        for (k, v) in &self.headers {
            let lk = k.to_ascii_lowercase();
            if lk == "host" || lk.starts_with("x-forwarded-") || (close && lk == "connection") {
                continue;
            }
            out.push_str(&format!("{k}: {v}\r\n"));
        }
        if close {
            out.push_str("Connection: close\r\n");
        }
        out.push_str("\r\n");
        out.into_bytes()
    }

    /// The `scheme://host` WebSocket base the client reached us at.
    pub fn public_ws_base(&self) -> Option<String> {
        let host = self
            .get("x-forwarded-host")
            .or_else(|| self.get("host"))
            .filter(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic()))?;
        let tls = self
            .get("x-forwarded-proto")
            .is_some_and(|p| p.eq_ignore_ascii_case("https"));
        Some(format!("{}://{host}", if tls { "wss" } else { "ws" }))
    }
}

/// Rewrites Chromium's own WebSocket addresses in a `/json*` body to `base` (`ws://host`).
pub fn rewrite_json(body: &str, upstream_port: u16, base: &str) -> String {
    let host = base.split_once("://").map(|(_, h)| h).unwrap_or(base);
    let mut out = body.to_string();
    for own in ["localhost", "127.0.0.1"] {
        let own = format!("{own}:{upstream_port}");
        out = out
            .replace(&format!("ws://{own}"), base)
            // devtoolsFrontendUrl carries it as `ws=localhost:9223/devtools/...`.
            .replace(&format!("ws={own}"), &format!("ws={host}"))
            .replace(&format!("wss={own}"), &format!("wss={host}"));
    }
    out
}

async fn read_head(s: &mut TcpStream) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return Ok((buf, rest));
        }
        anyhow::ensure!(buf.len() < HEAD_LIMIT, "request head too large");
        let n = s.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "connection closed before a request");
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn conn(mut client: TcpStream, upstream: SocketAddr) -> anyhow::Result<()> {
    let (raw, rest) = read_head(&mut client).await?;
    let Some(head) = Head::parse(&raw) else {
        client
            .write_all(
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            )
            .await?;
        return Ok(());
    };
    let mut up = match TcpStream::connect(upstream).await {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("the browser's DevTools endpoint is not up: {e}\n");
            let resp = format!(
                "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{msg}",
                msg.len()
            );
            client.write_all(resp.as_bytes()).await?;
            return Ok(());
        }
    };
    let _ = up.set_nodelay(true);
    let _ = client.set_nodelay(true);
    let is_json = head.method == "GET" && head.path.starts_with("/json");
    up.write_all(&head.upstream(upstream.port(), is_json))
        .await?;
    up.write_all(&rest).await?;
    if !is_json {
        tokio::io::copy_bidirectional(&mut client, &mut up).await?;
        return Ok(());
    }
    // Chromium keeps the connection open whatever `Connection` says: read the head, then the
    // body by its Content-Length (or to the end when it has none).
    let (rhead_raw, mut body) = read_head(&mut up).await?;
    let rh = String::from_utf8_lossy(&rhead_raw).to_ascii_lowercase();
    let len = rh.split("\r\n").find_map(|l| {
        l.strip_prefix("content-length:")?
            .trim()
            .parse::<usize>()
            .ok()
    });
    match len {
        Some(n) => {
            anyhow::ensure!(n <= JSON_LIMIT, "DevTools answer too large");
            let mut chunk = [0u8; 8192];
            while body.len() < n {
                let k = up.read(&mut chunk).await?;
                anyhow::ensure!(k > 0, "DevTools closed the connection mid-answer");
                body.extend_from_slice(&chunk[..k]);
            }
            body.truncate(n);
        }
        None => {
            (&mut up)
                .take(JSON_LIMIT as u64)
                .read_to_end(&mut body)
                .await?;
        }
    }
    let end = rhead_raw.len() - 4;
    let mut resp = rhead_raw;
    resp.extend_from_slice(&body);
    let (rhead, body) = resp.split_at(end + 4);
    let body = String::from_utf8_lossy(body);
    let body = match head.public_ws_base() {
        Some(base) => rewrite_json(&body, upstream.port(), &base),
        None => body.into_owned(),
    };
    let mut out = String::new();
    for (i, line) in String::from_utf8_lossy(rhead).split("\r\n").enumerate() {
        let l = line.to_ascii_lowercase();
        if line.is_empty()
            || (i > 0
                && (l.starts_with("content-length:")
                    || l.starts_with("connection:")
                    || l.starts_with("transfer-encoding:")))
        {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    client.write_all(out.as_bytes()).await?;
    client.write_all(body.as_bytes()).await?;
    client.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_is_rewritten_for_chromium() {
        let h = Head::parse(
            b"GET /json/version HTTP/1.1\r\nHost: localhost\r\nX-Forwarded-Host: 127.0.0.1:3000\r\nConnection: keep-alive\r\nUser-Agent: t\r\n\r\n",
        )
        .unwrap();
        assert_eq!(h.public_ws_base().as_deref(), Some("ws://127.0.0.1:3000"));
        let up = String::from_utf8(h.upstream(9223, true)).unwrap();
        assert_eq!(
            up,
            "GET /json/version HTTP/1.1\r\nHost: localhost:9223\r\nUser-Agent: t\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn json_urls_name_the_public_host() {
        let body = r#"{"webSocketDebuggerUrl": "ws://localhost:9223/devtools/browser/abc",
            "devtoolsFrontendUrl": "/devtools/inspector.html?ws=127.0.0.1:9223/devtools/page/1"}"#;
        let out = rewrite_json(body, 9223, "wss://9222-x.example.test");
        assert!(
            out.contains("\"wss://9222-x.example.test/devtools/browser/abc\""),
            "{out}"
        );
        assert!(
            out.contains("ws=9222-x.example.test/devtools/page/1"),
            "{out}"
        );
    }
}
