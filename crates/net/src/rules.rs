//! The nftables rulesets: one table per slot (in its router namespace) and one host table.
//!
//! Each ruleset is loaded with one `nft -f`, which is one atomic transaction: the table is
//! declared, deleted and defined again, so replacing a policy never leaves a moment with no
//! rules or with half of them.

use std::fmt::Write;
use std::net::Ipv4Addr;

use crate::policy::EgressPolicy;
use crate::{Cidr, GATEWAY_ADDR, GUEST_ADDR};

/// Name of the table in every router namespace.
pub const SLOT_TABLE: &str = "kiln";
/// Interface names inside a slot.
pub const UPLINK: &str = "up0";
pub const GUEST_LINK: &str = "gw0";

/// What the slot ruleset needs to know about the host.
#[derive(Debug, Clone, Default)]
pub struct HostFacts {
    /// Never reachable from a sandbox: the host's addresses and the whole host range.
    pub host_deny: Vec<Cidr>,
    /// Private ranges the operator lets sandboxes reach (still subject to their policy).
    pub operator_allow: Vec<Cidr>,
    /// Most connections a sandbox may have open at once (0: no cap).
    pub max_connections: u32,
    /// Egress bandwidth cap of a sandbox, MiB/s (0: none).
    pub egress_mib_per_sec: u32,
    /// Egress is audited: every TCP connection leaving a sandbox goes through its egress
    /// proxy (which records it), not only those to the web ports under domain rules; and the
    /// ruleset logs each UDP/ICMP flow's decision for the flow log ([`crate::flows`]).
    pub proxy_all_tcp: bool,
}

fn set(out: &mut String, name: &str, elems: &[Cidr]) {
    let _ = write!(
        out,
        "  set {name} {{ type ipv4_addr; flags interval; auto-merge;"
    );
    if !elems.is_empty() {
        let list: Vec<String> = elems.iter().map(Cidr::to_string).collect();
        let _ = write!(out, " elements = {{ {} }};", list.join(", "));
    }
    out.push_str(" }\n");
}

/// The ruleset of one slot's router namespace: NAT between the guest and the slot address,
/// the DNS forwarder's port, and the egress policy.
pub fn slot_ruleset(slot_addr: Ipv4Addr, host: &HostFacts, policy: &EgressPolicy) -> String {
    let t = SLOT_TABLE;
    let proxy = crate::PROXY_PORT;
    // With domain rules, TCP to the web ports goes through the egress proxy (which names
    // connections by SNI/Host), and QUIC (UDP) to the TLS ports is dropped: it cannot be named.
    let all = format!(
        "    iifname \"{GUEST_LINK}\" ip daddr != {GATEWAY_ADDR} meta l4proto tcp redirect to :{proxy}\n"
    );
    let rules = policy
        .transforms
        .as_ref()
        .is_some_and(|t| t.rules.has_hosts());
    let (redirect, quic) = if policy.domains().is_empty() && !rules {
        // Tunnelled through an upstream proxy: all TCP passes kiln's egress proxy.
        let r = if host.proxy_all_tcp || policy.egress_proxy.is_some() {
            all
        } else {
            String::new()
        };
        (r, String::new())
    } else {
        let mut tls: Vec<u16> = vec![443];
        tls.extend(policy.https_ports.iter().copied().filter(|p| *p != 80));
        tls.sort_unstable();
        tls.dedup();
        let list = |v: &[u16]| v.iter().map(u16::to_string).collect::<Vec<_>>().join(", ");
        let mut web = tls.clone();
        web.push(80);
        web.sort_unstable();
        (
            if host.proxy_all_tcp || policy.egress_proxy.is_some() {
                all
            } else {
                format!(
                    "    iifname \"{GUEST_LINK}\" tcp dport {{ {} }} redirect to :{proxy}\n",
                    list(&web)
                )
            },
            format!(
                "    iifname \"{GUEST_LINK}\" udp dport {{ {} }} drop\n",
                list(&tls)
            ),
        )
    };
    let mut caps = String::new();
    if host.egress_mib_per_sec > 0 {
        let _ = writeln!(
            caps,
            "    iifname \"{GUEST_LINK}\" limit rate over {} mbytes/second drop",
            host.egress_mib_per_sec
        );
    }
    if host.max_connections > 0 {
        let _ = writeln!(
            caps,
            "    iifname \"{GUEST_LINK}\" ct state new ct count over {} drop",
            host.max_connections
        );
    }
    // Audited: the decisions go through two chains that log UDP/ICMP flows first.
    let (ok, no) = if host.proxy_all_tcp {
        ("goto allowed", "goto denied")
    } else {
        ("accept", "drop")
    };
    let quic = if host.proxy_all_tcp {
        quic.replace(
            " drop\n",
            &format!(
                " log prefix \"{}\" group {LOG_GROUP} drop\n",
                FlowVerdict::Quic.prefix()
            ),
        )
    } else {
        quic
    };
    let mut s = format!("table ip {t}\ndelete table ip {t}\ntable ip {t} {{\n");
    set(&mut s, "host_deny", &host.host_deny);
    set(&mut s, "always_deny", &crate::addr::always_denied());
    set(&mut s, "operator_allow", &host.operator_allow);
    set(&mut s, "allow_out", &EgressPolicy::nets(&policy.allow_out));
    set(&mut s, "deny_out", &policy.effective_deny());
    let _ = write!(
        s,
        r#"  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{UPLINK}" ip daddr {slot_addr} dnat to {GUEST_ADDR}
{redirect}  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "{UPLINK}" ip saddr {GUEST_ADDR} snat to {slot_addr}
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
{caps}    iifname "lo" accept
    ct state established,related accept
    iifname "{GUEST_LINK}" ip daddr {GATEWAY_ADDR} udp dport 53 accept
    iifname "{GUEST_LINK}" ip daddr {GATEWAY_ADDR} tcp dport 53 accept
    iifname "{GUEST_LINK}" ip daddr {GATEWAY_ADDR} tcp dport {proxy} accept
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
{caps}    ct state established,related accept
{quic}    iifname "{UPLINK}" oifname "{GUEST_LINK}" ct status dnat accept
    iifname "{GUEST_LINK}" oifname "{UPLINK}" jump egress
  }}
  chain egress {{
    ip daddr @host_deny {no}
    ip daddr @operator_allow goto user_policy
    ip daddr @always_deny {no}
    goto user_policy
  }}
  chain user_policy {{
    ip daddr @allow_out {ok}
    ip daddr @deny_out {no}
    {ok}
  }}
