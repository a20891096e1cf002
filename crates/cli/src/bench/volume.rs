//! `kiln bench volume`: a volume's read and write throughput inside a sandbox vs the sandbox's
//! own disk, in one run: `dd` of the same size to and from a file on a mounted volume (its
//! own loop-mounted ext4 image, bind-mounted into the sandbox) and on the sandbox's writable
//! disk (`/home/user`), interleaved, median MB/s of each and their ratio (target ≥ 0.7×).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kiln_server::templates::Templates;

use super::side::{params, side};
use super::stats::median;

#[derive(clap::Args)]
pub struct Args {
    /// Template to start the sandbox from.
    #[arg(long, default_value = "base")]
    template: String,
    /// Rounds of each measurement (each one writes and reads both places).
    #[arg(long, default_value_t = 5)]
    n: usize,
    /// Size of the file written and read, MiB.
    #[arg(long, default_value_t = 128)]
    mib: u32,
    #[command(flatten)]
    rt: super::RuntimeArgs,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let store = kiln_template::Store::open_default().context("opening the template store")?;
    let templates: Arc<dyn Templates> = Arc::new(store);
    let work_root = a.rt.work_root()?;
    tokio::runtime::Runtime::new()?.block_on(bench(a, templates, work_root))
}

/// Seconds `cmd` took in the sandbox (it must succeed).
async fn timed(agent: &kiln_envd::EnvdClient, cmd: &str) -> anyhow::Result<f64> {
    let opts = kiln_envd::RunOptions {
        timeout: Some(Duration::from_secs(300)),
        ..Default::default()
    };
    let t = Instant::now();
    let out = agent.run(cmd, opts).await?;
    let took = t.elapsed().as_secs_f64();
    if out.exit_code != 0 {
        bail!("`{cmd}` failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(took)
}

async fn bench(a: Args, templates: Arc<dyn Templates>, work_root: PathBuf) -> anyhow::Result<i32> {
    let s = side(&work_root, "v", &a.rt.resolve()?, None, &templates)?;
    s.manager
        .set_volumes_db(kiln_server::store::VolumesDb::open(
            &s.dir().join("kiln.db"),
        )?);
    let vol = s.manager.create_volume("default", "bench").await?;
    let mounts = s
        .manager
        .resolve_mounts("default", &[("bench".into(), "/mnt/vol".into())])
        .await?;
    let mut p = params(&a.template);
    p.volume_mounts = mounts;
    let rec = s.manager.create(p).await?;
    let agent = s.manager.agent(&rec.id, None);
    let places = [("volume", "/mnt/vol"), ("own disk", "/home/user")];
    let mut write = [Vec::new(), Vec::new()];
    let mut read = [Vec::new(), Vec::new()];
    let mib = f64::from(a.mib) * 1.048_576;
    let measured = async {
        for _ in 0..a.n.max(1) {
            for (i, (_, dir)) in places.iter().enumerate() {
                let f = format!("{dir}/bench.bin");
                let w = format!(
                    "dd if=/dev/zero of={f} bs=1M count={} conv=fsync 2>/dev/null",
                    a.mib
                );
                write[i].push(mib / timed(&agent, &w).await?);
                let r = format!("dd if={f} of=/dev/null bs=1M 2>/dev/null");
                read[i].push(mib / timed(&agent, &r).await?);
                timed(&agent, &format!("rm -f {f}")).await?;
            }
        }
        anyhow::Ok(())
    }
    .await;
    let _ = s.manager.kill(&rec.id, "bench").await;
    let _ = s.manager.delete_volume("default", &vol.id).await;
    measured?;
    println!(
        "volume vs own disk, {} MiB file, {} rounds (median MB/s):",
        a.mib, a.n
    );
    println!(
        "  {:<8} {:>10} {:>10} {:>8}",
        "", "volume", "own disk", "ratio"
    );
    for (name, v) in [("write", &mut write), ("read", &mut read)] {
        let (vm, dm) = (median(&mut v[0]), median(&mut v[1]));
        println!(
            "  {name:<8} {vm:>10.0} {dm:>10.0} {:>7.2}x {}",
            vm / dm,
            if vm / dm >= 0.7 {
                "(target ≥ 0.7x: met)"
            } else {
                "(target ≥ 0.7x: missed)"
            }
        );
    }
    Ok(0)
}
