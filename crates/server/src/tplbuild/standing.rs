//! Standing build sandboxes: a template's next build most often changes only its last step
//! (the loop of editing a template), and that step's build sandbox boots from the layer below
//! it. So once a build has walked to its last layer-making step, a sandbox of that step's
//! parent layer is kept standing for the template's next build (`kiln serve
//! --template-standing`, default [`DEFAULT_STANDING`]): a build that needs a sandbox of that
//! layer takes it (waiting for its boot if it is still booting) instead of booting one, and a
//! replacement boots beside the step for the build after it.
//!
//! One per template, at most [`MAX_STANDING`] on the host (the most recently built
//! templates'), and only while the server has room beside it (`--max-sandboxes` and the host's
//! headroom, as for a warm pool's sandbox, with one place more). It is a build sandbox like
//! the others (hidden from the team's lists, outside its quota, never in standby), marked
//! [`STANDING`] until a build takes it; it is stopped when its time is up, when another
//! layer's replaces it, when its template is deleted, and after a restart (as a leftover).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::Builds;
use crate::store::SandboxState;

/// How long a standing sandbox waits for its template's next build unless set otherwise.
pub const DEFAULT_STANDING: Duration = Duration::from_secs(600);

/// Standing sandboxes at most, all templates together.
pub const MAX_STANDING: usize = 2;

/// The server's spare room a standing sandbox needs to boot: itself and one more, so it never
/// takes the last place a create could have.
const ROOM_NEEDED: usize = 2;

/// The build marker ([`super::BUILD_META`]) of a standing sandbox no build has taken yet.
pub(super) const STANDING: &str = "standing";

/// The standing sandbox of one template: booting (`None`), then booted (its id, or `None`
/// when the boot failed).
struct Slot {
    team: String,
    layer: String,
    /// Unique per slot: the end of a slot's time finds the slot gone, or another one.
    serial: u64,
    booted: watch::Receiver<Option<Option<String>>>,
}

/// Standing sandboxes by template id.
#[derive(Default)]
pub(super) struct Standing {
    slots: Mutex<HashMap<String, Slot>>,
    serial: AtomicU64,
}

impl Standing {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Puts `slot` as template `tpl`'s; returns the slots it replaces (the template's, and
    /// the oldest beyond [`MAX_STANDING`]), `None` when `tpl` has one of the same layer.
    fn put(&self, tpl: &str, slot: Slot) -> Option<Vec<Slot>> {
        let mut slots = self.lock();
        if slots
            .get(tpl)
            .is_some_and(|s| s.team == slot.team && s.layer == slot.layer)
        {
            return None;
        }
        let mut replaced: Vec<Slot> = slots.remove(tpl).into_iter().collect();
        while slots.len() >= MAX_STANDING {
            let oldest = slots
                .iter()
                .min_by_key(|(_, s)| s.serial)
                .map(|(t, _)| t.clone());
            replaced.extend(oldest.and_then(|t| slots.remove(&t)));
        }
        slots.insert(tpl.to_string(), slot);
        Some(replaced)
    }

    /// Removes template `tpl`'s slot if it is still slot `serial`.
    fn remove_if(&self, tpl: &str, serial: u64) -> bool {
        let mut slots = self.lock();
        if slots.get(tpl).is_some_and(|s| s.serial == serial) {
            slots.remove(tpl);
            return true;
        }
        false
    }
}

/// The booted sandbox of `slot` (waiting for its boot), `None` when its boot failed.
async fn booted(slot: Slot) -> Option<String> {
    let mut rx = slot.booted;
    let id = rx.wait_for(Option::is_some).await.ok()?.clone();
    id.flatten()
}

