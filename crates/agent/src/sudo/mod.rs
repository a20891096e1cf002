//! `sudo` without setuid: gVisor always sets "no new privileges" on a container's processes, so
//! the real (setuid) sudo cannot gain root. Templates replace `/usr/bin/sudo` with a link to
//! kiln-agent; invoked as `sudo`, it runs [`shim::main`], which hands its request (argv, env, cwd
//! and its stdin/stdout/stderr as file descriptors) to the agent's [`broker`] over an abstract
//! Unix socket. The broker (root, PID 1) identifies the caller by the socket's peer
//! credentials, applies the [`policy`] of `/etc/sudoers` (`NOPASSWD` rules; a rule needing a
//! password is refused, as `sudo -n` would), starts the command as the target user with the
//! caller's descriptors, relays signals and reports how it ended; the shim then exits the same
//! way (same code, or killed by the same signal).
//!
//! Messages are JSON, one per `SOCK_SEQPACKET` packet: the [`Request`] (with `SCM_RIGHTS`
//! carrying fds 0, 1, 2), then [`Msg`]s both ways.

pub mod broker;
pub mod policy;
pub mod shim;

use serde::{Deserialize, Serialize};

/// Abstract socket name of the broker (per sandbox network namespace; bound by PID 1 before any
/// user process runs). The shim also checks that the listener runs as root.
pub const SOCKET_NAME: &[u8] = b"kiln-sudo";
/// Largest request packet (argv + environment).
pub const MAX_REQUEST: usize = 256 * 1024;
/// PATH for commands run through sudo (Debian's `secure_path`).
pub const SECURE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What the shim asks for.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Request {
    /// Target user (`-u`), default root.
    pub user: Option<String>,
    /// Command and arguments (empty with `-s`/`-i` alone: an interactive shell).
    pub argv: Vec<String>,
    /// The caller's environment.
    pub env: Vec<(String, String)>,
    /// `VAR=value` assignments given on the command line.
    pub set_env: Vec<(String, String)>,
    /// The caller's working directory (`-D` overrides it).
    pub cwd: String,
    /// `-E`: keep the caller's environment.
    pub preserve_env: bool,
    /// `-i`: the target's login shell, in its home.
    pub login: bool,
    /// `-s`: a shell (`$SHELL`, else the target's).
    pub shell: bool,
    /// `-v`, `-l`: only check that the caller may use sudo.
    pub check_only: bool,
}

/// Later messages, both ways.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Msg {
    /// shim → broker: a signal the shim received, for the command's process group.
    Signal(i32),
    /// broker → shim: the command exited with this code.
    Exit(i32),
    /// broker → shim: the command was killed by this signal.
    Killed(i32),
    /// broker → shim: refused or failed before starting; printed as `sudo: <text>`, exit 1.
    Error(String),
}
