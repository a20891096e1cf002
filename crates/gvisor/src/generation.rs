//! A sandbox's runsc container id, and retiring the containers it no longer uses.
//!
//! A sandbox restored after a pause (or after a snapshot or fork of it) runs under a fresh runsc
//! container id, `g<N>-<sandbox id>`, so the restore does not wait for the previous
//! container's `runsc delete`: that one retires in the background meanwhile. Generation 0 is
//! the sandbox id itself. The current generation is the file `generation` in the sandbox's
//! directory (written before the restore that uses it, so it survives a server restart), and
//! each generation has its own host cgroup (`/kiln/<container id>`), since two containers of
//! one sandbox exist side by side for a moment.
//!
//! A retiring container has a marker `retiring/<container id>` in the sandbox's directory
//! until it is deleted; a server that died before that deletes it later (resume, stop or the
//! listing at start-up).

use std::path::{Path, PathBuf};

use super::reap;
use super::runsc::Runsc;
use super::GvisorDriver;
use crate::driver::{io_err, DriverError, Result};

const FILE: &str = "generation";
const RETIRING: &str = "retiring";
/// A retirement slower than this is logged with its steps' durations.
const SLOW_RETIRE: std::time::Duration = std::time::Duration::from_secs(2);

/// The runsc container id of generation `gen` of sandbox `id`.
pub fn container_id(id: &str, gen: u64) -> String {
    match gen {
        0 => id.to_string(),
        n => format!("g{n}-{id}"),
    }
}

/// The sandbox id of container `cid` when it is a later generation (`g<N>-<id>`).
fn sandbox_of(cid: &str) -> Option<&str> {
    let rest = cid.strip_prefix('g')?;
    let (n, id) = rest.split_once('-')?;
    (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && !id.is_empty()).then_some(id)
}

/// The current generation of the sandbox in `dir` (0 when it never changed).
pub fn current(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join(FILE))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

/// Makes the next generation of the sandbox in `dir` (sandbox `id`) current and returns its
/// container id. Its bundle's cgroup becomes the new container's own.
pub fn advance(dir: &Path, id: &str) -> Result<String> {
    let gen = current(dir) + 1;
    let cid = container_id(id, gen);
    set_cgroup(&dir.join("bundle/config.json"), &cid)?;
    let tmp = dir.join("generation.tmp");
    std::fs::write(&tmp, gen.to_string()).map_err(io_err(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, dir.join(FILE)).map_err(io_err(format!("renaming {}", tmp.display())))?;
    Ok(cid)
}

/// Points the bundle's `linux.cgroupsPath` (when it has one) at container `cid`'s own cgroup,
/// at the default CPU weight: a sandbox booted into a warm pool has the smallest in its spec,
/// and one that is restored was claimed long since (pooled sandboxes are never paused).
fn set_cgroup(config: &Path, cid: &str) -> Result<()> {
    let text = std::fs::read(config).map_err(io_err(format!("reading {}", config.display())))?;
    let mut spec: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| DriverError::Other(format!("parsing config.json: {e}")))?;
    let Some(path) = spec.pointer_mut("/linux/cgroupsPath") else {
        return Ok(());
    };
    *path = serde_json::Value::String(format!("/kiln/{cid}"));
    if let Some(cpu) = spec
        .pointer_mut("/linux/resources/cpu")
        .and_then(serde_json::Value::as_object_mut)
    {
        cpu.remove("shares");
    }
    let text = serde_json::to_vec_pretty(&spec)
        .map_err(|e| DriverError::Other(format!("encoding config.json: {e}")))?;
    let tmp = config.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(io_err(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, config).map_err(io_err(format!("renaming {}", tmp.display())))
}

/// The marker of retiring container `cid` in sandbox directory `dir`.
fn marker(dir: &Path, cid: &str) -> PathBuf {
    dir.join(RETIRING).join(cid)
}

/// Records that container `cid` of the sandbox in `dir` is to be deleted.
pub fn mark_retiring(dir: &Path, cid: &str) -> Result<()> {
    let m = marker(dir, cid);
    std::fs::create_dir_all(dir.join(RETIRING)).map_err(io_err("creating retiring/"))?;
    std::fs::write(&m, b"").map_err(io_err(format!("writing {}", m.display())))
}

/// The containers of the sandbox in `dir` still waiting to be deleted.
pub fn retiring(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir.join(RETIRING))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect()
}

/// Deletes container `cid` of the sandbox in `dir`, which no longer runs the sandbox: kills
/// and reaps `pids` (its processes, taken while they were the only ones of the sandbox) if
/// they are still the same processes, and the `runsc-sandbox` naming `cid`, then `runsc
/// delete`; removes its marker.
pub async fn retire(runsc: &Runsc, dir: &Path, cid: &str, pids: &[reap::Process]) -> Result<()> {
    let t = std::time::Instant::now();
    let mut mine = reap::still_running(pids);
    mine.extend(reap::sandbox_processes(cid, None, &runsc.root));
    mine.sort_unstable();
    mine.dedup();
    reap::kill_and_reap(&mine).await;
    let killed = t.elapsed();
    super::container::delete(runsc, cid).await?;
    let _ = std::fs::remove_file(marker(dir, cid));
    if t.elapsed() > SLOW_RETIRE {
        // (A paused sandbox's `runsc delete` was once seen running for over 10 s.)
        tracing::warn!(
            container = cid,
            "retiring took {:?}: {} processes killed and reaped in {killed:?}, runsc delete {:?}",
            t.elapsed(),
            mine.len(),
            t.elapsed() - killed
        );
    }
    Ok(())
}

