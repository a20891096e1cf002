//! Entry points of the `cargo fuzz` targets in `fuzz/` (and of `tests/fuzz_corpus.rs`, which
//! runs them on stable Rust): the agent's parsers of untrusted request bytes, each driven by one
//! fuzz input. Errors are expected answers; a panic (an invariant below breaking, or a crash in
//! the parser) is a finding.

use bytes::Bytes;
use futures::StreamExt;
use kiln_proto::envd::InitRequest;
use kiln_proto::filesystem as fspb;
use kiln_proto::framing::{self, EnvelopeDecoder};
use kiln_proto::process as pb;

use crate::files::{parse_query, percent_decode, FileParts};
use crate::rpc::{self, Codec, Msg};

/// Reads the fields of a fuzz input front to back (zeros once it runs out).
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    /// Up to the next `\n` (not included), at most `max` bytes.
    fn line(&mut self, max: usize) -> &'a [u8] {
        let end = self
            .0
            .iter()
            .take(max)
            .position(|&b| b == b'\n')
            .unwrap_or(self.0.len().min(max));
        let (l, rest) = self.0.split_at(end);
        self.0 = rest.strip_prefix(b"\n").unwrap_or(rest);
        l
    }
}

/// Splits `body` into chunks whose sizes cycle through `sizes` (each 1..=256).
fn chunks(body: &[u8], sizes: &[u8]) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut rest = body;
    let mut i = 0;
    while !rest.is_empty() {
        let n = sizes
            .get(i % sizes.len().max(1))
            .map_or(rest.len(), |&s| usize::from(s) + 1)
            .min(rest.len());
        let (a, b) = rest.split_at(n);
        out.push(Bytes::copy_from_slice(a));
        rest = b;
        i += 1;
    }
    out
}

/// The multipart upload parser (`POST /files`, `multipart/form-data`).
///
/// Input: `flags, chunk sizes (4), content type or boundary line, path line, body`. Flag bit 0:
/// signed URL; bit 1: a `path` parameter; bit 2: the first line is the boundary only.
/// Checked: a signed upload never writes a part anywhere but `path`; the parts' bytes never
/// exceed the body's.
pub fn multipart_upload(data: &[u8]) {
    let mut input = Input(data);
    let flags = input.u8();
    let sizes = [input.u8(), input.u8(), input.u8(), input.u8()];
    let first = String::from_utf8_lossy(input.line(256)).into_owned();
    let content_type = if flags & 4 != 0 {
        format!("multipart/form-data; boundary={first}")
    } else {
        first
    };
    let path_line = String::from_utf8_lossy(input.line(256)).into_owned();
    let path = (flags & 2 != 0).then_some(path_line.as_str());
    let signed = flags & 1 != 0;
    let body = input.0;
    let stream = futures::stream::iter(
        chunks(body, &sizes)
            .into_iter()
            .map(Ok::<_, std::convert::Infallible>),
    );
    let Ok(mut parts) = FileParts::new(&content_type, stream, path, signed) else {
        return;
    };
    futures::executor::block_on(async {
        let mut total = 0usize;
        while let Ok(Some((target, mut field))) = parts.next().await {
            if signed {
                assert_eq!(Some(target.as_str()), path, "signed part outside its path");
            }
            while let Some(chunk) = field.next().await {
                match chunk {
                    Ok(c) => total += c.len(),
                    Err(_) => break,
                }
            }
            assert!(total <= body.len(), "parts carry more bytes than the body");
        }
    });
}

