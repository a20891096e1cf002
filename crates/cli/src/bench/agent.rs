//! `kiln bench agent`: see `kiln_agent::bench`.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// kiln-agent binary (default: $KILN_AGENT_BIN, else `kiln-agent` next to this executable).
    #[arg(long, env = "KILN_AGENT_BIN")]
    agent_bin: Option<PathBuf>,
    /// Exec round trips to time.
    #[arg(long, default_value_t = 300)]
    iterations: usize,
    /// Upload/download size in MiB.
    #[arg(long, default_value_t = 100)]
    size_mib: usize,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let agent_bin = match a.agent_bin {
        Some(p) => p,
        None => std::env::current_exe()?.with_file_name("kiln-agent"),
    };
    let report = kiln_agent::bench::run(&kiln_agent::bench::BenchOptions {
        agent_bin,
        iterations: a.iterations,
        size_mib: a.size_mib,
    })?;
    print!("{}", report.render());
    Ok(0)
}
