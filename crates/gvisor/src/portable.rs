//! A paused gVisor sandbox moved to another host: the files that make it whole there, and
//! adopting such files as a paused sandbox of this host.
//!
//! What moves (relative to the sandbox's directory): `disk.img` (its writable layer's ext4
//! image, synced first), `checkpoint/*` (runsc's image of memory and processes, full pauses
//! only) and `portable.json` (whether the memory was kept, and the sandbox's egress policy as
//! lists). The bundle, the run directory and the network are this host's own: adopting
//! prepares the sandbox's directory as for a new sandbox of its template (its network attached
//! here under the moved policy, in force before anything in it runs again; its bundle written
//! for its paths here), puts the moved image in place of the fresh one, and records the pause; the normal
//! resume then mounts the image and restores from the memory image (as a fork's child
//! restores a snapshot taken in another directory).
//!
//! Only sandboxes with a disk quota (a disk image) stacked directly on their template move:
//! a sandbox restored from a snapshot stacks on frozen layers that stay on their host. Network
//! rules and an egress proxy (which lists cannot carry, and which hold secrets) are not in
//! `portable.json`: the caller carries them and gives them to the adopting host in the spec.

use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::checkpoint::Paused;
use super::mounts::unmount;
use super::network::PolicyLists;
use super::{check_id, disk, GvisorDriver};
use crate::driver::{io_err, DriverError, PortablePause, Result, SandboxSpec};

/// The moved pause's own record.
const PORTABLE: &str = "portable.json";
/// The directory of runsc's memory image, in a sandbox's (or a snapshot's) directory.
pub(super) const IMAGE_DIR: &str = "checkpoint";

#[derive(Debug, Serialize, Deserialize)]
struct Portable {
    memory: bool,
    /// The egress policy (None: the default, internet on).
    #[serde(default)]
    network: Option<PolicyLists>,
}

/// Flushes the filesystem holding `path` (its dirty pages and journal reach the disk image).
pub(super) fn syncfs(path: &Path) -> Result<()> {
    let dir = std::fs::File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    // SAFETY: the descriptor is open for the duration of the call.
    if unsafe { libc::syncfs(dir.as_raw_fd()) } != 0 {
        return Err(DriverError::Io {
            what: format!("syncing {}", path.display()),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// `dir` emptied (made when missing).
pub(super) fn fresh_dir(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(format!("clearing {}", dir.display()))(e)),
    }
    std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))
}

/// The regular files under `root/sub`, as paths relative to `root`.
pub(super) fn files_under(root: &Path, sub: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let at = root.join(sub);
    let rd = std::fs::read_dir(&at).map_err(io_err(format!("listing {}", at.display())))?;
    for e in rd {
        let e = e.map_err(io_err(format!("listing {}", at.display())))?;
        let rel = sub.join(e.file_name());
        let kind = e
            .file_type()
            .map_err(io_err(format!("listing {}", at.display())))?;
        if kind.is_dir() {
            files_under(root, &rel, out)?;
        } else if kind.is_file() {
            out.push(rel);
        }
    }
    Ok(())
}

impl GvisorDriver {
    fn incoming_path(&self, id: &str) -> PathBuf {
        self.cfg.dir.join("incoming").join(id)
    }

    pub(super) async fn export_paused(&self, id: &str) -> Result<PortablePause> {
        check_id(id)?;
        let Some(paused) = self.read_paused(id) else {
            return Err(DriverError::NotFound(id.to_string()));
        };
        let dir = self.sandbox_dir(id);
        if !dir.join(disk::IMAGE).exists() {
            return Err(DriverError::NotImplemented(
                "moving a paused sandbox without a disk quota",
            ));
        }
        if paused.lower.len() != 1 {
            return Err(DriverError::NotImplemented(
                "moving a paused sandbox restored from a snapshot",
            ));
        }
        // The writable layer's last writes are in the host's page cache until synced.
        let mount = dir.join(disk::MOUNT);
        if super::mounts::is_mounted(&mount) {
            syncfs(&mount)?;
        }
        let network = match &self.net {
            Some(net) => net.movable_policy(id).await?,
            None => None,
        };
        let record = serde_json::to_vec(&Portable {
            memory: paused.memory,
            network: network.as_ref().map(PolicyLists::of),
        })
        .map_err(|e| DriverError::Other(format!("encoding {PORTABLE}: {e}")))?;
        std::fs::write(dir.join(PORTABLE), record)
            .map_err(io_err(format!("writing {PORTABLE}")))?;
        let mut files = vec![PathBuf::from(PORTABLE), PathBuf::from(disk::IMAGE)];
        if paused.memory && self.image_dir(id).join("checkpoint.img").exists() {
            files_under(&dir, Path::new(IMAGE_DIR), &mut files)?;
        }
        Ok(PortablePause { dir, files })
    }

    pub(super) async fn fresh_incoming(&self, id: &str) -> Result<PathBuf> {
        check_id(id)?;
        let dir = self.incoming_path(id);
        fresh_dir(&dir)?;
        Ok(dir)
    }

