//! Naming a connection from its first bytes: the server name of a TLS ClientHello (SNI) and
//! the `Host` of an HTTP/1 request.

/// What the first bytes say.
#[derive(Debug, PartialEq, Eq)]
pub enum Peek {
    /// The name (lower-cased, without a port).
    Name(String),
    /// Complete, but no name in it.
    NoName,
    /// More bytes are needed.
    Incomplete,
}

/// The SNI of a TLS ClientHello at the start of `b`.
pub fn tls_server_name(b: &[u8]) -> Peek {
    if b.len() < 5 {
        return Peek::Incomplete;
    }
    if b[0] != 22 {
        return Peek::NoName;
    }
    let rec_len = usize::from(u16::from_be_bytes([b[3], b[4]]));
    if b.len() < 5 + rec_len {
        return Peek::Incomplete;
    }
    parse_client_hello(&b[5..5 + rec_len]).map_or(Peek::NoName, Peek::Name)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Some(h)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| usize::from(b[0]))
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    }
}

fn parse_client_hello(h: &[u8]) -> Option<String> {
    let mut r = Reader(h);
    if r.u8()? != 1 {
        return None;
    }
    r.take(3)?; // handshake length
    r.take(2 + 32)?; // version, random
    let n = r.u8()?;
    r.take(n)?; // session id
    let n = r.u16()?;
    r.take(n)?; // cipher suites
    let n = r.u8()?;
    r.take(n)?; // compression methods
    let n = r.u16()?;
    let mut ext = Reader(r.take(n)?);
    while !ext.0.is_empty() {
        let typ = ext.u16()?;
        let len = ext.u16()?;
        let body = ext.take(len)?;
        if typ != 0 {
            continue;
        }
        let mut names = Reader(body);
        let list = names.u16()?;
        let mut list = Reader(names.take(list)?);
        while !list.0.is_empty() {
            let kind = list.u8()?;
            let len = list.u16()?;
            let name = list.take(len)?;
            if kind == 0 {
                return Some(String::from_utf8_lossy(name).to_ascii_lowercase());
            }
        }
    }
    None
}

/// The `Host` of the HTTP/1 request at the start of `b`.
pub fn http_host(b: &[u8]) -> Peek {
    let Some(end) = b.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if b.len() > 16 * 1024 {
            Peek::NoName
        } else {
            Peek::Incomplete
        };
    };
    let head = String::from_utf8_lossy(&b[..end]);
    for line in head.split("\r\n").skip(1) {
        if let Some((k, v)) = line.split_once(':') {
            if k.trim().eq_ignore_ascii_case("host") {
                let v = v.trim();
                let name = match v.rsplit_once(':') {
                    Some((h, p)) if p.bytes().all(|c| c.is_ascii_digit()) => h,
                    _ => v,
                };
                return Peek::Name(name.trim_end_matches('.').to_ascii_lowercase());
            }
        }
    }
    Peek::NoName
}

/// A minimal TLS ClientHello naming `name` (for tests and probes).
pub fn client_hello(name: &str) -> Vec<u8> {
    let mut sni = Vec::new();
    let n = name.as_bytes();
    sni.extend(((n.len() + 3) as u16).to_be_bytes());
    sni.push(0);
    sni.extend((n.len() as u16).to_be_bytes());
    sni.extend(n);
    let mut ext = vec![0, 0];
    ext.extend((sni.len() as u16).to_be_bytes());
    ext.extend(sni);
    let mut body = vec![3, 3];
    body.extend([0u8; 32]);
    body.push(0); // session id
    body.extend([0, 2, 0x13, 0x01]); // one cipher suite
    body.extend([1, 0]); // compression: null
    body.extend((ext.len() as u16).to_be_bytes());
    body.extend(ext);
    let mut hs = vec![1];
    hs.extend(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend(body);
    let mut rec = vec![22, 3, 1];
    rec.extend((hs.len() as u16).to_be_bytes());
    rec.extend(hs);
    rec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sni_is_read() {
        let hello = client_hello("Www.Example.com");
        assert_eq!(
            tls_server_name(&hello),
            Peek::Name("www.example.com".into())
        );
        assert_eq!(tls_server_name(&hello[..20]), Peek::Incomplete);
        assert_eq!(tls_server_name(b"GET / HTTP/1.1\r\n"), Peek::NoName);
    }

    #[test]
    fn host_is_read() {
        let req = b"GET / HTTP/1.1\r\nUser-Agent: x\r\nHOST: Example.com:8080\r\n\r\n";
        assert_eq!(http_host(req), Peek::Name("example.com".into()));
        assert_eq!(http_host(b"GET / HTTP/1.1\r\nHost: a"), Peek::Incomplete);
        assert_eq!(http_host(b"GET / HTTP/1.0\r\n\r\n"), Peek::NoName);
    }
}
