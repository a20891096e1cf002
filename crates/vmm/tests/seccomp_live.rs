//! Forbidden calls made from inside a running `kiln-vmm`: the test stops one of its threads with
//! ptrace where it sits in a syscall, points it back at its `syscall` instruction with other
//! registers, and lets it go. A call the thread's filter forbids — a syscall, an ioctl request, a
//! socket family — kills the whole VMM with SIGSYS; an allowed one leaves the VM running.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::*;
use serde_json::json;

const T: Duration = Duration::from_secs(60);

/// A syscall to make the stopped thread perform: number and first three arguments.
#[derive(Clone, Copy)]
struct Call(i64, u64, u64, u64);

fn ptrace(req: libc::c_uint, tid: i32, data: *mut libc::c_void) -> i64 {
    // SAFETY: ptrace on a thread this test seized; `data` is null or points to a live
    // user_regs_struct of the size the request expects.
    unsafe { libc::ptrace(req, tid, std::ptr::null_mut::<libc::c_void>(), data) }
}

/// Makes thread `tid` (stopped in a syscall) perform `call` and resumes it. Returns false if
/// the thread was not at a syscall instruction (the caller may retry).
fn inject(tid: i32, call: Call) -> bool {
    assert_eq!(
        ptrace(libc::PTRACE_SEIZE, tid, std::ptr::null_mut()),
        0,
        "PTRACE_SEIZE {tid}: {}",
        std::io::Error::last_os_error()
    );
    assert_eq!(ptrace(libc::PTRACE_INTERRUPT, tid, std::ptr::null_mut()), 0);
    let mut status = 0;
    // SAFETY: status is a valid out pointer.
    let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
    assert_eq!(r, tid, "waitpid: {}", std::io::Error::last_os_error());
    // SAFETY: all-zero is a valid user_regs_struct.
    let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    let regs_ptr = |r: &mut libc::user_regs_struct| (r as *mut libc::user_regs_struct).cast();
    assert_eq!(ptrace(libc::PTRACE_GETREGS, tid, regs_ptr(&mut regs)), 0);
    // the two bytes before rip must be `syscall` (0f 05)
    // SAFETY: PEEKTEXT reads the tracee's memory; errors come back as -1 with errno.
    let word = unsafe {
        libc::ptrace(
            libc::PTRACE_PEEKTEXT,
            tid,
            (regs.rip - 2) as *mut libc::c_void,
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    let at_syscall = regs.orig_rax as i64 >= 0 && word & 0xffff == 0x050f;
    if at_syscall {
        regs.orig_rax = u64::MAX; // no syscall restart on resume
        regs.rip -= 2;
        regs.rax = call.0 as u64;
        regs.rdi = call.1;
        regs.rsi = call.2;
        regs.rdx = call.3;
        assert_eq!(ptrace(libc::PTRACE_SETREGS, tid, regs_ptr(&mut regs)), 0);
    }
    assert_eq!(ptrace(libc::PTRACE_DETACH, tid, std::ptr::null_mut()), 0);
    at_syscall
}

/// The tid of the thread of `pid` whose name starts with `name`.
fn thread(pid: u32, name: &str) -> i32 {
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let t = t.unwrap();
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.starts_with(name) {
            return t.file_name().to_string_lossy().parse().unwrap();
        }
    }
    panic!("no thread {name} in {pid}");
}

/// No core files from the VMMs killed here: the limit is inherited by every VMM this test
/// process spawns.
fn no_core_dumps() {
    let zero = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: sets this process's own core limit; `zero` outlives the call.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_CORE, &zero) }, 0);
}

/// Boots the counting guest (jailed unless `unjailed`), injects `call` into the thread named
/// `thread_name` and returns the VM.
fn boot_and_inject(dir: &std::path::Path, args: Args, thread_name: &str, call: Call) -> Vm {
    no_core_dumps();
    let mut vm = spawn(dir, "vm", args);
    vm.wait_serial("count=", T);
    vm.call(json!({"op": "stats"}));
    let pid = vm.pid();
    let tid = thread(pid, thread_name);
    for attempt in 0.. {
        if inject(tid, call) {
            break;
        }
        assert!(attempt < 100, "{thread_name} never stopped at a syscall");
        std::thread::sleep(Duration::from_millis(10));
    }
    vm
}

fn assert_killed_by_sigsys(vm: &mut Vm, what: &str) {
    let st = vm.wait_exit(T);
    assert_eq!(
        st.signal(),
        Some(libc::SIGSYS),
        "{what}: the VMM ended with {st} instead of SIGSYS; stderr:\n{}",
        vm.stderr_text()
    );
}

const SOCKET: i64 = libc::SYS_socket;
const IOCTL: i64 = libc::SYS_ioctl;
const OPENAT: i64 = libc::SYS_openat;
const KVM_CREATE_VM: u64 = 0xAE01;

#[test]
fn vmm_thread_socket_of_a_forbidden_family_is_killed() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let call = Call(SOCKET, libc::AF_INET as u64, libc::SOCK_STREAM as u64, 0);
    let mut vm = boot_and_inject(dir.path(), Args::linux64("count"), "kiln-vmm", call);
    assert_killed_by_sigsys(&mut vm, "socket(AF_INET) on the VMM thread");
}

#[test]
fn vmm_thread_forbidden_ioctl_request_is_killed() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let call = Call(IOCTL, 3, KVM_CREATE_VM, 0);
    let args = Args::linux64("count").unjailed();
    let mut vm = boot_and_inject(dir.path(), args, "kiln-vmm", call);
    assert_killed_by_sigsys(&mut vm, "ioctl(KVM_CREATE_VM) on the VMM thread");
}

#[test]
fn vcpu_thread_file_open_is_killed() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // openat is allowed on the VMM thread (snapshots) but not on a vCPU thread
    let call = Call(OPENAT, libc::AT_FDCWD as u64, 0, 0);
    let mut vm = boot_and_inject(dir.path(), Args::linux64("count"), "vcpu0", call);
    assert_killed_by_sigsys(&mut vm, "openat on a vCPU thread");
}

#[test]
fn an_allowed_call_leaves_the_vm_running() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // sched_yield returns 0, which the event loop takes as "no events"
    let call = Call(libc::SYS_sched_yield, 0, 0, 0);
    let mut vm = boot_and_inject(dir.path(), Args::linux64("count"), "kiln-vmm", call);
    std::thread::sleep(Duration::from_millis(200));
    let st = vm.call(json!({"op": "stats"}));
    assert_eq!(st["state"], "running");
    vm.call(json!({"op": "stop"}));
    assert_eq!(vm.wait_exit(T).code(), Some(0));
}
