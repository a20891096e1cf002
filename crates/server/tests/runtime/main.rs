//! The gVisor runtime tests: the driver, the manager's lifecycle (timeouts, pause/resume,
//! snapshots, forks, start commands, pools, restarts, template GC, disks, admission, timer
//! slack, the idle tick) and sandbox networking, all with real runsc sandboxes.
//!
//! One test binary (one link of kiln-server) per concern; each module is one former
//! `tests/<name>.rs`.

#[path = "../common/mod.rs"]
mod common;

mod capacity;
mod disk_pool;
mod gvisor_driver;
mod idle_wave;
mod lifecycle;
mod lifecycle_watch;
mod manager;
mod net_churn;
mod net_localhost;
mod pause_cut_short;
mod pool;
mod restart;
mod snapshot_modes;
mod start_cmd;
mod template_gc;
mod timer_slack;
