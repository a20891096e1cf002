//! `kiln bench vmm`: thin wrapper over `kiln_vmm::bench` (the logic lives in the kiln-vmm crate).

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Boot/snapshot/restore rounds.
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// kiln-vmm binary (default: $KILN_VMM_BIN, next to this executable, or on PATH).
    #[arg(long)]
    vmm_bin: Option<PathBuf>,
    /// Guest RAM per VM in MiB.
    #[arg(long, default_value_t = 128)]
    mem_mib: u64,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let note = match kiln_host::kvm::probe() {
        Ok(p) if p.hardware_speed() => format!("KVM probe: {}", p.verdict()),
        Ok(p) => format!(
            "KVM probe: {} -- this host's KVM is emulated (PVM): the test guest's few kernel-mode \
             boot instructions run slowly, its ring-3 work natively",
            p.verdict()
        ),
        Err(e) => format!("KVM probe failed: {e}"),
    };
    kiln_vmm::bench::run(kiln_vmm::bench::BenchOptions {
        iterations: a.iterations,
        vmm_bin: a.vmm_bin,
        mem_mib: a.mem_mib,
        note,
    })
}