/// Connect envelope framing of streaming requests, and the messages inside.
///
/// Input: `limit / 4, codec and message kind, chunk sizes (4), stream bytes`. Checked: the
/// frames and what stays buffered re-encode to exactly the bytes pushed (nothing lost, nothing
/// invented), an oversize header is refused, and the agent's reader
/// ([`rpc::next_message`]) takes the same stream without panicking.
pub fn connect_envelopes(data: &[u8]) {
    let mut input = Input(data);
    let limit = usize::from(input.u8()) * 4;
    let sel = input.u8();
    let sizes = [input.u8(), input.u8(), input.u8(), input.u8()];
    let stream = input.0;
    let pieces = chunks(stream, &sizes);

    // The raw decoder: frames + leftover == input, up to the first error.
    let mut d = EnvelopeDecoder::new(limit);
    let mut seen = Vec::new();
    let mut pushed = 0usize;
    'outer: for p in &pieces {
        d.push(p);
        pushed += p.len();
        loop {
            match d.next_frame() {
                Ok(Some(f)) => {
                    assert!(f.payload.len() <= limit, "frame over the limit");
                    if f.is_end_stream() {
                        let _ = framing::parse_end_stream(&f.payload);
                    }
                    seen.extend_from_slice(&framing::encode(f.flags, &f.payload));
                }
                Ok(None) => break,
                Err(framing::FramingError::TooLarge { len, .. }) => {
                    assert!(len > limit, "refused a frame within the limit");
                    break 'outer;
                }
                Err(e) => panic!("next_frame failed with {e}"),
            }
        }
        assert_eq!(seen.len() + d.buffered(), pushed, "bytes lost or invented");
        assert_eq!(
            &seen[..],
            &stream[..seen.len()],
            "frames differ from the input"
        );
    }
    if d.finish().is_ok() {
        assert_eq!(seen.len(), pushed);
    }

    // The agent's reader over the same chunks, as each streaming method reads it.
    let codec = if sel & 1 == 0 {
        Codec::Json
    } else {
        Codec::Proto
    };
    match (sel >> 1) % 4 {
        0 => read_all::<pb::StartRequest>(&pieces, limit, codec),
        1 => read_all::<pb::ConnectRequest>(&pieces, limit, codec),
        2 => read_all::<pb::StreamInputRequest>(&pieces, limit, codec),
        _ => read_all::<fspb::WatchDirRequest>(&pieces, limit, codec),
    }
}

fn read_all<M: Msg>(pieces: &[Bytes], limit: usize, codec: Codec) {
    let mut d = EnvelopeDecoder::new(limit);
    for p in pieces {
        d.push(p);
        loop {
            match rpc::next_message::<M>(&mut d, codec) {
                Ok(Some(Some(_))) => {}
                Ok(None) => break,
                Ok(Some(None)) | Err(_) => return,
            }
        }
    }
}

/// Decodes `payload` as `M` with `codec`; a message that decodes must survive a round trip
/// through the agent's own encoder unchanged.
fn round_trip<M: Msg + PartialEq + std::fmt::Debug>(codec: Codec, payload: &[u8]) {
    let Ok(m) = rpc::decode::<M>(codec, payload) else {
        return;
    };
    let again = rpc::encode(codec, &m);
    let back: M = rpc::decode(codec, &again)
        .unwrap_or_else(|e| panic!("re-encoded message does not decode: {e} ({again:?})"));
    assert_eq!(back, m, "round trip changed the message");
}

/// Unary Connect request bodies (JSON and binary protobuf) of every method the agent serves,
/// and the `/init` JSON body.
///
/// Input: `method, codec, body`.
pub fn connect_messages(data: &[u8]) {
    let mut input = Input(data);
    let method = input.u8();
    let codec = if input.u8() & 1 == 0 {
        Codec::Json
    } else {
        Codec::Proto
    };
    let body = input.0;
    match method % 18 {
        0 => round_trip::<pb::ListRequest>(codec, body),
        1 => round_trip::<pb::StartRequest>(codec, body),
        2 => round_trip::<pb::ConnectRequest>(codec, body),
        3 => round_trip::<pb::UpdateRequest>(codec, body),
        4 => round_trip::<pb::StreamInputRequest>(codec, body),
        5 => round_trip::<pb::SendInputRequest>(codec, body),
        6 => round_trip::<pb::SendSignalRequest>(codec, body),
        7 => round_trip::<pb::CloseStdinRequest>(codec, body),
        8 => round_trip::<fspb::StatRequest>(codec, body),
        9 => round_trip::<fspb::MakeDirRequest>(codec, body),
        10 => round_trip::<fspb::MoveRequest>(codec, body),
        11 => round_trip::<fspb::ListDirRequest>(codec, body),
        12 => round_trip::<fspb::RemoveRequest>(codec, body),
        13 => round_trip::<fspb::WatchDirRequest>(codec, body),
        14 => round_trip::<fspb::CreateWatcherRequest>(codec, body),
        15 => round_trip::<fspb::GetWatcherEventsRequest>(codec, body),
        16 => round_trip::<fspb::RemoveWatcherRequest>(codec, body),
        _ => {
            let _ = serde_json::from_slice::<InitRequest>(body);
        }
    }
}

