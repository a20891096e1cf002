//! Per-thread seccomp filters (seccompiler). vCPU threads get a small allowlist (KVM_RUN and
//! device emulation); the VMM thread a larger one (event loop, API, snapshots, vsock sockets).
//! Any other syscall kills the process. Disable with `--no-seccomp` for debugging only.

use std::collections::BTreeMap;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

const COMMON: &[i64] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_readv,
    libc::SYS_ioctl,
    libc::SYS_futex,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_sched_yield,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_close,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_tgkill,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_lseek,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_rseq,
    libc::SYS_fcntl,
];

const VMM_EXTRA: &[i64] = &[
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_create1,
    libc::SYS_accept4,
    libc::SYS_socket,
    libc::SYS_connect,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_openat,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_getdents64,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_getcwd,
    libc::SYS_getrandom,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_eventfd2,
    libc::SYS_sched_getaffinity,
    libc::SYS_getuid,
    libc::SYS_geteuid,
];

fn build(list: &[&[i64]]) -> Result<BpfProgram, String> {
    let mut rules = BTreeMap::new();
    for l in list {
        for &s in *l {
            rules.insert(s, vec![]);
        }
    }
    let f = SeccompFilter::new(
        rules,
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| e.to_string())?;
    f.try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())
}

pub fn vcpu_filter() -> Result<BpfProgram, String> {
    build(&[COMMON])
}

pub fn vmm_filter() -> Result<BpfProgram, String> {
    build(&[COMMON, VMM_EXTRA])
}

#[cfg(test)]
mod tests {
    #[test]
    fn filters_compile() {
        assert!(!super::vcpu_filter().unwrap().is_empty());
        assert!(super::vmm_filter().unwrap().len() > super::vcpu_filter().unwrap().len());
    }
}
