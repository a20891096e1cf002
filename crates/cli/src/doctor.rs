//! `kiln doctor`: thin layer over `kiln_host::doctor`.

#[derive(clap::Args)]
pub struct Args {
    /// Print the report as JSON for scripts.
    #[arg(long)]
    pub json: bool,
    /// Skip the slow probes (KVM speed, runsc platforms).
    #[arg(long)]
    pub quick: bool,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let report = kiln_host::doctor::report(kiln_host::doctor::Options {
        skip_probes: a.quick,
    });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", kiln_host::doctor::render(&report));
    }
    Ok(if report.can_run { 0 } else { 3 })
}
