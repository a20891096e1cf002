//! IPv4 CIDR blocks: parsing, containment, overlap, and the slot addresses of a host range.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use crate::NetError;

/// An IPv4 network (`a.b.c.d/len`); the address is stored with its host bits cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    base: u32,
    len: u8,
}

impl Cidr {
    pub fn new(addr: Ipv4Addr, len: u8) -> Result<Self, NetError> {
        if len > 32 {
            return Err(NetError::Config(format!("prefix length {len} is over 32")));
        }
        Ok(Self {
            base: u32::from(addr) & Self::mask_of(len),
            len,
        })
    }

    fn mask_of(len: u8) -> u32 {
        if len == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(len))
        }
    }

    pub fn addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.base)
    }

    pub fn prefix_len(&self) -> u8 {
        self.len
    }

    /// Number of addresses in the block.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.len))
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & Self::mask_of(self.len) == self.base
    }

    pub fn overlaps(&self, other: &Cidr) -> bool {
        let len = self.len.min(other.len);
        let m = Self::mask_of(len);
        self.base & m == other.base & m
    }

    /// The `n`-th address of the block, if inside it.
    pub fn nth(&self, n: u64) -> Option<Ipv4Addr> {
        (n < self.size()).then(|| Ipv4Addr::from(self.base.wrapping_add(n as u32)))
    }
}

impl FromStr for Cidr {
    type Err = NetError;
    /// `a.b.c.d` (a /32) or `a.b.c.d/len`.
    fn from_str(s: &str) -> Result<Self, NetError> {
        let bad = || NetError::Policy(format!("{s:?} is not an IPv4 address or CIDR block"));
        let (ip, len) = match s.trim().split_once('/') {
            Some((ip, len)) => (ip, len.parse::<u8>().map_err(|_| bad())?),
            None => (s.trim(), 32),
        };
        let ip: Ipv4Addr = ip.parse().map_err(|_| bad())?;
        if len > 32 {
            return Err(bad());
        }
        Cidr::new(ip, len)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr(), self.len)
    }
}

impl serde::Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Ranges no sandbox may reach, whatever its policy: loopback, "this network", RFC 1918,
/// carrier-grade NAT (100.64/10), link-local (cloud metadata), multicast and reserved.
pub fn always_denied() -> Vec<Cidr> {
    [
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
    ]
    .iter()
    .map(|c| c.parse().expect("valid built-in CIDR"))
    .collect()
}

/// The two addresses of slot `index` in the host range: (host side, slot side) of a /31.
pub fn slot_pair(range: &Cidr, index: u32) -> Option<(Ipv4Addr, Ipv4Addr)> {
    let host = range.nth(2 * u64::from(index))?;
    let slot = range.nth(2 * u64::from(index) + 1)?;
    Some((host, slot))
}

/// How many slots a host range holds.
pub fn slot_capacity(range: &Cidr) -> u32 {
    (range.size() / 2).min(u64::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_contains_overlap() {
        let c: Cidr = "10.1.2.3/16".parse().unwrap();
        assert_eq!(c.to_string(), "10.1.0.0/16");
        assert!(c.contains("10.1.255.1".parse().unwrap()));
        assert!(!c.contains("10.2.0.1".parse().unwrap()));
        let one: Cidr = "8.8.8.8".parse().unwrap();
        assert_eq!(one.prefix_len(), 32);
        assert!(c.overlaps(&"10.0.0.0/8".parse().unwrap()));
        assert!(!c.overlaps(&"10.2.0.0/16".parse().unwrap()));
        assert!("0.0.0.0/0".parse::<Cidr>().unwrap().overlaps(&one));
        for bad in ["", "1.2.3", "1.2.3.4/33", "example.com", "1.2.3.4/x"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn slot_addresses_are_unique_pairs() {
        let r: Cidr = "10.231.0.0/16".parse().unwrap();
        assert_eq!(slot_capacity(&r), 32768);
        assert_eq!(
            slot_pair(&r, 0).unwrap(),
            ("10.231.0.0".parse().unwrap(), "10.231.0.1".parse().unwrap())
        );
        assert_eq!(
            slot_pair(&r, 200).unwrap(),
            (
                "10.231.1.144".parse().unwrap(),
                "10.231.1.145".parse().unwrap()
            )
        );
        assert!(slot_pair(&r, 32768).is_none());
    }

    #[test]
    fn always_denied_covers_private_and_metadata() {
        let d = always_denied();
        for ip in [
            "127.0.0.1",
            "169.254.169.254",
            "10.0.0.1",
            "192.168.1.1",
            "100.64.0.1",
        ] {
            let ip: Ipv4Addr = ip.parse().unwrap();
            assert!(d.iter().any(|c| c.contains(ip)), "{ip}");
        }
        for ip in ["198.51.100.1", "203.0.113.9", "8.8.8.8"] {
            let ip: Ipv4Addr = ip.parse().unwrap();
            assert!(!d.iter().any(|c| c.contains(ip)), "{ip}");
        }
    }
}
