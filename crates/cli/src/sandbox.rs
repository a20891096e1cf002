//! Scaffolding: the owner of this area replaces it.

#[derive(clap::Subcommand)]
pub enum Cmd {}

pub fn run(c: Cmd) -> anyhow::Result<i32> {
    match c {}
}
