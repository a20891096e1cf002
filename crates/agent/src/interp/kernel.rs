//! One IPython kernel (`python3 -m ipykernel_launcher -f conn.json`) driven over the Jupyter
//! messaging protocol: a DEALER on its shell channel, a SUB on iopub. Executions are serialised
//! per kernel; an interrupt is SIGINT to the kernel process (ipykernel's default interrupt mode).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket};

use super::output::Event;
use super::wire::{Message, Signer};

/// The formatter script every Python kernel runs at start (E2B's charts, DataFrames as data).
const STARTUP: &str = include_str!("startup.py");

/// How a kernel is launched.
#[derive(Debug, Clone)]
pub struct KernelSpec {
    /// The Python interpreter (Debian's `python3` with ipykernel).
    pub python: PathBuf,
    /// Where connection files go.
    pub runtime_dir: PathBuf,
}

/// A running IPython kernel.
pub struct Kernel {
    child: Child,
    shell: DealerSocket,
    iopub: SubSocket,
    signer: Signer,
    session: String,
    conn_file: PathBuf,
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

impl Kernel {
    /// Launch a kernel in `cwd` and wait until it answers on shell and iopub. Retried: the
    /// ports are picked free but another process may take one before the kernel binds it.
    pub async fn start(spec: &KernelSpec, cwd: &Path) -> anyhow::Result<Kernel> {
        let mut last = None;
        for _ in 0..3 {
            match Kernel::start_once(spec, cwd).await {
                Ok(k) => return Ok(k),
                Err(e) => {
                    tracing::warn!("kernel start failed: {e:#}");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("kernel start failed")))
    }

    async fn start_once(spec: &KernelSpec, cwd: &Path) -> anyhow::Result<Kernel> {
        let key = super::new_id();
        let ports: Vec<u16> = (0..5).map(|_| free_port()).collect::<Result<_, _>>()?;
        let conn = json!({
            "transport": "tcp", "ip": "127.0.0.1", "key": key,
            "signature_scheme": "hmac-sha256", "kernel_name": "python3",
            "shell_port": ports[0], "iopub_port": ports[1], "stdin_port": ports[2],
            "control_port": ports[3], "hb_port": ports[4],
        });
        std::fs::create_dir_all(&spec.runtime_dir)?;
        let conn_file = spec
            .runtime_dir
            .join(format!("kernel-{}.json", super::new_id()));
        std::fs::write(&conn_file, serde_json::to_vec(&conn)?)?;
        let mut cmd = Command::new(&spec.python);
        super::end_with_service(&mut cmd);
        let child = cmd
            .args(["-m", "ipykernel_launcher", "-f"])
            .arg(&conn_file)
            .current_dir(cwd)
            .env("MPLBACKEND", "module://matplotlib_inline.backend_inline")
            .env("PYDEVD_DISABLE_FILE_VALIDATION", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start kernel with {}", spec.python.display()))?;
        let mut shell = DealerSocket::new();
        shell
            .connect(&format!("tcp://127.0.0.1:{}", ports[0]))
            .await?;
        let mut iopub = SubSocket::new();
        iopub
            .connect(&format!("tcp://127.0.0.1:{}", ports[1]))
            .await?;
        iopub.subscribe("").await?;
        let mut k = Kernel {
            child,
            shell,
            iopub,
            signer: Signer::new(&key),
            session: super::new_id(),
            conn_file,
        };
        k.wait_ready().await?;
        let (tx, mut rx) = mpsc::channel(64);
        k.execute(STARTUP, true, tx).await?;
        while let Ok(ev) = rx.try_recv() {
            if let Event::Error { name, value, .. } = ev {
                bail!("kernel startup script failed: {name}: {value}");
            }
        }
        Ok(k)
    }

    /// Send kernel_info_request until a reply arrives and iopub delivers our status messages
    /// (iopub subscriptions are asynchronous: messages sent before it joined are lost).
    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("kernel exited during start: {status}");
            }
            if tokio::time::Instant::now() > deadline {
                bail!("kernel did not become ready within 60s");
            }
            let req = Message::request(&self.session, "kernel_info_request", json!({}));
            self.shell.send(self.signer.encode(&req)).await?;
            let mut got_reply = false;
            let mut got_iopub = false;
            let step = tokio::time::Instant::now() + Duration::from_millis(500);
            while !(got_reply && got_iopub) {
                tokio::select! {
                    m = self.shell.recv() => {
                        if let Ok(m) = self.signer.decode(&m?) {
                            got_reply |= m.parent_id() == req.id();
                        }
                    }
                    m = self.iopub.recv() => {
                        if let Ok(m) = self.signer.decode(&m?) {
                            got_iopub |= m.parent_id() == req.id();
                        }
                    }
                    _ = tokio::time::sleep_until(step) => break,
                }
            }
            if got_reply && got_iopub {
                return Ok(());
            }
        }
    }

