//! The server's edges against hostile clients, over real TCP against the real router and
//! store (no sandbox needed): body caps with and without Content-Length (413), oversized
//! headers (431), the header read timeout (also closing idle keep-alive connections) and the
//! connection cap (503 + Retry-After).

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kiln_server::edge::{EdgeConfig, API_BODY_LIMIT};
use kiln_server::templates::FixedTemplates;
use kiln_server::LifecycleConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Fixture {
    addr: SocketAddr,
    key: String,
    _dir: tempfile::TempDir,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn start(cfg: EdgeConfig) -> Fixture {
    let dir = common::state_dir();
    let (app, key) = common::empty_app(dir.path()).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(kiln_server::edge::serve(listener, app, cfg));
    Fixture {
        addr,
        key,
        _dir: dir,
        server,
    }
}

/// Reads what the server sends until it closes the connection (or `limit` passes).
async fn read_all(s: &mut TcpStream, limit: Duration) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `head` (then `body` chunks) and returns everything the server answers.
async fn exchange(addr: SocketAddr, head: &str, body: &[&[u8]]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    for chunk in body {
        // The server may answer and close before the whole body was sent.
        if s.write_all(chunk).await.is_err() {
            break;
        }
    }
    read_all(&mut s, Duration::from_secs(10)).await
}

fn status_of(resp: &str) -> u16 {
    resp.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {resp:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_bodies_are_capped_with_and_without_content_length() {
    let f = start(EdgeConfig::default()).await;
    let big = API_BODY_LIMIT + 1;
    // Declared too large: refused before the body is read.
    let head = format!(
        "POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {big}\r\nConnection: close\r\n\r\n",
        f.key
    );
    let resp = exchange(f.addr, &head, &[]).await;
    assert_eq!(status_of(&resp), 413, "{resp}");
    assert!(resp.contains("\"code\":413"), "{resp}");
    // Chunked, no Content-Length: cut off at the cap, same answer.
    let head = format!(
        "POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        f.key
    );
    let chunk = format!("{:x}\r\n{}\r\n", 64 * 1024, "a".repeat(64 * 1024));
    let chunks: Vec<&[u8]> = (0..(big / (64 * 1024) + 2))
        .map(|_| chunk.as_bytes())
        .chain(std::iter::once(&b"0\r\n\r\n"[..]))
        .collect();
    let resp = exchange(f.addr, &head, &chunks).await;
    assert_eq!(status_of(&resp), 413, "{resp}");
    // Without a key the body is not even read: 401.
    let head = format!(
        "POST /sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: {big}\r\nConnection: close\r\n\r\n"
    );
    assert_eq!(status_of(&exchange(f.addr, &head, &[]).await), 401);
    // A small body still goes through (a 400/404 from the handler, not a cap).
    let body = r#"{"templateID":"nosuch"}"#;
    let head = format!(
        "POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        f.key,
        body.len()
    );
    assert_eq!(status_of(&exchange(f.addr, &head, &[]).await), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_get_431() {
    let f = start(EdgeConfig::default()).await;
    let head = format!(
        "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
        "b".repeat(100 * 1024)
    );
    let resp = exchange(f.addr, &head, &[]).await;
    assert_eq!(status_of(&resp), 431, "{resp}");
    // The server is fine afterwards.
    let ok = exchange(
        f.addr,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        &[],
    )
    .await;
    assert_eq!(status_of(&ok), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_idle_connections_are_closed() {
    let f = start(EdgeConfig {
        header_timeout: Duration::from_secs(1),
        ..EdgeConfig::default()
    })
    .await;
    // Half a request, then nothing: closed after the header timeout.
    let mut s = TcpStream::connect(f.addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let t = std::time::Instant::now();
    let resp = read_all(&mut s, Duration::from_secs(10)).await;
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "closed after {took:?}: {resp:?}"
    );
    // A keep-alive connection: one answer, then closed when idle for the timeout.
    let mut s = TcpStream::connect(f.addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let t = std::time::Instant::now();
    let resp = read_all(&mut s, Duration::from_secs(10)).await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "idle connection kept {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_get_503() {
    let f = start(EdgeConfig {
        max_connections: 2,
        header_timeout: Duration::from_secs(30),
        ..EdgeConfig::default()
    })
    .await;
    let held: Vec<TcpStream> =
        futures::future::join_all((0..2).map(|_| TcpStream::connect(f.addr)))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    // Let the server accept them.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let resp = exchange(
        f.addr,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        &[],
    )
    .await;
    assert_eq!(status_of(&resp), 503, "{resp}");
    assert!(
        resp.to_ascii_lowercase().contains("retry-after: 1"),
        "{resp}"
    );
    assert!(resp.contains("too many open connections"), "{resp}");
    drop(held);
    // Slots come back once those connections close.
    let mut ok = 0;
    for _ in 0..50 {
        let resp = exchange(
            f.addr,
            "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            &[],
        )
        .await;
        if status_of(&resp) == 200 {
            ok += 1;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ok, 1, "no slot came back after the connections closed");
}

/// A proxied upload without Content-Length (chunked) streams into the sandbox whatever its size,
/// and a body-less GET through the proxy still works (the buffered path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_uploads_stream_through_the_proxy() {
    if !common::sandboxes_run() {
        return;
    }
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let g = common::Ground::new();
    let (state, tpl, driver, cleanup) = (&g.state, &g.tpl, g.driver.clone(), &g.cleanup);
    let manager = common::manager(
        state.path(),
        driver.clone(),
        Arc::new(FixedTemplates(vec![kiln_server::templates::from_dir(
            "t",
            tpl.path(),
        )])),
        LifecycleConfig {
            default_memory_mb: 256,
            ..Default::default()
        },
    );
    let (app, key) = common::app(manager.clone(), state.path()).await;
    let (s, v) = common::call(
        &app,
        Some(&key),
        "POST",
        "/sandboxes",
        Some(r#"{"templateID":"t","timeout":120}"#),
        &[],
    )
    .await;
    assert_eq!(s.as_u16(), 201, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    cleanup.add(&id);
    let token = v["envdAccessToken"].as_str().unwrap().to_string();
    // 3 MiB (three times what the proxy ever buffers) in 64 KiB chunks, no Content-Length.
    const CHUNKS: usize = 48;
    let chunks = futures::stream::iter(
        (0..CHUNKS).map(|i| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![i as u8; 64 << 10]))),
    );
    let req = http::Request::builder()
        .method("POST")
        .uri("/files?path=/home/user/big.bin&username=user")
        .header("E2b-Sandbox-Id", &id)
        .header("X-Access-Token", &token)
        .header("content-type", "application/octet-stream")
        .body(Body::from_stream(chunks))
        .unwrap();
    assert!(req.headers().get("content-length").is_none());
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status.as_u16(), 200, "{}", String::from_utf8_lossy(&body));
    let out = manager
        .agent(&id, Some(token.clone()))
        .run("ls -ln /home/user/big.bin", Default::default())
        .await
        .unwrap();
    let ls = String::from_utf8_lossy(&out.stdout).to_string();
    let n: usize = ls
        .split_whitespace()
        .nth(4)
        .and_then(|f| f.parse().ok())
        .unwrap_or(0);
    assert_eq!(n, CHUNKS * (64 << 10), "{out:?}");
    // A body-less GET through the proxy: the download comes back whole.
    let (s, v) = common::call(
        &app,
        None,
        "GET",
        "/files?path=/home/user/big.bin&username=user",
        None,
        &[("E2b-Sandbox-Id", &id), ("X-Access-Token", &token)],
    )
    .await;
    assert_eq!(s.as_u16(), 200);
    // (bytes 0..48 are ASCII: the text form has the same length)
    assert_eq!(
        v.as_str().map(str::len),
        Some(CHUNKS * (64 << 10)),
        "download"
    );
    manager.kill_all("test done").await;
}