/// Fork parents whose continuation waits, by sandbox id (see
/// [`crate::driver::Checkpoint::capture_for_fork`]): dropping the sender lets it go on.
pub(super) type HoldMap = std::collections::HashMap<String, tokio::sync::oneshot::Sender<()>>;
pub(super) type Holds = std::sync::Mutex<HoldMap>;

impl GvisorDriver {
    /// The runsc container currently running (or last to run) sandbox `id`.
    pub fn cid(&self, id: &str) -> String {
        container_id(id, current(&self.sandbox_dir(id)))
    }

    /// Deletes container `cid` of sandbox `id` in the background (see [`retire`]).
    pub(super) fn retire_later(&self, id: &str, cid: &str, pids: Vec<reap::Process>) {
        let (runsc, dir, c) = (self.runsc.clone(), self.sandbox_dir(id), cid.to_string());
        self.retiring.spawn(cid, async move {
            if let Err(e) = retire(&runsc, &dir, &c, &pids).await {
                tracing::warn!(container = c, error = %e, "deleting a retired container");
            }
        });
    }

    /// Retires the containers of sandbox `id` that a server before this one left marked.
    pub(super) fn retire_leftovers(&self, id: &str) {
        for cid in retiring(&self.sandbox_dir(id)) {
            if !self.retiring.pending(&cid) {
                self.retire_later(id, &cid, Vec::new());
            }
        }
    }

    pub(super) fn holds_map(&self) -> std::sync::MutexGuard<'_, HoldMap> {
        self.holds.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The sandboxes of the runsc containers on the host (beside `ids`, the sandbox
    /// directories, to which containers of unknown sandboxes are added); returns those
    /// running. Older generations of known sandboxes (left by a server that died before
    /// deleting them) are retired.
    pub(super) async fn containers_on_host(
        &self,
        ids: &mut std::collections::BTreeSet<String>,
    ) -> Result<std::collections::BTreeSet<String>> {
        let out = self.runsc.output(&["list", "--format=json"]).await?;
        let mut running = std::collections::BTreeSet::new();
        let mut containers = Vec::new();
        if let Ok(serde_json::Value::Array(list)) = serde_json::from_str(out.trim()) {
            for c in list {
                if let Some(cid) = c["id"].as_str() {
                    containers.push((cid.to_string(), c["status"].as_str() == Some("running")));
                }
            }
        }
        for (cid, up) in containers {
            // A container of a known sandbox: its current generation, or an older one
            // left by a server that died before deleting it.
            let owner = match ids.contains(&cid) {
                true => Some(cid.clone()),
                false => sandbox_of(&cid)
                    .filter(|id| ids.contains(*id))
                    .map(str::to_string),
            };
            match owner {
                Some(id) if self.cid(&id) == cid => {
                    if up {
                        running.insert(id);
                    }
                }
                Some(id) => {
                    let _ = mark_retiring(&self.sandbox_dir(&id), &cid);
                    self.retire_leftovers(&id);
                }
                None => {
                    if up {
                        running.insert(cid.clone());
                    }
                    ids.insert(cid);
                }
            }
        }
        Ok(running)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_name_containers_and_own_their_cgroup() {
        let dir = std::env::temp_dir().join(format!("kiln-gen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("bundle")).unwrap();
        // As a warm pool's sandbox was booted: at the smallest CPU weight.
        let spec = serde_json::json!({"linux": {"cgroupsPath": "/kiln/sbx",
            "resources": {"cpu": {"quota": 200_000, "period": 100_000, "shares": 2}}}});
        std::fs::write(dir.join("bundle/config.json"), spec.to_string()).unwrap();
        assert_eq!(current(&dir), 0);
        assert_eq!(container_id("sbx", 0), "sbx");
        assert_eq!(advance(&dir, "sbx").unwrap(), "g1-sbx");
        assert_eq!(advance(&dir, "sbx").unwrap(), "g2-sbx");
        // No container id is a prefix of another (runsc takes unique prefixes as ids, and
        // calls an id that prefixes two containers ambiguous).
        for (a, b) in [
            ("sbx", "g1-sbx"),
            ("g1-sbx", "g10-sbx"),
            ("g1-sbx", "g12-sbx"),
        ] {
            assert!(!b.starts_with(a) && !a.starts_with(b), "{a} {b}");
        }
        assert_eq!(sandbox_of("g12-sbx"), Some("sbx"));
        assert_eq!(sandbox_of("sbx"), None);
        assert_eq!(sandbox_of("g-sbx"), None);
        assert_eq!(current(&dir), 2);
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("bundle/config.json")).unwrap())
                .unwrap();
        assert_eq!(v["linux"]["cgroupsPath"], "/kiln/g2-sbx");
        // A restored container runs at the default CPU weight, within the same limit.
        assert!(v["linux"]["resources"]["cpu"].get("shares").is_none());
        assert_eq!(v["linux"]["resources"]["cpu"]["quota"], 200_000);
        assert!(retiring(&dir).is_empty());
        mark_retiring(&dir, "g1-sbx").unwrap();
        assert_eq!(retiring(&dir), vec!["g1-sbx".to_string()]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
