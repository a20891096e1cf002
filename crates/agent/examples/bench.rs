//! Same benchmark as `kiln bench agent`, runnable without the kiln CLI:
//! `cargo run --release -p kiln-agent --example bench -- [AGENT_BIN] [ITERATIONS] [SIZE_MIB]`.

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let agent_bin = args
        .next()
        .or_else(|| std::env::var("KILN_AGENT_BIN").ok())
        .ok_or_else(|| anyhow::anyhow!("pass the kiln-agent binary path or set KILN_AGENT_BIN"))?;
    let iterations = args.next().map(|s| s.parse()).transpose()?.unwrap_or(300);
    let size_mib = args.next().map(|s| s.parse()).transpose()?.unwrap_or(100);
    let report = kiln_agent::bench::run(&kiln_agent::bench::BenchOptions {
        agent_bin: agent_bin.into(),
        iterations,
        size_mib,
    })?;
    print!("{}", report.render());
    Ok(())
}
