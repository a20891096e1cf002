//! Listeners (TCP, Unix sockets, vsock) and the accept loop.

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::router::serve_conn;
use crate::state::Agent;

/// Where to listen.
#[derive(Debug, Clone, Default)]
pub struct ListenConfig {
    /// TCP address (None: no TCP).
    pub tcp: Option<SocketAddr>,
    /// Unix socket paths (a stale socket file is removed first).
    pub unix: Vec<PathBuf>,
    /// vsock port (any CID).
    pub vsock_port: Option<u32>,
}

fn vsock_listener(port: u32) -> anyhow::Result<OwnedFd> {
    // SAFETY: plain socket creation; the fd is owned right after.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error())
            .context("create vsock socket (is vsock available?)");
    }
    // SAFETY: fd is a fresh valid socket we exclusively own.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: zeroed sockaddr_vm is valid; fields set below.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_port = port;
    addr.svm_cid = libc::VMADDR_CID_ANY;
    // SAFETY: bind/listen with a correctly sized sockaddr_vm.
    unsafe {
        if libc::bind(
            fd,
            (&addr as *const libc::sockaddr_vm).cast(),
            std::mem::size_of::<libc::sockaddr_vm>() as u32,
        ) < 0
        {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("bind vsock port {port}"));
        }
        if libc::listen(fd, 128) < 0 {
            return Err(std::io::Error::last_os_error()).context("listen on vsock");
        }
    }
    Ok(owned)
}

/// Suffix of the file written next to each Unix socket while the agent is detached.
pub const DETACHED_SUFFIX: &str = ".detached";

