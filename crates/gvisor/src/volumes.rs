//! Volumes: storage that outlives sandboxes. Each volume is its own sparse ext4 image
//! (`<state>/gvisor/volumes/<id>.img`, made like a sandbox's disk, see [`super::disk`])
//! loop-mounted on the host at `volumes/<id>/`, so writes beyond its size get ENOSPC and
//! nothing else fills up. Its files live in `volumes/<id>/data/` (the filesystem's root keeps
//! ext4's `lost+found` out of sight), which sandboxes get as a read-write bind mount in their
//! OCI spec (runsc runs with `--overlay2=none`, so writes reach the host at once and several
//! sandboxes share one volume) and the server reads for its volume-content API.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::disk::{make_image, mount_image};
use super::mounts::{is_mounted, unmount};
use super::{check_id, GvisorDriver};
use crate::driver::{io_err, DriverError, Result, VolumeMount};

/// Directory of a volume's files inside its filesystem.
const DATA: &str = "data";

/// Where the driver keeps volumes (under its state directory).
pub(super) fn volumes_dir(driver_dir: &Path) -> PathBuf {
    driver_dir.join("volumes")
}

fn image(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.img"))
}

/// Mounts volume `id`'s image (when it is not mounted, e.g. after a host reboot) and returns
/// the directory of its files.
async fn ensure_mounted(dir: &Path, id: &str) -> Result<PathBuf> {
    check_id(id)?;
    let mnt = dir.join(id);
    let img = image(dir, id);
    if !img.exists() {
        return Err(DriverError::NotFound(format!("volume {id}")));
    }
    if !is_mounted(&mnt) {
        mount_image(&img, &mnt).await?;
    }
    let data = mnt.join(DATA);
    if !data.exists() {
        std::fs::create_dir(&data).map_err(io_err(format!("creating {}", data.display())))?;
        // Any user of any sandbox may write at the volume's top (the owner of what it makes
        // is that user).
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o777))
            .map_err(io_err(format!("setting the mode of {}", data.display())))?;
    }
    Ok(data)
}

/// Adds a read-write bind mount of each volume of `volumes` to the OCI spec `config`.
pub(super) async fn add_mounts(
    config: &mut serde_json::Value,
    volumes: &[VolumeMount],
    dir: &Path,
) -> Result<()> {
    for v in volumes {
        let source = ensure_mounted(dir, &v.volume_id).await?;
        let m = json!({"destination": v.path, "type": "bind", "source": source,
            "options": ["rbind", "rw"]});
        match config["mounts"].as_array_mut() {
            Some(mounts) => mounts.push(m),
            None => return Err(DriverError::Other("the OCI spec has no mounts".into())),
        }
    }
    Ok(())
}

impl GvisorDriver {
    fn volumes(&self) -> PathBuf {
        volumes_dir(&self.cfg.dir)
    }

    pub(super) async fn make_volume(&self, id: &str, size_mb: u32) -> Result<()> {
        check_id(id)?;
        if size_mb == 0 {
            return Err(DriverError::Other(
                "a volume needs a size above 0 MiB".into(),
            ));
        }
        let dir = self.volumes();
        std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let img = image(&dir, id);
        if img.exists() {
            return Err(DriverError::Other(format!("volume {id} exists already")));
        }
        let made = async {
            make_image(&img, size_mb).await?;
            ensure_mounted(&dir, id).await.map(|_| ())
        }
        .await;
        if made.is_err() {
            let _ = self.remove_volume(id);
        }
        made
    }

    pub(super) fn remove_volume(&self, id: &str) -> Result<()> {
        check_id(id)?;
        let dir = self.volumes();
        let mnt = dir.join(id);
        unmount(&mnt)?;
        for r in [
            std::fs::remove_dir(&mnt),
            std::fs::remove_file(image(&dir, id)),
        ] {
            match r {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(DriverError::Io {
                        what: format!("removing volume {id}"),
                        source: e,
                    })
                }
            }
        }
        Ok(())
    }

    pub(super) async fn volume_data(&self, id: &str) -> Result<PathBuf> {
        ensure_mounted(&self.volumes(), id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn mounts_are_read_write_binds_of_the_volume_data() {
        let tmp = tempfile::tempdir().unwrap();
        let mut config = json!({"mounts": []});
        // An unknown volume is refused before anything is added.
        let vols = vec![VolumeMount {
            volume_id: "v1".into(),
            path: "/mnt/data".into(),
        }];
        let r = add_mounts(&mut config, &vols, tmp.path()).await;
        assert!(matches!(r, Err(DriverError::NotFound(_))), "{r:?}");
        assert_eq!(config["mounts"].as_array().unwrap().len(), 0);
        let bad = vec![VolumeMount {
            volume_id: "../x".into(),
            path: "/mnt".into(),
        }];
        assert!(matches!(
            add_mounts(&mut config, &bad, tmp.path()).await,
            Err(DriverError::InvalidId(_))
        ));
    }
}
