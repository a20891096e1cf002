//! `kiln bench audit`: what the audit log costs. Two servers in this process, the same in every
//! way but `--audit on` / `--audit off`, each with one networked sandbox of the same template,
//! both alive at once; exec round trips (`/bin/true` started through the server's proxy, until
//! its end event) and large uploads through the proxy, in rounds that alternate the two sides
//! (ABAB …, the first side swapping each round) so machine noise hits both alike. Each round
//! gives an on/off ratio; the bench prints the median of those ratios and the overall p50s,
//! and, as a second measure that noise from other processes barely moves, the CPU time each
//! side spent: this process's (both servers and the client live here, and only one side is
//! busy at a time) plus the sandbox's host cgroup. Then audited egress
//! ([`super::audit_egress`]) and syscall-level auditing: on the audit-on server, a `python3 -c`
//! workload in a sandbox created with `kiln.audit.syscalls=true` vs the plain one, interleaved
//! too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::served::{envd_of, exec, BackgroundServer, Side};
use super::stats::{median, median_ci, percentiles};
use anyhow::Context;
use kiln_envd::EnvdClient;
use kiln_server::audit::AuditConfig;
use kiln_server::manager::CreateParams;

use crate::drivers::DriverConfig;

#[derive(clap::Args)]
pub struct Args {
    /// Template of the two sandboxes.
    #[arg(long, default_value = "base")]
    template: String,
    /// Rounds of exec round trips (each: `--execs-per-round` on one side, then on the other).
    #[arg(long, default_value_t = 100)]
    exec_rounds: usize,
    /// Exec round trips per side in each round.
    #[arg(long, default_value_t = 10)]
    execs_per_round: usize,
    /// Size of each upload, MiB.
    #[arg(long, default_value_t = 1024)]
    upload_mib: usize,
    /// Where in the sandbox the uploads go (the default is on the sandbox's disk: its `/tmp` is
    /// a tmpfs smaller than 1 GiB).
    #[arg(long, default_value = "/home/user/bench-upload")]
    upload_path: String,
    /// Upload rounds (each: one upload on one side, then one on the other).
    #[arg(long, default_value_t = 10)]
    uploads: usize,
    /// Egress rounds (0: skip): each runs the in-sandbox client once per mode (audit on with
    /// splice, on with the copy loop, off).
    #[arg(long, default_value_t = 5)]
    egress_rounds: usize,
    /// Connects per egress round and mode.
    #[arg(long, default_value_t = 50)]
    egress_connects: usize,
    /// Size of the download per egress round and mode, MiB.
    #[arg(long, default_value_t = 256)]
    egress_mib: usize,
    /// Runs of the `python3 -c` workload per sandbox (syscall auditing on vs off; 0: skip).
    #[arg(long, default_value_t = 30)]
    py_runs: usize,
    /// The `python3 -c` workload.
    #[arg(long, default_value = "import json, os; open('/etc/hostname').read()")]
    py: String,
    #[command(flatten)]
    rt: super::RuntimeArgs,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let super::ServerBench {
        templates,
        work,
        driver,
        runtime,
    } = super::server_bench(&a.rt, "a")?;
    println!(
        "kiln bench audit ({}, template {}): {}×{} exec round trips \
         and {} uploads of {} MiB per server, audit on vs off, interleaved",
        runtime.label(),
        a.template,
        a.exec_rounds,
        a.execs_per_round,
        a.uploads,
        a.upload_mib
    );
    let rt = tokio::runtime::Runtime::new()?;
    let code = rt.block_on(async move {
        // Every server started so far, for the cleanup whatever happens.
        let servers: std::sync::Mutex<Vec<BackgroundServer>> = Default::default();
        let body = async {
            let sides = start_sides(&a, &templates, &driver, work.path(), &servers).await?;
            let mut r = measure(&a, &sides).await;
            if r.is_ok() && a.egress_rounds > 0 {
                r = super::audit_egress::measure(
                    &sides,
                    a.egress_rounds,
                    a.egress_connects,
                    a.egress_mib,
                )
                .await;
            }
            if r.is_ok() && a.py_runs > 0 {
                r = syscalls(&a, &sides[0]).await;
            }
            r
        };
        // A signal ends the run where it is (dropping the egress test host with it) and still
        // cleans up: the servers' own handlers only stop them, which would leave this waiting.
        let (r, code) = tokio::select! {
            r = body => (r, 0),
            (number, name) = kiln_server::stop_signal() => {
                eprintln!("kiln bench audit: {name}; cleaning up");
                (Ok(()), 128 + number)
            }
        };
        let list = std::mem::take(&mut *servers.lock().unwrap_or_else(|e| e.into_inner()));
        let cleanup = async {
            for s in list {
                // (Its driver releases the slots kept ready, and the host table once no
                // sandbox is left.)
                s.end("bench audit done").await;
            }
        };
        if tokio::time::timeout(CLEANUP_TIMEOUT, cleanup)
            .await
            .is_err()
        {
            eprintln!("kiln bench audit: cleanup did not finish in {CLEANUP_TIMEOUT:?}");
        }
        r.map(|()| code)
    })?;
    Ok(code)
}

