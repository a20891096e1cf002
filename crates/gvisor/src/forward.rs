//! Reaching a server bound to localhost inside a sandbox: when a connection to the sandbox's
//! address is refused, the agent (over its host socket) connects to 127.0.0.1:port inside and
//! relays (`GET /kiln/forward`, see kiln-agent's `forward` module). An agent without the
//! endpoint answers 404, which counts as "nothing is listening".

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Longest response head accepted from the agent.
const MAX_HEAD: usize = 8 << 10;

/// A relayed connection to 127.0.0.1:`port` inside the sandbox over `s`, a connection to its
/// agent, or `None` when nothing listens there either (or the agent cannot forward).
pub async fn via_agent(mut s: UnixStream, port: u16) -> std::io::Result<Option<UnixStream>> {
    s.write_all(
        format!(
            "GET /kiln/forward?port={port} HTTP/1.1\r\nHost: agent\r\nConnection: Upgrade\r\n\
             Upgrade: kiln-tcp\r\n\r\n"
        )
        .as_bytes(),
    )
    .await?;
    // Byte by byte: nothing after the head may be consumed (the relayed server may speak
    // first).
    let mut head = Vec::with_capacity(256);
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_HEAD {
            return Ok(None);
        }
        let b = s.read_u8().await?;
        head.push(b);
    }
    let status_line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let switched = std::str::from_utf8(status_line)
        .ok()
        .and_then(|l| l.split_whitespace().nth(1))
        == Some("101");
    Ok(switched.then_some(s))
}
