//! The body wrappers of [`super::tap`]: a process event stream watched for its start and end
//! events, a download counted to its end, an upload counted as it streams in. Records made
//! while a body streams are sent (waiting for room in the writer's queue) before the frame
//! that caused them is passed on.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use kiln_proto::framing::{self, EnvelopeDecoder};
use kiln_proto::process::{self as pb, process_event};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;

use super::record::{Kind, NewRecord};
use super::tap::{Counter, Tap, Upload, EDGE};
use super::writer::Msg;

type Item = Option<Result<Frame<Bytes>, axum::Error>>;

/// Sends queued records from `poll` code, waiting for room; Ready once the queue is empty.
fn drain(
    cx: &mut Context<'_>,
    sender: &mut Option<PollSender<Msg>>,
    pending: &mut VecDeque<NewRecord>,
) -> Poll<()> {
    while let Some(s) = sender.as_mut() {
        if pending.is_empty() {
            return Poll::Ready(());
        }
        match ready!(s.poll_reserve(cx)) {
            Ok(()) => {
                if let Some(r) = pending.pop_front() {
                    let _ = s.send_item(Msg::Record(r));
                }
            }
            Err(_) => {
                tracing::error!("the audit writer has stopped");
                pending.clear();
            }
        }
    }
    pending.clear();
    Poll::Ready(())
}

/// Sends what is left without a task context (a body dropped mid-stream).
fn send_detached(tx: &mpsc::Sender<Msg>, pending: &mut VecDeque<NewRecord>) {
    let tx = tx.clone();
    let mut rest = Vec::new();
    for r in pending.drain(..) {
        if let Err(tokio::sync::mpsc::error::TrySendError::Full(m)) = tx.try_send(Msg::Record(r)) {
            rest.push(m);
        }
    }
    if !rest.is_empty() {
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(async move {
                for m in rest {
                    let _ = tx.send(m).await;
                }
            });
        }
    }
}

/// A `process.Process/Start` or `/Connect` response stream.
pub(super) struct StreamTap {
    pub inner: Body,
    pub dec: EnvelopeDecoder,
    pub tap: Option<Tap>,
    pub tx: mpsc::Sender<Msg>,
    pub pending: VecDeque<NewRecord>,
    pub sender: Option<PollSender<Msg>>,
    pub held: Option<Item>,
    pub done: bool,
    pub pid: Option<u32>,
}

impl StreamTap {
    fn feed(&mut self, data: &[u8]) {
        self.dec.push(data);
        while let Ok(Some(f)) = self.dec.next_frame() {
            if f.is_end_stream() {
                let err = framing::parse_end_stream(&f.payload)
                    .ok()
                    .and_then(|e| e.error)
                    .map(|e| e.code.as_str().to_string());
                self.finish(err.as_deref().or(Some("stream ended")));
                continue;
            }
            let Some(tap) = &self.tap else { continue };
            let Some(ev) = tap.decode_event(&f.payload) else {
                continue;
            };
            match ev {
                process_event::Event::Start(s) => {
                    self.pid = Some(s.pid);
                    let mut b = tap.fields.clone();
                    b.insert("pid".into(), s.pid.into());
                    self.pending
                        .push_back(tap.record(Kind::Process, Value::Object(b)));
                }
                process_event::Event::End(e) => {
                    if let Some(r) = self.end_record(Some(&e), None) {
                        self.pending.push_back(r);
                    }
                    self.tap = None;
                }
                _ => {}
            }
        }
    }

    fn end_record(
        &self,
        e: Option<&pb::process_event::EndEvent>,
        why: Option<&str>,
    ) -> Option<NewRecord> {
        let tap = self.tap.as_ref()?;
        let mut b = serde_json::Map::new();
        for k in ["cmd", "args", "user", "key", "pty", "tag"] {
            if let Some(v) = tap.fields.get(k) {
                b.insert(k.into(), v.clone());
            }
        }
        b.insert("event".into(), "end".into());
        b.insert("pid".into(), self.pid.into());
        if tap.fields.get("event") == Some(&json!("connect")) {
            b.insert("via".into(), "connect".into());
        }
        match e {
            Some(e) => {
                b.insert("exitCode".into(), e.exit_code.into());
                b.insert("exited".into(), e.exited.into());
                b.insert("status".into(), e.status.clone().into());
                if !e.exited {
                    let sig = e.status.strip_prefix("signal: ").unwrap_or(&e.status);
                    b.insert("signal".into(), sig.into());
                }
                if let Some(err) = &e.error {
                    b.insert("error".into(), err.clone().into());
                }
            }
            None => {
                b.insert("detached".into(), true.into());
                b.insert("reason".into(), why.unwrap_or("stream closed").into());
            }
        }
        b.insert(
            "durationMs".into(),
            (tap.started.elapsed().as_millis() as u64).into(),
        );
        Some(tap.record(Kind::Process, Value::Object(b)))
    }

