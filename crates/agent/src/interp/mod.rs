//! `kiln-agent interp`: the code interpreter service of the `code-interpreter-v1` template,
//! wire-compatible with `e2b-code-interpreter` (port 49999).
//!
//! [`http`] serves the API; [`contexts`] keeps one backend per context: an IPython kernel
//! ([`kernel`], driven over the Jupyter messaging protocol in [`wire`]), a persistent bash
//! ([`bash`]) or a persistent node ([`js`], running `driver.js`). [`output`] maps kernel messages to E2B's NDJSON lines. Python kernels run
//! `startup.py` first: formatters that attach E2B's structured charts to matplotlib figures and
//! column data to pandas DataFrames.

pub mod bash;
pub mod contexts;
pub mod http;
pub mod js;
pub mod kernel;
pub mod output;
pub mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;

pub use contexts::{Config, Contexts, Language};
pub use kernel::KernelSpec;

/// The port E2B's SDK talks to.
pub const PORT: u16 = 49999;

/// A fresh random id (32 hex digits).
pub fn new_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Makes a backend (kernel, bash, node) end with the service that started it: it gets
/// SIGKILL when the service dies, however it dies (a SIGTERM's default action or SIGKILL ends
/// the service without dropping its children). Best effort: a kernel without
/// `PR_SET_PDEATHSIG` still starts.
pub(crate) fn end_with_service(cmd: &mut tokio::process::Command) {
    let service = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls (prctl(2), getppid(2), _exit(2)) between fork and
    // exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) == 0
                && libc::getppid() != service
            {
                // The service died between fork and prctl: do not outlive it.
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// Service options.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub addr: SocketAddr,
    pub python: PathBuf,
    pub node: PathBuf,
    pub runtime_dir: PathBuf,
    pub default_cwd: PathBuf,
    /// Start the default Python context before serving (so the first `run_code` is fast).
    pub warm: bool,
}

/// Bind, optionally warm up the default Python context, and serve forever.
pub async fn serve(cfg: ServeConfig) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.addr)
        .await
        .with_context(|| format!("bind {}", cfg.addr))?;
    let ctxs = Contexts::new(Config {
        kernel: KernelSpec {
            python: cfg.python.clone(),
            runtime_dir: cfg.runtime_dir.clone(),
        },
        default_cwd: cfg.default_cwd.clone(),
        node: cfg.node.clone(),
    });
    if cfg.warm {
        let c = ctxs.clone();
        tokio::spawn(async move {
            if let Err(e) = c.default_for(Language::Python).await {
                tracing::warn!("warming the default python context: {e:#}");
            }
        });
    }
    tracing::info!("code interpreter listening on {}", listener.local_addr()?);
    serve_on(listener, ctxs).await
}

/// Serve on an already bound listener.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    ctxs: Arc<Contexts>,
) -> anyhow::Result<()> {
    loop {
        match listener.accept().await {
            Ok((s, _)) => {
                let _ = s.set_nodelay(true);
                tokio::spawn(http::serve_conn(ctxs.clone(), s));
            }
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}
