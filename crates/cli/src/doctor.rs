#[derive(clap::Args)]
pub struct Args {
    /// Print the report as JSON for scripts.
    #[arg(long)]
    pub json: bool,
}

pub fn run(_a: Args) -> anyhow::Result<i32> {
    anyhow::bail!("not implemented yet")
}
