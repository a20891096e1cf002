//! The OCI runtime spec (`config.json`) of one gVisor sandbox.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::json;

use super::{AGENT_PATH, AGENT_SOCKET_DIR, SOCKET_NAME};
use crate::driver::SandboxSpec;

const CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_SETFCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_MKNOD",
    "CAP_AUDIT_WRITE",
];

/// The host cgroup's memory limit for a sandbox of `memory_mb`: three times the sandbox's size
/// plus 256 MiB for the sentry itself, so that the agent's in-sandbox OOM killer (which kills
/// the biggest process once the sandbox uses `memory_mb`) acts before the host's OOM killer
/// would take the whole sandbox. The sandbox's own accounting does not see two costs the
/// extra sizes cover: the platform's per-process host cost (measured ≈2 MiB per live process
/// with systrap, bounded by the agent allowing a command at most `memory_mb / 2` processes
/// in its cgroup and a quarter more through `RLIMIT_NPROC`, which gVisor holds strictly),
/// and the platform's stub processes that process churn leaves pooled until the sandbox ends
/// (≈128 KiB each; a fork bomb adds ≈100 a second until it is killed, see `pressure.rs`).
pub fn host_memory_limit(memory_mb: u32) -> u64 {
    let mb = u64::from(memory_mb);
    (3 * mb + 256) << 20
}

/// The host cgroup's pids limit for a sandbox of `pids` processes. Under gVisor the host
/// cgroup counts the sentry's threads and the platform's stub processes, not the sandbox's
/// processes (those the sentry limits itself, see the agent's per-command cgroups), and a
/// sentry that reaches the host limit dies with everything in it: leave it room, also for the
/// stubs a fork bomb's churn piles up before it is killed (see `pressure.rs`).
pub fn host_pids_limit(pids: u32) -> i64 {
    i64::from(pids.max(16)) * 16 + 1024
}

/// The sandbox memory size (bytes) whose [`host_memory_limit`] is `host` (bytes), or `host`
/// itself when it is not one of ours.
pub fn sandbox_memory(host: u64) -> u64 {
    let mb = (host >> 20).saturating_sub(256) / 3;
    match u32::try_from(mb) {
        Ok(m) if m > 0 && host_memory_limit(m) == host => mb << 20,
        _ => host,
    }
}

/// The memory limit of the sandbox's cgroup: v1 memory controller, v2 unified hierarchy
/// (mounted at /sys/fs/cgroup, or at /sys/fs/cgroup/unified on hybrid hosts).
pub fn cgroup_memory_limit(id: &str) -> Option<u64> {
    let candidates = [
        format!("/sys/fs/cgroup/memory/kiln/{id}/memory.limit_in_bytes"),
        format!("/sys/fs/cgroup/kiln/{id}/memory.max"),
        format!("/sys/fs/cgroup/unified/kiln/{id}/memory.max"),
    ];
    candidates
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .find_map(|v| v.trim().parse::<u64>().ok())
}

/// Host page cache of sandbox `id`'s files charged to its cgroup: file pages that are not
/// shared memory (the runtime's guest memory is a memfd, which counts as shmem). v1:
/// `total_cache - total_shmem`; v2: `file - shmem`.
pub fn cgroup_file_cache(id: &str) -> Option<u64> {
    let stat = |path: String, cache: &str, shmem: &str| {
        let t = std::fs::read_to_string(path).ok()?;
        let get = |k: &str| {
            t.lines().find_map(|l| {
                let (name, v) = l.split_once(' ')?;
                (name == k).then(|| v.trim().parse::<u64>().ok()).flatten()
            })
        };
        Some(get(cache)?.saturating_sub(get(shmem).unwrap_or(0)))
    };
    stat(
        format!("/sys/fs/cgroup/memory/kiln/{id}/memory.stat"),
        "total_cache",
        "total_shmem",
    )
    .or_else(|| {
        stat(
            format!("/sys/fs/cgroup/kiln/{id}/memory.stat"),
            "file",
            "shmem",
        )
    })
    .or_else(|| {
        stat(
            format!("/sys/fs/cgroup/unified/kiln/{id}/memory.stat"),
            "file",
            "shmem",
        )
    })
}

/// `cpu.shares` of a sandbox booted ahead of demand (`SandboxSpec::background`): the smallest
/// the kernel takes (see `cpu_weight.rs`).
pub const BACKGROUND_SHARES: u64 = 2;

