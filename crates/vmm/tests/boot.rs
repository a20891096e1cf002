//! Boot path tests: the test guest booted through the 64-bit Linux boot protocol and through PVH,
//! serial output, e820/MP-table contents seen by the guest, i8042 reset, triple fault.

mod common;

use common::*;

fn mem_seen(serial: &str) -> u64 {
    let s = serial.split("mem=").nth(1).expect("guest printed mem=");
    s.split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn linux64_boot_serial_and_reset() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (st, serial, stderr) = run_to_end(
        dir.path(),
        "vm",
        Args::linux64("hello").mem_mib(96).vcpus(2),
    );
    assert_eq!(st.code(), Some(0), "serial:\n{serial}\nstderr:\n{stderr}");
    assert!(serial.contains("ring 3 up, boot=linux64"), "{serial}");
    assert!(
        serial.contains("hello from the kiln test guest"),
        "{serial}"
    );
    assert!(
        serial.contains("cpus=2"),
        "MP table must list 2 vCPUs: {serial}"
    );
    // e820: 0..0x9fc00 plus 1 MiB..96 MiB
    assert_eq!(mem_seen(&serial), 0x9fc00 + (96 << 20) - 0x10_0000);
    assert!(stderr.contains("GuestReset"), "{stderr}");
}

#[test]
fn pvh_boot_serial_and_reset() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (st, serial, stderr) =
        run_to_end(dir.path(), "vm", Args::pvh("hello").mem_mib(64).vcpus(3));
    assert_eq!(st.code(), Some(0), "serial:\n{serial}\nstderr:\n{stderr}");
    assert!(serial.contains("ring 3 up, boot=pvh"), "{serial}");
    assert!(serial.contains("cpus=3"), "{serial}");
    assert_eq!(mem_seen(&serial), 0x9fc00 + (64 << 20) - 0x10_0000);
}

#[test]
fn guest_triple_fault_ends_vm_with_status_2() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (st, serial, stderr) = run_to_end(dir.path(), "vm", Args::linux64("fault"));
    assert!(serial.contains("ring 3 up"), "{serial}");
    assert_eq!(st.code(), Some(2), "serial:\n{serial}\nstderr:\n{stderr}");
    assert!(stderr.contains("GuestShutdown"), "{stderr}");
}

#[test]
fn api_start_pause_resume_stats_stop() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = spawn(dir.path(), "vm", Args::linux64("count").paused());
    let st = vm.call(serde_json::json!({"op": "stats"}));
    assert_eq!(st["state"], "paused");
    assert!(vm.serial_text().is_empty(), "a paused VM must not run");
    vm.call(serde_json::json!({"op": "start"}));
    vm.wait_serial("count=", std::time::Duration::from_secs(60));
    vm.call(serde_json::json!({"op": "pause"}));
    let n1 = vm.serial_text().len();
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(vm.serial_text().len(), n1, "no output while paused");
    vm.call(serde_json::json!({"op": "resume"}));
    let st = vm.call(serde_json::json!({"op": "stats"}));
    assert_eq!(st["state"], "running");
    assert!(st["vmm_rss_bytes"].as_u64().unwrap() > 0);
    assert!(st["start_to_first_run_ms"].as_f64().unwrap() > 0.0);
    let bad = kiln_vmm::api::call(&vm.api, &serde_json::json!({"op": "fly"})).unwrap();
    assert_eq!(bad["ok"], false);
    assert!(
        bad["error"].as_str().unwrap().contains("bad request"),
        "{bad}"
    );
    vm.call(serde_json::json!({"op": "stop"}));
    assert_eq!(
        vm.wait_exit(std::time::Duration::from_secs(30)).code(),
        Some(0)
    );
}
