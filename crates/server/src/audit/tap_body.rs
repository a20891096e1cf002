//! The body wrappers of [`super::tap`]: a response body watched by a [`Watch`] ([`Watched`]:
//! a process event stream watched for its start and end events, a download counted to its
//! end), and an upload counted as it streams in ([`CountIn`]). Records made while a response
//! streams are sent (waiting for room in the writer's queue) before the frame that caused them
//! is passed on.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use kiln_proto::framing::{self, EnvelopeDecoder};
use kiln_proto::process::{self as pb, process_event};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;

use super::record::{Append, Kind, NewRecord};
use super::tap_record::{Counter, Recorded, EDGE};
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
                    let _ = s.send_item(Msg::Append(Append::Record(r)));
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
        if let Err(tokio::sync::mpsc::error::TrySendError::Full(m)) =
            tx.try_send(Msg::Append(Append::Record(r)))
        {
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

/// What a [`Watched`] body tells its watcher; each pushes the records it makes to `out`.
pub(super) trait Watch: Send + Unpin + 'static {
    /// A data frame passes (`last`: the body has nothing after it). Returns whether the
    /// watcher is done (the frame is still passed on, after the records).
    fn data(&mut self, d: &Bytes, last: bool, out: &mut VecDeque<NewRecord>) -> bool;
    /// The body broke off.
    fn error(&mut self, out: &mut VecDeque<NewRecord>);
    /// The body ended.
    fn end(&mut self, out: &mut VecDeque<NewRecord>);
    /// The body was dropped (the client went away); a no-op if already done.
    fn dropped(&mut self, out: &mut VecDeque<NewRecord>);
}

/// A response body passed on frame by frame while its watcher records what it sees.
pub(super) struct Watched<W: Watch> {
    inner: Body,
    watch: W,
    tx: mpsc::Sender<Msg>,
    pending: VecDeque<NewRecord>,
    sender: Option<PollSender<Msg>>,
    held: Option<Item>,
    done: bool,
}

impl<W: Watch> Watched<W> {
    pub(super) fn new(inner: Body, watch: W, tx: mpsc::Sender<Msg>) -> Self {
        Self {
            inner,
            watch,
            tx,
            pending: VecDeque::new(),
            sender: None,
            held: None,
            done: false,
        }
    }
}

impl<W: Watch> HttpBody for Watched<W> {
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
                        let last = this.inner.is_end_stream();
                        // The last frame waits for the records (sent first).
                        if this.watch.data(d, last, &mut this.pending) {
                            this.done = true;
                        }
                    }
                    this.held = Some(Some(Ok(frame)));
                }
                Some(Err(e)) => {
                    this.watch.error(&mut this.pending);
                    this.held = Some(Some(Err(e)));
                    this.done = true;
                }
                None => {
                    this.watch.end(&mut this.pending);
                    this.done = true;
                }
            }
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<W: Watch> Drop for Watched<W> {
    fn drop(&mut self) {
        self.watch.dropped(&mut self.pending);
        send_detached(&self.tx, &mut self.pending);
    }
}

/// A `process.Process/Start` or `/Connect` response stream, watched for the process's start
/// and end events.
pub(super) struct StreamTap {
    pub dec: EnvelopeDecoder,
    pub tap: Option<Recorded>,
    pub pid: Option<u32>,
}

