//! Choosing a host range on the real host (needs root for /run/kiln-net and `ip`): a choice
//! avoids the host's routes and addresses and the ranges other servers just claimed, prefers the
//! range asked for when free, and the probe says this host can do networking.

use kiln_net::range::{pick_range, probe};
use kiln_net::Cidr;

mod common;

use common::root_or_skip;

#[tokio::test]
async fn ranges_are_free_distinct_and_sticky() {
    if !root_or_skip() {
        return;
    }
    probe().await.expect("this host can do sandbox networking");
    // Two servers choosing one after the other never get the same range.
    let (pa, pb) = ("kf0a1", "kf0a2");
    let a = pick_range(pa, None).await.unwrap();
    let b = pick_range(pb, None).await.unwrap();
    assert_ne!(a, b);
    assert!(!a.overlaps(&b));
    for r in [a, b] {
        assert_eq!(r.prefix_len(), 16);
        let second = r.addr().octets()[1];
        assert!(
            r.addr().octets()[0] == 10 && (200..=254).contains(&second),
            "{r}"
        );
    }
    // Nothing of the host's overlaps them.
    let routes = std::process::Command::new("ip")
        .args(["-4", "route", "show", "table", "all"])
        .output()
        .unwrap();
    for line in String::from_utf8_lossy(&routes.stdout).lines() {
        let Some(dst) = line.split_whitespace().next() else {
            continue;
        };
        let dst = if dst == "local" || dst == "broadcast" {
            line.split_whitespace().nth(1).unwrap_or("")
        } else {
            dst
        };
        if let Ok(c) = dst.parse::<Cidr>() {
            if !line.contains(&format!(" {pa}h")) {
                assert!(!c.overlaps(&a), "{a} overlaps the route {line}");
            }
        }
    }
    // A server asking again for its own range gets it back; another server asking for a
    // range just claimed gets a different one.
    assert_eq!(pick_range(pa, Some(a)).await.unwrap(), a);
    assert_ne!(pick_range(pb, Some(a)).await.unwrap(), a);
    for p in [pa, pb] {
        let _ = std::fs::remove_file(format!("{}/{p}.range", kiln_net::host::LOCK_DIR));
    }
}
