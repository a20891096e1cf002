//! What one audited request has gathered (its sandbox, the caller, the fields of its record,
//! when it started) and how that becomes records: the request side ([`super::tap`]) fills it,
//! and the response's body watchers ([`super::tap_body`]) finish it. Also the decoding both
//! sides share: the request's codec and Connect envelopes.

use std::time::Instant;

use bytes::Bytes;
use http::{header, HeaderMap};
use kiln_proto::framing::EnvelopeDecoder;
use kiln_proto::process::{self as pb, process_event};
use serde_json::{Map, Value};

use super::record::{Append, Kind, NewRecord};
use super::writer::Msg;
use super::AuditLog;

/// Bytes kept of an upload's start and end (multipart framing is measured there).
pub(super) const EDGE: usize = 8 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Codec {
    Json,
    Proto,
}

/// One request's record in the making.
pub(super) struct Recorded {
    pub(super) log: AuditLog,
    pub(super) sandbox: String,
    pub(super) codec: Codec,
    pub(super) started: Instant,
    pub(super) fields: Map<String, Value>,
}

impl Recorded {
    pub(super) async fn owner(&mut self) {
        if let Some(k) = self.log.owner(&self.sandbox).await {
            self.fields.insert("key".into(), k.into());
        }
    }

    pub(super) fn record(&self, kind: Kind, body: Value) -> NewRecord {
        NewRecord {
            sandbox_id: self.sandbox.clone(),
            ts_ms: crate::store::now_ms(),
            kind,
            body,
        }
    }

    pub(super) async fn emit(&self, kind: Kind) {
        if let Some(tx) = self.log.sender() {
            let r = self.record(kind, Value::Object(self.fields.clone()));
            let _ = tx.send(Msg::Append(Append::Record(r))).await;
        }
    }

    /// The process event in one envelope of a Start or Connect response.
    pub(super) fn decode_event(&self, payload: &[u8]) -> Option<process_event::Event> {
        decode::<pb::StartResponse>(self.codec, payload)?
            .event?
            .event
    }
}

pub(super) fn codec_of(h: &HeaderMap) -> Codec {
    let ct = h
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if ct.contains("proto") {
        Codec::Proto
    } else {
        Codec::Json
    }
}

pub(super) fn decode<M: prost::Message + Default + serde::de::DeserializeOwned>(
    codec: Codec,
    data: &[u8],
) -> Option<M> {
    match codec {
        Codec::Proto => M::decode(data).ok(),
        Codec::Json if data.iter().all(u8::is_ascii_whitespace) => {
            serde_json::from_slice(b"{}").ok()
        }
        Codec::Json => serde_json::from_slice(data).ok(),
    }
}

/// The payload of the first envelope of an enveloped (streaming) request.
pub(super) fn first_envelope(body: &[u8]) -> Option<Bytes> {
    let mut d = EnvelopeDecoder::new(body.len().max(16));
    d.push(body);
    d.next_frame().ok().flatten().map(|f| f.payload)
}

/// Counts what is written to it (the size of a gzip-encoded download, decoded).
pub(super) struct Counter(pub(super) u64);

impl std::io::Write for Counter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0 += b.len() as u64;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
