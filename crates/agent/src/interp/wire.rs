//! The Jupyter messaging protocol's wire format: a multipart ZeroMQ message
//! `[identities…, "<IDS|MSG>", signature, header, parent_header, metadata, content, buffers…]`,
//! the signature being the hex HMAC-SHA256 of the four JSON frames under the connection key.

use bytes::Bytes;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use zeromq::ZmqMessage;

const DELIMITER: &[u8] = b"<IDS|MSG>";
/// The protocol version we speak (ipykernel 6 speaks 5.3).
pub const PROTOCOL_VERSION: &str = "5.3";

/// Errors decoding a message from a kernel.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("message without the <IDS|MSG> delimiter")]
    NoDelimiter,
    #[error("message too short")]
    Short,
    #[error("bad signature")]
    BadSignature,
    #[error("bad JSON frame: {0}")]
    Json(#[from] serde_json::Error),
}

/// A decoded (or to-be-sent) Jupyter message.
#[derive(Debug, Clone)]
pub struct Message {
    pub header: Value,
    pub parent_header: Value,
    pub metadata: Value,
    pub content: Value,
}

impl Message {
    /// A new request of `msg_type` in `session`, with a fresh message id.
    pub fn request(session: &str, msg_type: &str, content: Value) -> Message {
        Message {
            header: json!({
                "msg_id": super::new_id(),
                "session": session,
                "username": "kiln",
                "date": now_iso8601(),
                "msg_type": msg_type,
                "version": PROTOCOL_VERSION,
            }),
            parent_header: json!({}),
            metadata: json!({}),
            content,
        }
    }

    /// This message's id.
    pub fn id(&self) -> &str {
        self.header["msg_id"].as_str().unwrap_or_default()
    }

    /// This message's type (`execute_request`, `stream`, …).
    pub fn msg_type(&self) -> &str {
        self.header["msg_type"].as_str().unwrap_or_default()
    }

    /// The id of the request this message answers.
    pub fn parent_id(&self) -> &str {
        self.parent_header["msg_id"].as_str().unwrap_or_default()
    }
}

/// Signs and checks messages with one kernel's key.
#[derive(Clone)]
pub struct Signer {
    key: Vec<u8>,
}

impl Signer {
    pub fn new(key: &str) -> Signer {
        Signer {
            key: key.as_bytes().to_vec(),
        }
    }

    fn mac(&self, frames: &[&[u8]]) -> Hmac<Sha256> {
        // HMAC accepts keys of any length, so this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
        for f in frames {
            mac.update(f);
        }
        mac
    }

    /// The hex signature of the four JSON frames.
    pub fn sign(&self, frames: &[&[u8]]) -> String {
        hex(&self.mac(frames).finalize().into_bytes())
    }

    /// Encode `msg` for a DEALER socket (no identities).
    pub fn encode(&self, msg: &Message) -> ZmqMessage {
        let parts: Vec<Vec<u8>> = [&msg.header, &msg.parent_header, &msg.metadata, &msg.content]
            .iter()
            .map(|v| serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec()))
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        let sig = self.sign(&refs);
        let mut frames = vec![Bytes::from_static(DELIMITER), Bytes::from(sig.into_bytes())];
        frames.extend(parts.into_iter().map(Bytes::from));
        let mut out = ZmqMessage::from(frames.remove(0));
        for f in frames {
            out.push_back(f);
        }
        out
    }

    /// Decode and verify a message from a kernel.
    pub fn decode(&self, msg: &ZmqMessage) -> Result<Message, WireError> {
        let frames: Vec<&Bytes> = msg.iter().collect();
        let at = frames
            .iter()
            .position(|f| f.as_ref() == DELIMITER)
            .ok_or(WireError::NoDelimiter)?;
        let rest = &frames[at + 1..];
        if rest.len() < 5 {
            return Err(WireError::Short);
        }
        let body: Vec<&[u8]> = rest[1..5].iter().map(|b| b.as_ref()).collect();
        if !self.key.is_empty() {
            let want = unhex(rest[0]).ok_or(WireError::BadSignature)?;
            self.mac(&body)
                .verify_slice(&want)
                .map_err(|_| WireError::BadSignature)?;
        }
        Ok(Message {
            header: serde_json::from_slice(body[0])?,
            parent_header: serde_json::from_slice(body[1])?,
            metadata: serde_json::from_slice(body[2])?,
            content: serde_json::from_slice(body[3])?,
        })
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &[u8]) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.chunks(2)
        .map(|c| u8::from_str_radix(std::str::from_utf8(c).ok()?, 16).ok())
        .collect()
}

/// Current UTC time as ISO 8601 with microseconds (the protocol's `date`).
pub fn now_iso8601() -> String {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60,
        d.subsec_micros()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_tamper() {
        let s = Signer::new("secret");
        let m = Message::request("sess", "kernel_info_request", json!({"a": 1}));
        let wire = s.encode(&m);
        let back = s.decode(&wire).unwrap();
        assert_eq!(back.msg_type(), "kernel_info_request");
        assert_eq!(back.content["a"], 1);
        // Tampering with the content breaks the signature.
        let mut frames = wire.into_vec();
        frames[5] = Bytes::from_static(b"{\"a\":2}");
        let tampered = ZmqMessage::try_from(frames).unwrap();
        assert!(matches!(s.decode(&tampered), Err(WireError::BadSignature)));
    }

    #[test]
    fn known_hmac_vector() {
        // RFC 4231 test case 2.
        let s = Signer::new("Jefe");
        assert_eq!(
            s.sign(&[b"what do ya want ", b"for nothing?"]),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn date_format() {
        let d = now_iso8601();
        assert_eq!(d.len(), 27, "{d}");
        assert!(d.starts_with("20") && d.ends_with('Z'), "{d}");
    }
}
