//! The statistics every bench prints: percentiles of latency samples (nearest rank), medians
//! and the median's confidence interval, and interpolated quantiles (the definition
//! ComputeSDK's scores use, see [`super::tti_stats`]).

use std::time::Duration;

/// p50/p99 of a sample set, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Percentiles {
    pub n: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

pub(crate) fn percentiles(samples: &[Duration]) -> Percentiles {
    let mut v: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| -> f64 {
        if v.is_empty() {
            return f64::NAN;
        }
        let idx = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[idx]
    };
    Percentiles {
        n: v.len(),
        p50_ms: at(0.50),
        p99_ms: at(0.99),
    }
}

/// `v` sorted ascending (NaN last).
pub(crate) fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

/// The `q` quantile of sorted `v` (linear interpolation between ranks; NaN when empty).
pub(crate) fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let pos = q * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// The median of `v` (NaN when empty); sorts `v`.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|x, y| x.total_cmp(y));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The distribution-free 95 % confidence interval of the median of `sorted` (ascending): the
/// order statistics at n/2 ∓ 0.98·√n (the normal approximation of the binomial with p = ½),
/// so no assumption about the shape of the noise. NaN bounds below 6 values.
pub(crate) fn median_ci(sorted: &[f64]) -> (f64, f64) {
    let n = sorted.len();
    if n < 6 {
        return (f64::NAN, f64::NAN);
    }
    let half = 0.98 * (n as f64).sqrt();
    let lo = ((n as f64 / 2.0 - half).floor() as usize).min(n - 1);
    let hi = ((n as f64 / 2.0 + half).ceil() as usize).min(n - 1);
    (sorted[lo], sorted[hi])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_math() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let p = percentiles(&s);
        assert_eq!(p.n, 100);
        assert_eq!(p.p50_ms, 50.0);
        assert_eq!(p.p99_ms, 99.0);
        let one = percentiles(&[Duration::from_millis(7)]);
        assert_eq!((one.p50_ms, one.p99_ms), (7.0, 7.0));
        assert!(percentiles(&[]).p50_ms.is_nan());
    }

    #[test]
    fn median_and_its_interval() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert!(median(&mut []).is_nan());
        let v: Vec<f64> = (0..100).map(f64::from).collect();
        // 50 ∓ 0.98·10: the 41st and 60th smallest.
        assert_eq!(median_ci(&v), (40.0, 60.0));
        let (lo, hi) = median_ci(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(lo.is_nan() && hi.is_nan());
    }

    #[test]
    fn interpolated_quantiles() {
        let v = sorted(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!(v, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(quantile(&v, 0.5), 2.5);
        assert_eq!(quantile(&v, 1.0), 4.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
