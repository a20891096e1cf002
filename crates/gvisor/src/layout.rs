//! A sandbox's directory on the host (see the module docs of [`super`]): preparing its
//! writable layer, mounts and bundle before a start or restore, and removing all of it after.

use std::path::PathBuf;

use super::mounts::{mount_overlay_stack, mount_run_dir, unmount};
use super::oci::oci_spec;
use super::{disk, network, trace, volumes, GvisorDriver, AGENT_PATH};
use crate::driver::{io_err, DriverError, Result, SandboxSpec};

impl GvisorDriver {
    /// Prepares the sandbox's layer and bundle. The fresh writable layer stacks on `lowers`
    /// (topmost first; frozen layers of a snapshot), or on the template rootfs when None.
    pub(super) async fn prepare_with(
        &self,
        spec: &SandboxSpec,
        lowers: Option<&[PathBuf]>,
    ) -> Result<()> {
        let dir = self.sandbox_dir(&spec.id);
        if dir.exists() {
            return Err(DriverError::Other(format!(
                "sandbox directory {} already exists",
                dir.display()
            )));
        }
        if !spec
            .rootfs
            .join(AGENT_PATH.trim_start_matches('/'))
            .exists()
        {
            return Err(DriverError::Other(format!(
                "template {} has no {AGENT_PATH} in {}; rebuild the template",
                spec.template_name,
                spec.rootfs.display()
            )));
        }
        let quota = spec.disk_mb > 0;
        for sub in ["upper", "work", "rootfs", "run", "bundle"] {
            if quota && (sub == "upper" || sub == "work") {
                continue;
            }
            std::fs::create_dir_all(dir.join(sub))
                .map_err(io_err(format!("creating {}", dir.join(sub).display())))?;
        }
        mount_run_dir(&dir.join("run"))?;
        if quota {
            self.disks.create(&dir, spec.disk_mb).await?;
        }
        let template = [spec.rootfs.clone()];
        let lowers = lowers.unwrap_or(&template);
        for l in lowers {
            disk::ensure_layer(l).await?;
        }
        let (upper, work) = disk::layer_dirs(&dir);
        mount_overlay_stack(lowers, &upper, &work, &dir.join("rootfs"))?;
        let mut config = oci_spec(
            spec,
            &dir.join("rootfs"),
            &dir.join("run"),
            &self.cfg.agent_args,
            !self.cfg.ignore_cgroups,
        );
        volumes::add_mounts(
            &mut config,
            &spec.volumes,
            &volumes::volumes_dir(&self.cfg.dir),
        )
        .await?;
        if spec.syscall_audit {
            trace::write_config(&dir)?;
        }
        if let Some(net) = &self.net {
            let ns = net
                .attach(&spec.id, &dir.join("rootfs"), spec.network.as_ref())
                .await?;
            network::set_netns_path(&mut config, &ns);
        }
        let text = serde_json::to_vec_pretty(&config)
            .map_err(|e| DriverError::Other(format!("encoding config.json: {e}")))?;
        std::fs::write(dir.join("bundle/config.json"), text)
            .map_err(io_err("writing config.json"))?;

        Ok(())
    }

    /// Removes every host trace of a sandbox (after runsc is gone).
    pub(super) fn remove_files(&self, id: &str) -> Result<()> {
        let dir = self.sandbox_dir(id);
        // (Unsealed, in case `run/` is no mount of its own and must be removed with the rest.)
        self.agent(id).forget();
        unmount(&dir.join("rootfs"))?;
        unmount(&dir.join("run"))?;
        disk::unmount_disk(&dir)?;
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(DriverError::Io {
                what: format!("removing {}", dir.display()),
                source: e,
            }),
        }
    }
}
