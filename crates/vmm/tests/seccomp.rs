//! The seccomp filters, installed for real in a forked child that then makes one call: calls the
//! thread kind needs return, anything else — another syscall, another ioctl request, another
//! socket family or socket option, an executable mapping, a signal to another process — kills
//! the child with SIGSYS.

use kiln_vmm::seccomp::{supervisor_filter, vcpu_filter, vmm_filter};
use seccompiler::BpfProgram;

#[derive(Debug, PartialEq)]
enum Outcome {
    Returned,
    KilledBySigsys,
}

/// Forks; the child installs `filter`, runs `op` and exits 0 if it returned.
fn run_filtered(filter: &BpfProgram, op: fn()) -> Outcome {
    // SAFETY: the child only makes raw syscalls (no allocation, no locks) before _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: plain syscalls in the forked child.
        unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
        if seccompiler::apply_filter(filter).is_err() {
            // SAFETY: as above.
            unsafe { libc::_exit(3) };
        }
        op();
        // SAFETY: as above.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: status is a valid out pointer; pid is our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    if libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS {
        Outcome::KilledBySigsys
    } else {
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child ended with status {status:#x}"
        );
        Outcome::Returned
    }
}

// KVM_CREATE_VM, KVM_SET_USER_MEMORY_REGION, KVM_SET_REGS and KVM_RUN request numbers.
const KVM_CREATE_VM: libc::c_ulong = 0xAE01;
const KVM_SET_USER_MEMORY_REGION: libc::c_ulong = 0x4020_AE46;
const KVM_SET_REGS: libc::c_ulong = 0x4090_AE82;
const KVM_RUN: libc::c_ulong = 0xAE80;
const KVM_GET_REGS: libc::c_ulong = 0x8090_AE81;

// Each op uses fd -1 where an fd is needed: an allowed call returns EBADF, a forbidden one dies
// before the kernel looks at the fd.
fn ioctl(req: libc::c_ulong) {
    // SAFETY: fd -1 is invalid; the kernel fails the call without touching memory.
    unsafe { libc::ioctl(-1, req, 0) };
}
fn ioctl_kvm_run() {
    ioctl(KVM_RUN);
}
fn ioctl_kvm_get_regs() {
    ioctl(KVM_GET_REGS);
}
fn ioctl_kvm_create_vm() {
    ioctl(KVM_CREATE_VM);
}
fn ioctl_kvm_set_memory() {
    ioctl(KVM_SET_USER_MEMORY_REGION);
}
fn ioctl_kvm_set_regs() {
    ioctl(KVM_SET_REGS);
}
fn ioctl_tiocsti() {
    ioctl(libc::TIOCSTI);
}
fn ioctl_fionbio() {
    ioctl(libc::FIONBIO);
}
fn socket(domain: libc::c_int) {
    // SAFETY: plain syscall; the fd (if any) is left to process exit.
    unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
}
fn socket_unix() {
    socket(libc::AF_UNIX);
}
fn socket_inet() {
    socket(libc::AF_INET);
}
fn socket_inet6() {
    socket(libc::AF_INET6);
}
fn socket_netlink() {
    socket(libc::AF_NETLINK);
}
fn setsockopt(name: libc::c_int) {
    let v = [0u8; 16];
    // SAFETY: fd -1; v outlives the call.
    unsafe { libc::setsockopt(-1, libc::SOL_SOCKET, name, v.as_ptr().cast(), 16) };
}
fn setsockopt_rcvtimeo() {
    setsockopt(libc::SO_RCVTIMEO);
}
fn setsockopt_bindtodevice() {
    setsockopt(libc::SO_BINDTODEVICE);
}
fn openat_passwd() {
    // SAFETY: valid NUL-terminated path.
    unsafe { libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) };
}
fn mmap(prot: libc::c_int) {
    // SAFETY: a fresh anonymous mapping, never used.
    unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
}
fn mmap_rw() {
    mmap(libc::PROT_READ | libc::PROT_WRITE);
}
fn mmap_exec() {
    mmap(libc::PROT_READ | libc::PROT_EXEC);
}
fn kill_init() {
    // SAFETY: signal 0 only checks; the filter decides before the kernel does.
    unsafe { libc::kill(1, 0) };
}
fn tgkill_other_process() {
    // SAFETY: signal 0 to pid 1: nothing is delivered.
    unsafe { libc::syscall(libc::SYS_tgkill, 1, 1, 0) };
}
fn fcntl_setown() {
    // SAFETY: fd -1.
    unsafe { libc::fcntl(-1, libc::F_SETOWN, 1) };
}
fn fcntl_getfl() {
    // SAFETY: fd -1.
    unsafe { libc::fcntl(-1, libc::F_GETFL) };
}
fn execve() {
    let argv = [std::ptr::null::<libc::c_char>()];
    // SAFETY: a NUL-terminated path and an empty argv/envp.
    unsafe { libc::execve(c"/bin/true".as_ptr(), argv.as_ptr(), argv.as_ptr()) };
}
fn ptrace() {
    // SAFETY: PTRACE_TRACEME has no memory arguments.
    unsafe { libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) };
}
fn wait4() {
    // SAFETY: no children: returns ECHILD.
    unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) };
}

