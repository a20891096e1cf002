//! Server side of the Connect protocol: codecs (JSON and binary protobuf), unary and streaming
//! envelopes, and errors.

use std::io;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use http::{header, HeaderMap, Response, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use kiln_proto::connect::{Code, ErrorBody};
use kiln_proto::framing::{self, EnvelopeDecoder, FramingError};
use serde::{de::DeserializeOwned, Serialize};
use tokio::sync::mpsc;

/// Response body type of every handler.
pub type Body = UnsyncBoxBody<Bytes, io::Error>;

/// Largest unary request body and single streamed message accepted.
pub const MAX_MESSAGE: usize = 32 << 20;

/// Anything a Connect handler can receive or send.
pub trait Msg: prost::Message + Default + Serialize + DeserializeOwned + Send + 'static {}
impl<T: prost::Message + Default + Serialize + DeserializeOwned + Send + 'static> Msg for T {}

/// Message encoding negotiated from the request's content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Json,
    Proto,
}

/// A Connect error.
#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(m: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(Code::NotFound, m)
    }
    pub fn internal(m: impl Into<String>) -> Self {
        Self::new(Code::Internal, m)
    }
    /// Map an I/O error on `what` to the matching code.
    pub fn io(what: &str, e: &io::Error) -> Self {
        let code = match e.kind() {
            io::ErrorKind::NotFound => Code::NotFound,
            io::ErrorKind::PermissionDenied => Code::PermissionDenied,
            io::ErrorKind::AlreadyExists => Code::AlreadyExists,
            io::ErrorKind::InvalidInput | io::ErrorKind::InvalidData => Code::InvalidArgument,
            _ => match e.raw_os_error() {
                Some(libc::ENOTDIR)
                | Some(libc::EISDIR)
                | Some(libc::ENOTEMPTY)
                | Some(libc::ELOOP)
                | Some(libc::ENAMETOOLONG) => Code::InvalidArgument,
                Some(libc::ENOSPC) | Some(libc::EDQUOT) => Code::ResourceExhausted,
                _ => Code::Internal,
            },
        };
        RpcError::new(code, format!("{what}: {e}"))
    }
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

/// The kind of Connect call a content type denotes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    Unary(Codec),
    Stream(Codec),
}

/// Classify the request content type (`None`: unsupported).
pub fn call_kind(headers: &HeaderMap) -> Option<CallKind> {
    let ct = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    let ct = ct.split(';').next()?.trim().to_ascii_lowercase();
    match ct.as_str() {
        "application/json" => Some(CallKind::Unary(Codec::Json)),
        "application/proto" | "application/protobuf" => Some(CallKind::Unary(Codec::Proto)),
        "application/connect+json" => Some(CallKind::Stream(Codec::Json)),
        "application/connect+proto" => Some(CallKind::Stream(Codec::Proto)),
        _ => None,
    }
}

/// `connect-timeout-ms` of the request, if any.
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    let v = headers
        .get("connect-timeout-ms")?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(Duration::from_millis(v))
}

pub fn decode<M: Msg>(codec: Codec, data: &[u8]) -> Result<M, RpcError> {
    match codec {
        Codec::Proto => M::decode(data)
            .map_err(|e| RpcError::invalid(format!("malformed protobuf request: {e}"))),
        Codec::Json => {
            let data = if data.iter().all(u8::is_ascii_whitespace) {
                b"{}".as_slice()
            } else {
                data
            };
            serde_json::from_slice(data)
                .map_err(|e| RpcError::invalid(format!("malformed JSON request: {e}")))
        }
    }
}

pub fn encode<M: Msg>(codec: Codec, m: &M) -> Bytes {
    match codec {
        Codec::Proto => Bytes::from(m.encode_to_vec()),
        Codec::Json => Bytes::from(serde_json::to_vec(m).unwrap_or_else(|_| b"{}".to_vec())),
    }
}

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub fn empty() -> Body {
    full(Bytes::new())
}

/// Read a whole body, refusing more than `limit` bytes.
pub async fn read_body(body: Incoming, limit: usize) -> Result<Bytes, RpcError> {
    let limited = http_body_util::Limited::new(body, limit);
    match limited.collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => Err(RpcError::new(
            Code::ResourceExhausted,
            format!("request body unreadable or larger than {limit} bytes: {e}"),
        )),
    }
}

/// Unary error response (Connect JSON error body with the code's HTTP status).
pub fn error_response(err: &RpcError) -> Response<Body> {
    let body = serde_json::to_vec(&ErrorBody {
        code: err.code,
        message: err.message.clone(),
    })
    .unwrap_or_default();
    Response::builder()
        .status(
            StatusCode::from_u16(err.code.http_status())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        )
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(body))
        .expect("static response parts are valid")
}