    /// The kernel's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Interrupt the running cell (SIGINT to the kernel process).
    pub fn interrupt(&self) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
            unsafe { libc::kill(pid as i32, libc::SIGINT) };
        }
    }

    /// Run `code` and send its outputs to `out` until the kernel goes idle. If `out` is closed
    /// (the client went away), the cell is interrupted and drained so the context stays usable.
    /// Returns the execution count (None for silent runs).
    pub async fn execute(
        &mut self,
        code: &str,
        silent: bool,
        out: mpsc::Sender<Event>,
    ) -> anyhow::Result<Option<i64>> {
        let req = Message::request(
            &self.session,
            "execute_request",
            json!({
                "code": code, "silent": silent, "store_history": !silent,
                "user_expressions": {}, "allow_stdin": false,
                // One cell runs at a time, so there is no queue to abort after an error; with
                // `true` ipykernel aborts requests arriving shortly after a failed cell.
                "stop_on_error": false,
            }),
        );
        self.shell.send(self.signer.encode(&req)).await?;
        let mut interrupted = false;
        let mut idle = false;
        let mut count = None;
        let mut replied = false;
        while !(idle && replied) {
            let closed = out.is_closed();
            if closed && !interrupted {
                interrupted = true;
                self.interrupt();
            }
            tokio::select! {
                m = self.iopub.recv() => {
                    let Ok(m) = self.signer.decode(&m?) else { continue };
                    if m.parent_id() != req.id() {
                        continue;
                    }
                    if m.msg_type() == "status" {
                        idle |= m.content["execution_state"] == "idle";
                        continue;
                    }
                    if let Some(ev) = Event::from_iopub(&m) {
                        let _ = out.send(ev).await;
                    }
                }
                m = self.shell.recv(), if !replied => {
                    let Ok(m) = self.signer.decode(&m?) else { continue };
                    if m.parent_id() == req.id() {
                        replied = true;
                        count = m.content["execution_count"].as_i64();
                        if m.content["status"] == "aborted" {
                            let _ = out.send(Event::Internal("the kernel aborted the execution".into())).await;
                        }
                    }
                }
                _ = out.closed(), if !closed => {}
                _ = self.child.wait() => bail!("the kernel died"),
            }
        }
        Ok(if silent { None } else { count })
    }

    /// Run code silently and return its error, if any.
    pub async fn run_silent(&mut self, code: &str) -> anyhow::Result<()> {
        let (tx, mut rx) = mpsc::channel(64);
        self.execute(code, true, tx).await?;
        while let Ok(ev) = rx.try_recv() {
            if let Event::Error { name, value, .. } = ev {
                bail!("{name}: {value}");
            }
        }
        Ok(())
    }

    /// Stop the kernel process.
    pub async fn shutdown(mut self) {
        let _ = self.child.kill().await;
        let _ = std::fs::remove_file(&self.conn_file);
    }
}

/// Python code setting `env` for one execution; `restore` undoes it afterwards.
pub fn env_code(env: &serde_json::Map<String, Value>) -> (String, String) {
    // A JSON string literal is also a valid Python string literal.
    let env = Value::String(Value::Object(env.clone()).to_string()).to_string();
    let set = format!(
        "import os as _kiln_os, json as _kiln_json\n\
         _kiln_env = _kiln_json.loads({env})\n\
         _kiln_saved = {{k: _kiln_os.environ.get(k) for k in _kiln_env}}\n\
         _kiln_os.environ.update({{k: str(v) for k, v in _kiln_env.items()}})\n"
    );
    let restore = "for _k, _v in _kiln_saved.items():\n    \
                   if _v is None: _kiln_os.environ.pop(_k, None)\n    \
                   else: _kiln_os.environ[_k] = _v\n\
                   del _k, _v, _kiln_saved, _kiln_env, _kiln_os, _kiln_json\n"
        .to_string();
    (set, restore)
}
