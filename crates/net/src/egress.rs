//! The per-sandbox egress proxy. When a policy names domains, the slot's ruleset redirects the
//! sandbox's TCP connections to ports 80, 443 and `httpsPorts` to this listener (in the router
//! namespace); when connections are audited ([`HostFacts::proxy_all_tcp`]), every TCP
//! connection leaving the sandbox comes here. It names each connection to a web port from its
//! first bytes (TLS SNI, or the HTTP `Host`), never from DNS answers, decides with the policy,
//! checks the original address against the always-denied ranges (so a name cannot smuggle a
//! private address in), and splices it to its original destination. A refused connection is
//! reset. Its observer ([`crate::observe`]) hears of each decision and each end, with bytes.
//! TLS connections to a host named by the policy's `network.rules` are handed to
//! [`crate::intercept`] instead of being spliced (after the same decision). With an
//! `egressProxy` every allowed connection is dialled through it ([`crate::upstream`]).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::egress_sock::SocketMaker;
use crate::observe::{Conn, NetEvent, Observer, Slot};
use crate::policy::EgressPolicy;
use crate::rules::HostFacts;
use crate::sni::{http_host, tls_server_name, Peek};
use crate::upstream::UpStream;
use crate::{io_err, Result, GATEWAY_ADDR};

const PEEK_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const PEEK_MAX: usize = 16 * 1024;

/// A running proxy; stops when dropped.
pub struct EgressProxy {
    task: tokio::task::JoinHandle<()>,
    policy: Arc<RwLock<EgressPolicy>>,
    observer: Slot,
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl EgressProxy {
    /// Starts the proxy of the router namespace at `router_ns`.
    pub async fn start(router_ns: &Path, policy: EgressPolicy, facts: HostFacts) -> Result<Self> {
        let at = SocketAddr::from((GATEWAY_ADDR, crate::PROXY_PORT));
        let l = crate::netns::in_netns(router_ns, move || std::net::TcpListener::bind(at)).await?;
        l.set_nonblocking(true)
            .map_err(io_err("setting the proxy socket non-blocking"))?;
        let l = TcpListener::from_std(l).map_err(io_err("proxy socket"))?;
        let sockets = SocketMaker::start(router_ns).await?;
        let policy = Arc::new(RwLock::new(policy));
        let observer = Slot::default();
        let ctx = Arc::new(Ctx {
            sockets,
            policy: policy.clone(),
            facts,
            observer: observer.clone(),
        });
        let task = tokio::spawn(async move {
            loop {
                let Ok((s, _)) = l.accept().await else {
                    continue;
                };
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    if let Err(e) = ctx.handle(s).await {
                        tracing::debug!(error = %e, "egress proxy connection");
                    }
                });
            }
        });
        Ok(Self {
            task,
            policy,
            observer,
        })
    }

    /// Sets (or with `None` clears) the observer told of every connection.
    pub fn set_observer(&self, o: Option<Observer>) {
        self.observer.set(o);
    }

    /// Replaces the policy (new connections see it).
    pub fn set_policy(&self, p: EgressPolicy) {
        *self.policy.write().unwrap_or_else(|e| e.into_inner()) = p;
    }
}

struct Ctx {
    sockets: SocketMaker,
    policy: Arc<RwLock<EgressPolicy>>,
    facts: HostFacts,
    observer: Slot,
}

impl Ctx {
    async fn handle(&self, mut s: TcpStream) -> std::io::Result<()> {
        let orig = original_dst(&s)?;
        // Answers go out as written: a small write waiting for the sandbox's delayed ACK
        // (Nagle) would stall a kept-alive request by tens of milliseconds.
        s.set_nodelay(true)?;
        let src = match s.peer_addr()? {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(_) => return Ok(()),
        };
        let policy = self
            .policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let tls = orig.port() == 443 || policy.https_ports.contains(&orig.port());
        let mut buf = Vec::with_capacity(4096);
        let name = if tls || orig.port() == 80 {
            peek_name(&mut s, &mut buf, tls).await
        } else {
            None
        };
        let ip = *orig.ip();
        let (allowed, rule) = match always_denied(&self.facts, ip) {
            Some(rule) => (false, rule),
            None => policy.decide(name.as_deref(), ip),
        };
        // A rule's host, over TLS: intercepted (only then), and the audit says which rule.
        let hit = policy
            .transforms
            .as_ref()
            .filter(|_| allowed && tls)
            .and_then(|t| {
                let host = t.rules.matching(name.as_deref(), ip)?.clone();
                Some((t.clone(), host))
            });
        let rule = match &hit {
            Some((_, h)) => format!(
                "{rule}; transform {} ({})",
                h.key,
                h.header_names().join(", ")
            ),
            None => rule,
        };
        let sni = name.clone();
        let conn = Conn {
            src,
            dst: orig,
            name,
            rule,
        };
        if !allowed {
            tracing::debug!(?conn, "egress denied");
            DENIED.fetch_add(1, Ordering::Relaxed);
            self.observer.tell(NetEvent::Deny(conn)).await;
            reset(&s);
            return Ok(());
        }
        ALLOWED.fetch_add(1, Ordering::Relaxed);
        self.observer.tell(NetEvent::Connect(conn.clone())).await;
        let started = std::time::Instant::now();
        if let Some((t, host)) = hit {
            let name = sni.unwrap_or_else(|| ip.to_string());
            let (out, inn) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
            let up = self.dial(policy.egress_proxy.as_ref(), orig).await;
            let r =
                crate::intercept::mitm::relay(t, host, &name, s, buf, up, out.clone(), inn.clone())
                    .await;
            if let Err(e) = &r {
                tracing::info!(%name, error = %e, "intercepted egress connection failed");
            }
            self.observer
                .tell(NetEvent::Close {
                    conn,
                    bytes_out: out.load(Ordering::Relaxed),
                    bytes_in: inn.load(Ordering::Relaxed),
                    duration_ms: started.elapsed().as_millis() as u64,
                    error: r.err().map(|e| e.to_string()),
                })
                .await;
            return Ok(());
        }
        let r = self
            .splice(&mut s, policy.egress_proxy.as_ref(), orig, &buf)
            .await;
        let (bytes_out, bytes_in, error) = match &r {
            Ok((o, i)) => (*o, *i, None),
            Err((o, i, e)) => (*o, *i, Some(e.to_string())),
        };
        self.observer
            .tell(NetEvent::Close {
                conn,
                bytes_out,
                bytes_in,
                duration_ms: started.elapsed().as_millis() as u64,
                error,
            })
            .await;
        if r.is_err() {
            reset(&s);
        }
        Ok(())
    }