pub fn unary_response<M: Msg>(codec: Codec, r: Result<M, RpcError>) -> Response<Body> {
    match r {
        Ok(m) => Response::builder()
            .status(StatusCode::OK)
            .header(
                header::CONTENT_TYPE,
                if codec == Codec::Json {
                    "application/json"
                } else {
                    "application/proto"
                },
            )
            .body(full(encode(codec, &m)))
            .expect("static response parts are valid"),
        Err(e) => error_response(&e),
    }
}

/// Sending half of a server-streaming response.
pub struct StreamWriter {
    codec: Codec,
    tx: mpsc::Sender<Result<Frame<Bytes>, io::Error>>,
}

impl StreamWriter {
    /// Send one message; `false` when the client went away.
    pub async fn send<M: Msg>(&self, m: &M) -> bool {
        let payload = encode(self.codec, m);
        self.tx
            .send(Ok(Frame::data(framing::encode(0, &payload))))
            .await
            .is_ok()
    }

    /// Finish the stream (successfully or with an error).
    pub async fn finish(self, err: Option<RpcError>) {
        let end = framing::end_stream(err.map(|e| ErrorBody {
            code: e.code,
            message: e.message,
        }));
        let _ = self.tx.send(Ok(Frame::data(end))).await;
    }

    /// Resolves when the client stopped reading (the response body was dropped).
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// Build a streaming response and the writer feeding it.
pub fn stream_response(codec: Codec) -> (Response<Body>, StreamWriter) {
    let (tx, rx) = mpsc::channel(16);
    let body = StreamBody::new(ReceiverStream(rx)).boxed_unsync();
    let resp = Response::builder()
        .status(StatusCode::OK)
        .header(
            header::CONTENT_TYPE,
            if codec == Codec::Json {
                "application/connect+json"
            } else {
                "application/connect+proto"
            },
        )
        .body(body)
        .expect("static response parts are valid");
    (resp, StreamWriter { codec, tx })
}

/// A streaming response that only carries an error (Connect streams answer HTTP 200).
pub fn stream_error(codec: Codec, err: RpcError) -> Response<Body> {
    let end = framing::end_stream(Some(ErrorBody {
        code: err.code,
        message: err.message,
    }));
    Response::builder()
        .status(StatusCode::OK)
        .header(
            header::CONTENT_TYPE,
            if codec == Codec::Json {
                "application/connect+json"
            } else {
                "application/connect+proto"
            },
        )
        .body(full(end))
        .expect("static response parts are valid")
}

struct ReceiverStream<T>(mpsc::Receiver<T>);

impl<T> Stream for ReceiverStream<T> {
    type Item = T;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        self.0.poll_recv(cx)
    }
}

/// The next message buffered in `decoder`: `None` when more input is needed, `Some(None)` at
/// the end-of-stream envelope, `Some(Some(m))` for a message.
pub fn next_message<M: Msg>(
    decoder: &mut EnvelopeDecoder,
    codec: Codec,
) -> Result<Option<Option<M>>, RpcError> {
    let frame = decoder.next_frame().map_err(|e| match e {
        FramingError::TooLarge { .. } => RpcError::new(Code::ResourceExhausted, e.to_string()),
        _ => RpcError::invalid(e.to_string()),
    })?;
    let Some(f) = frame else { return Ok(None) };
    if f.is_compressed() {
        return Err(RpcError::new(
            Code::Unimplemented,
            "compressed messages are not supported (send identity encoding)",
        ));
    }
    if f.is_end_stream() {
        return Ok(Some(None));
    }
    decode(codec, &f.payload).map(|m| Some(Some(m)))
}

/// Reader of enveloped request messages (server and client streaming requests).
pub struct EnvelopeReader {
    body: Incoming,
    decoder: EnvelopeDecoder,
    codec: Codec,
}

impl EnvelopeReader {
    pub fn new(body: Incoming, codec: Codec) -> Self {
        EnvelopeReader {
            body,
            decoder: EnvelopeDecoder::new(MAX_MESSAGE),
            codec,
        }
    }

    /// Reads and discards the rest of the request body. A server-streaming call reads one
    /// message and then only answers; reading the body to its end keeps the connection in a
    /// clean state (nothing unread when it is closed or reused). Run it in its own task beside
    /// the answer.
    pub async fn drain(mut self) {
        while let Some(Ok(_)) = self.body.frame().await {}
    }

    /// Next message; `Ok(None)` at end of the request stream.
    pub async fn next<M: Msg>(&mut self) -> Result<Option<M>, RpcError> {
        loop {
            if let Some(m) = next_message(&mut self.decoder, self.codec)? {
                return Ok(m);
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.decoder.push(&d);
                    }
                }
                Some(Err(e)) => {
                    return Err(RpcError::new(
                        Code::Canceled,
                        format!("request stream broke: {e}"),
                    ))
                }
                None => {
                    return self
                        .decoder
                        .finish()
                        .map(|()| None)
                        .map_err(|e| RpcError::invalid(format!("request {e}")))
                }
            }
        }
    }
}
