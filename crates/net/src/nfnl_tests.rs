use super::*;

// Captured in a slot's router namespace (crates/net/tests/flows.rs): a let-out UDP packet
// (169.254.0.21:40001 -> 198.51.100.169:7000, "hello") and a refused ICMP echo (id 0x4b1, seq
// 1, to 198.51.100.170) as NFLOG passed them up; the destroy events of the UDP flow (2
// packets of 33 bytes out, 2 of 32 in) and of the ICMP flow (3 echoes of 36 bytes each way).
const UDP_ALLOWED: &str = "ac00000000040000000000000000000002001ba308000100080002000f000a006b696c6e20616c6c6f7700000800040000000003080005000000000210000800000600004607cf6948db000006000f000001000006001100000e0000120010000a97217abf174607cf6948db0800000014000300000000006b0e7790000000000000bc8d25000900450000213b3040003f112baca9fe0015c63364a99c411b58000dd50e68656c6c6f000000";
const ICMP_DENIED: &str = "ac00000000040000000000000000000002001ba308000100080002000e000a006b696c6e2064656e790000000800040000000003080005000000000210000800000600004607cf6948db000006000f000001000006001100000e0000120010000a97217abf174607cf6948db0800000014000300000000006b0e7791000000000001397528000900450000242a8840003f013c60a9fe0015c63364aa08003ca504b100016b696c6e70696e67";
const UDP_ENDED: &str = "cc00000002010000000000000000000002000000340001801400018008000100a9fe001508000200c63364a91c0002800500010011000000060002009c410000060003001b580000340002801400018008000100c63364a9080002000aa500031c0002800500010011000000060002001b580000060003009c41000008000c0048540946080003000000039a1c0009800c00010000000000000000020c00020000000000000000421c000a800c00010000000000000000020c0002000000000000000040080008000000006b";
const ICMP_ENDED: &str = "dc000000020100000000000000000000020000003c0001801400018008000100a9fe001508000200c63364a92400028005000100010000000600040004b10000050005000800000005000600000000003c0002801400018008000100c63364a9080002000aa500032400028005000100010000000600040004b100000500050000000000050006000000000008000c001f581139080003000000039a1c0009800c00010000000000000000030c000200000000000000006c1c000a800c00010000000000000000030c000200000000000000006c080008000000006b";

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn one(s: &str) -> Message {
    let buf = hex(s);
    let all: Vec<Message> = messages(&buf).map(|(t, p)| parse(t, p)).collect();
    assert_eq!(all.len(), 1);
    all.into_iter().next().unwrap()
}

const GUEST: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 21);
const HOST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 169);

/// A flow from the sandbox's address.
fn from_guest(proto: u8, dst: Ipv4Addr, sport: u16, dport: u16) -> Tuple {
    Tuple {
        proto,
        src: GUEST,
        dst,
        sport,
        dport,
    }
}

#[test]
fn nflog_packets_are_read() {
    assert_eq!(
        one(UDP_ALLOWED),
        Message::Logged(Logged {
            prefix: "kiln allow".into(),
            tuple: from_guest(IPPROTO_UDP, HOST, 40001, 7000),
            icmp: None,
        })
    );
    assert_eq!(
        one(ICMP_DENIED),
        Message::Logged(Logged {
            prefix: "kiln deny".into(),
            tuple: from_guest(IPPROTO_ICMP, Ipv4Addr::new(198, 51, 100, 170), 0x4b1, 0),
            icmp: Some((8, 0)),
        })
    );
}

#[test]
fn conntrack_destroy_events_are_read() {
    assert_eq!(
        one(UDP_ENDED),
        Message::Ended(Ended {
            tuple: from_guest(IPPROTO_UDP, HOST, 40001, 7000),
            icmp: None,
            mark: 0x6b,
            orig: (2, 66),
            reply: (2, 64),
        })
    );
    assert_eq!(
        one(ICMP_ENDED),
        Message::Ended(Ended {
            tuple: from_guest(IPPROTO_ICMP, HOST, 0x4b1, 0),
            icmp: Some((8, 0)),
            mark: 0x6b,
            orig: (3, 108),
            reply: (3, 108),
        })
    );
}

#[test]
fn truncated_and_foreign_input_is_not_a_record() {
    let buf = hex(UDP_ALLOWED);
    for cut in [0, 3, 15, 16, 40, buf.len() - 1] {
        let m: Vec<Message> = messages(&buf[..cut]).map(|(t, p)| parse(t, p)).collect();
        assert!(m.iter().all(|m| *m == Message::Other), "{cut}: {m:?}");
    }
    // A payload cut inside the IP header, and an IPv6 one.
    assert!(packet(&[0x45, 0, 0]).is_none());
    assert!(packet(&[0x60; 48]).is_none());
    // An acknowledgement.
    let mut ack = 36u32.to_ne_bytes().to_vec();
    ack.extend(2u16.to_ne_bytes());
    ack.extend([0u8; 30]);
    let m: Vec<Message> = messages(&ack).map(|(t, p)| parse(t, p)).collect();
    assert_eq!(m, vec![Message::Error(0)]);
}

#[test]
fn bind_request_layout() {
    let m = bind_log_group(7075, 96, 1);
    assert_eq!(m.len(), 16 + 4 + 8 + 12 + 8);
    assert_eq!(
        u32::from_ne_bytes(m[..4].try_into().unwrap()) as usize,
        m.len()
    );
    assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), 0x0401);
    assert_eq!(&m[18..20], &7075u16.to_be_bytes());
    let a: Vec<(u16, Vec<u8>)> = attrs(&m[20..]).map(|(t, v)| (t, v.to_vec())).collect();
    assert_eq!(a[0], (1, vec![1]));
    assert_eq!(a[1], (2, vec![0, 0, 0, 96, 2, 0]));
    assert_eq!(a[2], (5, vec![0, 0, 0, 1]));
}