impl Builds {
    /// Keeps a sandbox of `layer` standing for the next build of template `tpl` of `team`
    /// (nothing when standing sandboxes are off, when one of `layer` already stands, or when
    /// the server has less than [`ROOM_NEEDED`] spare room).
    pub(super) fn stand_by(self: &Arc<Self>, tpl: &str, team: &str, layer: &str) {
        let Some(hold) = self.config.standing else {
            return;
        };
        if self.manager.spare_room() < ROOM_NEEDED {
            return;
        }
        let serial = self.standing.serial.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = watch::channel(None);
        let slot = Slot {
            team: team.to_string(),
            layer: layer.to_string(),
            serial,
            booted: rx,
        };
        let Some(replaced) = self.standing.put(tpl, slot) else {
            return;
        };
        let (me, tpl, team, layer) = (
            Arc::clone(self),
            tpl.to_string(),
            team.to_string(),
            layer.to_string(),
        );
        tokio::spawn(async move {
            for old in replaced {
                me.discard(old, "a newer standing build sandbox replaces it")
                    .await;
            }
            // The store's timeout stops it too if this task does not live to.
            let lifetime = hold.as_secs() + 60;
            let id = match me
                .boot_build_sandbox(&team, &layer, STANDING, lifetime)
                .await
            {
                Ok(id) => Some(id),
                Err(e) => {
                    tracing::debug!(template = tpl, error = e, "a standing build sandbox");
                    None
                }
            };
            let _ = tx.send(Some(id.clone()));
            let Some(id) = id else {
                me.standing.remove_if(&tpl, serial);
                return;
            };
            tokio::time::sleep(hold).await;
            if me.standing.remove_if(&tpl, serial) {
                let _ = me
                    .manager
                    .kill(&id, "its template's next build did not come in time")
                    .await;
            }
        });
    }

    /// The standing sandbox of `layer` of `team`, taken for a build that runs a step on
    /// `layer` (waiting for its boot if it still boots); it then lives as long as a build
    /// sandbox. A replacement starts booting for the build after this one.
    pub(super) async fn take_standing(self: &Arc<Self>, team: &str, layer: &str) -> Option<String> {
        let (tpl, slot) = {
            let mut slots = self.standing.lock();
            let tpl = slots
                .iter()
                .find(|(_, s)| s.team == team && s.layer == layer)
                .map(|(t, _)| t.clone())?;
            let slot = slots.remove(&tpl)?;
            (tpl, slot)
        };
        let id = booted(slot).await?;
        let running = self
            .manager
            .get(&id)
            .is_ok_and(|r| r.state == SandboxState::Running);
        if !running
            || self
                .manager
                .set_timeout(&id, super::runner::BUILD_SANDBOX_SECS as i64)
                .await
                .is_err()
        {
            let _ = self
                .manager
                .kill(&id, "a standing build sandbox lost")
                .await;
            return None;
        }
        self.stand_by(&tpl, team, layer);
        Some(id)
    }

    /// Stops template `tpl`'s standing sandbox (it is deleted).
    pub(super) async fn drop_standing(&self, tpl: &str) {
        let slot = self.standing.lock().remove(tpl);
        if let Some(slot) = slot {
            self.discard(slot, "its template was deleted").await;
        }
    }

    async fn discard(&self, slot: Slot, why: &str) {
        if let Some(id) = booted(slot).await {
            let _ = self.manager.kill(&id, why).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(team: &str, layer: &str, serial: u64) -> Slot {
        Slot {
            team: team.into(),
            layer: layer.into(),
            serial,
            booted: watch::channel(None).1,
        }
    }

    fn layers(v: &[Slot]) -> Vec<&str> {
        v.iter().map(|s| s.layer.as_str()).collect()
    }

    #[test]
    fn one_per_template_and_the_newest_templates() {
        let st = Standing::default();
        assert_eq!(layers(&st.put("a", slot("t", "a1", 1)).unwrap()), [""; 0]);
        // The same layer again: the standing one stays.
        assert!(st.put("a", slot("t", "a1", 2)).is_none());
        // Another layer of the same template replaces it.
        assert_eq!(layers(&st.put("a", slot("t", "a2", 3)).unwrap()), ["a1"]);
        // The same layer of another team is another slot.
        assert_eq!(layers(&st.put("a", slot("u", "a2", 4)).unwrap()), ["a2"]);
        assert!(st.put("b", slot("t", "b1", 5)).unwrap().is_empty());
        // A third template: the oldest slot (a's) goes.
        assert_eq!(layers(&st.put("c", slot("t", "c1", 6)).unwrap()), ["a2"]);
        assert_eq!(st.lock().len(), MAX_STANDING);
        // Its time ends only the slot it was.
        assert!(!st.remove_if("b", 6));
        assert!(st.remove_if("b", 5));
        assert!(!st.remove_if("b", 5));
    }
}
