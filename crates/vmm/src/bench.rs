//! `kiln bench vmm`: boot, snapshot and restore latency of real `kiln-vmm` processes running the
//! test guest, VMM RSS without guest memory, against raw baselines measured in the same run
//! (spawning `/bin/true`; writing the snapshot's bytes to a file with `write` + `fsync`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::json;

pub struct BenchOptions {
    pub iterations: usize,
    /// kiln-vmm binary; default: `$KILN_VMM_BIN`, next to the running executable, or on PATH.
    pub vmm_bin: Option<PathBuf>,
    pub mem_mib: u64,
    /// Printed with the results, e.g. the KVM speed probe's verdict for this host.
    pub note: String,
}

/// Finds the kiln-vmm binary.
pub fn find_vmm_bin(explicit: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit.or_else(|| std::env::var_os("KILN_VMM_BIN").map(PathBuf::from)) {
        return Ok(p);
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            for cand in [dir.join("kiln-vmm"), dir.join("../kiln-vmm")] {
                if cand.is_file() {
                    return Ok(cand);
                }
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            if d.join("kiln-vmm").is_file() {
                return Ok(d.join("kiln-vmm"));
            }
        }
    }
    bail!("kiln-vmm binary not found: build it (cargo build -p kiln-vmm) or pass --vmm-bin / set KILN_VMM_BIN")
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

struct Proc {
    child: Child,
    serial: PathBuf,
    api: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(bin: &Path, dir: &Path, name: &str, args: &[&str]) -> anyhow::Result<Proc> {
    let serial = dir.join(format!("{name}.serial"));
    let api = dir.join(format!("{name}.api"));
    let child = Command::new(bin)
        .args(args)
        .arg("--serial-out")
        .arg(&serial)
        .arg("--api-sock")
        .arg(&api)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("spawning {}", bin.display()))?;
    Ok(Proc { child, serial, api })
}

fn wait_for(deadline: Duration, mut f: impl FnMut() -> bool) -> anyhow::Result<()> {
    let end = Instant::now() + deadline;
    while !f() {
        if Instant::now() > end {
            bail!("timed out");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

fn serial_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

fn call(api: &Path, req: serde_json::Value) -> anyhow::Result<serde_json::Value> {
    wait_for(Duration::from_secs(30), || {
        std::os::unix::net::UnixStream::connect(api).is_ok()
    })?;
    let r = crate::api::call(api, &req)?;
    if r["ok"] != true {
        bail!("API call {req} failed: {r}");
    }
    Ok(r)
}

#[derive(Default)]
struct Samples {
    spawn_true: Vec<f64>,
    boot_first_output: Vec<f64>,
    boot_first_run: Vec<f64>,
    snapshot_api: Vec<f64>,
    snapshot_pause: Vec<f64>,
    raw_write: Vec<f64>,
    restore_first_output: Vec<f64>,
    restore_first_run: Vec<f64>,
    vmm_rss_boot: Vec<f64>,
    vmm_rss_restore: Vec<f64>,
    guest_rss_restore: Vec<f64>,
}

/// Runs the benchmark and prints the report; returns the process exit code.
pub fn run(opts: BenchOptions) -> anyhow::Result<i32> {
    let bin = find_vmm_bin(opts.vmm_bin)?;
    let guest = crate::test_guests::LINUX64;
    if !Path::new(guest).is_file() {
        bail!("test guest {guest} is missing: rebuild kiln-vmm on this machine");
    }
    let tmp = tempdir()?;
    let dir = tmp.path.as_path();
    let mem = opts.mem_mib.to_string();
    let mut s = Samples::default();
    for i in 0..opts.iterations.max(1) {
        // raw baseline: process spawn
        let t = Instant::now();
        Command::new("/bin/true")
            .status()
            .context("running /bin/true")?;
        s.spawn_true.push(t.elapsed().as_secs_f64() * 1e3);

        // boot → first guest output
        let t = Instant::now();
        let boot_name = format!("boot{i}");
        let vm = spawn(
            &bin,
            dir,
            &boot_name,
            &[
                "--kernel",
                guest,
                "--cmdline",
                "kiln.test=count kiln.count_shift=16",
                "--mem-mib",
                &mem,
            ],
        )?;
        wait_for(Duration::from_secs(60), || serial_len(&vm.serial) > 0)
            .context("waiting for the booted guest")?;
        s.boot_first_output.push(t.elapsed().as_secs_f64() * 1e3);
        let st = call(&vm.api, json!({"op": "stats"}))?;
        s.boot_first_run
            .push(st["start_to_first_run_ms"].as_f64().unwrap_or(f64::NAN));
        s.vmm_rss_boot
            .push(st["vmm_rss_bytes"].as_f64().unwrap_or(f64::NAN));

        // snapshot
        let snap = dir.join(format!("snap{i}"));
        let t = Instant::now();
        let r = call(
            &vm.api,
            json!({"op": "snapshot", "dir": snap, "resume": false}),
        )?;
        s.snapshot_api.push(t.elapsed().as_secs_f64() * 1e3);
        s.snapshot_pause
            .push(r["snapshot_ms"].as_f64().unwrap_or(f64::NAN));
        let written = r["memory_bytes_written"].as_u64().unwrap_or(0) as usize;
        call(&vm.api, json!({"op": "stop"}))?;
        drop(vm);

        // raw baseline: write the same number of bytes and fsync
        let buf = vec![0x5au8; written.max(4096)];
        let t = Instant::now();
        {
            let mut f = std::fs::File::create(dir.join(format!("raw{i}")))?;
            f.write_all(&buf)?;
            f.sync_all()?;
        }
        s.raw_write.push(t.elapsed().as_secs_f64() * 1e3);

        // restore → guest running again (first output after restore)
        let t = Instant::now();
        let vm = spawn(
            &bin,
            dir,
            &format!("restore{i}"),
            &["--restore", snap.to_str().unwrap_or_default()],
        )?;
        wait_for(Duration::from_secs(60), || serial_len(&vm.serial) > 0)
            .context("waiting for the restored guest")?;
        s.restore_first_output.push(t.elapsed().as_secs_f64() * 1e3);
        let st = call(&vm.api, json!({"op": "stats"}))?;
        s.restore_first_run
            .push(st["start_to_first_run_ms"].as_f64().unwrap_or(f64::NAN));
        s.vmm_rss_restore
            .push(st["vmm_rss_bytes"].as_f64().unwrap_or(f64::NAN));
        s.guest_rss_restore
            .push(st["guest_rss_bytes"].as_f64().unwrap_or(f64::NAN));
        call(&vm.api, json!({"op": "stop"}))?;
        drop(vm);
        let _ = std::fs::remove_dir_all(&snap);
    }

    let n = opts.iterations.max(1);
    let spawn50 = pct(&mut s.spawn_true, 0.5);
    let raw50 = pct(&mut s.raw_write, 0.5);
    println!(
        "kiln bench vmm: {n} iterations, guest RAM {} MiB, kiln-vmm = {}",
        opts.mem_mib,
        bin.display()
    );
    if !opts.note.is_empty() {
        println!("note: {}", opts.note);
    }
    println!(
        "{:<44} {:>10} {:>10} {:>12}",
        "metric (ms unless noted)", "p50", "p99", "ratio(p50)"
    );
    let line = |name: &str, v: &mut Vec<f64>, base: Option<f64>| {
        let p50 = pct(v, 0.5);
        let p99 = pct(v, 0.99);
        let ratio = base.map(|b| format!("{:.1}x", p50 / b)).unwrap_or_default();
        println!("{name:<44} {p50:>10.2} {p99:>10.2} {ratio:>12}");
    };
    line("baseline: spawn /bin/true", &mut s.spawn_true.clone(), None);
    line(
        "boot: spawn -> first guest output",
        &mut s.boot_first_output,
        Some(spawn50),
    );
    line(
        "boot: VM setup start -> first KVM_RUN",
        &mut s.boot_first_run,
        None,
    );
    line(
        "snapshot: API round trip (paused VM)",
        &mut s.snapshot_api,
        Some(raw50),
    );
    line(
        "snapshot: pause+state+memory in VMM",
        &mut s.snapshot_pause,
        Some(raw50),
    );
    line(
        "baseline: write+fsync same bytes",
        &mut s.raw_write.clone(),
        None,
    );
    line(
        "restore: spawn -> first guest output",
        &mut s.restore_first_output,
        Some(spawn50),
    );
    line(
        "restore: setup start -> first KVM_RUN",
        &mut s.restore_first_run,
        None,
    );
    let mib = |v: &mut Vec<f64>| pct(v, 0.5) / (1024.0 * 1024.0);
    println!(
        "VMM RSS excluding guest memory (MiB, p50): booted {:.2}, restored {:.2} (goal <= 5)",
        mib(&mut s.vmm_rss_boot),
        mib(&mut s.vmm_rss_restore)
    );
    println!(
        "guest RAM resident after restore (MiB, p50): {:.2} of {} (lazy MAP_PRIVATE faults)",
        mib(&mut s.guest_rss_restore),
        opts.mem_mib
    );
    Ok(0)
}

struct TempDir {
    path: PathBuf,
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn tempdir() -> anyhow::Result<TempDir> {
    let path = std::env::temp_dir().join(format!("kiln-bench-vmm-{}", std::process::id()));
    std::fs::create_dir_all(&path)?;
    Ok(TempDir { path })
}
