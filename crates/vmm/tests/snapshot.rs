//! Snapshot, restore and copy-on-write fork tests.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::json;

const T: Duration = Duration::from_secs(60);

fn counter_addr(serial: &str) -> u64 {
    let s = serial
        .split("counter at 0x")
        .nth(1)
        .expect("guest printed the counter address");
    u64::from_str_radix(s.lines().next().unwrap().trim(), 16).unwrap()
}

fn counter_in(snapshot: &Path, addr: u64) -> u64 {
    let f = std::fs::File::open(snapshot.join("memory")).unwrap();
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, addr).unwrap();
    u64::from_le_bytes(b)
}

/// Counts printed on complete lines (the last line may still be being written).
fn counts(serial: &str) -> Vec<u64> {
    serial
        .split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .filter_map(|l| l.strip_prefix("count="))
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

/// Waits until the VM printed at least one complete count line; returns the counts.
fn wait_counts(vm: &mut Vm) -> Vec<u64> {
    let deadline = std::time::Instant::now() + T;
    loop {
        vm.wait_serial("count=", T);
        let c = counts(&vm.serial_text());
        if !c.is_empty() {
            return c;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no complete count line"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn proc_rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kb * 1024
}

#[test]
fn snapshot_fork_twice_isolated_and_lazy() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let snap = d.join("snap");
    let mut vm = spawn(d, "orig", Args::linux64("count").mem_mib(256));
    wait_counts(&mut vm);
    let addr = counter_addr(&vm.serial_text());
    let r = vm.call(json!({"op": "snapshot", "dir": snap, "resume": false}));
    assert!(r["snapshot_ms"].as_f64().unwrap() > 0.0);
    vm.call(json!({"op": "stop"}));
    assert_eq!(vm.wait_exit(T).code(), Some(0));
    let c = counter_in(&snap, addr);
    assert!(c > 0, "the snapshot holds the running count");
    assert!(counts(&vm.serial_text()).iter().all(|&x| x <= c));
    let mem_hash = sha256(&snap.join("memory"));
    // the memory file is sparse: far less allocated than the 256 MiB of guest RAM
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(snap.join("memory")).unwrap();
        assert_eq!(m.len(), 256 << 20);
        assert!(
            m.blocks() * 512 < 16 << 20,
            "memory file allocates {} bytes",
            m.blocks() * 512
        );
    }

    // fork A runs, fork B stays paused
    let mut a = spawn(d, "a", Args::restore(&snap));
    let mut b = spawn(d, "b", Args::restore(&snap).paused());
    let a_counts = wait_counts(&mut a);
    assert!(
        a_counts[0] > c,
        "fork A continues from the saved count {c}: {a_counts:?}"
    );
    assert!(
        a_counts[0] - c <= 1 << 22,
        "fork A's first print follows the saved count closely"
    );
    let sa = d.join("snap-a");
    a.call(json!({"op": "snapshot", "dir": sa, "resume": false}));
    let ca = counter_in(&sa, addr);
    assert!(ca > c);
    // B never ran: exactly the saved count, untouched by A's writes
    let sb = d.join("snap-b0");
    b.call(json!({"op": "snapshot", "dir": sb, "resume": false}));
    assert_eq!(
        counter_in(&sb, addr),
        c,
        "fork A's writes leaked into fork B"
    );
    // now B runs; A (paused) keeps its own count
    b.call(json!({"op": "resume"}));
    assert!(wait_counts(&mut b)[0] > c);
    let sb1 = d.join("snap-b1");
    b.call(json!({"op": "snapshot", "dir": sb1, "resume": true}));
    assert!(counter_in(&sb1, addr) > c);
    let sa2 = d.join("snap-a2");
    a.call(json!({"op": "snapshot", "dir": sa2, "resume": false}));
    assert_eq!(
        counter_in(&sa2, addr),
        ca,
        "fork B's writes leaked into fork A"
    );
    // neither fork wrote to the snapshot's memory file
    assert_eq!(sha256(&snap.join("memory")), mem_hash);
    assert_eq!(counter_in(&snap, addr), c);

    // lazily faulted: a fork's resident guest memory is what it touched, not 256 MiB
    for (name, vm) in [("a", &a), ("b", &b)] {
        let st = vm.call(json!({"op": "stats"}));
        let guest_rss = st["guest_rss_bytes"].as_u64().unwrap();
        assert!(
            guest_rss < 8 << 20,
            "fork {name} has {guest_rss} bytes of guest RAM resident"
        );
        let rss = proc_rss(vm.pid());
        assert!(rss < 64 << 20, "fork {name} process RSS {rss} bytes");
        assert_eq!(st["restored_from"], json!(snap));
    }
    a.call(json!({"op": "stop"}));
    b.call(json!({"op": "stop"}));
    assert_eq!(a.wait_exit(T).code(), Some(0));
    assert_eq!(b.wait_exit(T).code(), Some(0));

    // snapshotting over the snapshot a fork runs from is refused (it would corrupt all forks)
    let mut a3 = spawn(d, "a3", Args::restore(&sa2).paused());
    a3.wait_api();
    let r = kiln_vmm::api::call(&a3.api, &json!({"op": "snapshot", "dir": sa2})).unwrap();
    assert_eq!(r["ok"], false, "{r}");
    assert!(
        r["error"].as_str().unwrap().contains("restored from"),
        "{r}"
    );
    a3.call(json!({"op": "stop"}));
    a3.wait_exit(T);

    // a snapshot of a restored VM restores too (fork of a fork)
    let mut a2 = spawn(d, "a2", Args::restore(&sa2));
    assert!(wait_counts(&mut a2)[0] > ca);
    a2.call(json!({"op": "stop"}));
    a2.wait_exit(T);
}

#[test]
fn restore_with_devices_resets_vsock_and_forks_the_overlay() {
    if !kvm_usable() {
        return;
    }
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = d.join("base.img");
    std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
    let base_hash = sha256(&base);
    let snap = d.join("snap");
    let uds0 = d.join("v0.sock");
    let ov0 = d.join("ov0");
    let mut vm = spawn(
        d,
        "orig",
        Args::linux64("restore kiln.vsock_port=6000")
            .disk_base(&base)
            .disk_overlay(&ov0)
            .vsock(5, &uds0)
            .rng(),
    );
    vm.wait_serial("restore: ready for snapshot", T);
    assert!(vm.serial_text().contains("restore: blk write status=0"));
    vm.call(json!({"op": "snapshot", "dir": snap, "resume": false}));
    vm.call(json!({"op": "stop"}));
    vm.wait_exit(T);
    assert!(snap.join("disk.overlay").exists());

    // restoring without per-VM paths is a clear error
    let (st, _, stderr) = run_to_end(d, "noov", Args::restore(&snap));
    assert_eq!(st.code(), Some(1));
    assert!(stderr.contains("--disk-overlay"), "{stderr}");

    let mut rngs = Vec::new();
    for fork in ["x", "y"] {
        let uds = d.join(format!("{fork}.sock"));
        let ov = d.join(format!("{fork}.overlay"));
        let listener = host_listener(format!("{}_6000", uds.display()));
        let echo = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(T)).unwrap();
            let mut b = [0u8; 14];
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
            b
        });
        let mut f = spawn(
            d,
            fork,
            Args::restore(&snap).disk_overlay(&ov).vsock_uds(&uds),
        );
        let s = f.wait_serial("restore: done", T);
        assert!(
            s.contains("restore: vsock event head=0 len=4 id=0"),
            "transport reset event: {s}"
        );
        assert!(
            s.contains("restore: blk read1 status=0 data=BEFORE-SNAPSHOT"),
            "{s}"
        );
        assert!(s.contains("restore: blk write2 status=0"), "{s}");
        assert!(s.contains("restore: vsock reply=after-restore"), "{s}");
        assert_eq!(&echo.join().unwrap(), b"after-restore\n");
        assert_eq!(f.wait_exit(T).code(), Some(0));
        let rng = s
            .split("restore: rng=")
            .nth(1)
            .unwrap()
            .lines()
            .next()
            .unwrap()
            .to_string();
        let o = std::fs::read(&ov).unwrap();
        assert_eq!(
            &o[1024..1056],
            rng.as_bytes(),
            "fork {fork}'s own overlay holds its write"
        );
        rngs.push(rng);
    }
    assert_ne!(
        rngs[0], rngs[1],
        "forks must get fresh entropy, not replayed bytes"
    );
    // the snapshot's overlay copy and the base are untouched by the forks
    let snap_ov = std::fs::read(snap.join("disk.overlay")).unwrap();
    assert!(snap_ov[1024..1056].iter().all(|&b| b == 0));
    assert_eq!(&snap_ov[512..527], b"BEFORE-SNAPSHOT");
    assert_eq!(sha256(&base), base_hash);
}