/// The OCI runtime spec of one sandbox.
pub fn oci_spec(
    spec: &SandboxSpec,
    rootfs: &Path,
    run_dir: &Path,
    agent_args: &[String],
    with_cgroups: bool,
) -> serde_json::Value {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert(
        "PATH".into(),
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    );
    env.insert("HOME".into(), "/root".into());
    for (k, v) in &spec.env {
        env.insert(k.clone(), v.clone());
    }
    // The agent enforces these per command inside (crates/agent/src/limits.rs).
    env.insert(
        "KILN_SANDBOX_PIDS".into(),
        spec.pids_limit.max(16).to_string(),
    );
    env.insert("KILN_SANDBOX_MEMORY_MB".into(), spec.memory_mb.to_string());
    let env: Vec<String> = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut args = vec![
        AGENT_PATH.to_string(),
        "--listen-unix".to_string(),
        format!("{AGENT_SOCKET_DIR}/{SOCKET_NAME}"),
    ];
    args.extend(agent_args.iter().cloned());
    let period: u64 = 100_000;
    let mut linux = json!({
        "namespaces": [
            {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}
        ],
        "resources": {
            "memory": {"limit": host_memory_limit(spec.memory_mb)},
            "cpu": {"quota": i64::from(spec.cpu_count.max(1)) * period as i64, "period": period},
            "pids": {"limit": host_pids_limit(spec.pids_limit)}
        },
        "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
        "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"]
    });
    if with_cgroups {
        linux["cgroupsPath"] = json!(format!("/kiln/{}", spec.id));
        if spec.background {
            // runsc gives cgroup v2 the weight these shares map to (1).
            linux["resources"]["cpu"]["shares"] = json!(BACKGROUND_SHARES);
        }
    }
    let mut v = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": env,
            "cwd": "/",
            "capabilities": {
                "bounding": CAPS, "effective": CAPS, "permitted": CAPS, "inheritable": CAPS
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576u64, "soft": 1048576u64}],
            "noNewPrivileges": false
        },
        "root": {"path": rootfs, "readonly": false},
        "hostname": spec.id,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            // gVisor's own cgroupfs (not the host's): the agent gives every command a pids
            // cgroup there, which the sentry enforces.
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "rw"]},
            {"destination": AGENT_SOCKET_DIR, "type": "bind", "source": run_dir,
             "options": ["rbind", "rw"]}
        ],
        "linux": linux
    });
    if tmp_is_empty(&spec.rootfs) {
        // runsc would mount an unbounded tmpfs (sandbox memory) over an empty /tmp: bound it.
        let tmp = json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777", format!("size={}m", tmp_size_mb(spec.memory_mb))]});
        if let Some(m) = v["mounts"].as_array_mut() {
            m.push(tmp);
        }
    }
    v
}

/// Size of a sandbox's `/tmp` (a tmpfs, so sandbox memory): half the sandbox's memory.
pub fn tmp_size_mb(memory_mb: u32) -> u32 {
    (memory_mb / 2).max(16)
}

/// Whether the template has nothing in `/tmp` (then /tmp is a tmpfs; otherwise it stays on the
/// sandbox's disk, with the template's files, bounded by the disk quota).
fn tmp_is_empty(rootfs: &Path) -> bool {
    match std::fs::read_dir(rootfs.join("tmp")) {
        Ok(mut d) => d.next().is_none(),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_limit_round_trips() {
        for mb in [64u32, 256, 512, 1024, 2048, 8192] {
            assert_eq!(sandbox_memory(host_memory_limit(mb)), u64::from(mb) << 20);
        }
        assert_eq!(sandbox_memory(12345), 12345);
    }

    #[test]
    fn spec_carries_limits_agent_and_socket_mount() {
        let spec = SandboxSpec {
            id: "sbx1".into(),
            template_name: "base".into(),
            rootfs: "/t/rootfs".into(),
            image: None,
            env: BTreeMap::from([("LANG".into(), "C.UTF-8".into())]),
            cpu_count: 2,
            memory_mb: 256,
            pids_limit: 300,
            syscall_audit: false,
            disk_mb: 0,
            volumes: vec![],
            network: None,
            background: false,
        };
        let v = oci_spec(
            &spec,
            Path::new("/s/rootfs"),
            Path::new("/s/run"),
            &[],
            true,
        );
        assert_eq!(v["process"]["args"][0], AGENT_PATH);
        assert_eq!(v["process"]["args"][2], "/run/kiln/agent.sock");
        assert_eq!(
            v["linux"]["resources"]["memory"]["limit"],
            (3 * 256u64 + 256) << 20
        );
        assert_eq!(v["linux"]["resources"]["cpu"]["quota"], 200_000);
        assert_eq!(v["linux"]["resources"]["pids"]["limit"], 300 * 16 + 1024);
        assert_eq!(v["linux"]["cgroupsPath"], "/kiln/sbx1");
        assert!(v["linux"]["resources"]["cpu"].get("shares").is_none());
        assert_eq!(v["root"]["path"], "/s/rootfs");
        let env: Vec<&str> = v["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap())
            .collect();
        assert!(env.contains(&"LANG=C.UTF-8"));
        assert!(env.contains(&"KILN_SANDBOX_MEMORY_MB=256"));
        assert!(env.contains(&"KILN_SANDBOX_PIDS=300"));
        let mounts = v["mounts"].as_array().unwrap();
        let tmp = mounts.iter().find(|m| m["destination"] == "/tmp").unwrap();
        assert_eq!(tmp["type"], "tmpfs");
        assert!(tmp["options"]
            .as_array()
            .unwrap()
            .contains(&json!("size=128m")));
        assert!(mounts
            .iter()
            .any(|m| m["destination"] == "/run/kiln" && m["source"] == "/s/run"));
        let v = oci_spec(
            &spec,
            Path::new("/s/rootfs"),
            Path::new("/s/run"),
            &[],
            false,
        );
        assert!(v["linux"].get("cgroupsPath").is_none());
        // A warm pool's sandbox starts at the smallest weight, with the same CPU limit.
        let background = SandboxSpec {
            background: true,
            ..spec
        };
        let v = oci_spec(
            &background,
            Path::new("/s/rootfs"),
            Path::new("/s/run"),
            &[],
            true,
        );
        assert_eq!(v["linux"]["resources"]["cpu"]["shares"], 2);
        assert_eq!(v["linux"]["resources"]["cpu"]["quota"], 200_000);
    }
}