"#
    );
    if host.proxy_all_tcp {
        // A flow's first packet is logged once when let out (the conntrack mark says it was),
        // every dropped packet when refused (the flow log folds repeats).
        let flow = "meta l4proto { udp, icmp }";
        let _ = write!(
            s,
            r#"  chain allowed {{
    {flow} ct mark != {FLOW_MARK:#x} ct mark set {FLOW_MARK:#x} log prefix "{}" group {LOG_GROUP}
    accept
  }}
  chain denied {{
    {flow} log prefix "{}" group {LOG_GROUP}
    drop
  }}
"#,
            FlowVerdict::Allow.prefix(),
            FlowVerdict::Deny.prefix()
        );
    }
    s.push_str("}\n");
    s
}

/// NFLOG group of the flow log's rules (one listener per router namespace).
pub const LOG_GROUP: u16 = 7075;
/// Conntrack mark of a UDP/ICMP flow the flow log has been told of.
pub const FLOW_MARK: u32 = 0x6b;

/// What a logged packet's rule decided (its log prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowVerdict {
    Allow,
    Deny,
    /// UDP to a TLS port under domain rules (QUIC cannot be named).
    Quic,
}

impl FlowVerdict {
    pub fn prefix(self) -> &'static str {
        match self {
            Self::Allow => "kiln allow",
            Self::Deny => "kiln deny",
            Self::Quic => "kiln quic",
        }
    }

    pub fn from_prefix(p: &str) -> Option<Self> {
        [Self::Allow, Self::Deny, Self::Quic]
            .into_iter()
            .find(|v| v.prefix() == p)
    }
}