    /// The stream is over (`why`: its error, if any) without an end event.
    fn finish(&mut self, why: Option<&str>) {
        let Some(tap) = &self.tap else { return };
        if self.pid.is_none() {
            // Never started (or a Connect to a process that is gone).
            let mut b = tap.fields.clone();
            b.insert("pid".into(), Value::Null);
            b.insert("error".into(), why.unwrap_or("no start event").into());
            self.pending
                .push_back(tap.record(Kind::Process, Value::Object(b)));
        } else if let Some(r) = self.end_record(None, why) {
            self.pending.push_back(r);
        }
        self.tap = None;
    }
}

impl HttpBody for StreamTap {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Item> {
        let this = self.get_mut();
        loop {
            if !this.pending.is_empty() {
                if this.sender.is_none() {
                    this.sender = Some(PollSender::new(this.tx.clone()));
                }
                ready!(drain(cx, &mut this.sender, &mut this.pending));
            }
            if let Some(f) = this.held.take() {
                return Poll::Ready(f);
            }
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(d) = frame.data_ref() {
                        this.feed(&d.clone());
                    }
                    this.held = Some(Some(Ok(frame)));
                }
                Some(Err(e)) => {
                    this.finish(Some("stream broke off"));
                    this.held = Some(Some(Err(e)));
                    this.done = true;
                }
                None => {
                    this.finish(None);
                    this.done = true;
                }
            }
        }
    }
}

impl Drop for StreamTap {
    fn drop(&mut self) {
        if self.tap.is_some() {
            self.finish(Some("client went away"));
        }
        send_detached(&self.tx, &mut self.pending);
    }
}

/// A download: bytes counted to the end of the body.
pub(super) struct CountOut {
    pub inner: Body,
    /// Bytes sent.
    pub bytes: u64,
    /// A gzip-encoded download is decoded to count the file's own bytes.
    pub gunzip: Option<flate2::write::GzDecoder<Counter>>,
    pub tap: Option<Tap>,
    pub tx: mpsc::Sender<Msg>,
    pub sender: Option<PollSender<Msg>>,
    pub pending: VecDeque<NewRecord>,
    pub held: Option<Item>,
    pub done: bool,
}

impl CountOut {
    fn finish(&mut self, result: &str) {
        let Some(tap) = self.tap.take() else { return };
        let mut b = tap.fields.clone();
        b.insert("op".into(), "read".into());
        match self.gunzip.take().map(|g| g.finish()) {
            Some(Ok(c)) => {
                b.insert("bytes".into(), c.0.into());
                b.insert("wireBytes".into(), self.bytes.into());
                b.insert("gzip".into(), true.into());
            }
            Some(Err(_)) => {
                b.insert("bytes".into(), Value::Null);
                b.insert("wireBytes".into(), self.bytes.into());
                b.insert("gzip".into(), true.into());
            }
            None => {
                b.insert("bytes".into(), self.bytes.into());
            }
        }
        b.insert("result".into(), result.into());
        self.pending
            .push_back(tap.record(Kind::File, Value::Object(b)));
    }
}

impl HttpBody for CountOut {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Item> {
        let this = self.get_mut();
        loop {
            if !this.pending.is_empty() {
                if this.sender.is_none() {
                    this.sender = Some(PollSender::new(this.tx.clone()));
                }
                ready!(drain(cx, &mut this.sender, &mut this.pending));
            }
            if let Some(f) = this.held.take() {
                return Poll::Ready(f);
            }
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(d) = frame.data_ref() {
                        this.bytes += d.len() as u64;
                        if let Some(g) = this.gunzip.as_mut() {
                            use std::io::Write;
                            if g.write_all(d).is_err() {
                                this.gunzip = None;
                            }
                        }
                    }
                    // The last frame waits for the record (sent first).
                    if this.inner.is_end_stream() {
                        this.finish("ok");
                        this.done = true;
                    }
                    this.held = Some(Some(Ok(frame)));
                }
                Some(Err(e)) => {
                    this.finish("aborted");
                    this.held = Some(Some(Err(e)));
                    this.done = true;
                }
                None => {
                    this.finish("ok");
                    this.done = true;
                }
            }
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for CountOut {
    fn drop(&mut self) {
        self.finish("aborted");
        send_detached(&self.tx, &mut self.pending);
    }
}

/// An upload streaming in: bytes counted, its first and last bytes kept.
pub(super) struct CountIn {
    pub inner: Body,
    pub up: Arc<Upload>,
}

impl HttpBody for CountIn {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Item> {
        let this = self.get_mut();
        let f = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if let Some(Ok(frame)) = &f {
            if let Some(d) = frame.data_ref() {
                let before = this.up.bytes.fetch_add(d.len() as u64, Ordering::Relaxed);
                if let Ok(mut e) = this.up.edges.lock() {
                    if before < EDGE as u64 {
                        let room = EDGE - e.0.len();
                        e.0.extend_from_slice(&d[..d.len().min(room)]);
                    }
                    e.1.extend_from_slice(&d[d.len().saturating_sub(EDGE)..]);
                    let extra = e.1.len().saturating_sub(EDGE);
                    e.1.drain(..extra);
                }
            }
        }
        Poll::Ready(f)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}
