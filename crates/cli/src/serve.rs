//! Scaffolding: the owner of this area replaces it.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_a: Args) -> anyhow::Result<i32> {
    anyhow::bail!("not implemented yet")
}
