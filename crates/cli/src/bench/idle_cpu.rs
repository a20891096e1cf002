//! Idle CPU cost of sandboxes, load-independent: host CPU time charged to each sandbox's host
//! cgroup (the sentry, the gofer and the platform's stub processes) and to this process (the
//! server: sampler, watcher, agents' clients) over a window, per sandbox-second. On a host
//! shared with other work this still measures what the sandboxes cost, unlike /proc/stat idle.

use std::time::{Duration, Instant};

/// CPU used over a window, in host cores (1.0 = one core busy all the time).
#[derive(Debug, Default, Clone, Copy)]
pub struct IdleCpu {
    /// Mean over the sandboxes whose cgroup could be read (cores per sandbox).
    pub per_sandbox: f64,
    /// This process and its reaped children, divided by the sandboxes (cores per sandbox).
    pub server_per_sandbox: f64,
    /// Sandboxes whose cgroup could be read at both ends.
    pub measured: usize,
}

/// Cumulative CPU time (ns) of sandbox `id`'s host cgroup: cgroup v1 `cpuacct.usage`, or v2
/// `cpu.stat` usage_usec (unified at /sys/fs/cgroup or /sys/fs/cgroup/unified).
pub fn cgroup_cpu_ns(id: &str) -> Option<u64> {
    let v1 = format!("/sys/fs/cgroup/cpuacct/kiln/{id}/cpuacct.usage");
    if let Ok(s) = std::fs::read_to_string(v1) {
        return s.trim().parse().ok();
    }
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        if let Ok(s) = std::fs::read_to_string(format!("{root}/kiln/{id}/cpu.stat")) {
            let usec = s
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())?;
            return Some(usec * 1000);
        }
    }
    None
}

/// CPU time (ns) of this process and its reaped children.
fn own_cpu_ns() -> u64 {
    let one = |who| {
        // SAFETY: getrusage fills the zeroed struct it is given.
        let mut r: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `r` is a valid rusage to write into.
        if unsafe { libc::getrusage(who, &mut r) } != 0 {
            return 0u64;
        }
        let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
        tv(r.ru_utime) + tv(r.ru_stime)
    };
    one(libc::RUSAGE_SELF) + one(libc::RUSAGE_CHILDREN)
}

/// Measures `ids` over `window` (the caller keeps them idle meanwhile).
pub async fn measure(ids: &[String], window: Duration) -> IdleCpu {
    let before: Vec<Option<u64>> = ids.iter().map(|id| cgroup_cpu_ns(id)).collect();
    let own = own_cpu_ns();
    let t = Instant::now();
    tokio::time::sleep(window).await;
    let secs = t.elapsed().as_secs_f64();
    let own = own_cpu_ns().saturating_sub(own);
    let mut sum = 0u64;
    let mut measured = 0;
    for (id, b) in ids.iter().zip(before) {
        if let (Some(b), Some(a)) = (b, cgroup_cpu_ns(id)) {
            sum += a.saturating_sub(b);
            measured += 1;
        }
    }
    IdleCpu {
        per_sandbox: sum as f64 / 1e9 / secs / measured.max(1) as f64,
        server_per_sandbox: own as f64 / 1e9 / secs / ids.len().max(1) as f64,
        measured,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_grows_with_work() {
        // Spins until 20 ms of CPU time are counted (wall time varies with the host's load).
        let a = own_cpu_ns();
        let t = Instant::now();
        let mut x = 0u64;
        while own_cpu_ns() < a + 20_000_000 && t.elapsed() < Duration::from_secs(20) {
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        }
        assert!(own_cpu_ns() >= a + 20_000_000, "no CPU time counted ({x})");
    }

    #[test]
    fn unknown_sandbox_has_no_cgroup() {
        assert_eq!(cgroup_cpu_ns("no-such-sandbox-kiln-test"), None);
    }
}
