//! Control API: newline-delimited JSON over a Unix stream socket.
//!
//! Each request is one JSON object on one line; each gets one JSON line back with `"ok": true`
//! plus fields, or `"ok": false, "error": "…"`.
//!
//! | request | effect |
//! |---|---|
//! | `{"op":"start"}` | run vCPUs created paused (`--paused`); no-op when running |
//! | `{"op":"pause"}` / `{"op":"resume"}` | stop / continue all vCPUs |
//! | `{"op":"snapshot","dir":"/path","resume":true}` | write a snapshot directory (pauses while writing; resumes if it was running and `resume` is not false) |
//! | `{"op":"stats"}` | state, memory and RSS figures, boot timings, per-device metrics |
//! | `{"op":"stop"}` | end the VM; the process exits 0 |

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum ApiRequest {
    Start,
    Pause,
    Resume,
    Snapshot { dir: PathBuf, resume: Option<bool> },
    Stats,
    Stop,
}

pub struct ApiServer {
    pub listener: UnixListener,
}

impl ApiServer {
    pub fn bind(path: &Path) -> std::io::Result<Self> {
        if path.exists() {
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        Ok(ApiServer { listener })
    }

    pub fn accept(&self) -> Option<ApiConn> {
        let (stream, _) = self.listener.accept().ok()?;
        stream.set_nonblocking(true).ok()?;
        Some(ApiConn {
            stream,
            buf: Vec::new(),
        })
    }
}

/// Largest request line accepted.
const MAX_LINE: usize = 64 * 1024;

pub struct ApiConn {
    pub stream: UnixStream,
    buf: Vec<u8>,
}

impl ApiConn {
    /// Reads what is available; returns complete requests and whether the peer is gone.
    pub fn read_requests(&mut self) -> (Vec<Result<ApiRequest, String>>, bool) {
        let mut closed = false;
        let mut chunk = [0u8; 4096];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    closed = true;
                    break;
                }
            }
            if self.buf.len() > MAX_LINE {
                break;
            }
        }
        let mut out = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&c| c == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            if line.trim().is_empty() {
                continue;
            }
            out.push(
                serde_json::from_str::<ApiRequest>(line.trim())
                    .map_err(|e| format!("bad request: {e}")),
            );
        }
        if self.buf.len() > MAX_LINE {
            self.buf.clear();
            out.push(Err(format!("request line longer than {MAX_LINE} bytes")));
            closed = true;
        }
        (out, closed)
    }

    pub fn respond(&mut self, v: &serde_json::Value) {
        let mut line = v.to_string();
        line.push('\n');
        let _ = self.stream.set_nonblocking(false);
        let _ = self
            .stream
            .set_write_timeout(Some(std::time::Duration::from_secs(5)));
        let _ = self.stream.write_all(line.as_bytes());
        let _ = self.stream.set_nonblocking(true);
    }
}

/// Client helper: sends one request line and reads one response line.
pub fn call(sock: &Path, req: &serde_json::Value) -> std::io::Result<serde_json::Value> {
    let mut s = UnixStream::connect(sock)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))?;
    let mut line = req.to_string();
    line.push('\n');
    s.write_all(line.as_bytes())?;
    let mut buf = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        let n = s.read(&mut b)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&b[..n]);
        if buf.contains(&b'\n') {
            break;
        }
    }
    serde_json::from_slice(&buf).map_err(std::io::Error::other)
}
