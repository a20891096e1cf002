//! The console's sign-in rate limit: failed sign-ins are counted per client address (an IPv6
//! address by its /64, the block one host usually holds) over a sliding minute; past
//! [`MAX_FAILURES`], sign-ins from that address are refused with `429` and `Retry-After`
//! until the oldest failure leaves the window, whatever key they carry.
//!
//! Where they are counted is a [`SignInCounter`]: this process ([`SignInLimit`], `kiln
//! serve`), or the cluster's etcd (`kiln control`), so that a client does not get its tries
//! at every control replica.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;

/// Failed sign-ins an address may make per [`WINDOW`].
pub const MAX_FAILURES: usize = 5;
/// The sliding window failures are counted over.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Addresses tracked at once; past this, the ones with no failure in the window are dropped
/// first, then the stalest.
const MAX_ADDRESSES: usize = 50_000;

/// Where failed sign-ins are counted.
#[async_trait]
pub trait SignInCounter: Send + Sync {
    /// `Some(seconds to wait)` when `ip` has used up its failures, else `None`.
    async fn check(&self, ip: IpAddr) -> Option<u64>;
    /// Counts a failed sign-in from `ip`.
    async fn failed(&self, ip: IpAddr);
}

/// The bucket `ip` counts in, as text (IPv4 dotted, an IPv6 /64 with its host part zero).
pub fn bucket_name(ip: IpAddr) -> String {
    bucket(ip).to_string()
}

/// For a bucket with failures at `times_ms`: `Some(seconds to wait, rounded up)` at `now_ms`
/// when [`MAX_FAILURES`] or more are within [`WINDOW`], else `None`. With more than that (the
/// replicas of a cluster count at once), the wait lasts until enough have left the window
/// for one more to fit.
pub fn wait_for(times_ms: &[i64], now_ms: i64) -> Option<u64> {
    let window = WINDOW.as_millis() as i64;
    let mut live: Vec<i64> = times_ms
        .iter()
        .copied()
        .filter(|t| now_ms.saturating_sub(*t) < window)
        .collect();
    if live.len() < MAX_FAILURES {
        return None;
    }
    live.sort_unstable();
    let frees_a_slot = live[live.len() - MAX_FAILURES];
    let wait_ms = window - now_ms.saturating_sub(frees_a_slot);
    Some(((wait_ms + 999) / 1000).max(1) as u64)
}

/// Failed sign-ins per client address, in this process.
#[derive(Debug, Default)]
pub struct SignInLimit {
    failures: Mutex<HashMap<IpAddr, VecDeque<Instant>>>,
}

/// The bucket an address counts in: itself for IPv4, its /64 for IPv6 (an IPv4-mapped IPv6
/// address counts as the IPv4 address).
fn bucket(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut s = v6.segments();
                s[4..].fill(0);
                IpAddr::V6(s.into())
            }
        },
    }
}

fn prune(q: &mut VecDeque<Instant>, now: Instant) {
    while q
        .front()
        .is_some_and(|t| now.saturating_duration_since(*t) >= WINDOW)
    {
        q.pop_front();
    }
}

impl SignInLimit {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, VecDeque<Instant>>> {
        self.failures.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `Some(seconds to wait)` when `ip` has used up its failures, else `None`.
    pub fn check(&self, ip: IpAddr) -> Option<u64> {
        self.check_at(ip, Instant::now())
    }

    fn check_at(&self, ip: IpAddr, now: Instant) -> Option<u64> {
        let mut map = self.map();
        let q = map.get_mut(&bucket(ip))?;
        prune(q, now);
        if q.len() < MAX_FAILURES {
            return None;
        }
        let oldest = *q.front()?;
        let wait = WINDOW.saturating_sub(now.saturating_duration_since(oldest));
        // Rounded up: a client that waits as told is let in.
        Some(wait.as_secs() + u64::from(wait.subsec_nanos() > 0))
    }

    /// Counts a failed sign-in from `ip`.
    pub fn failed(&self, ip: IpAddr) {
        self.failed_at(ip, Instant::now())
    }

