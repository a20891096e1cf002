//! One `allowOut`/`denyOut` entry (an IPv4 network or a domain pattern) and how a domain
//! pattern matches a name: what the egress policy and the header rules both select hosts by.

use serde::Serialize;

use crate::{Cidr, NetError, Result};

/// One `allowOut`/`denyOut` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Target {
    Net(Cidr),
    /// `example.com` or `*.example.com` (lower-cased).
    Domain(String),
}

impl Target {
    pub fn parse(s: &str) -> Result<Self> {
        let t = s.trim();
        if t.is_empty() {
            return Err(NetError::Policy("empty allowOut/denyOut entry".into()));
        }
        if t.starts_with(|c: char| c.is_ascii_digit()) && t.parse::<Cidr>().is_ok() {
            return Ok(Target::Net(t.parse()?));
        }
        if t.contains(':') {
            return Err(NetError::Policy(format!(
                "{t:?}: IPv6 addresses are not supported (sandboxes have IPv4 only)"
            )));
        }
        let name = t.strip_prefix("*.").unwrap_or(t);
        let ok = !name.is_empty()
            && name.len() <= 253
            && name.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            })
            && !name
                .bytes()
                .all(|b| b.is_ascii_digit() || b == b'.' || b == b'/');
        if !ok {
            return Err(NetError::Policy(format!(
                "{t:?} is neither an IPv4 address, a CIDR block nor a domain name"
            )));
        }
        Ok(Target::Domain(t.to_ascii_lowercase()))
    }

    /// The entry as the API shows it (a single address without its `/32`).
    pub fn api_string(&self) -> String {
        match self {
            Target::Net(c) if c.prefix_len() == 32 => c.addr().to_string(),
            Target::Net(c) => c.to_string(),
            Target::Domain(d) => d.clone(),
        }
    }
}

/// `example.com` matches that name; `*.example.com` matches its subdomains.
pub fn domain_matches(pattern: &str, name: &str) -> bool {
    let name = name.trim_end_matches('.');
    match pattern.strip_prefix("*.") {
        Some(suffix) => name
            .strip_suffix(suffix)
            .is_some_and(|head| head.ends_with('.') && head.len() > 1),
        None => pattern == name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse() {
        assert_eq!(
            Target::parse("1.2.3.4").unwrap(),
            Target::Net("1.2.3.4/32".parse().unwrap())
        );
        assert_eq!(
            Target::parse("*.Example.com").unwrap(),
            Target::Domain("*.example.com".into())
        );
        for bad in ["", "1.2.3.4/40", "::1", "a..b", "exa mple.com", "1.2.3"] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn entries_show_as_the_api_wrote_them() {
        for s in ["1.2.3.4", "10.0.0.0/8", "*.example.com"] {
            assert_eq!(Target::parse(s).unwrap().api_string(), s);
        }
    }
}
