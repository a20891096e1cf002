//! `kiln doctor`: the host report of `kiln_host::doctor`, and how many sandboxes this host's
//! state holds (awake, in standby, paused), read from the state database without changing it.

use std::path::{Path, PathBuf};

use kiln_server::manager::Census;

#[derive(clap::Args)]
pub struct Args {
    /// Print the report as JSON for scripts.
    #[arg(long)]
    pub json: bool,
    /// Skip the slow probes (KVM speed, runsc platforms).
    #[arg(long)]
    pub quick: bool,
    /// The state directory whose sandboxes are counted (as given to `kiln serve`).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let report = kiln_host::doctor::report(kiln_host::doctor::Options {
        skip_probes: a.quick,
    });
    let state_dir = a.state_dir.unwrap_or_else(kiln_host::paths::state_dir);
    let sandboxes = count_sandboxes(&state_dir);
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["sandboxes"] = match &sandboxes {
            Ok(Some(c)) => serde_json::to_value(c)?,
            Ok(None) => serde_json::Value::Null,
            Err(e) => serde_json::json!({ "error": e }),
        };
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", kiln_host::doctor::render(&report));
        println!("{}", render_sandboxes(&sandboxes));
    }
    Ok(if report.can_run { 0 } else { 3 })
}

/// The census of `<state_dir>/kiln.db`; None when there is no database yet.
fn count_sandboxes(state_dir: &Path) -> Result<Option<Census>, String> {
    let db = state_dir.join("kiln.db");
    if !db.exists() {
        return Ok(None);
    }
    let store = kiln_server::store::SqliteStore::open_read_only(&db).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(kiln_server::manager::census(&store))
        .map(Some)
        .map_err(|e| format!("reading the state database: {e}"))
}

fn render_sandboxes(c: &Result<Option<Census>, String>) -> String {
    match c {
        Ok(Some(c)) => format!(
            "sandboxes: {} running, {} in standby (checkpointed to disk), {} paused",
            c.running, c.standby, c.paused
        ),
        Ok(None) => "sandboxes: none yet (no state database)".to_string(),
        Err(e) => format!("sandboxes: cannot count them: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_census_line_names_each_count() {
        let c = Census {
            running: 3,
            standby: 12,
            paused: 2,
        };
        assert_eq!(
            render_sandboxes(&Ok(Some(c))),
            "sandboxes: 3 running, 12 in standby (checkpointed to disk), 2 paused"
        );
        assert!(render_sandboxes(&Ok(None)).contains("none yet"));
    }

    #[test]
    fn a_state_dir_without_a_database_counts_nothing_and_creates_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(count_sandboxes(dir.path()), Ok(None));
        assert!(!dir.path().join("kiln.db").exists());
    }
}
