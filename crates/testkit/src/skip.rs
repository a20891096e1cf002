//! The skip policy: a test either runs, or fails naming what this host lacks, or (only with
//! `KILN_ALLOW_SKIPS=1`) prints `SKIP <test>: <why>` where the test output shows it and returns.
//!
//! ```no_run
//! #[test]
//! fn needs_namespaces() {
//!     if !kiln_testkit::needs().root("network namespaces").tool("nft").ok() {
//!         return;
//!     }
//!     // ...
//! }
//! ```

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::host;

/// The environment variable that turns a missing prerequisite into a printed skip.
pub const ALLOW_SKIPS: &str = "KILN_ALLOW_SKIPS";

/// Whether `KILN_ALLOW_SKIPS=1` asks for printed skips instead of failures.
pub fn skips_allowed() -> bool {
    std::env::var(ALLOW_SKIPS).as_deref() == Ok("1")
}

/// The running test's name: libtest runs each test on a thread named after it.
pub fn current_test() -> String {
    match std::thread::current().name() {
        Some(n) if n != "main" => n.to_string(),
        _ => "this test".to_string(),
    }
}

/// What the policy does about a test whose prerequisites are `missing`.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing is missing.
    Run,
    /// Skips are allowed: print this line and return.
    Skip(String),
    /// Skips are not allowed: fail with this message.
    Fail(String),
}

/// The policy itself, without side effects.
pub fn verdict(test: &str, missing: &[String], allowed: bool) -> Verdict {
    if missing.is_empty() {
        return Verdict::Run;
    }
    let why = missing.join("; ");
    if allowed {
        Verdict::Skip(format!("SKIP {test}: {why}"))
    } else {
        Verdict::Fail(format!(
            "{test} cannot run on this host: {why} (set {ALLOW_SKIPS}=1 to skip it instead)"
        ))
    }
}

/// A test's prerequisites, checked in order; [`Needs::ok`] applies the policy.
#[must_use = "call .ok() (or .require()) to apply the skip policy"]
#[derive(Debug, Default)]
pub struct Needs {
    missing: Vec<String>,
}

/// Starts a list of prerequisites.
pub fn needs() -> Needs {
    Needs::default()
}

impl Needs {
    /// Requires `ok`; `why` names what is missing when it is false.
    pub fn that(mut self, ok: bool, why: impl Into<String>) -> Self {
        if !ok {
            self.missing.push(why.into());
        }
        self
    }

    /// Requires `r` to be Ok; its error names what is missing.
    pub fn check<T>(self, r: Result<T, String>) -> Self {
        match r {
            Ok(_) => self,
            Err(why) => self.that(false, why),
        }
    }

    /// Requires root; `what` says what needs it (e.g. "network namespaces").
    pub fn root(self, what: &str) -> Self {
        self.that(host::is_root(), format!("{what} need root"))
    }

    /// Requires `program` on PATH (or in an sbin directory).
    pub fn tool(self, program: &str) -> Self {
        self.that(
            host::which(program).is_some(),
            format!("`{program}` is not installed"),
        )
    }

    /// Requires every program in `programs`.
    pub fn tools(self, programs: &[&str]) -> Self {
        programs.iter().fold(self, |n, p| n.tool(p))
    }

    /// Requires runsc (`KILN_RUNSC`, else on PATH).
    pub fn runsc(self) -> Self {
        self.check(host::runsc())
    }

    /// Requires a `/dev/kvm` this process can open read-write.
    pub fn kvm(self) -> Self {
        self.check(host::kvm())
    }

    /// Requires `python` to import every module in `modules`; `hint` says how to get them.
    pub fn python_modules(self, python: &Path, modules: &[&str], hint: &str) -> Self {
        let imports = format!("import {}", modules.join(", "));
        let ok = Command::new(python)
            .args(["-c", &imports])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        self.that(
            ok,
            format!(
                "{} cannot import {} ({hint})",
                python.display(),
                modules.join(", ")
            ),
        )
    }

    /// What is missing, joined; None when nothing is.
    pub fn missing(&self) -> Option<String> {
        (!self.missing.is_empty()).then(|| self.missing.join("; "))
    }

    /// Applies the policy for the running test: true when it can run; false after printing
    /// the skip line (`KILN_ALLOW_SKIPS=1`); otherwise panics naming what is missing.
    pub fn ok(self) -> bool {
        self.ok_as(&current_test())
    }

    /// [`Needs::ok`] for a test named `test`.
    pub fn ok_as(self, test: &str) -> bool {
        match verdict(test, &self.missing, skips_allowed()) {
            Verdict::Run => true,
            Verdict::Skip(line) => {
                print_skip(&line);
                false
            }
            Verdict::Fail(msg) => panic!("{msg}"),
        }
    }

    /// Panics naming what is missing, whatever `KILN_ALLOW_SKIPS` says: for setup code that
    /// cannot return early (the test should have called [`Needs::ok`] first).
    pub fn require(self) {
        if let Some(why) = self.missing() {
            panic!(
                "{} cannot run on this host: {why} (with {ALLOW_SKIPS}=1 the test must check \
                 kiln_testkit::needs() before its setup to be skipped)",
                current_test()
            );
        }
    }
}

/// Writes `line` to the process's stderr directly: libtest captures `eprintln!` of passing
/// tests, and a skip must show in the test output.
fn print_skip(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_missing_runs_whatever_the_setting() {
        assert_eq!(verdict("t", &[], false), Verdict::Run);
        assert_eq!(verdict("t", &[], true), Verdict::Run);
    }

    #[test]
    fn missing_fails_naming_it_unless_skips_are_allowed() {
        let missing = vec![
            "runsc sandboxes need root".to_string(),
            "`nft` is not installed".into(),
        ];
        match verdict("a::b", &missing, false) {
            Verdict::Fail(m) => {
                assert!(m.starts_with("a::b cannot run on this host: runsc sandboxes need root; `nft` is not installed"), "{m}");
                assert!(m.contains("KILN_ALLOW_SKIPS=1"), "{m}");
            }
            v => panic!("{v:?}"),
        }
        assert_eq!(
            verdict("a::b", &missing, true),
            Verdict::Skip("SKIP a::b: runsc sandboxes need root; `nft` is not installed".into())
        );
    }

    #[test]
    fn needs_collects_what_is_missing_in_order() {
        let n = needs()
            .that(true, "never shown")
            .tool("kiln-no-such-program-xyz")
            .check(Err::<(), _>("no etcd".to_string()));
        assert_eq!(
            n.missing().as_deref(),
            Some("`kiln-no-such-program-xyz` is not installed; no etcd")
        );
        assert!(needs().tool("sh").missing().is_none());
    }

    #[test]
    fn the_test_name_comes_from_the_test_thread() {
        assert_eq!(
            current_test(),
            "skip::tests::the_test_name_comes_from_the_test_thread"
        );
    }
}
