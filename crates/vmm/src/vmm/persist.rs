//! Snapshots: pause, save vCPU / VM / device state and guest memory into a snapshot directory,
//! resume.

use std::path::Path;
use std::time::{Duration, Instant};

use super::Vmm;
use crate::snapshot::{self, DevicePersist, Snapshot};
use crate::vstate::vcpu::{VcpuCmd, VcpuReply};

impl Vmm {
    /// Takes a snapshot into `dir` (created if missing). The VM is paused while the state and
    /// memory are written and resumed afterwards if it was running and `resume` is true.
    pub fn snapshot(&mut self, dir: &Path, resume: bool) -> Result<serde_json::Value, String> {
        let t0 = Instant::now();
        let was_running = !self.paused;
        if was_running {
            self.pause_all()?;
        }
        let res = self.snapshot_paused(dir);
        let pause_ms = t0.elapsed().as_secs_f64() * 1e3;
        if was_running && resume {
            self.resume_all();
        }
        let (mem_written, state_ms) = res?;
        Ok(serde_json::json!({
            "dir": dir,
            "snapshot_ms": pause_ms,
            "state_ms": state_ms,
            "memory_bytes_written": mem_written,
            "resumed": was_running && resume,
        }))
    }

    fn snapshot_paused(&mut self, dir: &Path) -> Result<(u64, f64), String> {
        let t0 = Instant::now();
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        // This VM's RAM is mapped from the snapshot it was restored from: overwriting that file
        // would corrupt this VM and every other fork of it.
        if let Some(src) = &self.restored_from {
            let same = match (std::fs::canonicalize(src), std::fs::canonicalize(dir)) {
                (Ok(a), Ok(b)) => a == b,
                _ => false,
            };
            if same {
                return Err(format!(
                    "{} is the snapshot this VM was restored from; write the new snapshot elsewhere",
                    dir.display()
                ));
            }
        }
        let mut vcpus = Vec::new();
        for v in &self.vcpus {
            match v.request(VcpuCmd::Save, Duration::from_secs(10)) {
                Some(VcpuReply::Saved(st)) => vcpus.push((*st)?),
                _ => return Err(format!("vCPU {} did not save its state", v.id)),
            }
        }
        let vm = self.vm.save().map_err(|e| e.to_string())?;
        let serial = self.serial.lock().unwrap_or_else(|p| p.into_inner()).save();
        let devices = self
            .transports
            .iter()
            .map(|t| {
                let t = t.lock().unwrap_or_else(|p| p.into_inner());
                DevicePersist {
                    device_type: t.device.device_type(),
                    transport: t.save(),
                    state: t.device.save(),
                }
            })
            .collect();
        let state_ms = t0.elapsed().as_secs_f64() * 1e3;
        let written = self
            .ram
            .dump(&dir.join(snapshot::MEMORY_FILE))
            .map_err(|e| e.to_string())?;
        if let Some(ov) = &self.overlay {
            snapshot::sparse_copy(ov, &dir.join(snapshot::OVERLAY_FILE))
                .map_err(|e| format!("copying the overlay: {e}"))?;
        }
        let snap = Snapshot {
            vmm_version: env!("CARGO_PKG_VERSION").to_string(),
            config: self.config.clone(),
            mem_size: self.ram.size,
            vm,
            vcpus,
            serial,
            devices,
        };
        snapshot::write_state(dir, &snap).map_err(|e| e.to_string())?;
        Ok((written, state_ms))
    }
}