/// Longest the cleanup may take (sandbox kills, slot teardown).
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The two servers (audit on, audit off) and a sandbox on each. Networked only when the egress
/// part runs (no namespaces otherwise).
async fn start_sides(
    a: &Args,
    templates: &Arc<dyn kiln_server::templates::Templates>,
    driver: &DriverConfig,
    work: &std::path::Path,
    servers: &std::sync::Mutex<Vec<BackgroundServer>>,
) -> anyhow::Result<Vec<Side>> {
    let mut sides = Vec::new();
    for (name, on, range) in [
        ("on", true, "10.152.0.0/24"),
        ("off", false, "10.153.0.0/24"),
    ] {
        let dir = work.join(name);
        let mut driver = driver.clone();
        driver.set_network(match a.egress_rounds {
            0 => None,
            _ => Some(crate::drivers::bench_network(&dir, range, 1, Vec::new())?),
        });
        let audit = AuditConfig {
            enabled: on,
            ..Default::default()
        };
        let cfg = super::server_config(&dir, driver, audit)?;
        let server = cfg.prepare(templates.clone()).await?;
        let (manager, addr) = (server.manager.clone(), server.local_addr);
        servers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(BackgroundServer::spawn(server));
        let sandbox = manager
            .create(CreateParams {
                template_id: a.template.clone(),
                timeout_secs: Some(3600),
                secure: true,
                ..Default::default()
            })
            .await?;
        let envd = envd_of(addr, &sandbox);
        sides.push(Side {
            name,
            manager,
            sandbox,
            envd,
            addr,
        });
    }
    Ok(sides)
}

async fn exec_true(envd: &EnvdClient) -> anyhow::Result<Duration> {
    exec(envd, "/bin/true", &[]).await
}

/// CPU time so far, ns: this process's (user + system) and the sandbox's host cgroup's.
fn cpu_ns(sandbox_id: &str) -> (u64, u64) {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `t`, which lives for the call.
    let me = if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) } == 0 {
        t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
    } else {
        0
    };
    let v1 = format!("/sys/fs/cgroup/cpuacct/kiln/{sandbox_id}/cpuacct.usage");
    let cgroup = std::fs::read_to_string(v1)
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok())
        .or_else(|| {
            ["/sys/fs/cgroup/kiln", "/sys/fs/cgroup/unified/kiln"]
                .iter()
                .filter_map(|d| std::fs::read_to_string(format!("{d}/{sandbox_id}/cpu.stat")).ok())
                .find_map(|t| {
                    t.lines()
                        .find_map(|l| l.strip_prefix("usage_usec "))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .map(|us| us * 1000)
                })
        })
        .unwrap_or(0);
    (me, cgroup)
}

/// What one side's turn in a round cost: wall time, CPU of this process and of the sandbox.
#[derive(Default, Clone, Copy)]
struct Cost {
    wall: Duration,
    cpu_self_ns: u64,
    cpu_sandbox_ns: u64,
}

impl Cost {
    fn cpu_ms(&self) -> f64 {
        (self.cpu_self_ns + self.cpu_sandbox_ns) as f64 / 1e6
    }
}

/// Runs `f` on `side`, measuring its [`Cost`].
async fn costed<F, Fut, T>(side: &Side, f: F) -> anyhow::Result<(Cost, T)>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let (s0, c0) = cpu_ns(&side.sandbox.id);
    let t = Instant::now();
    let v = f().await?;
    let wall = t.elapsed();
    let (s1, c1) = cpu_ns(&side.sandbox.id);
    Ok((
        Cost {
            wall,
            cpu_self_ns: s1.saturating_sub(s0),
            cpu_sandbox_ns: c1.saturating_sub(c0),
        },
        v,
    ))
}

