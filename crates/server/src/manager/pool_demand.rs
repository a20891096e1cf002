//! How big each warm pool should be: the pool's settings ([`PoolPolicy`]) and the demand a
//! template's creates show ([`Demand`]), turned into a target size by [`Demand::target`].
//!
//! An adaptive pool holds as many sandboxes as the template's busiest moment of the last idle
//! period asked for (the most creates within any [`BURST_SPAN`]), at least one while the
//! template was used within [`PoolPolicy::forget`], none for a template never used (or long
//! unused), never more than [`PoolPolicy::max_per_template`]. A pinned size (`--pool T=N`,
//! `LifecycleConfig::pools`) overrides all of that.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Creates this close together count as one burst.
pub const BURST_SPAN: Duration = Duration::from_secs(2);

/// Warm pool settings (`kiln serve --pool*`, `--create-queue`).
#[derive(Debug, Clone)]
pub struct PoolPolicy {
    /// No pool at all (`--pool-off`): every create boots a sandbox.
    pub off: bool,
    /// An adaptive pool never holds more than this many sandboxes of one template.
    pub max_per_template: u32,
    /// Demand is measured over this long; a pool shrinks once its template saw no burst
    /// this long (to one sandbox).
    pub idle: Duration,
    /// A template unused this long keeps no pooled sandbox at all.
    pub forget: Duration,
    /// How long a create waits for a pooled sandbox or a boot slot before it is refused
    /// (503 with `Retry-After`).
    pub queue: Duration,
}

impl Default for PoolPolicy {
    fn default() -> Self {
        Self {
            off: false,
            max_per_template: 100,
            idle: Duration::from_secs(120),
            forget: Duration::from_secs(3600),
            queue: Duration::from_secs(30),
        }
    }
}

/// The pinned size of `template` among `pinned` (`--pool T=N`; the last one given wins).
pub fn pinned(pinned: &[(String, u32)], template: &str) -> Option<u32> {
    pinned
        .iter()
        .rev()
        .find(|(t, _)| t == template)
        .map(|(_, n)| *n)
}

/// One template's recent creates.
#[derive(Debug, Default, Clone)]
pub struct Demand {
    /// When each create of the last idle period came (oldest first).
    recent: VecDeque<Instant>,
    /// The last create.
    last: Option<Instant>,
}

impl Demand {
    /// A create of this template at `now`; entries older than `window` are dropped.
    pub fn note(&mut self, now: Instant, window: Duration) {
        self.recent.push_back(now);
        self.last = Some(now);
        self.trim(now, window);
    }

    fn trim(&mut self, now: Instant, window: Duration) {
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > window)
        {
            self.recent.pop_front();
        }
    }

    /// The most creates within any [`BURST_SPAN`] of the last `window`.
    pub fn peak(&mut self, now: Instant, window: Duration) -> u32 {
        self.trim(now, window);
        let v = &self.recent;
        let (mut best, mut lo) = (0usize, 0usize);
        for hi in 0..v.len() {
            while v[hi].saturating_duration_since(v[lo]) > BURST_SPAN {
                lo += 1;
            }
            best = best.max(hi - lo + 1);
        }
        best as u32
    }

    /// The adaptive size of this template's pool at `now` (before capacity caps).
    pub fn target(&mut self, now: Instant, p: &PoolPolicy) -> u32 {
        match self.last {
            Some(last) if now.saturating_duration_since(last) <= p.forget => {
                self.peak(now, p.idle).max(1).min(p.max_per_template.max(1))
            }
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> PoolPolicy {
        PoolPolicy {
            idle: Duration::from_secs(10),
            forget: Duration::from_secs(100),
            max_per_template: 50,
            ..PoolPolicy::default()
        }
    }

    #[test]
    fn a_burst_grows_the_target_and_idleness_shrinks_it_to_one_then_none() {
        let p = policy();
        let t0 = Instant::now();
        let mut d = Demand::default();
        assert_eq!(d.target(t0, &p), 0, "never used: no pool");
        for i in 0..30 {
            d.note(t0 + Duration::from_millis(i * 10), p.idle);
        }
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(d.target(t1, &p), 30);
        // Sequential use afterwards does not count as a burst.
        for i in 0..5 {
            d.note(t1 + Duration::from_secs(3 * (i + 1)), p.idle);
        }
        let t2 = t1 + Duration::from_secs(15);
        assert_eq!(
            d.target(t2, &p),
            1,
            "the burst is older than the idle period"
        );
        assert_eq!(d.target(t2 + Duration::from_secs(60), &p), 1);
        assert_eq!(d.target(t2 + Duration::from_secs(200), &p), 0, "forgotten");
    }

    #[test]
    fn the_target_is_capped_and_pins_win() {
        let p = policy();
        let t0 = Instant::now();
        let mut d = Demand::default();
        for _ in 0..80 {
            d.note(t0, p.idle);
        }
        assert_eq!(d.target(t0, &p), 50);
        let pins = vec![("base".into(), 3), ("base".into(), 4)];
        assert_eq!(pinned(&pins, "base"), Some(4));
        assert_eq!(pinned(&pins, "other"), None);
    }
}
