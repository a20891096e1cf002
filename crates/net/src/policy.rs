//! A sandbox's egress policy, in E2B's terms: internet on or off, `allowOut` and `denyOut`
//! lists, DNS servers.
//!
//! Precedence (E2B's): an `allowOut` match beats a `denyOut` match; `0.0.0.0/0` in `denyOut`
//! denies everything not allowed; `allow_internet_access=false` is `denyOut: ["0.0.0.0/0"]`.
//! Whatever the policy, the always-denied ranges ([`crate::addr::always_denied`]), the host
//! and other sandboxes stay unreachable.

use std::net::Ipv4Addr;

use serde::Serialize;

use crate::target::{domain_matches, Target};
use crate::{Cidr, NetError, Result};

/// What a sandbox may reach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressPolicy {
    pub allow_internet_access: bool,
    pub allow_out: Vec<Target>,
    pub deny_out: Vec<Target>,
    /// Upstream resolvers of the sandbox's DNS forwarder (empty: kiln's default).
    pub dns_servers: Vec<Ipv4Addr>,
    /// Ports besides 443 whose connections are named by TLS SNI (domain rules).
    pub https_ports: Vec<u16>,
    /// `network.rules` (header transforms) with what applying them needs; `None`: none.
    #[serde(skip)]
    pub transforms: Option<std::sync::Arc<crate::intercept::Transforms>>,
    /// `egressProxy`: allowed TCP egress goes through this SOCKS5 proxy; `None`: direct.
    #[serde(skip)]
    pub egress_proxy: Option<crate::upstream::EgressProxyConfig>,
}

impl Default for EgressPolicy {
    /// E2B's default: internet on, no lists.
    fn default() -> Self {
        Self {
            allow_internet_access: true,
            allow_out: Vec::new(),
            deny_out: Vec::new(),
            dns_servers: Vec::new(),
            https_ports: Vec::new(),
            transforms: None,
            egress_proxy: None,
        }
    }
}

