//! kiln-rules: anomaly detection over kiln's audit records, independent of the server.
//!
//! - [`parse`]: the condition language (tokens, grammar, syntax errors with offsets);
//! - [`fields`]: the fields a condition reads from a record ([`Event`]);
//! - [`cond`]: conditions compiled against lists and macros, and their evaluation;
//! - [`glob`]: wildcard patterns for `glob`;
//! - [`yaml`]: the rules file as a YAML tree with positions;
//! - [`model`]: rules, priorities, actions, windows, overrides and load errors;
//! - [`ruleset`]: rules files (`rule`, `macro`, `list`, `override`) → a [`RuleSet`], with
//!   errors at line and column; the built-in pack ([`ruleset::DEFAULT_PACK`]);
//! - [`procs`]: per-sandbox process tables (ancestry);
//! - [`engine`]: evaluation in record order, windows, sums, sequences and `for` → [`Alert`]s;
//! - [`incident`]: alerts of one incident on one sandbox grouped into one;
//! - [`reload`]: a rules file watched for changes (a bad file never replaces a good set);
//! - [`bench`]: throughput measurement (`kiln bench rules`).
//!
//! See docs/rules.md.

pub mod bench;
pub mod cond;
pub mod engine;
pub mod fields;
pub mod glob;
pub mod incident;
pub mod model;
pub mod parse;
pub mod procs;
pub mod reload;
pub mod ruleset;
pub mod yaml;

pub use engine::{Alert, Engine};
pub use fields::Event;
pub use incident::{Admitted, Incidents};
pub use ruleset::{Action, LoadError, LoadErrors, Priority, RuleSet};
