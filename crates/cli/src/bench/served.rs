//! A sandbox of an in-process kiln server as the server benches reach it: envd through the
//! server's own proxy (the headers and token an SDK sends), and one command's round trip.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_envd::{EnvdClient, ProcessEvent};
use kiln_proto::process as pb;
use kiln_server::store::SandboxRecord;
use kiln_server::Manager;

/// One server of a comparison (e.g. audit on / off) and its sandbox.
pub(crate) struct Side {
    pub name: &'static str,
    pub manager: Arc<Manager>,
    pub sandbox: SandboxRecord,
    pub envd: EnvdClient,
    pub addr: std::net::SocketAddr,
}

pub(crate) fn envd_of(addr: std::net::SocketAddr, sandbox: &SandboxRecord) -> EnvdClient {
    EnvdClient::tcp(addr)
        .with_header("host", addr.to_string())
        .with_header("e2b-sandbox-id", sandbox.id.clone())
        .with_header("e2b-sandbox-port", kiln_proto::envd::ENVD_PORT.to_string())
        .with_access_token(sandbox.envd_token.clone())
}

/// Starts `cmd args` in the sandbox and waits for its end: the round trip.
pub(crate) async fn exec(envd: &EnvdClient, cmd: &str, args: &[&str]) -> anyhow::Result<Duration> {
    let req = pb::StartRequest {
        process: Some(pb::ProcessConfig {
            cmd: cmd.into(),
            args: args.iter().map(|a| a.to_string()).collect(),
            ..Default::default()
        }),
        stdin: Some(false),
        ..Default::default()
    };
    let t = Instant::now();
    let mut s = envd.start(&req, None).await?;
    while let Some(ev) = s.next_event().await? {
        if let ProcessEvent::Exited { .. } = ev {
            return Ok(t.elapsed());
        }
    }
    anyhow::bail!("the process stream ended without an end event")
}

/// An in-process server serving in the background until [`BackgroundServer::end`].
pub(crate) struct BackgroundServer {
    manager: Arc<Manager>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl BackgroundServer {
    pub fn spawn(server: kiln_server::Server) -> Self {
        let manager = server.manager.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server.serve_with(kiln_server::front::router, async move {
            let _ = stopped.await;
        }));
        Self {
            manager,
            stop,
            task,
        }
    }

    /// Kills its sandboxes, then stops it as a signal stops `kiln serve`: the warm pools'
    /// sandboxes stop (those booting too) and the driver releases what it keeps ready
    /// (killing its sandboxes alone would leave the pool's running).
    pub async fn end(self, reason: &str) {
        self.manager.kill_all(reason).await;
        // The server tears down on either exit; a send fails when it already ended.
        let _ = self.stop.send(());
        match self.task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("the bench's server stopped serving early: {e}"),
            Err(e) => eprintln!("the bench's server task failed: {e}"),
        }
    }
}
