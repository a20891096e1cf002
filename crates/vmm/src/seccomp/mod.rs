//! Per-thread seccomp filters with argument checks (seccompiler), in the manner of Firecracker:
//!
//! - vCPU threads: `KVM_RUN` and the vCPU state reads a snapshot needs, eventfd writes
//!   (interrupts), serial output, memory management without `PROT_EXEC`, the kick signal to
//!   their own process only, and the `AF_UNIX` socket calls of a vsock activation or reset; no
//!   file opens, no VM-wide KVM ioctls.
//! - the VMM thread: the epoll loop, the control API and vsock sockets (`AF_UNIX` only), snapshot
//!   files, guest entropy, the VM-wide state reads a snapshot needs and `FIONBIO`.
//!
//! Anything else — another syscall, another ioctl request, another socket family, an executable
//! mapping, a signal to another process — kills the process (`SIGSYS`). Seccomp cannot look at
//! path strings; which paths exist for the VMM is decided by the jail (see [`crate::jail`]).
//! `--no-seccomp` disables the filters, for debugging only.

mod ioctls;

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

type Rules = BTreeMap<i64, Vec<SeccompRule>>;

/// Syscalls both kinds of thread make with any arguments.
const COMMON: &[i64] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_readv,
    libc::SYS_futex,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_sched_yield,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_close,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_rseq,
];

/// Device emulation, with any arguments: virtio device code runs on the VMM thread (queue and
/// socket events) and on a vCPU thread when the guest's MMIO write activates or resets a device
/// (vsock then connects, accepts and closes its Unix sockets).
const DEVICE: &[i64] = &[
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_getrandom,
];

/// Syscalls only the VMM thread makes, with any arguments (their file arguments are fds the VMM
/// opened, or paths inside the jail).
const VMM_ONLY: &[i64] = &[
    libc::SYS_openat,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_lseek,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
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
];

fn cond(arg: u8, op: Op, value: u64) -> Result<SeccompCondition, String> {
    SeccompCondition::new(arg, Len::Qword, op, value).map_err(|e| e.to_string())
}

fn cond32(arg: u8, op: Op, value: u64) -> Result<SeccompCondition, String> {
    SeccompCondition::new(arg, Len::Dword, op, value).map_err(|e| e.to_string())
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, String> {
    SeccompRule::new(conds).map_err(|e| e.to_string())
}

/// One rule per allowed value of argument `arg` (32-bit compare).
fn any_of(arg: u8, values: &[u64]) -> Result<Vec<SeccompRule>, String> {
    values
        .iter()
        .map(|&v| rule(vec![cond32(arg, Op::Eq, v)?]))
        .collect()
}

fn unconditional(rules: &mut Rules, list: &[i64]) {
    for &s in list {
        rules.insert(s, vec![]);
    }
}

/// Rules both thread kinds share: the unconditional list, memory mappings that are never
/// executable, and signals only to threads of this process (the vCPU kick, or abort).
fn common_rules(kick_signal: i32) -> Result<Rules, String> {
    let mut rules = Rules::new();
    unconditional(&mut rules, COMMON);
    let no_exec = || -> Result<Vec<SeccompRule>, String> {
        Ok(vec![rule(vec![cond(
            2,
            Op::MaskedEq(libc::PROT_EXEC as u64),
            0,
        )?])?])
    };
    rules.insert(libc::SYS_mmap, no_exec()?);
    rules.insert(libc::SYS_mprotect, no_exec()?);
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u64;
    let mut tgkill = Vec::new();
    for sig in [kick_signal, libc::SIGABRT] {
        tgkill.push(rule(vec![
            cond32(0, Op::Eq, pid)?,
            cond32(2, Op::Eq, sig as u64)?,
        ])?);
    }
    rules.insert(libc::SYS_tgkill, tgkill);
    Ok(rules)
}

/// Device emulation rules (see [`DEVICE`]): Unix sockets only, socket timeouts only, file status
/// flags only, `FIONBIO`.
fn device_rules(rules: &mut Rules) -> Result<(), String> {
    unconditional(rules, DEVICE);
    // Unix sockets only: vsock's host side and the control API.
    rules.insert(
        libc::SYS_socket,
        vec![rule(vec![cond32(0, Op::Eq, libc::AF_UNIX as u64)?])?],
    );
    // Socket timeouts only (the API and vsock set send/receive timeouts).
    let mut sockopt = Vec::new();
    for name in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        sockopt.push(rule(vec![
            cond32(1, Op::Eq, libc::SOL_SOCKET as u64)?,
            cond32(2, Op::Eq, name as u64)?,
        ])?);
    }
    rules.insert(libc::SYS_setsockopt, sockopt);
    rules.insert(
        libc::SYS_fcntl,
        any_of(
            1,
            &[
                libc::F_GETFL as u64,
                libc::F_SETFL as u64,
                libc::F_GETFD as u64,
                libc::F_SETFD as u64,
                libc::F_DUPFD_CLOEXEC as u64,
            ],
        )?,
    );
    Ok(())
}

fn compile(rules: Rules) -> Result<BpfProgram, String> {
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

/// The filter of a vCPU thread. Built in the process that installs it (it names its pid).
pub fn vcpu_filter() -> Result<BpfProgram, String> {
    let mut rules = common_rules(crate::vstate::vcpu::kick_signal())?;
    device_rules(&mut rules)?;
    let mut allowed = ioctls::vcpu();
    allowed.push(libc::FIONBIO);
    rules.insert(libc::SYS_ioctl, any_of(1, &allowed)?);
    compile(rules)
}

/// The filter of the VMM (event loop) thread. Built in the process that installs it.
pub fn vmm_filter() -> Result<BpfProgram, String> {
    let mut rules = common_rules(crate::vstate::vcpu::kick_signal())?;
    device_rules(&mut rules)?;
    unconditional(&mut rules, VMM_ONLY);
    rules.insert(libc::SYS_ioctl, any_of(1, &ioctls::vmm())?);
    compile(rules)
}

/// The filter of the jail's supervising parent, which only waits for the VMM and then ends the
/// way the VMM ended: `wait4`, `kill` of itself, `exit_group`.
/// `ready` is the pipe the supervisor writes its one byte to (and closes) once filtered.
pub fn supervisor_filter(ready: i32) -> Result<BpfProgram, String> {
    let mut rules = Rules::new();
    unconditional(
        &mut rules,
        &[
            libc::SYS_wait4,
            libc::SYS_exit_group,
            libc::SYS_exit,
            libc::SYS_rt_sigreturn,
            libc::SYS_getpid,
        ],
    );
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u64;
    rules.insert(libc::SYS_kill, vec![rule(vec![cond32(0, Op::Eq, pid)?])?]);
    for call in [libc::SYS_write, libc::SYS_close] {
        rules.insert(call, vec![rule(vec![cond32(0, Op::Eq, ready as u64)?])?]);
    }
    compile(rules)
}

#[cfg(test)]
mod tests {
    #[test]
    fn filters_compile() {
        assert!(!super::vcpu_filter().unwrap().is_empty());
        assert!(super::vmm_filter().unwrap().len() > super::vcpu_filter().unwrap().len());
    }
}