    fn failed_at(&self, ip: IpAddr, now: Instant) {
        let mut map = self.map();
        if map.len() >= MAX_ADDRESSES && !map.contains_key(&bucket(ip)) {
            map.retain(|_, q| {
                prune(q, now);
                !q.is_empty()
            });
            if map.len() >= MAX_ADDRESSES {
                let stalest = map
                    .iter()
                    .min_by_key(|(_, q)| q.back().copied())
                    .map(|(k, _)| *k);
                if let Some(k) = stalest {
                    map.remove(&k);
                }
            }
        }
        let q = map.entry(bucket(ip)).or_default();
        prune(q, now);
        q.push_back(now);
    }

    /// Addresses with failures on record (expired ones included until pruned).
    pub fn tracked(&self) -> usize {
        self.map().len()
    }
}

#[async_trait]
impl SignInCounter for SignInLimit {
    async fn check(&self, ip: IpAddr) -> Option<u64> {
        SignInLimit::check(self, ip)
    }
    async fn failed(&self, ip: IpAddr) {
        SignInLimit::failed(self, ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_failures_wait_until_one_more_fits() {
        let s = 1000;
        assert_eq!(wait_for(&[0, s, 2 * s, 3 * s], 10 * s), None, "four");
        assert_eq!(wait_for(&[0, s, 2 * s, 3 * s, 4 * s], 10 * s), Some(50));
        // Seven failures (replicas counting at once): two more must leave the window.
        let seven = [6 * s, 0, s, 2 * s, 3 * s, 4 * s, 5 * s];
        assert_eq!(wait_for(&seven, 10 * s), Some(52));
        assert_eq!(wait_for(&seven, 62 * s + 1), None, "three left the window");
        assert_eq!(
            wait_for(&[0, 0, 0, 0, 59_999], 59_999),
            Some(1),
            "rounded up"
        );
        assert_eq!(
            bucket_name("fd00:1:2:3::9".parse().unwrap()),
            "fd00:1:2:3::"
        );
    }

    #[test]
    fn five_failures_a_minute_then_a_wait() {
        let l = SignInLimit::default();
        let a: IpAddr = "192.168.7.1".parse().unwrap();
        let b: IpAddr = "192.168.7.2".parse().unwrap();
        let t0 = Instant::now();
        for i in 0..MAX_FAILURES {
            assert_eq!(l.check_at(a, t0), None, "failure {i} is still let through");
            l.failed_at(a, t0 + Duration::from_secs(i as u64));
        }
        let now = t0 + Duration::from_secs(10);
        assert_eq!(
            l.check_at(a, now),
            Some(50),
            "waits until the oldest failure expires"
        );
        assert_eq!(l.check_at(b, now), None, "another address is not affected");
        assert_eq!(l.check_at(a, t0 + Duration::from_millis(59_500)), Some(1));
        assert_eq!(l.check_at(a, t0 + WINDOW), None, "the window slides");
        l.failed_at(a, t0 + WINDOW);
        assert_eq!(
            l.check_at(a, t0 + WINDOW),
            Some(1),
            "four older failures and one new one"
        );
    }

    #[test]
    fn ipv6_counts_by_its_64_and_mapped_v4_as_v4() {
        let l = SignInLimit::default();
        let t0 = Instant::now();
        for i in 0..MAX_FAILURES {
            l.failed_at(format!("fd00:1:2:3::{i:x}").parse().unwrap(), t0);
        }
        assert!(l
            .check_at("fd00:1:2:3:ffff::9".parse().unwrap(), t0)
            .is_some());
        assert!(l.check_at("fd00:1:2:4::1".parse().unwrap(), t0).is_none());
        for _ in 0..MAX_FAILURES {
            l.failed_at("::ffff:10.0.0.9".parse().unwrap(), t0);
        }
        assert!(l.check_at("10.0.0.9".parse().unwrap(), t0).is_some());
    }

    #[test]
    fn the_table_stays_bounded() {
        let l = SignInLimit::default();
        let t0 = Instant::now();
        for i in 0..(MAX_ADDRESSES as u32 + 10) {
            l.failed_at(IpAddr::V4(i.into()), t0);
        }
        assert!(l.tracked() <= MAX_ADDRESSES);
        // Once the window has passed, expired addresses make room without evicting live ones.
        let later = t0 + WINDOW + Duration::from_secs(1);
        l.failed_at("10.9.9.9".parse().unwrap(), later);
        assert_eq!(l.tracked(), 1);
    }
}
