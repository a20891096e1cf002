//! Network records: what kiln-net's egress proxy and DNS forwarder tell the audit log (see
//! [`kiln_net::observe`]), as `net` and `dns` records of the sandbox's chain; and the
//! observer of the driver's syscall tracing (`syscall` records).

use std::sync::Arc;

use kiln_net::observe::{Conn, Flow, NetEvent};
use serde_json::{json, Value};

use super::{AuditLog, Kind};
use crate::driver::NetObserver;

/// The observer the driver's networks tell: each event becomes a record of that sandbox,
/// queued before the traffic goes on.
pub fn observer(log: AuditLog) -> NetObserver {
    Arc::new(move |id: &str, e: NetEvent| {
        let (log, id) = (log.clone(), id.to_string());
        Box::pin(async move {
            let (kind, body) = body(e);
            log.record(&id, kind, body).await;
        })
    })
}

/// The observer of audited system calls: `syscall` records.
pub fn syscall_observer(log: AuditLog) -> crate::driver::SyscallObserver {
    Arc::new(move |id: &str, body: Value| {
        let (log, id) = (log.clone(), id.to_string());
        Box::pin(async move { log.record(&id, Kind::Syscall, body).await })
    })
}

fn conn(event: &str, c: &Conn) -> Value {
    json!({
        "event": event,
        "proto": "tcp",
        "src": c.src.to_string(),
        "dst": c.dst.to_string(),
        "name": c.name,
        "rule": c.rule,
    })
}

/// A UDP or ICMP flow's body: the same fields as a TCP connection's (`src`/`dst` carry ports
/// for UDP, addresses alone for ICMP), plus the ICMP type, code and echo identifier.
fn flow(event: &str, f: &Flow) -> Value {
    let at = |ip: std::net::Ipv4Addr, port: Option<u16>| match port {
        Some(p) => format!("{ip}:{p}"),
        None => ip.to_string(),
    };
    let mut b = json!({
        "event": event,
        "proto": f.proto,
        "src": at(f.src, f.ports.map(|p| p.0)),
        "dst": at(f.dst, f.ports.map(|p| p.1)),
        "name": null,
        "rule": f.rule,
    });
    if let Some((ty, code, id)) = f.icmp {
        b["icmpType"] = json!(ty);
        b["icmpCode"] = json!(code);
        b["icmpId"] = json!(id);
    }
    b
}

/// A record's kind and body for one event.
pub fn body(e: NetEvent) -> (Kind, Value) {
    match e {
        NetEvent::Connect(c) => (Kind::Net, conn("connect", &c)),
        NetEvent::Deny(c) => (Kind::Net, conn("deny", &c)),
        NetEvent::Close {
            conn: c,
            bytes_out,
            bytes_in,
            duration_ms,
            error,
        } => {
            let mut b = conn("close", &c);
            b["bytesOut"] = json!(bytes_out);
            b["bytesIn"] = json!(bytes_in);
            b["durationMs"] = json!(duration_ms);
            if let Some(e) = error {
                b["error"] = json!(e);
            }
            (Kind::Net, b)
        }
        NetEvent::FlowOpen(f) => (Kind::Net, flow("connect", &f)),
        NetEvent::FlowDeny(f) => (Kind::Net, flow("deny", &f)),
        NetEvent::FlowClose {
            flow: f,
            bytes_out,
            bytes_in,
            packets_out,
            packets_in,
            duration_ms,
        } => {
            let mut b = flow("close", &f);
            b["bytesOut"] = json!(bytes_out);
            b["bytesIn"] = json!(bytes_in);
            b["packetsOut"] = json!(packets_out);
            b["packetsIn"] = json!(packets_in);
            b["durationMs"] = json!(duration_ms);
            (Kind::Net, b)
        }
        NetEvent::Dns(q) => (
            Kind::Dns,
            json!({
                "name": q.name,
                "type": q.qtype,
                "transport": q.transport,
                "rcode": q.rcode,
                "answers": q.answers,
            }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_net::observe::DnsQuery;

    #[test]
    fn events_become_bodies() {
        let c = Conn {
            src: "169.254.0.21:40000".parse().unwrap(),
            dst: "198.51.100.10:80".parse().unwrap(),
            name: Some("host-a.test".into()),
            rule: "default".into(),
        };
        let (k, b) = body(NetEvent::Deny(c.clone()));
        assert_eq!(k, Kind::Net);
        assert_eq!(b["event"], "deny");
        assert_eq!(b["dst"], "198.51.100.10:80");
        assert_eq!(b["name"], "host-a.test");
        let (_, b) = body(NetEvent::Close {
            conn: c,
            bytes_out: 3,
            bytes_in: 5,
            duration_ms: 1,
            error: Some("refused".into()),
        });
        assert_eq!(
            (b["bytesOut"].as_u64(), b["bytesIn"].as_u64()),
            (Some(3), Some(5))
        );
        assert_eq!(b["error"], "refused");
        let (k, b) = body(NetEvent::Dns(DnsQuery {
            name: "host-a.test".into(),
            qtype: "A".into(),
            transport: "udp",
            rcode: None,
            answers: vec![],
        }));
        assert_eq!(k, Kind::Dns);
        assert_eq!(b["rcode"], Value::Null);
        assert_eq!(b["type"], "A");
        let f = Flow {
            proto: "icmp",
            src: "169.254.0.21".parse().unwrap(),
            dst: "198.51.100.169".parse().unwrap(),
            ports: None,
            icmp: Some((8, 0, 0x4b1)),
            rule: "default".into(),
        };
        let (k, b) = body(NetEvent::FlowClose {
            flow: f.clone(),
            bytes_out: 24,
            bytes_in: 24,
            packets_out: 3,
            packets_in: 3,
            duration_ms: 7,
        });
        assert_eq!(k, Kind::Net);
        assert_eq!(
            b,
            json!({"event": "close", "proto": "icmp", "src": "169.254.0.21",
                "dst": "198.51.100.169", "name": null, "rule": "default", "icmpType": 8,
                "icmpCode": 0, "icmpId": 0x4b1, "bytesOut": 24, "bytesIn": 24, "packetsOut": 3,
                "packetsIn": 3, "durationMs": 7})
        );
        let (_, b) = body(NetEvent::FlowDeny(Flow {
            proto: "udp",
            ports: Some((40001, 7000)),
            icmp: None,
            rule: "denyOut 198.51.100.170".into(),
            ..f
        }));
        assert_eq!(
            (b["src"].as_str(), b["dst"].as_str(), b.get("icmpType")),
            (
                Some("169.254.0.21:40001"),
                Some("198.51.100.169:7000"),
                None
            )
        );
    }
}
