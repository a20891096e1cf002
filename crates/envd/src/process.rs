//! Connect calls: unary, server streams, and the `process.Process` conveniences (run a command,
//! start one with typed events, PTY input and resize).

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use kiln_proto::framing::{self, EnvelopeDecoder};
use kiln_proto::process::{self as pb, process_event, ProcessConfig};
use prost::Message;

use crate::{EnvdClient, EnvdError};

/// Largest streamed message accepted from envd.
pub const MAX_MESSAGE: usize = 32 << 20;

/// Options for [`EnvdClient::run`].
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// User to run as (HTTP Basic `user:`); `None` uses envd's default user.
    pub user: Option<String>,
    /// Working directory; `None` uses the default workdir or the user's home.
    pub cwd: Option<String>,
    /// Extra environment variables.
    pub envs: HashMap<String, String>,
    /// `X-Access-Token` for this call (overrides the client's).
    pub access_token: Option<String>,
    /// Deadline for the whole command (sent as `connect-timeout-ms` and enforced locally).
    pub timeout: Option<Duration>,
}

/// Collected result of [`EnvdClient::run`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Exit code; `-1` when the process was killed by a signal.
    pub exit_code: i32,
}

/// One event of a process started with [`EnvdClient::start`] (keepalives are skipped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessEvent {
    Started { pid: u32 },
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Pty(Vec<u8>),
    Exited { code: i32, error: Option<String> },
}

impl EnvdClient {
    /// Opens a Connect server stream (binary protobuf) and returns a reader of its messages.
    pub async fn server_stream<M: Message>(
        &self,
        path: &str,
        msg: &M,
        user: Option<&str>,
        token: Option<&str>,
        timeout: Option<Duration>,
    ) -> Result<MessageStream, EnvdError> {
        let body = framing::encode(0, &msg.encode_to_vec());
        let mut b = self
            .builder(Method::POST, path, user, token)
            .header(header::CONTENT_TYPE, "application/connect+proto")
            .header("connect-protocol-version", "1");
        if let Some(t) = timeout {
            b = b.header("connect-timeout-ms", t.as_millis().to_string());
        }
        let resp = self.send(b.body(Full::new(body))?).await?;
        if resp.status() != StatusCode::OK {
            let status = resp.status();
            let body = resp.into_body().collect().await?.to_bytes();
            return Err(crate::error::http_error(status, &body));
        }
        Ok(MessageStream {
            body: resp.into_body(),
            decoder: EnvelopeDecoder::new(MAX_MESSAGE),
            done: false,
        })
    }

    /// Unary Connect call with binary protobuf.
    pub async fn unary<Req: Message, Resp: Message + Default>(
        &self,
        path: &str,
        msg: &Req,
        user: Option<&str>,
    ) -> Result<Resp, EnvdError> {
        let r = self
            .builder(Method::POST, path, user, None)
            .header(header::CONTENT_TYPE, "application/proto")
            .header("connect-protocol-version", "1")
            .body(Full::new(Bytes::from(msg.encode_to_vec())))?;
        let body = Self::expect_ok(self.send(r).await?).await?;
        Resp::decode(body).map_err(|e| EnvdError::Decode(e.to_string()))
    }

    /// Runs `cmd` with `/bin/bash -l -c` and collects its output and exit code.
    pub async fn run(&self, cmd: &str, opts: RunOptions) -> Result<RunOutput, EnvdError> {
        let req = bash_request(cmd, opts.envs.clone(), opts.cwd.clone(), None);
        self.run_request(req, opts).await
    }

    /// Runs `program` (found on the sandbox's `PATH`) with `args` and no shell, and collects
    /// its output and exit code: a login shell's profile costs more than a short command.
    pub async fn exec(
        &self,
        program: &str,
        args: &[&str],
        opts: RunOptions,
    ) -> Result<RunOutput, EnvdError> {
        let req = pb::StartRequest {
            process: Some(ProcessConfig {
                cmd: program.into(),
                args: args.iter().map(|a| a.to_string()).collect(),
                envs: opts.envs.clone(),
                cwd: opts.cwd.clone(),
            }),
            ..Default::default()
        };
        self.run_request(req, opts).await
    }

    async fn run_request(
        &self,
        mut req: pb::StartRequest,
        opts: RunOptions,
    ) -> Result<RunOutput, EnvdError> {
        req.stdin = Some(false);
        let fut = async {
            let stream = self
                .server_stream(
                    "/process.Process/Start",
                    &req,
                    opts.user.as_deref(),
                    opts.access_token.as_deref(),
                    opts.timeout,
                )
                .await?;
            let mut events = ProcessStream { inner: stream };
            let mut out = RunOutput::default();
            while let Some(ev) = events.next_event().await? {
                match ev {
                    ProcessEvent::Stdout(b) | ProcessEvent::Pty(b) => out.stdout.extend(b),
                    ProcessEvent::Stderr(b) => out.stderr.extend(b),
                    ProcessEvent::Exited { code, .. } => {
                        out.exit_code = code;
                        return Ok(out);
                    }
                    ProcessEvent::Started { .. } => {}
                }
            }
            Err(EnvdError::Decode(
                "process stream ended without an end event".into(),
            ))
        };
        match opts.timeout {
            Some(t) => tokio::time::timeout(t, fut)
                .await
                .map_err(|_| EnvdError::Timeout(t))?,
            None => fut.await,
        }
    }

