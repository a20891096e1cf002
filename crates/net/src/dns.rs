//! The per-sandbox DNS forwarder: a UDP socket on the slot's gateway address (inside the
//! router namespace), forwarding each query to an upstream resolver from the host and the
//! answer back. The sandbox's `resolv.conf` points at it. It remembers the names asked for
//! (the last [`LOG_LEN`]) for auditing.

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UdpSocket;

use crate::{io_err, Result, GATEWAY_ADDR};

/// How many queries the forwarder remembers.
pub const LOG_LEN: usize = 256;
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);

/// A running forwarder; stops when dropped.
pub struct DnsForwarder {
    task: tokio::task::JoinHandle<()>,
    log: Arc<Mutex<VecDeque<String>>>,
    upstreams: Arc<Mutex<Vec<Ipv4Addr>>>,
}

impl Drop for DnsForwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl DnsForwarder {
    /// Starts the forwarder of the router namespace at `router_ns`.
    pub async fn start(router_ns: &Path, upstreams: Vec<Ipv4Addr>) -> Result<Self> {
        let std_sock =
            crate::netns::bind_udp(router_ns, SocketAddr::from((GATEWAY_ADDR, 53))).await?;
        std_sock
            .set_nonblocking(true)
            .map_err(io_err("setting the DNS socket non-blocking"))?;
        let sock = Arc::new(UdpSocket::from_std(std_sock).map_err(io_err("DNS socket"))?);
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let upstreams = Arc::new(Mutex::new(upstreams));
        let task = tokio::spawn(serve(sock, log.clone(), upstreams.clone()));
        Ok(Self {
            task,
            log,
            upstreams,
        })
    }

    /// Replaces the upstream resolvers (new queries use them).
    pub fn set_upstreams(&self, upstreams: Vec<Ipv4Addr>) {
        *self.upstreams.lock().unwrap_or_else(|e| e.into_inner()) = upstreams;
    }

    /// The names asked for, oldest first.
    pub fn queries(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

async fn serve(
    sock: Arc<UdpSocket>,
    log: Arc<Mutex<VecDeque<String>>>,
    upstreams: Arc<Mutex<Vec<Ipv4Addr>>>,
) {
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok((n, from)) = sock.recv_from(&mut buf).await else {
            continue;
        };
        let query = buf[..n].to_vec();
        if let Some(name) = question_name(&query) {
            let mut l = log.lock().unwrap_or_else(|e| e.into_inner());
            if l.len() == LOG_LEN {
                l.pop_front();
            }
            l.push_back(name);
        }
        let ups = upstreams.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let sock = sock.clone();
        tokio::spawn(async move {
            for up in ups {
                if let Some(answer) = ask(up, &query).await {
                    let _ = sock.send_to(&answer, from).await;
                    return;
                }
            }
        });
    }
}

/// One query to one upstream, from the host's namespace.
async fn ask(upstream: Ipv4Addr, query: &[u8]) -> Option<Vec<u8>> {
    let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await.ok()?;
    s.connect((upstream, 53)).await.ok()?;
    s.send(query).await.ok()?;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(UPSTREAM_TIMEOUT, s.recv(&mut buf))
        .await
        .ok()?
        .ok()?;
    // The answer must be for this query (same id).
    (n >= 2 && query.len() >= 2 && buf[..2] == query[..2]).then(|| buf[..n].to_vec())
}

/// The first question's name of a DNS message (`None` if malformed).
pub fn question_name(msg: &[u8]) -> Option<String> {
    if msg.len() < 12 || u16::from_be_bytes([msg[4], msg[5]]) == 0 {
        return None;
    }
    let mut i = 12;
    let mut labels = Vec::new();
    loop {
        let len = *msg.get(i)? as usize;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
        let label = msg.get(i + 1..i + 1 + len)?;
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        i += 1 + len;
    }
    Some(labels.join("."))
}

/// The host's resolvers from `/etc/resolv.conf` (IPv4 only).
pub fn system_resolvers() -> Vec<Ipv4Addr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn question_names_are_read() {
        let mut q = vec![0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in ["www", "Example", "com"] {
            q.push(l.len() as u8);
            q.extend(l.as_bytes());
        }
        q.extend([0, 0, 1, 0, 1]);
        assert_eq!(question_name(&q).as_deref(), Some("www.example.com"));
        assert_eq!(question_name(&q[..14]), None);
        assert_eq!(question_name(&[0; 5]), None);
    }
}