    pub(super) async fn adopt_incoming(&self, spec: &SandboxSpec) -> Result<()> {
        check_id(&spec.id)?;
        let incoming = self.incoming_path(&spec.id);
        let portable: Portable = std::fs::read(incoming.join(PORTABLE))
            .ok()
            .and_then(|t| serde_json::from_slice(&t).ok())
            .ok_or_else(|| {
                DriverError::Other(format!("the moved pause of {} is incomplete", spec.id))
            })?;
        if !incoming.join(disk::IMAGE).is_file() {
            return Err(DriverError::Other(format!(
                "the moved pause of {} has no disk image",
                spec.id
            )));
        }
        let mut spec = spec.clone();
        spec.disk_mb = spec.disk_mb.max(16);
        let lists = portable
            .network
            .as_ref()
            .map(PolicyLists::policy)
            .transpose()
            .map_err(|e| DriverError::Other(format!("the moved sandbox's egress policy: {e}")))?;
        // The lists moved with the files; the rules and egress proxy come with the spec.
        spec.network = match (lists, spec.network.take()) {
            (lists, Some(given)) => {
                let mut p = lists.unwrap_or_default();
                p.transforms = given.transforms;
                p.egress_proxy = given.egress_proxy;
                Some(p)
            }
            (lists, None) => lists,
        };
        self.prepare_with(&spec, None).await?;
        let adopted = self.place_incoming(&spec, &incoming, portable.memory).await;
        if adopted.is_err() {
            let _ = crate::driver::Driver::stop(self, &spec.id).await;
        }
        let _ = std::fs::remove_dir_all(&incoming);
        adopted
    }

    /// Puts the moved disk image and memory image into the prepared directory of `spec.id`
    /// and records the pause (written last, as a pause does).
    async fn place_incoming(
        &self,
        spec: &SandboxSpec,
        incoming: &Path,
        memory: bool,
    ) -> Result<()> {
        let dir = self.sandbox_dir(&spec.id);
        // The fresh layer gives way to the moved one (mounted again by the resume).
        unmount(&dir.join("rootfs"))?;
        disk::unmount_disk(&dir)?;
        std::fs::rename(incoming.join(disk::IMAGE), dir.join(disk::IMAGE))
            .map_err(io_err("placing the moved disk image"))?;
        let image = incoming.join(IMAGE_DIR);
        let memory = memory && image.join("checkpoint.img").is_file();
        if memory {
            std::fs::rename(&image, self.image_dir(&spec.id))
                .map_err(io_err("placing the moved memory image"))?;
        }
        let record = serde_json::to_vec(&Paused {
            memory,
            lower: vec![spec.rootfs.clone()],
        })
        .map_err(|e| DriverError::Other(format!("encoding paused.json: {e}")))?;
        let tmp = dir.join("paused.json.tmp");
        std::fs::write(&tmp, record).map_err(io_err(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, self.paused_file(&spec.id))
            .map_err(io_err(format!("renaming {}", tmp.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_net::EgressPolicy;

    #[test]
    fn a_policy_moves_as_lists_and_comes_back_the_same() {
        let p = EgressPolicy::from_lists(
            false,
            &["198.51.100.7".into(), "pkgs.example.internal".into()],
            &["0.0.0.0/0".into()],
            &["198.51.100.53".into()],
        )
        .unwrap();
        let lists = PolicyLists::of(&p);
        let text = serde_json::to_vec(&Portable {
            memory: true,
            network: Some(lists),
        })
        .unwrap();
        let back: Portable = serde_json::from_slice(&text).unwrap();
        assert_eq!(back.network.unwrap().policy().unwrap(), p);
        // A record without a policy (the default) reads as none.
        let old: Portable = serde_json::from_slice(br#"{"memory":false}"#).unwrap();
        assert!(old.network.is_none());
        let bad: PolicyLists = serde_json::from_str(
            r#"{"allowInternetAccess":true,"allowOut":["not a target!"],"denyOut":[],"dnsServers":[]}"#,
        )
        .unwrap();
        assert!(bad.policy().is_err());
    }

    #[test]
    fn the_memory_image_is_listed_file_by_file_relative_to_the_sandbox() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join(IMAGE_DIR);
        std::fs::create_dir_all(image.join("sub")).unwrap();
        for f in ["checkpoint.img", "pages.img", "sub/more.img"] {
            std::fs::write(image.join(f), b"x").unwrap();
        }
        std::os::unix::fs::symlink("/etc/passwd", image.join("link")).unwrap();
        let mut files = Vec::new();
        files_under(dir.path(), Path::new(IMAGE_DIR), &mut files).unwrap();
        files.sort();
        let want: Vec<PathBuf> = ["checkpoint.img", "pages.img", "sub/more.img"]
            .iter()
            .map(|f| Path::new(IMAGE_DIR).join(f))
            .collect();
        assert_eq!(files, want, "regular files only, no symlink followed");
    }
}
