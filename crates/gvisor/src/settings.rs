//! The driver's settings: the `[gvisor]` section of kiln's configuration
//! ([`GvisorSettings`]) and what one driver instance resolves it to ([`GvisorConfig`]).

use std::path::{Path, PathBuf};

/// The `[gvisor]` section of kiln's configuration.
#[derive(Debug, Clone, Default)]
pub struct GvisorSettings {
    /// runsc binary (default: `runsc` on PATH).
    pub runsc: Option<PathBuf>,
    /// `--platform` (default `ptrace`; `systrap`/`kvm` where they work).
    pub platform: Option<String>,
    /// Skip cgroup configuration entirely (hosts where runsc cannot manage cgroups).
    pub ignore_cgroups: bool,
    /// Sandbox networking (`None`: `--network=none`, the agent socket only).
    pub network: Option<kiln_net::NetConfig>,
    /// Timer slack of the sandboxes' host tasks (`None`: the kernel's; see [`slack`]).
    pub timer_slack: Option<std::time::Duration>,
    /// Timer slack of an idle sandbox's host tasks (`None`: idle hints change nothing; see
    /// [`slack::IdleSlack`]).
    pub idle_timer_slack: Option<std::time::Duration>,
    /// The timer slack of a sandbox hinted idle for long (`None`: the idle slack stays).
    pub deep_idle: Option<crate::slack::DeepIdle>,
}

/// Resolved settings of one gVisor driver instance.
#[derive(Debug, Clone)]
pub struct GvisorConfig {
    /// Root of the driver's state (`<state>/gvisor`).
    pub dir: PathBuf,
    /// `runsc` binary.
    pub runsc: PathBuf,
    /// `--platform`.
    pub platform: String,
    /// Skip cgroup configuration entirely.
    pub ignore_cgroups: bool,
    /// Extra arguments given to the agent (after the socket flag).
    pub agent_args: Vec<String>,
    /// Sandbox networking (`None`: `--network=none`).
    pub network: Option<kiln_net::NetConfig>,
    /// Timer slack of the sandboxes' host tasks (see [`crate::slack`]).
    pub timer_slack: Option<std::time::Duration>,
    /// Timer slack of an idle sandbox's host tasks (see [`crate::slack::IdleSlack`]).
    pub idle_timer_slack: Option<std::time::Duration>,
    /// The timer slack of a sandbox hinted idle for long (see [`crate::slack::DeepIdle`]).
    pub deep_idle: Option<crate::slack::DeepIdle>,
}

impl GvisorConfig {
    /// Defaults for a driver whose state lives under `state_dir/gvisor`.
    pub fn new(state_dir: &Path) -> Self {
        Self::from_settings(&GvisorSettings::default(), state_dir)
    }

    pub fn from_settings(s: &GvisorSettings, state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join("gvisor"),
            runsc: s.runsc.clone().unwrap_or_else(|| {
                kiln_host::prereq::which("runsc").unwrap_or_else(|| PathBuf::from("runsc"))
            }),
            platform: s.platform.clone().unwrap_or_else(|| "ptrace".into()),
            ignore_cgroups: s.ignore_cgroups,
            agent_args: Vec::new(),
            network: s.network.clone(),
            timer_slack: s.timer_slack,
            idle_timer_slack: s.idle_timer_slack,
            deep_idle: s.deep_idle,
        }
    }
}
