//! `/metrics` sampling (as envd reports it) and clock setting for `/init`.

use kiln_proto::envd::Metrics;

/// This system's CPU counters from `/proc/stat`, in clock ticks: (all, idle + iowait). All is
/// the first eight fields (user nice system idle iowait irq softirq steal); guest time is
/// already in user and nice.
pub fn cpu_times() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let line = s.lines().next()?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.len() < 4 {
        return None;
    }
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some((v.iter().take(8).sum(), idle))
}

/// The CPU counters the previous sample read (`/proc/stat`: all, idle).
static LAST_CPU: std::sync::Mutex<Option<(u64, u64)>> = std::sync::Mutex::new(None);

/// CPU use between readings `a` and `b` of [`cpu_times`], percent; 0 when no time passed.
fn cpu_pct(a: (u64, u64), b: (u64, u64)) -> f32 {
    let (total, idle) = (b.0.saturating_sub(a.0), b.1.saturating_sub(a.1));
    if total == 0 {
        return 0.0;
    }
    (total.saturating_sub(idle) as f32 / total as f32 * 100.0).clamp(0.0, 100.0)
}

/// Take one sample, at once: CPU usage is measured since the previous sample (the server
/// samples every few seconds), or since boot for the first one. A kill asks for the agent's
/// last kills through here, so nothing here waits.
pub async fn sample() -> Metrics {
    let now = cpu_times();
    let cpu_used_pct = {
        let mut last = LAST_CPU.lock().unwrap_or_else(|p| p.into_inner());
        let pct = now.map_or(0.0, |b| cpu_pct(last.unwrap_or((0, 0)), b));
        if now.is_some() {
            *last = now;
        }
        pct
    };
    let mut mem_total = 0;
    let mut mem_avail = 0;
    let mut mem_cache = 0;
    if let Ok(m) = std::fs::read_to_string("/proc/meminfo") {
        for l in m.lines() {
            let kb = |l: &str| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse::<u64>().ok())
                    .unwrap_or(0)
                    * 1024
            };
            if l.starts_with("MemTotal:") {
                mem_total = kb(l);
            } else if l.starts_with("MemAvailable:") {
                mem_avail = kb(l);
            } else if l.starts_with("Cached:") {
                mem_cache = kb(l);
            }
        }
    }
    let mem_used = mem_total.saturating_sub(mem_avail);
    let (disk_total, disk_used) = match nix::sys::statvfs::statvfs("/") {
        Ok(s) => {
            let bs = s.fragment_size();
            let total = s.blocks() * bs;
            (total, total.saturating_sub(s.blocks_free() * bs))
        }
        Err(_) => (0, 0),
    };
    Metrics {
        ts: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0),
        cpu_count: std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1),
        cpu_used_pct,
        mem_total,
        mem_used,
        mem_total_mib: mem_total >> 20,
        mem_used_mib: mem_used >> 20,
        disk_used,
        disk_total,
        mem_cache,
        kiln_kills: crate::kills::recent(),
    }
}

/// Set the system clock from an RFC 3339 timestamp when running as PID 1 and it is off by more
/// than a second (inside a restored sandbox the clock may be stale). Never fails the request.
pub fn maybe_set_clock(ts: &str) {
    if std::process::id() != 1 {
        return;
    }
    let Some(secs) = parse_rfc3339(ts) else {
        tracing::warn!("ignoring unparsable /init timestamp {ts:?}");
        return;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    if (now - secs).abs() < 1.0 {
        return;
    }
    let tv = libc::timespec {
        tv_sec: secs.trunc() as libc::time_t,
        tv_nsec: (secs.fract() * 1e9) as libc::c_long,
    };
    // SAFETY: clock_settime with a valid timespec pointer.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &tv) } != 0 {
        tracing::warn!("cannot set the clock: {}", std::io::Error::last_os_error());
    }
}

/// Seconds since the epoch of `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`.
pub fn parse_rfc3339(s: &str) -> Option<f64> {
    let b = s.as_bytes();
    if b.len() < 20 {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d, h, mi, se) = (
        num(0..4)?,
        num(5..7)?,
        num(8..10)?,
        num(11..13)?,
        num(14..16)?,
        num(17..19)?,
    );
    let mut rest = &s[19..];
    let mut frac = 0.0;
    if let Some(r) = rest.strip_prefix('.') {
        let end = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
        frac = format!("0.{}", &r[..end]).parse().ok()?;
        rest = &r[end..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        o if o.len() == 6 => {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            sign * (o.get(1..3)?.parse::<i64>().ok()? * 3600
                + o.get(4..6)?.parse::<i64>().ok()? * 60)
        }
        _ => return None,
    };
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if mo <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * (if mo > 2 { mo - 3 } else { mo + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146097 + doe - 719468;
    Some((days * 86400 + h * 3600 + mi * 60 + se - offset) as f64 + frac)
}

#[cfg(test)]
mod tests {
    #[test]
    fn cpu_percent_between_two_readings() {
        assert_eq!(super::cpu_pct((100, 50), (200, 100)), 50.0);
        assert_eq!(super::cpu_pct((100, 50), (200, 150)), 0.0);
        assert_eq!(super::cpu_pct((100, 50), (200, 50)), 100.0);
        assert_eq!(super::cpu_pct((100, 50), (100, 50)), 0.0, "no time passed");
        assert_eq!(super::cpu_pct((0, 0), (400, 100)), 75.0, "since boot");
    }

    #[tokio::test]
    async fn a_sample_answers_at_once() {
        let t = std::time::Instant::now();
        let m = super::sample().await;
        assert!(
            t.elapsed() < std::time::Duration::from_millis(100),
            "{:?}",
            t.elapsed()
        );
        assert!((0.0..=100.0).contains(&m.cpu_used_pct));
    }

    #[test]
    fn rfc3339() {
        assert_eq!(super::parse_rfc3339("1970-01-01T00:00:00Z"), Some(0.0));
        assert_eq!(
            super::parse_rfc3339("2024-03-01T12:00:00+01:00"),
            Some(1709290800.0)
        );
        assert_eq!(
            super::parse_rfc3339("2024-03-01T11:00:00.5Z"),
            Some(1709290800.5)
        );
        assert_eq!(super::parse_rfc3339("garbage"), None);
        assert_eq!(super::parse_rfc3339("2024-03-01T11:00:00+\u{e9}:00"), None);
    }
}