    /// `process.Process/Start` returning the process's typed events as they come.
    pub async fn start(
        &self,
        req: &pb::StartRequest,
        user: Option<&str>,
    ) -> Result<ProcessStream, EnvdError> {
        let inner = self
            .server_stream("/process.Process/Start", req, user, None, None)
            .await?;
        Ok(ProcessStream { inner })
    }

    /// Sends bytes to a process's stdin, or to its PTY when `pty`.
    pub async fn send_input(
        &self,
        pid: u32,
        data: Vec<u8>,
        pty: bool,
        user: Option<&str>,
    ) -> Result<(), EnvdError> {
        let input = if pty {
            pb::process_input::Input::Pty(data)
        } else {
            pb::process_input::Input::Stdin(data)
        };
        let req = pb::SendInputRequest {
            process: Some(by_pid(pid)),
            input: Some(pb::ProcessInput { input: Some(input) }),
        };
        self.unary::<_, pb::SendInputResponse>("/process.Process/SendInput", &req, user)
            .await
            .map(|_| ())
    }

    /// Sends SIGKILL to a process.
    pub async fn kill(&self, pid: u32, user: Option<&str>) -> Result<(), EnvdError> {
        let req = pb::SendSignalRequest {
            process: Some(by_pid(pid)),
            signal: pb::Signal::Sigkill as i32,
        };
        self.unary::<_, pb::SendSignalResponse>("/process.Process/SendSignal", &req, user)
            .await
            .map(|_| ())
    }

    /// Resizes a process's PTY.
    pub async fn resize_pty(
        &self,
        pid: u32,
        cols: u16,
        rows: u16,
        user: Option<&str>,
    ) -> Result<(), EnvdError> {
        let req = pb::UpdateRequest {
            process: Some(by_pid(pid)),
            pty: Some(pb::Pty {
                size: Some(pb::pty::Size {
                    cols: cols.into(),
                    rows: rows.into(),
                }),
            }),
        };
        self.unary::<_, pb::UpdateResponse>("/process.Process/Update", &req, user)
            .await
            .map(|_| ())
    }
}

/// A `StartRequest` running `cmd` with `/bin/bash -l -c`, in a PTY of `pty` (cols, rows) if set.
/// `stdin` is left unset (envd's default: open).
pub fn bash_request(
    cmd: &str,
    envs: HashMap<String, String>,
    cwd: Option<String>,
    pty: Option<(u16, u16)>,
) -> pb::StartRequest {
    pb::StartRequest {
        process: Some(ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into(), "-c".into(), cmd.into()],
            envs,
            cwd,
        }),
        pty: pty.map(|(cols, rows)| pb::Pty {
            size: Some(pb::pty::Size {
                cols: cols.into(),
                rows: rows.into(),
            }),
        }),
        tag: None,
        stdin: None,
    }
}

fn by_pid(pid: u32) -> pb::ProcessSelector {
    pb::ProcessSelector {
        selector: Some(pb::process_selector::Selector::Pid(pid)),
    }
}

/// Reader of the enveloped messages of a Connect server-streaming response.
pub struct MessageStream {
    body: Incoming,
    decoder: EnvelopeDecoder,
    done: bool,
}

impl MessageStream {
    /// Next message payload; `Ok(None)` at a clean end of stream; an end-stream error becomes
    /// [`EnvdError::Rpc`].
    pub async fn next_message(&mut self) -> Result<Option<Bytes>, EnvdError> {
        loop {
            if self.done {
                return Ok(None);
            }
            let frame = self
                .decoder
                .next_frame()
                .map_err(|e| EnvdError::Decode(e.to_string()))?;
            if let Some(f) = frame {
                if !f.is_end_stream() {
                    return Ok(Some(f.payload));
                }
                self.done = true;
                let end = framing::parse_end_stream(&f.payload)
                    .map_err(|e| EnvdError::Decode(e.to_string()))?;
                return match end.error {
                    Some(err) => Err(EnvdError::rpc(err.code, err.message)),
                    None => Ok(None),
                };
            }
            match self.body.frame().await {
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.decoder.push(&data);
                    }
                }
                None => {
                    self.done = true;
                    return Err(EnvdError::Decode(
                        "stream ended without an end-stream message".into(),
                    ));
                }
            }
        }
    }
}

/// Typed events of a `process.Process/Start` (or `Connect`) stream.
pub struct ProcessStream {
    inner: MessageStream,
}

impl ProcessStream {
    /// Next event; `Ok(None)` once the stream ended cleanly (after [`ProcessEvent::Exited`]).
    pub async fn next_event(&mut self) -> Result<Option<ProcessEvent>, EnvdError> {
        use process_event::data_event::Output;
        use process_event::Event;
        while let Some(msg) = self.inner.next_message().await? {
            // StartResponse and ConnectResponse share one layout (field 1: the event).
            let resp =
                pb::StartResponse::decode(msg).map_err(|e| EnvdError::Decode(e.to_string()))?;
            let ev = match resp.event.and_then(|e| e.event) {
                Some(Event::Start(s)) => ProcessEvent::Started { pid: s.pid },
                Some(Event::Data(d)) => match d.output {
                    Some(Output::Stdout(b)) => ProcessEvent::Stdout(b),
                    Some(Output::Stderr(b)) => ProcessEvent::Stderr(b),
                    Some(Output::Pty(b)) => ProcessEvent::Pty(b),
                    None => continue,
                },
                Some(Event::End(e)) => ProcessEvent::Exited {
                    code: e.exit_code,
                    error: e.error,
                },
                Some(Event::Keepalive(_)) | None => continue,
            };
            return Ok(Some(ev));
        }
        Ok(None)
    }
}
