//! libFuzzer target: virtio queue handling (transport, block, rng, vsock) through
//! `kiln_vmm::devices::virtio::fuzz::Harness`.
#![no_main]

use std::sync::OnceLock;

use kiln_vmm::devices::virtio::fuzz::Harness;
use libfuzzer_sys::fuzz_target;

static HARNESS: OnceLock<(tempfile::TempDir, Harness)> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let (_, harness) = HARNESS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("scratch directory");
        let harness = Harness::new(dir.path()).expect("fuzz harness");
        (dir, harness)
    });
    harness.run(data);
});