use Outcome::*;

#[test]
fn vcpu_thread_filter() {
    let f = vcpu_filter().unwrap();
    let cases: &[(&str, fn(), Outcome)] = &[
        ("KVM_RUN", ioctl_kvm_run, Returned),
        ("KVM_GET_REGS", ioctl_kvm_get_regs, Returned),
        ("FIONBIO", ioctl_fionbio, Returned),
        ("socket(AF_UNIX)", socket_unix, Returned),
        ("mmap rw", mmap_rw, Returned),
        ("KVM_SET_REGS", ioctl_kvm_set_regs, KilledBySigsys),
        ("KVM_CREATE_VM", ioctl_kvm_create_vm, KilledBySigsys),
        (
            "KVM_SET_USER_MEMORY_REGION",
            ioctl_kvm_set_memory,
            KilledBySigsys,
        ),
        ("TIOCSTI", ioctl_tiocsti, KilledBySigsys),
        ("socket(AF_INET)", socket_inet, KilledBySigsys),
        ("open", openat_passwd, KilledBySigsys),
        ("mmap exec", mmap_exec, KilledBySigsys),
        ("execve", execve, KilledBySigsys),
    ];
    for (name, op, want) in cases {
        assert_eq!(&run_filtered(&f, *op), want, "vCPU thread: {name}");
    }
}

#[test]
fn vmm_thread_filter() {
    let f = vmm_filter().unwrap();
    let cases: &[(&str, fn(), Outcome)] = &[
        ("FIONBIO", ioctl_fionbio, Returned),
        ("socket(AF_UNIX)", socket_unix, Returned),
        ("setsockopt(SO_RCVTIMEO)", setsockopt_rcvtimeo, Returned),
        ("open", openat_passwd, Returned),
        ("fcntl(F_GETFL)", fcntl_getfl, Returned),
        ("mmap rw", mmap_rw, Returned),
        ("KVM_RUN", ioctl_kvm_run, KilledBySigsys),
        ("KVM_CREATE_VM", ioctl_kvm_create_vm, KilledBySigsys),
        (
            "KVM_SET_USER_MEMORY_REGION",
            ioctl_kvm_set_memory,
            KilledBySigsys,
        ),
        ("TIOCSTI", ioctl_tiocsti, KilledBySigsys),
        ("socket(AF_INET)", socket_inet, KilledBySigsys),
        ("socket(AF_INET6)", socket_inet6, KilledBySigsys),
        ("socket(AF_NETLINK)", socket_netlink, KilledBySigsys),
        (
            "setsockopt(SO_BINDTODEVICE)",
            setsockopt_bindtodevice,
            KilledBySigsys,
        ),
        ("fcntl(F_SETOWN)", fcntl_setown, KilledBySigsys),
        ("mmap exec", mmap_exec, KilledBySigsys),
        ("kill", kill_init, KilledBySigsys),
        (
            "tgkill another process",
            tgkill_other_process,
            KilledBySigsys,
        ),
        ("execve", execve, KilledBySigsys),
        ("ptrace", ptrace, KilledBySigsys),
    ];
    for (name, op, want) in cases {
        assert_eq!(&run_filtered(&f, *op), want, "VMM thread: {name}");
    }
}

/// The fd the supervisor filter of the test below allows to write and close (its ready pipe).
const READY_FD: i32 = 77;
fn write_ready_fd() {
    // SAFETY: fd 77 is not open in the child: EBADF.
    unsafe { libc::write(READY_FD, [1u8].as_ptr().cast(), 1) };
}
fn close_ready_fd() {
    // SAFETY: as above.
    unsafe { libc::close(READY_FD) };
}
fn write_stderr() {
    // SAFETY: writes an empty buffer to stderr (the filter decides first).
    unsafe { libc::write(2, [].as_ptr(), 0) };
}
fn close_stderr() {
    // SAFETY: closes the forked child's stderr.
    unsafe { libc::close(2) };
}

#[test]
fn jail_supervisor_filter() {
    let f = supervisor_filter(READY_FD).unwrap();
    for op in [wait4, write_ready_fd, close_ready_fd] {
        assert_eq!(run_filtered(&f, op), Returned);
    }
    for op in [
        socket_unix,
        openat_passwd,
        ioctl_fionbio,
        kill_init,
        execve,
        write_stderr,
        close_stderr,
    ] {
        assert_eq!(run_filtered(&f, op), KilledBySigsys);
    }
}
