//! Build output: the full log file (with a tail for error messages) and the progress display.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use crate::{io_err, Error, Result};

/// The full build log.
pub(crate) struct Log {
    file: File,
    pub(crate) path: PathBuf,
    tail: std::collections::VecDeque<String>,
}

impl Log {
    pub(crate) fn create(path: &Path) -> Result<Log> {
        let file = File::create(path).map_err(io_err(format!("creating {}", path.display())))?;
        Ok(Log {
            file,
            path: path.to_path_buf(),
            tail: Default::default(),
        })
    }

    pub(crate) fn line(&mut self, l: &str) {
        let _ = writeln!(self.file, "{l}");
        self.tail.push_back(l.to_string());
        if self.tail.len() > 25 {
            self.tail.pop_front();
        }
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for l in String::from_utf8_lossy(bytes).lines() {
            self.line(l);
        }
    }

    pub(crate) fn failure(&self, step: &str, path: &Path) -> Error {
        Error::BuildFailed {
            step: step.to_string(),
            log: path.display().to_string(),
            tail: self
                .tail
                .iter()
                .map(|l| format!("    {l}"))
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// Progress output: a spinner per phase with elapsed time on a terminal, plain lines elsewhere.
pub(crate) struct Ui {
    pub(crate) quiet: bool,
}

pub(crate) struct Phase {
    bar: Option<ProgressBar>,
    name: String,
    started: Instant,
    quiet: bool,
}

impl Ui {
    pub(crate) fn line(&self, s: &str) {
        if !self.quiet {
            eprintln!("{s}");
        }
    }

    pub(crate) fn phase(&self, name: &str) -> Phase {
        let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let bar = (!self.quiet && tty).then(|| {
            let b = ProgressBar::new_spinner();
            b.set_style(
                ProgressStyle::with_template("  {spinner} {prefix} [{elapsed}] {wide_msg}")
                    .expect("valid template"),
            );
            b.set_prefix(name.to_string());
            b.enable_steady_tick(Duration::from_millis(120));
            b
        });
        if !self.quiet && !tty {
            eprintln!("  … {name}");
        }
        Phase {
            bar,
            name: name.to_string(),
            started: Instant::now(),
            quiet: self.quiet,
        }
    }
}

impl Phase {
    pub(crate) fn message(&self, m: &str) {
        if let Some(b) = &self.bar {
            b.set_message(m.chars().take(100).collect::<String>());
        }
    }

    fn finish(&mut self, mark: &str) {
        let line = format!(
            "  {mark} {} ({:.1}s)",
            self.name,
            self.started.elapsed().as_secs_f64()
        );
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        if !self.quiet {
            eprintln!("{line}");
        }
    }

    pub(crate) fn done(mut self) {
        self.finish("✓");
    }

    pub(crate) fn fail(mut self) {
        self.finish("✗");
    }
}