/// Accepts on `accept` until `stop` is cancelled; each connection is served in a task owned
/// by this one. Once stopped, every connection it accepted is closed *before* it returns (its
/// task aborted and dropped), then the listener goes with the future: awaiting the end of this
/// task is awaiting the end of every socket it made (`accept` owns the listener).
async fn accept_loop<S, F, Fut>(
    agent: Arc<Agent>,
    what: &'static str,
    stop: CancellationToken,
    mut accept: F,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    F: FnMut() -> Fut,
    Fut: Future<Output = std::io::Result<S>>,
{
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            r = accept() => match r {
                Ok(s) => {
                    conns.spawn(serve_conn(agent.clone(), s));
                }
                Err(e) => {
                    tracing::warn!("{what} accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    // The listener first (nothing new queues), then the connections.
    drop(accept);
    conns.shutdown().await;
}

/// The listeners being served: dropping it closes them and every connection they accepted
/// (without waiting); [`Served::close`] waits until every one of those sockets is closed.
struct Served {
    tasks: tokio::task::JoinSet<()>,
    stop: CancellationToken,
}

impl Served {
    /// Stops accepting and closes every connection, then the listeners, and returns once all
    /// are closed: the detach marker (after which the server checkpoints) goes out only when
    /// no host-backed socket is open or still closing, which gVisor cannot checkpoint.
    async fn close(mut self) {
        self.stop.cancel();
        let all = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(CLOSE_TIMEOUT, all).await.is_err() {
            tracing::warn!("connections did not close within {CLOSE_TIMEOUT:?}: aborted");
            self.tasks.shutdown().await;
        }
        crate::control::close_upgraded().await;
    }
}

/// How long a detach waits for its accept loops to close their connections (they only abort
/// tasks, so this is a backstop).
const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Binds the TCP and Unix listeners and serves them (see [`Served`]).
async fn bind_socket_listeners(agent: &Arc<Agent>, cfg: &ListenConfig) -> anyhow::Result<Served> {
    let mut tasks = tokio::task::JoinSet::new();
    let stop = CancellationToken::new();
    if let Some(addr) = cfg.tcp {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("bind TCP {addr}"))?;
        tracing::info!("listening on tcp {}", l.local_addr()?);
        let l = Arc::new(l);
        tasks.spawn(accept_loop(agent.clone(), "TCP", stop.clone(), move || {
            let l = l.clone();
            async move {
                let (s, _) = l.accept().await?;
                let _ = s.set_nodelay(true);
                Ok(s)
            }
        }));
    }
    for path in &cfg.unix {
        if let Ok(m) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if m.file_type().is_socket() {
                let _ = std::fs::remove_file(path);
            } else {
                anyhow::bail!(
                    "{} exists and is not a socket; refusing to replace it",
                    path.display()
                );
            }
        }
        if let Some(parent) = path.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let l = tokio::net::UnixListener::bind(path)
            .with_context(|| format!("bind unix socket {}", path.display()))?;
        tracing::info!("listening on unix {}", path.display());
        let l = Arc::new(l);
        tasks.spawn(accept_loop(
            agent.clone(),
            "unix",
            stop.clone(),
            move || {
                let l = l.clone();
                async move { l.accept().await.map(|(s, _)| s) }
            },
        ));
    }
    Ok(Served { tasks, stop })
}

/// How often a detached agent looks whether the server removed its markers.
const MARKER_POLL: std::time::Duration = std::time::Duration::from_millis(3);

/// Closes the listeners and connections, removes the socket files and writes the markers
/// (the acknowledgement the server waits for).
async fn detach_sockets(served: &mut Option<Served>, cfg: &ListenConfig) {
    if served.is_some() {
        if let Some(p) = cfg.unix.iter().find(|p| !writable_dir_of(p)) {
            // The server opens the directory before it asks (it is sealed otherwise, see the
            // server's `driver/gvisor/seal.rs`): this request came from inside the sandbox, and
            // a detach nobody can undo would only leave the agent unreachable.
            tracing::warn!(
                "detach refused: the directory of {} is sealed (only the server asks for a \
                 detach, before a checkpoint)",
                p.display()
            );
            return;
        }
    }
    if let Some(s) = served.take() {
        s.close().await;
    }
    for p in &cfg.unix {
        let _ = std::fs::remove_file(p);
        let _ = std::fs::write(detached_marker(p), b"");
    }
    tracing::info!("detached from sockets");
}

/// Binds the listeners again (when detached) and removes the markers.
async fn attach_sockets(agent: &Arc<Agent>, served: &mut Option<Served>, cfg: &ListenConfig) {
    if served.is_none() {
        match bind_socket_listeners(agent, cfg).await {
            Ok(t) => *served = Some(t),
            Err(e) => tracing::warn!("attaching to sockets again: {e:#}"),
        }
    }
    for p in &cfg.unix {
        let _ = std::fs::remove_file(detached_marker(p));
    }
    tracing::info!("attached to sockets");
}

/// Whether entries can be made beside `socket` (a probe file made and removed at once): a
/// sealed directory refuses them.
fn writable_dir_of(socket: &std::path::Path) -> bool {
    let mut probe = socket.as_os_str().to_owned();
    probe.push(".probe");
    let probe = PathBuf::from(probe);
    match std::fs::write(&probe, b"") {
        Ok(()) => {
            let _ = std::fs::remove_file(&probe);
            true
        }
        Err(e) => {
            e.kind() != std::io::ErrorKind::PermissionDenied
                && e.raw_os_error() != Some(libc::EROFS)
        }
    }
}

fn detached_marker(socket: &std::path::Path) -> PathBuf {
    let mut p = socket.as_os_str().to_owned();
    p.push(DETACHED_SUFFIX);
    PathBuf::from(p)
}

/// Bind every listener, then serve until `shutdown` resolves. Binding errors are returned
/// before anything is served, so a caller knows the agent is reachable once this is polled.
///
/// SIGUSR1 detaches the agent from its TCP and Unix sockets (listeners and connections are
/// closed, socket files removed, then `<socket>.detached` is written next to each Unix
/// socket as the acknowledgement); SIGUSR2 binds them again and removes the markers, and so
/// does the server removing the markers (see [`crate::control`], which also detaches on a
/// request over the socket). gVisor
/// cannot checkpoint a sandbox that holds sockets backed by the host (`--host-uds`), so the
/// server detaches the agent before a checkpoint and attaches it after a restore.
pub async fn run(
    agent: Arc<Agent>,
    cfg: ListenConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    // Handlers first: an early SIGUSR1 must not end the agent.
    let (mut detach, mut attach) = (
        signal(SignalKind::user_defined1()).context("SIGUSR1 handler")?,
        signal(SignalKind::user_defined2()).context("SIGUSR2 handler")?,
    );
    let mut served = Some(bind_socket_listeners(&agent, &cfg).await?);
    for p in &cfg.unix {
        let _ = std::fs::remove_file(detached_marker(p));
    }
    if let Some(port) = cfg.vsock_port {
        let fd = vsock_listener(port)?;
        tracing::info!("listening on vsock port {port}");
        let a = agent.clone();
        let handle = tokio::runtime::Handle::current();
        std::thread::Builder::new()
            .name("vsock-accept".into())
            .spawn(move || loop {
                use std::os::fd::AsRawFd;
                // SAFETY: accept on our listening socket; returned fd is owned below.
                let c = unsafe {
                    libc::accept4(
                        fd.as_raw_fd(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                    )
                };
                if c < 0 {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    continue;
                }
                // SAFETY: `c` is a connected stream socket we exclusively own; a Unix stream
                // wrapper only issues read/write/shutdown on it, which vsock supports.
                let std_stream = unsafe { std::os::unix::net::UnixStream::from_raw_fd(c) };
                let a = a.clone();
                handle.spawn(async move {
                    match tokio::net::UnixStream::from_std(std_stream) {
                        Ok(s) => serve_conn(a, s).await,
                        Err(e) => tracing::warn!("vsock connection setup failed: {e}"),
                    }
                });
            })?;
    }
    if cfg.tcp.is_none() && cfg.unix.is_empty() && cfg.vsock_port.is_none() {
        anyhow::bail!("no listener configured: drop --no-tcp or add --listen-unix/--vsock-port");
    }
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            // In this order: when a detach and an attach are both pending (signals sent close
            // together lose their order), the detach goes first and the agent ends attached, as
            // after the usual detach-then-attach.
            biased;
            _ = &mut shutdown => break,
            _ = detach.recv() => detach_sockets(&mut served, &cfg).await,
            _ = crate::control::detach_requested() => detach_sockets(&mut served, &cfg).await,
            _ = attach.recv() => attach_sockets(&agent, &mut served, &cfg).await,
            // Detached: the server removes the markers after a restore to have the agent
            // attach again (no signal needed, see crate::control).
            _ = tokio::time::sleep(MARKER_POLL), if served.is_none() && !cfg.unix.is_empty() => {
                if cfg.unix.iter().all(|p| !detached_marker(p).exists()) {
                    attach_sockets(&agent, &mut served, &cfg).await;
                }
            }
        }
    }
    drop(served);
    for p in &cfg.unix {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}
