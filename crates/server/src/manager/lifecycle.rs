//! Pause, resume, snapshot and fork: the driver does the work; the manager checks the sandbox's
//! state, keeps the store and the registry in step, and talks to the agent. Drivers that cannot
//! do them answer "not implemented" (501).
//!
//! A paused sandbox stays in the registry (state `paused`) so it can be listed, shown and
//! killed, but the proxy does not route to it. Its end time does not run out: only running
//! sandboxes expire.

use std::time::Instant;

use super::create::init_request;
use super::Manager;
use crate::error::{Error, Result};
use crate::store::{now_ms, PauseMode, SandboxRecord, SandboxState};

impl Manager {
    /// `POST /sandboxes/{id}/pause`: with `memory`, processes and memory are kept (resuming
    /// continues them); without, only the filesystem (resuming boots again on it).
    pub async fn pause(&self, id: &str, memory: bool) -> Result<()> {
        self.pause_checked(id, memory, false).await
    }

    /// [`Manager::pause`]; with `require_healthy_guest` (E2B's `requireHealthyGuest`) the
    /// sandbox's agent must answer its health check first, else 409 and nothing is saved.
    pub async fn pause_checked(
        &self,
        id: &str,
        memory: bool,
        require_healthy_guest: bool,
    ) -> Result<()> {
        let _guard = self.lifecycle_lock.write().await;
        let rec = self.get(id)?;
        if rec.state == SandboxState::Paused {
            return Err(Error::Conflict(format!(
                "sandbox \"{id}\" is already paused"
            )));
        }
        if self.idle.standby_since(id).is_some() {
            if memory {
                return self.pause_from_standby(id).await;
            }
            // A pause of the disk only must not keep the processes: woken, then paused so.
            self.wake_locked(id, "a filesystem pause").await?;
        }
        // A pause is a use: a runtime hinted idle is told otherwise first (a resumed one
        // starts afresh).
        self.used(id);
        if require_healthy_guest {
            let health = self.agent(id, rec.envd_token.clone()).health().await;
            if let Err(e) = health {
                tracing::info!(sandbox = id, error = %e, "pause refused: guest not healthy");
                return Err(Error::Conflict(format!(
                    "sandbox \"{id}\" was not paused: its guest did not answer its health \
                     check (requireHealthyGuest); retry, or pause without requireHealthyGuest"
                )));
            }
        }
        let mode = if memory {
            PauseMode::Full
        } else {
            PauseMode::Filesystem
        };
        let t = Instant::now();
        if let Err(e) = self.driver.pause(id, memory).await {
            // A runtime may stop the sandbox when its checkpoint fails: then it is gone.
            let running = self.driver.is_running(id).await.unwrap_or(false);
            if !running && !self.driver.is_paused(id).await.unwrap_or(false) {
                drop(_guard);
                let _ = self.kill(id, &format!("lost while pausing: {e}")).await;
            }
            return Err(e.into());
        }
        self.store.set_paused(id, mode).await?;
        self.registry.update(id, |r| {
            r.state = SandboxState::Paused;
            r.pause_mode = Some(mode);
        });
        self.event(
            id,
            "paused",
            format!("{} pause in {} ms", mode.as_str(), t.elapsed().as_millis()),
        )
        .await;
        Ok(())
    }

    /// Resumes the paused sandbox `id` for `secs` seconds (restoring its memory when it was
    /// saved and `memory` is true, else booting it on its saved disk). Returns false, doing
    /// nothing, when the sandbox is running.
    pub async fn resume(&self, id: &str, memory: bool, secs: i64) -> Result<bool> {
        let secs = self.check_timeout(secs)?;
        let _guard = self.lifecycle_lock.write().await;
        let rec = self.get(id)?;
        if rec.state != SandboxState::Paused {
            return Ok(false);
        }
        let t = Instant::now();
        let restored = self.driver.resume(id, memory).await?;
        // The clock starts again now; set before the state, so the reaper never sees a running
        // sandbox with its old end time.
        let end = now_ms() + secs as i64 * 1000;
        self.store.set_end_at(id, end).await?;
        self.store
            .set_state(id, SandboxState::Running, None)
            .await?;
        self.registry.update(id, |r| {
            r.state = SandboxState::Running;
            r.end_at_ms = end;
        });
        let how = if restored {
            "memory restored"
        } else {
            "booted on its saved disk"
        };
        if let Err(e) = self.reinit_agent(&rec, restored).await {
            self.event(
                id,
                "resumed",
                format!("{how}; the agent did not come back: {e}"),
            )
            .await;
            return Err(e);
        }
        self.event(
            id,
            "resumed",
            format!("{how} in {} ms, timeout {secs}s", t.elapsed().as_millis()),
        )
        .await;
        Ok(true)
    }

    /// After a resume: waits for the agent; a restored agent gets its clock set, a rebooted one
    /// its whole identity and the template's start command, as at create.
    pub(super) async fn reinit_agent(&self, rec: &SandboxRecord, restored: bool) -> Result<()> {
        let agent = self.agent(&rec.id, rec.envd_token.clone());
        if let Err(e) = agent.wait_ready(self.cfg.agent_ready_timeout).await {
            let log = self
                .driver
                .console_log(&rec.id, 2000)
                .await
                .unwrap_or_default();
            return Err(Error::internal(format!(
                "the agent did not answer within {:?} after resuming ({e}). Sandbox output:\n{log}",
                self.cfg.agent_ready_timeout
            )));
        }
        if restored {
            let init = kiln_proto::envd::InitRequest {
                timestamp: Some(
                    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                ),
                ..Default::default()
            };
            agent.init(&init).await?;
            return Ok(());
        }
        let tpl = self.lookup_template(&rec.template_id).await?;
        // A rebooted agent has no token yet: its first /init goes without one.
        self.agent(&rec.id, None)
            .init(&init_request(rec, &tpl, self.extra_cas()))
            .await?;
        if let Some(cmd) = &tpl.start_cmd {
            self.start_cmd(rec, &tpl, cmd).await?;
            if let Some(ready) = &tpl.ready_cmd {
                self.wait_start_ready(rec, &tpl, ready).await?;
            }
        }
        Ok(())
    }

    /// `POST /v2/sandboxes/{id}/connect`: resumes a paused sandbox (see [`Self::resume`]),
    /// or makes a running one live at least `secs` more. Returns the sandbox and whether it
    /// was resumed.
    pub async fn connect(
        &self,
        id: &str,
        secs: i64,
        memory: bool,
    ) -> Result<(SandboxRecord, bool)> {
        if self.resume(id, memory, secs).await? {
            return Ok((self.get(id)?, true));
        }
        // A client that connects is about to use the sandbox.
        self.wake(id, "connect").await?;
        self.used(id);
        Ok((self.extend(id, secs, "connected").await?, false))
    }
}
