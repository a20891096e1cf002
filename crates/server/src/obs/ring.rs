//! A sandbox's metrics history: a bounded ring of samples covering its whole life. When the
//! ring is full, every other sample is dropped and from then on only every other offered
//! sample is kept (the stride doubles), so the history always spans the sandbox's life at a
//! resolution that degrades gracefully instead of forgetting its start.

use std::collections::VecDeque;

/// One metrics sample of a sandbox (E2B's `SandboxMetric`).
#[derive(Debug, Clone, PartialEq)]
pub struct MetricSample {
    pub timestamp_ms: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// Default bound of one sandbox's history (at 5 s a sample: about 11 h at full resolution).
pub const DEFAULT_CAPACITY: usize = 8192;

/// What [`MetricRing::push`] did with a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Not kept (only the newest sample shows it).
    Skipped,
    /// Added to the kept samples.
    Kept,
    /// Added after every other kept sample was dropped.
    Thinned,
}

#[derive(Debug, Clone)]
pub struct MetricRing {
    samples: VecDeque<MetricSample>,
    cap: usize,
    /// Only every `stride`-th offered sample is kept.
    stride: u64,
    offered: u64,
    /// The newest sample offered, kept or not (what "current" metrics show).
    latest: Option<MetricSample>,
}

impl MetricRing {
    pub fn new(cap: usize) -> Self {
        Self {
            samples: VecDeque::new(),
            cap: cap.max(2),
            stride: 1,
            offered: 0,
            latest: None,
        }
    }

    /// A ring holding `samples` (a history read back from disk, oldest first).
    pub fn restore(cap: usize, samples: Vec<MetricSample>) -> Self {
        let mut r = Self::new(cap);
        for s in samples {
            r.push(s);
        }
        r
    }

    /// Records a sample (samples are offered in time order); what became of it.
    pub fn push(&mut self, s: MetricSample) -> Pushed {
        let keep = self.offered.is_multiple_of(self.stride);
        self.offered += 1;
        let mut thinned = false;
        if keep {
            if self.samples.len() >= self.cap {
                self.decimate();
                thinned = true;
            }
            self.samples.push_back(s.clone());
        }
        self.latest = Some(s);
        match (keep, thinned) {
            (false, _) => Pushed::Skipped,
            (true, false) => Pushed::Kept,
            (true, true) => Pushed::Thinned,
        }
    }

    /// The kept samples, oldest first.
    pub fn kept(&self) -> Vec<MetricSample> {
        self.samples.iter().cloned().collect()
    }

    fn decimate(&mut self) {
        let kept: VecDeque<MetricSample> = self.samples.iter().step_by(2).cloned().collect();
        self.samples = kept;
        self.stride *= 2;
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The newest sample offered.
    pub fn latest(&self) -> Option<&MetricSample> {
        self.latest.as_ref()
    }

    /// Kept samples with `start_ms <= timestamp <= end_ms`, oldest first (the newest offered
    /// sample included when it falls in the window, even if the stride skipped it).
    pub fn window(&self, start_ms: i64, end_ms: i64) -> Vec<MetricSample> {
        let inside = |s: &MetricSample| s.timestamp_ms >= start_ms && s.timestamp_ms <= end_ms;
        let mut out: Vec<MetricSample> =
            self.samples.iter().filter(|s| inside(s)).cloned().collect();
        if let Some(l) = &self.latest {
            if inside(l) && out.last().map(|s| s.timestamp_ms) != Some(l.timestamp_ms) {
                out.push(l.clone());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ts: i64) -> MetricSample {
        MetricSample {
            timestamp_ms: ts,
            cpu_count: 1,
            cpu_used_pct: 0.0,
            mem_used: ts as u64,
            mem_total: 1,
            mem_cache: 0,
            disk_used: 0,
            disk_total: 1,
        }
    }

    #[test]
    fn window_is_inclusive_and_ordered() {
        let mut r = MetricRing::new(100);
        for t in 0..10 {
            r.push(sample(t * 1000));
        }
        let w: Vec<i64> = r
            .window(2000, 5000)
            .iter()
            .map(|s| s.timestamp_ms)
            .collect();
        assert_eq!(w, vec![2000, 3000, 4000, 5000]);
        assert!(r.window(10_001, 20_000).is_empty());
        assert_eq!(r.window(i64::MIN, i64::MAX).len(), 10);
    }

    #[test]
    fn bounded_and_still_spans_the_whole_life() {
        let mut r = MetricRing::new(64);
        for t in 0..10_000 {
            r.push(sample(t));
            assert!(r.len() <= 64, "ring grew past its bound at {t}");
        }
        let all = r.window(i64::MIN, i64::MAX);
        assert_eq!(
            all.first().unwrap().timestamp_ms,
            0,
            "the first sample is kept"
        );
        assert_eq!(
            all.last().unwrap().timestamp_ms,
            9_999,
            "the newest sample is shown"
        );
        assert!(
            all.len() >= 32,
            "decimation keeps at least half: {}",
            all.len()
        );
        assert!(all
            .windows(2)
            .all(|w| w[0].timestamp_ms < w[1].timestamp_ms));
        // Evenly spread: no gap larger than twice the stride.
        let gaps: Vec<i64> = all
            .windows(2)
            .map(|w| w[1].timestamp_ms - w[0].timestamp_ms)
            .collect();
        let max = *gaps.iter().max().unwrap();
        assert!(max <= 2 * 256, "largest gap {max}");
    }

    #[test]
    fn latest_tracks_every_offer() {
        let mut r = MetricRing::new(2);
        for t in 0..5 {
            r.push(sample(t));
        }
        assert_eq!(r.latest().unwrap().timestamp_ms, 4);
    }

    #[test]
    fn push_tells_what_it_kept_and_a_restored_ring_has_the_kept_samples() {
        let mut r = MetricRing::new(4);
        let got: Vec<Pushed> = (0..8).map(|t| r.push(sample(t))).collect();
        use Pushed::*;
        // Full at 4: the 5th thins (0, 2 kept), then every other sample is kept.
        assert_eq!(
            got,
            vec![Kept, Kept, Kept, Kept, Thinned, Skipped, Kept, Skipped]
        );
        let kept: Vec<i64> = r.kept().iter().map(|s| s.timestamp_ms).collect();
        assert_eq!(kept, vec![0, 2, 4, 6]);
        let back = MetricRing::restore(4, r.kept());
        assert_eq!(back.kept(), r.kept());
        assert_eq!(back.latest().unwrap().timestamp_ms, 6);
    }
}