impl StreamTap {
    fn feed(&mut self, data: &[u8], out: &mut VecDeque<NewRecord>) {
        self.dec.push(data);
        while let Ok(Some(f)) = self.dec.next_frame() {
            if f.is_end_stream() {
                let err = framing::parse_end_stream(&f.payload)
                    .ok()
                    .and_then(|e| e.error)
                    .map(|e| e.code.as_str().to_string());
                self.finish(err.as_deref().or(Some("stream ended")), out);
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
                    out.push_back(tap.record(Kind::Process, Value::Object(b)));
                }
                process_event::Event::End(e) => {
                    if let Some(r) = self.end_record(Some(&e), None) {
                        out.push_back(r);
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
    fn finish(&mut self, why: Option<&str>, out: &mut VecDeque<NewRecord>) {
        let Some(tap) = &self.tap else { return };
        if self.pid.is_none() {
            // Never started (or a Connect to a process that is gone).
            let mut b = tap.fields.clone();
            b.insert("pid".into(), Value::Null);
            b.insert("error".into(), why.unwrap_or("no start event").into());
            out.push_back(tap.record(Kind::Process, Value::Object(b)));
        } else if let Some(r) = self.end_record(None, why) {
            out.push_back(r);
        }
        self.tap = None;
    }
}

impl Watch for StreamTap {
    fn data(&mut self, d: &Bytes, _last: bool, out: &mut VecDeque<NewRecord>) -> bool {
        self.feed(d, out);
        false
    }

    fn error(&mut self, out: &mut VecDeque<NewRecord>) {
        self.finish(Some("stream broke off"), out);
    }

    fn end(&mut self, out: &mut VecDeque<NewRecord>) {
        self.finish(None, out);
    }

    fn dropped(&mut self, out: &mut VecDeque<NewRecord>) {
        if self.tap.is_some() {
            self.finish(Some("client went away"), out);
        }
    }
}

/// A download: bytes counted to the end of the body.
pub(super) struct CountOut {
    /// Bytes sent.
    pub bytes: u64,
    /// A gzip-encoded download is decoded to count the file's own bytes.
    pub gunzip: Option<flate2::write::GzDecoder<Counter>>,
    pub tap: Option<Recorded>,
}

impl CountOut {
    fn finish(&mut self, result: &str, out: &mut VecDeque<NewRecord>) {
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
        out.push_back(tap.record(Kind::File, Value::Object(b)));
    }
}

impl Watch for CountOut {
    fn data(&mut self, d: &Bytes, last: bool, out: &mut VecDeque<NewRecord>) -> bool {
        self.bytes += d.len() as u64;
        if let Some(g) = self.gunzip.as_mut() {
            use std::io::Write;
            if g.write_all(d).is_err() {
                self.gunzip = None;
            }
        }
        if last {
            self.finish("ok", out);
        }
        last
    }

    fn error(&mut self, out: &mut VecDeque<NewRecord>) {
        self.finish("aborted", out);
    }

    fn end(&mut self, out: &mut VecDeque<NewRecord>) {
        self.finish("ok", out);
    }

    fn dropped(&mut self, out: &mut VecDeque<NewRecord>) {
        self.finish("aborted", out);
    }
}

/// What passed of an upload's body: its size, first bytes and last bytes (multipart framing
/// is measured there).
#[derive(Default)]
pub(super) struct Upload {
    pub(super) bytes: AtomicU64,
    edges: Mutex<Edges>,
}

#[derive(Default)]
struct Edges {
    /// The first [`EDGE`] bytes.
    head: Vec<u8>,
    /// The last frames, together at least [`EDGE`] bytes when there were that many (shared
    /// with the body, not copied: a frame costs a reference count, not a copy).
    tail: VecDeque<Bytes>,
    tail_len: usize,
}

impl Upload {
    /// An upload read whole.
    pub(super) fn whole(body: &[u8]) -> Self {
        let tail = Bytes::copy_from_slice(&body[body.len().saturating_sub(EDGE)..]);
        Self {
            bytes: AtomicU64::new(body.len() as u64),
            edges: Mutex::new(Edges {
                head: body[..body.len().min(EDGE)].to_vec(),
                tail_len: tail.len(),
                tail: VecDeque::from([tail]),
            }),
        }
    }

    /// A frame of the body passed.
    pub(super) fn push(&self, d: &Bytes) {
        let before = self.bytes.fetch_add(d.len() as u64, Ordering::Relaxed);
        let mut e = self.edges.lock().unwrap_or_else(|p| p.into_inner());
        if before < EDGE as u64 {
            let room = EDGE.saturating_sub(e.head.len());
            e.head.extend_from_slice(&d[..d.len().min(room)]);
        }
        e.tail_len += d.len();
        e.tail.push_back(d.clone());
        while e.tail.front().is_some_and(|f| e.tail_len - f.len() >= EDGE) {
            if let Some(f) = e.tail.pop_front() {
                e.tail_len -= f.len();
            }
        }
    }

    /// The first bytes (at most [`EDGE`]).
    pub(super) fn head(&self) -> Vec<u8> {
        self.edges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .head
            .clone()
    }

    /// The last bytes (at most [`EDGE`]).
    pub(super) fn tail(&self) -> Vec<u8> {
        let e = self.edges.lock().unwrap_or_else(|p| p.into_inner());
        let mut t = Vec::with_capacity(e.tail_len);
        for f in &e.tail {
            t.extend_from_slice(f);
        }
        t.split_off(t.len().saturating_sub(EDGE))
    }
}

/// An upload streaming in: counted as it passes.
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
                this.up.push(d);
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
