//! The per-sandbox DNS forwarder: UDP and TCP sockets on the slot's gateway address (inside
//! the router namespace), forwarding each query to an upstream resolver from the host and the
//! answer back (TCP for the answers too large for UDP). The sandbox's `resolv.conf` points at it. It remembers the names asked for
//! (the last [`LOG_LEN`]), and tells its observer ([`crate::observe`]) each query with its
//! outcome before the answer goes back.

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UdpSocket;

use crate::observe::{DnsQuery, NetEvent, Observer, Slot};
use crate::{dns_msg, io_err, Result, GATEWAY_ADDR};

/// How many queries the forwarder remembers.
pub const LOG_LEN: usize = 256;
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);

/// A running forwarder; stops when dropped.
pub struct DnsForwarder {
    task: tokio::task::JoinHandle<()>,
    tcp_task: tokio::task::JoinHandle<()>,
    log: Arc<Mutex<VecDeque<String>>>,
    upstreams: Arc<Mutex<Vec<Ipv4Addr>>>,
    observer: Slot,
}

impl Drop for DnsForwarder {
    fn drop(&mut self) {
        self.task.abort();
        self.tcp_task.abort();
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
        let at = SocketAddr::from((GATEWAY_ADDR, 53));
        let l = crate::netns::in_netns(router_ns, move || std::net::TcpListener::bind(at)).await?;
        l.set_nonblocking(true)
            .map_err(io_err("setting the DNS socket non-blocking"))?;
        let l = tokio::net::TcpListener::from_std(l).map_err(io_err("DNS TCP socket"))?;
        let observer = Slot::default();
        let shared = Shared {
            log: log.clone(),
            upstreams: upstreams.clone(),
            observer: observer.clone(),
        };
        let task = tokio::spawn(serve(sock, shared.clone()));
        let tcp_task = tokio::spawn(serve_tcp(l, shared));
        Ok(Self {
            task,
            tcp_task,
            log,
            upstreams,
            observer,
        })
    }

    /// Sets (or with `None` clears) the observer told of every query.
    pub fn set_observer(&self, o: Option<Observer>) {
        self.observer.set(o);
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

#[derive(Clone)]
struct Shared {
    log: Arc<Mutex<VecDeque<String>>>,
    upstreams: Arc<Mutex<Vec<Ipv4Addr>>>,
    observer: Slot,
}

impl Shared {
    fn upstreams(&self) -> Vec<Ipv4Addr> {
        self.upstreams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Tells the observer about `query` and its `answer` (`None`: no upstream answered).
    async fn tell(&self, transport: &'static str, query: &[u8], answer: Option<&[u8]>) {
        if !self.observer.is_set() {
            return;
        }
        let (name, t) = dns_msg::question(query).unwrap_or_default();
        let q = DnsQuery {
            name,
            qtype: dns_msg::type_name(t),
            transport,
            rcode: answer.and_then(dns_msg::rcode),
            answers: answer.map(dns_msg::answers).unwrap_or_default(),
        };
        self.observer.tell(NetEvent::Dns(q)).await;
    }
}

async fn serve(sock: Arc<UdpSocket>, sh: Shared) {
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok((n, from)) = sock.recv_from(&mut buf).await else {
            continue;
        };
        let query = buf[..n].to_vec();
        remember(&sh.log, &query);
        let ups = sh.upstreams();
        let (sock, sh) = (sock.clone(), sh.clone());
        tokio::spawn(async move {
            for up in ups {
                if let Some(answer) = ask(up, &query).await {
                    sh.tell("udp", &query, Some(&answer)).await;
                    let _ = sock.send_to(&answer, from).await;
                    return;
                }
            }
            sh.tell("udp", &query, None).await;
        });
    }
}

fn remember(log: &Mutex<VecDeque<String>>, query: &[u8]) {
    if let Some(name) = question_name(query) {
        let mut l = log.lock().unwrap_or_else(|e| e.into_inner());
        if l.len() == LOG_LEN {
            l.pop_front();
        }
        l.push_back(name);
    }
}

async fn serve_tcp(l: tokio::net::TcpListener, sh: Shared) {
    loop {
        let Ok((mut c, _)) = l.accept().await else {
            continue;
        };
        let sh = sh.clone();
        tokio::spawn(async move {
            // Length-prefixed messages, several per connection.
            while let Ok(Some(query)) = read_framed(&mut c).await {
                remember(&sh.log, &query);
                let mut answer = None;
                for up in sh.upstreams() {
                    answer = ask_tcp(up, &query).await;
                    if answer.is_some() {
                        break;
                    }
                }
                sh.tell("tcp", &query, answer.as_deref()).await;
                let Some(answer) = answer else { return };
                let mut out = (answer.len() as u16).to_be_bytes().to_vec();
                out.extend(answer);
                if c.write_all(&out).await.is_err() {
                    return;
                }
            }
        });
    }
}

async fn read_framed(s: &mut tokio::net::TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 2];
    match tokio::time::timeout(UPSTREAM_TIMEOUT * 4, s.read_exact(&mut len)).await {
        Ok(Ok(_)) => {}
        _ => return Ok(None),
    }
    let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
    tokio::time::timeout(UPSTREAM_TIMEOUT, s.read_exact(&mut msg))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    Ok(Some(msg))
}

/// One query to one upstream over TCP, from the host's namespace.
async fn ask_tcp(upstream: Ipv4Addr, query: &[u8]) -> Option<Vec<u8>> {
    let mut s = tokio::time::timeout(
        UPSTREAM_TIMEOUT,
        tokio::net::TcpStream::connect((upstream, 53)),
    )
    .await
    .ok()?
    .ok()?;
    let mut out = (query.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(query);
    s.write_all(&out).await.ok()?;
    let answer = read_framed(&mut s).await.ok()??;
    (answer.len() >= 2 && query.len() >= 2 && answer[..2] == query[..2]).then_some(answer)
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