/// Percent-decoding as RFC 3986 defines it: `%` and two hex digits make a byte, `+` a space,
/// anything else stays as it is.
fn reference_percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |c: u8| char::from(c).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push(h << 4 | l);
                i += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                i += 1;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The `/files` query string (path, user and signature parameters).
///
/// Checked: percent-decoding agrees with [`reference_percent_decode`], and the parsed path is
/// the decoded value of the last `path=` pair.
pub fn files_query(data: &[u8]) {
    let q = String::from_utf8_lossy(data);
    assert_eq!(percent_decode(&q), reference_percent_decode(&q), "{q:?}");
    let parsed = parse_query(Some(&q));
    let last_path = q
        .split('&')
        .filter_map(|p| p.split_once('=').or(Some((p, ""))))
        .rfind(|(k, _)| reference_percent_decode(k) == "path")
        .map(|(_, v)| reference_percent_decode(v));
    assert_eq!(parsed.path, last_path);
    let _ = crate::files::signature(
        parsed.path.as_deref().unwrap_or(""),
        "write",
        parsed.username.as_deref().unwrap_or(""),
        "token",
        parsed
            .signature_expiration
            .as_deref()
            .and_then(|e| e.parse().ok()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding_takes_only_two_hex_digits() {
        // `u8::from_str_radix` accepts a sign: "%+1" decoded to byte 1 before.
        assert_eq!(percent_decode("%+1x"), "% 1x");
        assert_eq!(percent_decode("%-0"), "%-0");
        assert_eq!(percent_decode("a%2Fb%2"), "a/b%2");
        assert_eq!(percent_decode("%e9%"), "\u{fffd}%");
        files_query(b"path=%+2F&path=%2F%2b");
    }

    #[test]
    fn signed_multipart_parts_stay_on_the_signed_path() {
        let mut input = b"\x07\x03\x05\xff\x00B\n/home/user/a\n".to_vec();
        input.extend_from_slice(
            b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/etc/x\"\r\n\r\n\
              one\r\n--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/etc/y\"\r\n\
              \r\ntwo\r\n--B--\r\n",
        );
        multipart_upload(&input);
        let body = futures::stream::iter(vec![Ok::<_, std::convert::Infallible>(
            Bytes::copy_from_slice(&input[17..]),
        )]);
        let mut parts = FileParts::new(
            "multipart/form-data; boundary=B",
            body,
            Some("/home/user/a"),
            true,
        )
        .unwrap();
        futures::executor::block_on(async {
            let (t, _) = parts.next().await.unwrap().unwrap();
            assert_eq!(t, "/home/user/a");
            let err = parts.next().await.err().unwrap();
            assert_eq!(err.0, http::StatusCode::UNAUTHORIZED);
        });
    }

    #[test]
    fn envelopes_and_messages() {
        let mut wire = vec![64, 1, 3, 7, 0, 255];
        wire.extend_from_slice(&framing::encode(0, br#"{"process":{"cmd":"/bin/true"}}"#));
        wire.extend_from_slice(&framing::end_stream(None));
        wire.extend_from_slice(&[0, 0, 0, 1]);
        connect_envelopes(&wire);
        connect_messages(b"\x01\x00{\"process\":{\"cmd\":\"ls\",\"args\":[\"-l\"]},\"tag\":\"t\"}");
        connect_messages(b"\x0b\x01\x0a\x01/\x10\x02");
        connect_messages(b"\x11\x00{\"envVars\":{\"A\":\"1\"}}");
    }
}