/// The host's table: masquerade the host range out of the host, and keep sandboxes off the
/// host itself (its addresses, kiln's port) and off each other.
pub fn host_ruleset(table: &str, veth_prefix: &str, range: &Cidr) -> String {
    let v = format!("{veth_prefix}*");
    format!(
        r#"table ip {table}
delete table ip {table}
table ip {table} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {range} oifname != "{v}" masquerade
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{v}" ct state established,related accept
    iifname "{v}" drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{v}" oifname "{v}" drop
  }}
}}
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_ruleset_carries_policy_and_nat() {
        let p = EgressPolicy::from_lists(
            false,
            &["198.51.100.7".into(), "example.com".into()],
            &["203.0.113.0/24".into()],
            &[],
        )
        .unwrap();
        let host = HostFacts {
            host_deny: vec!["10.231.0.0/16".parse().unwrap()],
            operator_allow: vec![],
            max_connections: 0,
            egress_mib_per_sec: 0,
            proxy_all_tcp: false,
        };
        let r = slot_ruleset("10.231.0.1".parse().unwrap(), &host, &p);
        assert!(r.starts_with("table ip kiln\ndelete table ip kiln\n"));
        assert!(r.contains("set allow_out { type ipv4_addr; flags interval; auto-merge; elements = { 198.51.100.7/32 }; }"));
        assert!(r.contains("elements = { 203.0.113.0/24, 0.0.0.0/0 }"));
        assert!(r.contains("set host_deny { type ipv4_addr; flags interval; auto-merge; elements = { 10.231.0.0/16 }; }"));
        assert!(r.contains("set operator_allow { type ipv4_addr; flags interval; auto-merge; }"));
        assert!(r.contains("dnat to 169.254.0.21"));
        assert!(r.contains("snat to 10.231.0.1"));
        // Host and always-denied ranges come before the user's allow list.
        let deny = r.find("ip daddr @always_deny drop").unwrap();
        assert!(r.find("ip daddr @host_deny drop").unwrap() < deny);
        assert!(deny < r.find("ip daddr @allow_out accept").unwrap());
        assert!(r.contains("tcp dport { 80, 443 } redirect to :15001"));
        assert!(r.contains("udp dport { 443 } drop"));
        let plain = slot_ruleset(
            "10.231.0.1".parse().unwrap(),
            &host,
            &EgressPolicy::default(),
        );
        assert!(!plain.contains("redirect"));
        assert!(!plain.contains("ct count") && !plain.contains("limit rate"));
        // An upstream SOCKS5 proxy takes all TCP through kiln's egress proxy.
        let tunnelled = EgressPolicy {
            egress_proxy: Some(
                crate::upstream::EgressProxyConfig::parse(
                    &serde_json::json!({"address": "198.51.100.9:1080"}),
                )
                .unwrap(),
            ),
            ..EgressPolicy::default()
        };
        let r = slot_ruleset("10.231.0.1".parse().unwrap(), &host, &tunnelled);
        assert!(r.contains("ip daddr != 169.254.0.22 meta l4proto tcp redirect to :15001"));
        let capped = HostFacts {
            max_connections: 100,
            egress_mib_per_sec: 5,
            ..host
        };
        let r = slot_ruleset(
            "10.231.0.1".parse().unwrap(),
            &capped,
            &EgressPolicy::default(),
        );
        assert!(r.contains("iifname \"gw0\" ct state new ct count over 100 drop"));
        assert!(r.contains("iifname \"gw0\" limit rate over 5 mbytes/second drop"));
        let audited = HostFacts {
            proxy_all_tcp: true,
            ..capped
        };
        for p in [EgressPolicy::default(), p.clone()] {
            let r = slot_ruleset("10.231.0.1".parse().unwrap(), &audited, &p);
            assert!(r.contains(
                "iifname \"gw0\" ip daddr != 169.254.0.22 meta l4proto tcp redirect to :15001"
            ));
            assert!(!r.contains("tcp dport { 80, 443 } redirect"));
            // UDP/ICMP decisions are logged for the flow log: a let-out flow once (marked),
            // every refused packet.
            assert!(r.contains("ip daddr @host_deny goto denied"));
            assert!(r.contains("ip daddr @allow_out goto allowed"));
            assert!(r.contains("ip daddr @deny_out goto denied\n    goto allowed\n"));
            assert!(r.contains("meta l4proto { udp, icmp } ct mark != 0x6b ct mark set 0x6b log prefix \"kiln allow\" group 7075\n    accept"));
            assert!(r.contains(
                "meta l4proto { udp, icmp } log prefix \"kiln deny\" group 7075\n    drop"
            ));
        }
        let r = slot_ruleset("10.231.0.1".parse().unwrap(), &audited, &p);
        assert!(r.contains("udp dport { 443 } log prefix \"kiln quic\" group 7075 drop"));
        assert!(!plain.contains("goto denied") && !plain.contains("log "));
    }

    #[test]
    fn host_ruleset_isolates_host_and_sandboxes() {
        let r = host_ruleset("kiln_ab12", "kab12h", &"10.231.0.0/16".parse().unwrap());
        assert!(r.contains("ip saddr 10.231.0.0/16 oifname != \"kab12h*\" masquerade"));
        assert!(r.contains("iifname \"kab12h*\" drop"));
        assert!(r.contains("iifname \"kab12h*\" oifname \"kab12h*\" drop"));
    }
}