impl EgressPolicy {
    /// Builds a policy from the API's fields, validating every entry.
    pub fn from_lists(
        allow_internet_access: bool,
        allow_out: &[String],
        deny_out: &[String],
        dns_servers: &[String],
    ) -> Result<Self> {
        let parse = |v: &[String]| {
            v.iter()
                .map(|s| Target::parse(s))
                .collect::<Result<Vec<_>>>()
        };
        let dns = dns_servers
            .iter()
            .map(|s| {
                s.trim().parse::<Ipv4Addr>().map_err(|_| {
                    NetError::Policy(format!("dnsServers entry {s:?} is not an IPv4 address"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            allow_internet_access,
            allow_out: parse(allow_out)?,
            deny_out: parse(deny_out)?,
            dns_servers: dns,
            https_ports: Vec::new(),
            transforms: None,
            egress_proxy: None,
        })
    }

    /// Whether `list` matches a connection to `ip` named `name` (SNI or Host).
    pub fn list_matches(list: &[Target], name: Option<&str>, ip: Ipv4Addr) -> bool {
        list.iter().any(|t| match t {
            Target::Net(c) => c.contains(ip),
            Target::Domain(d) => name.is_some_and(|n| domain_matches(d, n)),
        })
    }

    /// E2B's precedence for one connection: an allow match wins, then a deny match (or
    /// internet access off) denies, else it is allowed. (The always-denied ranges are checked
    /// before this, by the caller.)
    pub fn allows(&self, name: Option<&str>, ip: Ipv4Addr) -> bool {
        if Self::list_matches(&self.allow_out, name, ip) {
            return true;
        }
        self.allow_internet_access && !Self::list_matches(&self.deny_out, name, ip)
    }

    /// [`Self::allows`] with the rule that decided: `allowOut <entry>`, `denyOut <entry>`,
    /// `internet off` or `default`.
    pub fn decide(&self, name: Option<&str>, ip: Ipv4Addr) -> (bool, String) {
        let hit = |list: &[Target]| {
            list.iter()
                .find(|t| match t {
                    Target::Net(c) => c.contains(ip),
                    Target::Domain(d) => name.is_some_and(|n| domain_matches(d, n)),
                })
                .map(|t| Self::list_strings(std::slice::from_ref(t)).remove(0))
        };
        if let Some(t) = hit(&self.allow_out) {
            return (true, format!("allowOut {t}"));
        }
        if !self.allow_internet_access {
            return (false, "internet off".into());
        }
        match hit(&self.deny_out) {
            Some(t) => (false, format!("denyOut {t}")),
            None => (true, "default".into()),
        }
    }

    /// The CIDR entries of a list.
    pub fn nets(list: &[Target]) -> Vec<Cidr> {
        list.iter()
            .filter_map(|t| match t {
                Target::Net(c) => Some(*c),
                Target::Domain(_) => None,
            })
            .collect()
    }

    /// Every domain entry of both lists.
    pub fn domains(&self) -> Vec<&str> {
        self.allow_out
            .iter()
            .chain(&self.deny_out)
            .filter_map(|t| match t {
                Target::Domain(d) => Some(d.as_str()),
                Target::Net(_) => None,
            })
            .collect()
    }

    /// The effective deny list: `denyOut`, plus everything when internet access is off.
    pub fn effective_deny(&self) -> Vec<Cidr> {
        let mut d = Self::nets(&self.deny_out);
        if !self.allow_internet_access {
            d.push(Cidr::new(Ipv4Addr::UNSPECIFIED, 0).expect("valid"));
        }
        d
    }

    /// The API's view: the lists as strings.
    pub fn list_strings(list: &[Target]) -> Vec<String> {
        list.iter().map(Target::api_string).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_and_precedence() {
        assert!(domain_matches("example.com", "example.com"));
        assert!(!domain_matches("example.com", "www.example.com"));
        assert!(domain_matches("*.example.com", "a.b.example.com"));
        assert!(!domain_matches("*.example.com", "example.com"));
        assert!(!domain_matches("*.example.com", "badexample.com"));
        let ip: Ipv4Addr = "203.0.113.10".parse().unwrap();
        let p =
            EgressPolicy::from_lists(true, &["a.test".into()], &["0.0.0.0/0".into()], &[]).unwrap();
        assert!(p.allows(Some("a.test"), ip));
        assert!(!p.allows(Some("b.test"), ip));
        assert!(!p.allows(None, ip));
        assert_eq!(
            p.decide(Some("a.test"), ip),
            (true, "allowOut a.test".into())
        );
        assert_eq!(p.decide(None, ip), (false, "denyOut 0.0.0.0/0".into()));
        let p = EgressPolicy::from_lists(true, &[], &["*.b.test".into()], &[]).unwrap();
        assert!(!p.allows(Some("x.b.test"), ip));
        assert_eq!(
            p.decide(Some("x.b.test"), ip),
            (false, "denyOut *.b.test".into())
        );
        assert_eq!(p.decide(Some("a.test"), ip), (true, "default".into()));
        let off = EgressPolicy::from_lists(false, &["203.0.113.10".into()], &[], &[]).unwrap();
        assert_eq!(off.decide(None, ip), (true, "allowOut 203.0.113.10".into()));
        assert_eq!(
            off.decide(None, Ipv4Addr::new(198, 51, 100, 1)),
            (false, "internet off".into())
        );
        assert!(p.allows(Some("a.test"), ip));
    }

    #[test]
    fn internet_off_denies_everything_not_allowed() {
        let p = EgressPolicy::from_lists(false, &["198.51.100.0/24".into()], &[], &[]).unwrap();
        assert_eq!(p.effective_deny(), vec!["0.0.0.0/0".parse().unwrap()]);
        assert_eq!(EgressPolicy::nets(&p.allow_out).len(), 1);
        assert!(EgressPolicy::default().effective_deny().is_empty());
        assert!(EgressPolicy::from_lists(true, &[], &[], &["x".into()]).is_err());
    }
}
