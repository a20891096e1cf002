//! Admission control: a create that would exceed the configured cap (`--max-sandboxes`) or the
//! host's capacity is refused before anything starts — 429 or 503 with `Retry-After` and the
//! limit named — instead of failing half-way in the runtime and harming running sandboxes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_host::capacity::{self, SandboxCost};

use super::Manager;
use crate::error::{Error, Result};

/// Admission settings.
#[derive(Debug, Clone, Default)]
pub struct AdmissionConfig {
    /// At most this many sandboxes at once (running or being created); None: host capacity only.
    pub max_sandboxes: Option<usize>,
    /// What one sandbox costs on this host (estimate; see [`SandboxCost::default`]).
    pub cost: SandboxCost,
    /// Where sandbox layers are written (for the disk check); None skips it.
    pub state_dir: Option<PathBuf>,
    /// Skip the host-capacity check (tests that must not depend on the host's load).
    pub skip_host_check: bool,
}

/// Seconds a refused client is told to wait.
const RETRY_AFTER_SECS: u64 = 5;

/// Counts creates in flight, so concurrent creates cannot all pass one check.
#[derive(Default)]
pub(super) struct InFlight(AtomicUsize);

/// Held while a create runs; releases its slot when dropped.
pub(super) struct Ticket<'a>(&'a InFlight);

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Manager {
    /// Admits one more create, or says which limit refuses it.
    pub(super) fn admit(&self) -> Result<Ticket<'_>> {
        let pending = self.in_flight.0.fetch_add(1, Ordering::SeqCst);
        let ticket = Ticket(&self.in_flight);
        let adm = &self.cfg.admission;
        if let Some(max) = adm.max_sandboxes {
            let live = self.registry.len() + self.registry.pending_len();
            if live + pending >= max {
                return Err(Error::Capacity {
                    limit: format!(
                        "the server's sandbox limit (--max-sandboxes {max}; {live} running, \
                         {pending} being created)"
                    ),
                    retry_after_secs: RETRY_AFTER_SECS,
                    quota: true,
                });
            }
        }
        if !adm.skip_host_check {
            let dir = adm.state_dir.clone().unwrap_or_else(|| PathBuf::from("/"));
            let limits = capacity::read_limits(&dir);
            let room = capacity::headroom(&limits, &adm.cost);
            if let Some(tight) = room.first() {
                // Creates already in flight will take their share too.
                if tight.sandboxes <= pending as u64 {
                    return Err(Error::Capacity {
                        limit: format!("host capacity: {} is nearly used up", tight.limit),
                        retry_after_secs: RETRY_AFTER_SECS,
                        quota: false,
                    });
                }
            }
        }
        Ok(ticket)
    }
}