/// The on/off ratios of each round (`per[0]` on, `per[1]` off) of `f`'s value: their median
/// with its 95 % confidence interval.
fn median_ratio(per: &[Vec<Cost>], f: impl Fn(&Cost) -> f64) -> Ratio {
    let mut r: Vec<f64> = per[0]
        .iter()
        .zip(&per[1])
        .map(|(on, off)| f(on) / f(off))
        .collect();
    let mid = median(&mut r);
    let (lo, hi) = median_ci(&r);
    Ratio { mid, lo, hi }
}

/// A median of on/off ratios and its 95 % confidence interval.
#[derive(Debug, Clone, Copy)]
struct Ratio {
    mid: f64,
    lo: f64,
    hi: f64,
}

impl std::fmt::Display for Ratio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = |r: f64| (r - 1.0) * 100.0;
        let text = if self.lo.is_nan() {
            format!("{:+.1}%", p(self.mid))
        } else {
            format!(
                "{:+.1}% [{:+.1}, {:+.1}]",
                p(self.mid),
                p(self.lo),
                p(self.hi)
            )
        };
        f.pad(&text)
    }
}

fn pct(ratio: f64) -> String {
    format!("{:+.1}%", (ratio - 1.0) * 100.0)
}

async fn measure(a: &Args, sides: &[Side]) -> anyhow::Result<()> {
    // Warm-up: connections, page cache, the agent.
    for s in sides {
        for _ in 0..10 {
            exec_true(&s.envd).await?;
        }
    }
    // Exec rounds: each side's turn is `execs_per_round` round trips.
    let mut exec: Vec<Vec<Duration>> = vec![Vec::new(); sides.len()];
    let mut exec_rounds: Vec<Vec<Cost>> = vec![Vec::new(); sides.len()];
    let mut exec_p50: Vec<Vec<Cost>> = vec![Vec::new(); sides.len()];
    for i in 0..a.exec_rounds {
        for k in 0..sides.len() {
            // Alternate which side goes first.
            let k = (k + i) % sides.len();
            let (cost, times) = costed(&sides[k], || async {
                let mut v = Vec::with_capacity(a.execs_per_round);
                for _ in 0..a.execs_per_round {
                    v.push(exec_true(&sides[k].envd).await?);
                }
                Ok(v)
            })
            .await?;
            let p50 = percentiles(&times).p50_ms;
            exec_p50[k].push(Cost {
                wall: Duration::from_secs_f64(p50 / 1e3),
                ..cost
            });
            exec_rounds[k].push(cost);
            exec[k].extend(times);
        }
    }
    // Upload rounds: one upload per side and round.
    let data = bytes_of(a.upload_mib << 20);
    let mut up: Vec<Vec<Cost>> = vec![Vec::new(); sides.len()];
    for i in 0..a.uploads {
        for k in 0..sides.len() {
            let k = (k + i) % sides.len();
            let body = data.clone();
            let (cost, ()) = costed(&sides[k], || async {
                sides[k]
                    .envd
                    .write_file(&a.upload_path, body, None)
                    .await
                    .with_context(|| format!("upload to the audit-{} server", sides[k].name))
            })
            .await?;
            up[k].push(cost);
        }
    }
    let p: Vec<_> = exec.iter().map(|e| percentiles(e)).collect();
    let mbs = |c: &Cost| data.len() as f64 / c.wall.as_secs_f64() / 1e6;
    let mb: Vec<f64> = up
        .iter()
        .map(|v| median(&mut v.iter().map(mbs).collect::<Vec<_>>()))
        .collect();
    let cpu_per = |v: &[Cost], n: usize| {
        median(&mut v.iter().map(|c| c.cpu_ms() / n as f64).collect::<Vec<_>>())
    };
    println!(
        "  {:<26} {:>10} {:>10} {:>11} {:>24}",
        "", "audit on", "audit off", "on vs off", "rounds' median [95% CI]"
    );
    println!(
        "  {:<26} {:>7.2} ms {:>7.2} ms {:>11} {:>24}",
        "exec round trip p50",
        p[0].p50_ms,
        p[1].p50_ms,
        pct(p[0].p50_ms / p[1].p50_ms),
        median_ratio(&exec_p50, |c| c.wall.as_secs_f64())
    );
    println!(
        "  {:<26} {:>7.2} ms {:>7.2} ms {:>11}",
        "exec round trip p99",
        p[0].p99_ms,
        p[1].p99_ms,
        pct(p[0].p99_ms / p[1].p99_ms),
    );
    println!(
        "  {:<26} {:>7.2} ms {:>7.2} ms {:>11} {:>24}",
        "exec CPU (kiln + sandbox)",
        cpu_per(&exec_rounds[0], a.execs_per_round),
        cpu_per(&exec_rounds[1], a.execs_per_round),
        "",
        median_ratio(&exec_rounds, Cost::cpu_ms)
    );
    let self_ms = |v: &[Cost], n: usize| {
        median(
            &mut v
                .iter()
                .map(|c| c.cpu_self_ns as f64 / 1e6 / n as f64)
                .collect::<Vec<_>>(),
        )
    };
    println!(
        "  {:<26} {:>7.2} ms {:>7.2} ms {:>11} {:>24}",
        "  of which kiln's process",
        self_ms(&exec_rounds[0], a.execs_per_round),
        self_ms(&exec_rounds[1], a.execs_per_round),
        "",
        median_ratio(&exec_rounds, |c| c.cpu_self_ns as f64)
    );
    println!(
        "  {:<26} {:>5.0} MB/s {:>5.0} MB/s {:>11} {:>24}",
        format!("{} MiB upload median", a.upload_mib),
        mb[0],
        mb[1],
        pct(mb[1] / mb[0]),
        median_ratio(&up, |c| c.wall.as_secs_f64())
    );
    println!(
        "  {:<26} {:>7.0} ms {:>7.0} ms {:>11} {:>24}",
        "upload CPU (kiln + sandbox)",
        cpu_per(&up[0], 1),
        cpu_per(&up[1], 1),
        "",
        median_ratio(&up, Cost::cpu_ms)
    );
    println!(
        "  {:<26} {:>7.0} ms {:>7.0} ms {:>11} {:>24}",
        "  of which kiln's process",
        self_ms(&up[0], 1),
        self_ms(&up[1], 1),
        "",
        median_ratio(&up, |c| c.cpu_self_ns as f64)
    );
    let recs = sides[0]
        .manager
        .audit()
        .query(kiln_server::audit::Filter {
            sandbox_id: Some(sides[0].sandbox.id.clone()),
            limit: 100_000,
            ..Default::default()
        })
        .await?;
    println!(
        "  (overhead: how much slower, or how much more CPU, with audit on; target ≤ 5%. \
         \"rounds' median\": the median of the rounds' on/off ratios, with its \
         distribution-free 95% confidence interval. CPU: this process (both \
         servers and the client) + the sandbox's host cgroup, per exec or upload. The \
         audit-on sandbox has {} records; the audit-off one none)",
        recs.len()
    );
    Ok(())
}

