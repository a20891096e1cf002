//! `kiln completions bash|zsh|fish` and `kiln man`: shell completion scripts and roff man
//! pages generated from the clap definitions (clap_complete, clap_mangen), so they always
//! match the commands this binary has.

use std::path::PathBuf;

use anyhow::Context;
use clap::CommandFactory;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  source <(kiln completions bash)\n  \
    kiln completions zsh > \"${fpath[1]}/_kiln\"\n  \
    kiln completions fish > ~/.config/fish/completions/kiln.fish")]
pub struct CompletionArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  kiln man | man -l -\n  kiln man --dir /usr/local/share/man/man1"
)]
pub struct ManArgs {
    /// Write `kiln.1` and one page per subcommand (`kiln-sandbox-exec.1`, …) into this
    /// directory instead of printing `kiln.1`.
    #[arg(long)]
    dir: Option<PathBuf>,
}

pub fn completions(a: CompletionArgs) -> anyhow::Result<i32> {
    let mut cmd = crate::Cli::command();
    clap_complete::generate(a.shell, &mut cmd, "kiln", &mut std::io::stdout());
    Ok(0)
}

/// The roff of the man page of `cmd`.
fn page(cmd: clap::Command) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd)
        .render(&mut out)
        .context("rendering the man page")?;
    Ok(out)
}

/// Every page: `kiln.1` and one per subcommand at any depth, named as clap displays them
/// (`kiln-sandbox-exec.1`).
fn pages() -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let mut root = crate::Cli::command();
    // Gives every subcommand its display name (`kiln-sandbox-exec`) and bin name.
    root.build();
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(cmd) = todo.pop() {
        todo.extend(
            cmd.get_subcommands()
                .filter(|s| s.get_name() != "help")
                .cloned(),
        );
        let name = cmd
            .get_display_name()
            .unwrap_or_else(|| cmd.get_name())
            .to_string();
        out.push((format!("{name}.1"), page(cmd)?));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

pub fn man(a: ManArgs) -> anyhow::Result<i32> {
    match a.dir {
        None => {
            use std::io::Write;
            std::io::stdout().write_all(&page(crate::Cli::command())?)?;
        }
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for (name, roff) in pages()? {
                let p = dir.join(&name);
                std::fs::write(&p, roff).with_context(|| format!("writing {}", p.display()))?;
                println!("{}", p.display());
            }
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bash_completion_knows_the_subcommands() {
        let mut out = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut crate::Cli::command(),
            "kiln",
            &mut out,
        );
        let s = String::from_utf8(out).unwrap();
        assert!(s.contains("complete -F _kiln"), "{s}");
        for word in ["sandbox", "completions", "top", "mcp"] {
            assert!(s.contains(word), "{word} missing");
        }
    }

    #[test]
    fn man_pages_cover_every_subcommand() {
        let pages = pages().unwrap();
        let names: Vec<&str> = pages.iter().map(|(n, _)| n.as_str()).collect();
        for n in [
            "kiln.1",
            "kiln-sandbox.1",
            "kiln-sandbox-shell.1",
            "kiln-top.1",
        ] {
            assert!(names.contains(&n), "{n} missing from {names:?}");
        }
        let (_, root) = &pages[names.iter().position(|n| *n == "kiln.1").unwrap()];
        let root = String::from_utf8_lossy(root);
        assert!(
            root.starts_with(".ie") || root.contains(".TH kiln"),
            "{root}"
        );
        assert!(
            root.contains(".SH SUBCOMMANDS") && root.contains("sandbox"),
            "{root}"
        );
    }
}
