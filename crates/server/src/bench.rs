//! `kiln bench create`: sandbox create → first `echo` output, sequential and concurrent, against
//! the raw floor measured in the same run (`runsc run` of the same rootfs printing `echo`).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::driver::gvisor::{GvisorConfig, GvisorDriver};
use crate::manager::{CreateParams, LifecycleConfig, Manager};
use crate::store::Store;
use crate::templates::Templates;

#[derive(Debug, Clone)]
pub struct CreateBenchOptions {
    pub template: String,
    /// Sequential creates.
    pub sequential: usize,
    /// Concurrent creates (one wave).
    pub concurrency: usize,
    /// Raw `runsc run` samples.
    pub raw: usize,
    pub platform: String,
    /// Where the bench keeps its sandboxes (a fresh temp dir inside it).
    pub work_dir: std::path::PathBuf,
}

/// p50/p99 of a sample set, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    pub n: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

pub fn percentiles(samples: &[Duration]) -> Percentiles {
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

#[derive(Debug, Clone)]
pub struct CreateBenchReport {
    pub sequential: Percentiles,
    pub concurrent: Percentiles,
    pub raw: Percentiles,
}

async fn create_and_echo(m: &Manager, template: &str) -> Result<(Duration, String), String> {
    let t = Instant::now();
    let rec = m
        .create(CreateParams {
            template_id: template.to_string(),
            timeout_secs: Some(600),
            secure: true,
            ..Default::default()
        })
        .await
        .map_err(|e| e.message)?;
    let route = m.route(&rec.id).ok_or("sandbox vanished")?;
    let agent = kiln_agent::client::AgentClient::unix(&route.socket);
    let out = agent
        .run(
            "echo kiln-bench",
            kiln_agent::client::RunOptions {
                access_token: route.envd_token.clone(),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| format!("echo in {}: {e}", rec.id))?;
    let took = t.elapsed();
    if out.stdout != b"kiln-bench\n" {
        return Err(format!(
            "unexpected echo output {:?}",
            String::from_utf8_lossy(&out.stdout)
        ));
    }
    Ok((took, rec.id))
}

/// `runsc run` of `rootfs` (read-only) printing `echo`: the floor any gVisor create pays.
fn raw_runsc_echo(
    runsc: &Path,
    work: &Path,
    rootfs: &Path,
    platform: &str,
    i: usize,
) -> Result<Duration, String> {
    let bundle = work.join(format!("raw-{i}"));
    std::fs::create_dir_all(&bundle).map_err(|e| e.to_string())?;
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"terminal": false, "user": {"uid": 0, "gid": 0},
                    "args": ["/bin/echo", "kiln-bench"], "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
        "root": {"path": rootfs, "readonly": true},
        "hostname": "raw",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]}
    });
    std::fs::write(bundle.join("config.json"), spec.to_string()).map_err(|e| e.to_string())?;
    let root = work.join("raw-runsc-root");
    let id = format!("kiln-bench-raw-{}-{i}", std::process::id());
    let t = Instant::now();
    let out = std::process::Command::new(runsc)
        .arg(format!("--root={}", root.display()))
        .arg(format!("--platform={platform}"))
        .arg("--network=none")
        .args(["run", "--bundle"])
        .arg(&bundle)
        .arg(&id)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("running runsc: {e}"))?;
    let took = t.elapsed();
    if String::from_utf8_lossy(&out.stdout).trim() != "kiln-bench" {
        return Err(format!(
            "raw runsc run printed {:?} (stderr {:?})",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(took)
}

/// Runs the benchmark, printing progress to stderr.
pub async fn create_bench(
    opts: &CreateBenchOptions,
    templates: Arc<dyn Templates>,
) -> Result<CreateBenchReport, String> {
    let tpl = templates
        .lookup(&opts.template)?
        .ok_or_else(|| format!("template {:?} is not built", opts.template))?;
    std::fs::create_dir_all(&opts.work_dir).map_err(|e| e.to_string())?;
    let work = tempfile::Builder::new()
        .prefix("kiln-bench-")
        .tempdir_in(&opts.work_dir)
        .map_err(|e| e.to_string())?;
    let store = Arc::new(Store::open(&work.path().join("kiln.db")).map_err(|e| e.to_string())?);
    let mut gcfg = GvisorConfig::new(work.path());
    gcfg.platform = opts.platform.clone();
    let runsc = gcfg.runsc.clone();
    let driver = Arc::new(GvisorDriver::new(gcfg).map_err(|e| e.to_string())?);
    let manager = Manager::new(LifecycleConfig::default(), store, driver, templates);

    let result = async {
        // Warm-up (page cache, binaries), not counted.
        let (_, id) = create_and_echo(&manager, &opts.template).await?;
        let _ = manager.kill(&id, "bench").await;

        eprintln!("raw floor: {} × runsc run echo …", opts.raw);
        let mut raw = Vec::new();
        for i in 0..opts.raw {
            let (r, w, t, p) = (
                runsc.clone(),
                work.path().to_path_buf(),
                tpl.rootfs.clone(),
                opts.platform.clone(),
            );
            raw.push(
                tokio::task::spawn_blocking(move || raw_runsc_echo(&r, &w, &t, &p, i))
                    .await
                    .map_err(|e| e.to_string())??,
            );
        }

        eprintln!("sequential: {} × create → echo …", opts.sequential);
        let mut seq = Vec::new();
        for _ in 0..opts.sequential {
            let (d, id) = create_and_echo(&manager, &opts.template).await?;
            seq.push(d);
            let _ = manager.kill(&id, "bench").await;
        }

        eprintln!("concurrent: {} creates at once …", opts.concurrency);
        let m = manager.clone();
        let futs = (0..opts.concurrency).map(|_| {
            let m = m.clone();
            let t = opts.template.clone();
            async move { create_and_echo(&m, &t).await }
        });
        let results = futures::future::join_all(futs).await;
        let mut conc = Vec::new();
        let mut first_err = None;
        for r in results {
            match r {
                Ok((d, id)) => {
                    conc.push(d);
                    let _ = manager.kill(&id, "bench").await;
                }
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        Ok(CreateBenchReport {
            sequential: percentiles(&seq),
            concurrent: percentiles(&conc),
            raw: percentiles(&raw),
        })
    }
    .await;
    manager.kill_all("bench done").await;
    result
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
}