fn bytes_of(n: usize) -> Vec<u8> {
    vec![0x5au8; n]
}

/// The `python3 -c` workload in a sandbox with syscall auditing vs the plain audit-on one.
async fn syscalls(a: &Args, on: &Side) -> anyhow::Result<()> {
    let traced = on
        .manager
        .create(CreateParams {
            template_id: a.template.clone(),
            timeout_secs: Some(3600),
            secure: true,
            metadata: [("kiln.audit.syscalls".to_string(), "true".to_string())].into(),
            ..Default::default()
        })
        .await?;
    let envds = [envd_of(on.addr, &traced), on.envd.clone()];
    let args = ["-c", a.py.as_str()];
    for e in &envds {
        exec(e, "python3", &args).await?;
    }
    let mut t: Vec<Vec<Duration>> = vec![Vec::new(); 2];
    for i in 0..a.py_runs {
        for k in 0..2 {
            let k = (k + i) % 2;
            t[k].push(exec(&envds[k], "python3", &args).await?);
        }
    }
    let p: Vec<_> = t.iter().map(|e| percentiles(e)).collect();
    let recs = on
        .manager
        .audit()
        .query(kiln_server::audit::Filter {
            sandbox_id: Some(traced.id.clone()),
            kinds: vec![kiln_server::audit::Kind::Syscall],
            limit: 1_000_000,
            ..Default::default()
        })
        .await?;
    println!(
        "  {:<22} {:>7.2} ms {:>7.2} ms {:>15.1}%   (syscalls on vs off, audit on)",
        "python3 -c p50",
        p[0].p50_ms,
        p[1].p50_ms,
        (p[0].p50_ms / p[1].p50_ms - 1.0) * 100.0
    );
    println!(
        "  ({} syscall records for {} runs: {:.0} per run)",
        recs.len(),
        a.py_runs + 1,
        recs.len() as f64 / (a.py_runs + 1) as f64
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ratio_prints_as_percent_with_its_interval() {
        let r = Ratio {
            mid: 1.02,
            lo: 0.99,
            hi: 1.05,
        };
        assert_eq!(format!("{r:>20}"), "  +2.0% [-1.0, +5.0]");
    }
}
