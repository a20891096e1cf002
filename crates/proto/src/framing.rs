//! Connect envelope framing, the one copy every kiln component uses: encoding an envelope
//! (flags byte, big-endian `u32` length, payload), an incremental decoder fed with whatever
//! chunks the transport delivers, and the JSON end-of-stream message.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::connect::{EndStream, ErrorBody, FLAG_COMPRESSED, FLAG_END_STREAM};

/// Bytes before the payload: one flags byte and a big-endian `u32` length.
pub const HEADER_LEN: usize = 5;

/// Appends one envelope to `buf`.
///
/// # Panics
/// If `payload` is longer than `u32::MAX` bytes (the length field cannot say it).
pub fn encode_into(buf: &mut BytesMut, flags: u8, payload: &[u8]) {
    let len = u32::try_from(payload.len()).expect("Connect message longer than 4 GiB");
    buf.reserve(HEADER_LEN + payload.len());
    buf.put_u8(flags);
    buf.put_u32(len);
    buf.put_slice(payload);
}

/// One envelope holding `payload`.
pub fn encode(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER_LEN + payload.len());
    encode_into(&mut b, flags, payload);
    b.freeze()
}

/// The end-of-stream envelope (flag [`FLAG_END_STREAM`], JSON payload), carrying `error` if any.
pub fn end_stream(error: Option<ErrorBody>) -> Bytes {
    let payload = serde_json::to_vec(&EndStream { error }).unwrap_or_else(|_| b"{}".to_vec());
    encode(FLAG_END_STREAM, &payload)
}

/// Parses the JSON payload of an end-of-stream envelope (an empty payload means success).
pub fn parse_end_stream(payload: &[u8]) -> Result<EndStream, FramingError> {
    if payload.iter().all(u8::is_ascii_whitespace) {
        return Ok(EndStream::default());
    }
    serde_json::from_slice(payload).map_err(|e| FramingError::BadEndStream(e.to_string()))
}

/// One decoded envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub flags: u8,
    pub payload: Bytes,
}

impl Frame {
    /// This is the end-of-stream message.
    pub fn is_end_stream(&self) -> bool {
        self.flags & FLAG_END_STREAM != 0
    }

    /// The payload is compressed (kiln never negotiates compression).
    pub fn is_compressed(&self) -> bool {
        self.flags & FLAG_COMPRESSED != 0
    }
}

/// What can go wrong while decoding envelopes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    #[error("message of {len} bytes exceeds the {limit} byte limit")]
    TooLarge { len: usize, limit: usize },
    #[error("stream ended inside an envelope ({0} stray bytes)")]
    Truncated(usize),
    #[error("malformed end-of-stream message: {0}")]
    BadEndStream(String),
}

/// Incremental envelope decoder: [`push`](Self::push) bytes as they arrive, then
/// [`next_frame`](Self::next_frame) until it answers `None`.
#[derive(Debug)]
pub struct EnvelopeDecoder {
    buf: BytesMut,
    limit: usize,
}

impl EnvelopeDecoder {
    /// A decoder refusing messages longer than `limit` bytes.
    pub fn new(limit: usize) -> Self {
        EnvelopeDecoder {
            buf: BytesMut::new(),
            limit,
        }
    }

    /// Buffers more input.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Bytes buffered but not yet returned as a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete envelope, `Ok(None)` when more input is needed. A header announcing a
    /// message over the limit is an error as soon as the header is complete.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FramingError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.limit {
            return Err(FramingError::TooLarge {
                len,
                limit: self.limit,
            });
        }
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let flags = self.buf[0];
        self.buf.advance(HEADER_LEN);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Frame { flags, payload }))
    }

    /// Call at the end of input: an error if a partial envelope is left.
    pub fn finish(&self) -> Result<(), FramingError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FramingError::Truncated(self.buf.len()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connect::Code;

    #[test]
    fn encodes_flags_length_and_payload() {
        assert_eq!(&encode(2, b"{}")[..], &[2, 0, 0, 0, 2, b'{', b'}']);
        assert_eq!(&encode(0, b"")[..], &[0, 0, 0, 0, 0]);
        let mut b = BytesMut::new();
        encode_into(&mut b, 0, b"a");
        encode_into(&mut b, 1, b"bc");
        assert_eq!(&b[..], &[0, 0, 0, 0, 1, b'a', 1, 0, 0, 0, 2, b'b', b'c']);
    }

    #[test]
    fn frames_split_across_reads_come_out_whole() {
        let mut wire = BytesMut::new();
        encode_into(&mut wire, 0, b"first message");
        encode_into(&mut wire, 0, &[7u8; 300]);
        wire.extend_from_slice(&end_stream(None));
        // Feed the stream one byte at a time, then in uneven chunks: same frames either way.
        for chunk in [1usize, 3, 7, 1000] {
            let mut d = EnvelopeDecoder::new(1024);
            let mut got = Vec::new();
            for piece in wire.chunks(chunk) {
                d.push(piece);
                while let Some(f) = d.next_frame().unwrap() {
                    got.push(f);
                }
            }
            d.finish().unwrap();
            assert_eq!(got.len(), 3, "chunk size {chunk}");
            assert_eq!(&got[0].payload[..], b"first message");
            assert_eq!(&got[1].payload[..], &[7u8; 300][..]);
            assert!(!got[1].is_end_stream());
            assert!(got[2].is_end_stream());
            assert_eq!(parse_end_stream(&got[2].payload).unwrap().error, None);
        }
    }

    #[test]
    fn oversize_frame_is_refused_from_its_header() {
        let mut d = EnvelopeDecoder::new(16);
        d.push(&encode(0, &[0u8; 16]));
        assert_eq!(d.next_frame().unwrap().unwrap().payload.len(), 16);
        // Only the header of a 17-byte message: refused without waiting for the payload.
        d.push(&[0, 0, 0, 0, 17]);
        assert_eq!(
            d.next_frame(),
            Err(FramingError::TooLarge { len: 17, limit: 16 })
        );
    }

    #[test]
    fn truncated_input_is_reported_at_finish() {
        let mut d = EnvelopeDecoder::new(64);
        d.push(&encode(0, b"hello")[..7]);
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(d.buffered(), 7);
        assert_eq!(d.finish(), Err(FramingError::Truncated(7)));
    }

    #[test]
    fn end_stream_with_error_round_trips() {
        let env = end_stream(Some(ErrorBody {
            code: Code::NotFound,
            message: "no such process".into(),
        }));
        let mut d = EnvelopeDecoder::new(1024);
        d.push(&env);
        let f = d.next_frame().unwrap().unwrap();
        assert!(f.is_end_stream());
        assert!(!f.is_compressed());
        let json: serde_json::Value = serde_json::from_slice(&f.payload).unwrap();
        assert_eq!(json["error"]["code"], "not_found");
        let end = parse_end_stream(&f.payload).unwrap();
        let err = end.error.unwrap();
        assert_eq!(err.code, Code::NotFound);
        assert_eq!(err.message, "no such process");
        assert!(parse_end_stream(b"").unwrap().error.is_none());
        assert!(matches!(
            parse_end_stream(b"{\"error\":{\"code\":\"bogus\"}}"),
            Err(FramingError::BadEndStream(_))
        ));
    }
}
