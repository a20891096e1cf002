//! Reading DNS messages for the record: the question (name, type), the answer's rcode and its
//! address and alias records.

use std::net::{Ipv4Addr, Ipv6Addr};

/// The first question's name and type of a DNS message (`None` if malformed).
pub fn question(msg: &[u8]) -> Option<(String, u16)> {
    if msg.len() < 12 || u16::from_be_bytes([msg[4], msg[5]]) == 0 {
        return None;
    }
    let (name, end) = read_name(msg, 12)?;
    let t = msg.get(end..end + 2)?;
    Some((name, u16::from_be_bytes([t[0], t[1]])))
}

/// A name at `at` (following compression pointers) and where the name ends at `at`.
fn read_name(msg: &[u8], at: usize) -> Option<(String, usize)> {
    let (mut i, mut end, mut jumps) = (at, None, 0);
    let mut labels = Vec::new();
    loop {
        let len = *msg.get(i)? as usize;
        match len {
            0 => break,
            l if l & 0xc0 == 0xc0 => {
                let ptr = ((l & 0x3f) << 8) | *msg.get(i + 1)? as usize;
                end.get_or_insert(i + 2);
                jumps += 1;
                if jumps > 16 {
                    return None;
                }
                i = ptr;
                continue;
            }
            l if l > 63 => return None,
            l => {
                let label = msg.get(i + 1..i + 1 + l)?;
                labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
                i += 1 + l;
            }
        }
    }
    Some((labels.join("."), end.unwrap_or(i + 1)))
}

/// A record type's name (or its number).
pub fn type_name(t: u16) -> String {
    match t {
        1 => "A",
        2 => "NS",
        5 => "CNAME",
        6 => "SOA",
        12 => "PTR",
        15 => "MX",
        16 => "TXT",
        28 => "AAAA",
        33 => "SRV",
        65 => "HTTPS",
        255 => "ANY",
        _ => return t.to_string(),
    }
    .to_string()
}

/// An answer's rcode name.
pub fn rcode(msg: &[u8]) -> Option<String> {
    let code = msg.get(3)? & 0x0f;
    Some(
        match code {
            0 => "NOERROR",
            1 => "FORMERR",
            2 => "SERVFAIL",
            3 => "NXDOMAIN",
            4 => "NOTIMP",
            5 => "REFUSED",
            _ => return Some(code.to_string()),
        }
        .to_string(),
    )
}

/// An answer's A, AAAA and CNAME records, in order (what is malformed ends the list).
pub fn answers(msg: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    if msg.len() < 12 {
        return out;
    }
    let qd = u16::from_be_bytes([msg[4], msg[5]]);
    let an = u16::from_be_bytes([msg[6], msg[7]]);
    let mut i = 12;
    for _ in 0..qd {
        let Some((_, end)) = read_name(msg, i) else {
            return out;
        };
        i = end + 4;
    }
    for _ in 0..an {
        let Some((_, end)) = read_name(msg, i) else {
            return out;
        };
        let Some(h) = msg.get(end..end + 10) else {
            return out;
        };
        let t = u16::from_be_bytes([h[0], h[1]]);
        let len = usize::from(u16::from_be_bytes([h[8], h[9]]));
        let start = end + 10;
        let Some(data) = msg.get(start..start + len) else {
            return out;
        };
        match (t, len) {
            (1, 4) => out.push(Ipv4Addr::new(data[0], data[1], data[2], data[3]).to_string()),
            (28, 16) => {
                let mut b = [0u8; 16];
                b.copy_from_slice(data);
                out.push(Ipv6Addr::from(b).to_string());
            }
            (5, _) => {
                if let Some((n, _)) = read_name(msg, start) {
                    out.push(n);
                }
            }
            _ => {}
        }
        i = start + len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, t: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            q.push(l.len() as u8);
            q.extend(l.as_bytes());
        }
        q.push(0);
        q.extend(t.to_be_bytes());
        q.extend([0, 1]);
        q
    }

    #[test]
    fn questions_and_answers_are_read() {
        let q = query("www.Example.com", 1);
        assert_eq!(question(&q), Some(("www.example.com".into(), 1)));
        assert_eq!(question(&q[..14]), None);
        // An answer: CNAME www -> web.example.com (compressed), then A 198.51.100.10.
        let mut a = q.clone();
        a[2..4].copy_from_slice(&[0x81, 0x80]);
        a[6..8].copy_from_slice(&[0, 2]);
        a.extend([
            0xc0, 0x0c, 0, 5, 0, 1, 0, 0, 0, 60, 0, 6, 3, b'w', b'e', b'b', 0xc0, 0x10,
        ]);
        a.extend([0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 198, 51, 100, 10]);
        assert_eq!(rcode(&a).as_deref(), Some("NOERROR"));
        assert_eq!(answers(&a), vec!["web.example.com", "198.51.100.10"]);
        let mut nx = q.clone();
        nx[2..4].copy_from_slice(&[0x81, 0x83]);
        assert_eq!(rcode(&nx).as_deref(), Some("NXDOMAIN"));
        assert!(answers(&nx).is_empty());
        // A pointer loop ends.
        let mut bad = q;
        bad[6..8].copy_from_slice(&[0, 1]);
        bad.extend([0xc0, 0x21, 0xc0, 0x21]);
        assert!(answers(&bad).is_empty());
        assert_eq!(type_name(28), "AAAA");
        assert_eq!(type_name(99), "99");
    }
}