    /// A connection to `orig`: through the upstream proxy when there is one (failing when it
    /// fails), else direct.
    async fn dial(
        &self,
        proxy: Option<&crate::upstream::EgressProxyConfig>,
        orig: SocketAddrV4,
    ) -> std::io::Result<UpStream> {
        match proxy {
            Some(p) => p.dial(&self.sockets, orig, CONNECT_TIMEOUT).await,
            None => self
                .sockets
                .connect(SocketAddr::V4(orig), CONNECT_TIMEOUT)
                .await
                .map(UpStream::Tcp),
        }
    }

    /// Connects to `orig`, sends what was peeked and splices both ways: bytes out and in.
    async fn splice(
        &self,
        s: &mut TcpStream,
        proxy: Option<&crate::upstream::EgressProxyConfig>,
        orig: SocketAddrV4,
        peeked: &[u8],
    ) -> Result<(u64, u64), (u64, u64, std::io::Error)> {
        let mut up = match self.dial(proxy, orig).await.map_err(|e| (0, 0, e))? {
            UpStream::Tcp(t) => t,
            UpStream::Tls(mut t) => {
                // Inside TLS to the proxy: copied, not spliced.
                t.write_all(peeked).await.map_err(|e| (0, 0, e))?;
                return match tokio::io::copy_bidirectional(s, t.as_mut()).await {
                    Ok((o, i)) => Ok((o + peeked.len() as u64, i)),
                    Err(e) => Err((peeked.len() as u64, 0, e)),
                };
            }
        };
        let sent = peeked.len() as u64;
        up.write_all(peeked).await.map_err(|e| (0, 0, e))?;
        let (out, inn) = (AtomicU64::new(sent), AtomicU64::new(0));
        let r = crate::relay::relay(s, &up, &out, &inn).await;
        let (o, i) = (out.into_inner(), inn.into_inner());
        r.map(|_| (o, i)).map_err(|e| (o, i, e))
    }
}

/// The rule denying `ip` whatever the policy (`host`, `always denied <range>`), if any.
pub(crate) fn always_denied(facts: &HostFacts, ip: Ipv4Addr) -> Option<String> {
    if facts.host_deny.iter().any(|c| c.contains(ip)) {
        return Some("host".into());
    }
    if facts.operator_allow.iter().any(|c| c.contains(ip)) {
        return None;
    }
    crate::addr::always_denied()
        .iter()
        .find(|c| c.contains(ip))
        .map(|c| format!("always denied {c}"))
}

/// Reads the connection's first bytes into `buf` until they name it (TLS SNI or HTTP Host).
async fn peek_name(s: &mut TcpStream, buf: &mut Vec<u8>, tls: bool) -> Option<String> {
    tokio::time::timeout(PEEK_TIMEOUT, async {
        loop {
            let peek = if tls {
                tls_server_name(buf)
            } else {
                http_host(buf)
            };
            match peek {
                Peek::Name(n) => return Some(n),
                Peek::NoName => return None,
                Peek::Incomplete if buf.len() >= PEEK_MAX => return None,
                Peek::Incomplete => {}
            }
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .unwrap_or(None)
}

/// Makes the close of `s` a reset (as a refused or failed connection looks without a proxy).
fn reset(s: &TcpStream) {
    let l = nix::libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let _ = nix::sys::socket::setsockopt(s, nix::sys::socket::sockopt::Linger, &l);
}

static ALLOWED: AtomicU64 = AtomicU64::new(0);
static DENIED: AtomicU64 = AtomicU64::new(0);

/// Connections every egress proxy of this process let out and refused, so far.
pub fn counts() -> (u64, u64) {
    (
        ALLOWED.load(Ordering::Relaxed),
        DENIED.load(Ordering::Relaxed),
    )
}

/// The destination a redirected connection was addressed to (`SO_ORIGINAL_DST`).
fn original_dst(s: &TcpStream) -> std::io::Result<SocketAddrV4> {
    // SAFETY: a zeroed sockaddr_in is a valid value of that plain C struct.
    let mut addr: nix::libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<nix::libc::sockaddr_in>() as nix::libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `addr`, which is that large, on a
    // socket this stream owns.
    let rc = unsafe {
        nix::libc::getsockopt(
            s.as_raw_fd(),
            nix::libc::SOL_IP,
            nix::libc::SO_ORIGINAL_DST,
            (&mut addr as *mut nix::libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    ))
}
