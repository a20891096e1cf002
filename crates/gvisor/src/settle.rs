//! Work on a sandbox's host side that finishes after the call that started it returned (keyed
//! by sandbox id, or by container id for retiring containers).
//!
//! After a pause's checkpoint the sandbox's state is on disk and its processes are exiting on
//! their own; deleting the container (`runsc delete`, reaping, cgroups) only cleans up. The
//! pause returns once the checkpoint is complete and leaves that cleanup to a background
//! task. Every operation that needs the container gone (resume, stop) first waits for it
//! with [`Settling::settle`].

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

/// The background tasks still running, by sandbox id.
#[derive(Default, Clone)]
pub struct Settling {
    pending: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

impl Settling {
    /// Runs `work` for sandbox `id` in the background; [`Settling::settle`] waits for it.
    pub fn spawn<F>(&self, id: &str, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let lock = Arc::new(tokio::sync::Mutex::new(()));
        let Ok(guard) = lock.clone().try_lock_owned() else {
            // A fresh mutex is always free.
            unreachable!("a new mutex is locked");
        };
        let previous = self.lock().insert(id.to_string(), lock.clone());
        let pending = self.pending.clone();
        let id = id.to_string();
        tokio::spawn(async move {
            // Work started earlier for the same sandbox finishes first.
            if let Some(p) = previous {
                let _ = p.lock().await;
            }
            work.await;
            drop(guard);
            let mut map = pending.lock().unwrap_or_else(|e| e.into_inner());
            if map.get(&id).is_some_and(|l| Arc::ptr_eq(l, &lock)) {
                map.remove(&id);
            }
        });
    }

    /// Marks work on sandbox `id` that the caller does itself until the returned guard is
    /// dropped: [`Settling::settle`] waits for it as for background work.
    pub fn hold(&self, id: &str) -> Held {
        let lock = Arc::new(tokio::sync::Mutex::new(()));
        let Ok(guard) = lock.clone().try_lock_owned() else {
            // A fresh mutex is always free.
            unreachable!("a new mutex is locked");
        };
        self.lock().insert(id.to_string(), lock.clone());
        Held {
            pending: self.pending.clone(),
            id: id.to_string(),
            lock,
            _guard: guard,
        }
    }

    /// Whether background work for `id` is running.
    pub fn pending(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }

    /// Waits until no background work for sandbox `id` is running.
    pub async fn settle(&self, id: &str) {
        let lock = self.lock().get(id).cloned();
        if let Some(l) = lock {
            let _ = l.lock().await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<()>>>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Work on a sandbox done in the foreground (see [`Settling::hold`]); done when dropped.
pub struct Held {
    pending: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    id: String,
    lock: Arc<tokio::sync::Mutex<()>>,
    _guard: tokio::sync::OwnedMutexGuard<()>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut map = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if map
            .get(&self.id)
            .is_some_and(|l| Arc::ptr_eq(l, &self.lock))
        {
            map.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Settling;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn settle_waits_for_the_work_of_its_sandbox_only() {
        let s = Settling::default();
        let done = Arc::new(AtomicUsize::new(0));
        let (d1, d2) = (done.clone(), done.clone());
        s.spawn("a", async move {
            tokio::time::sleep(Duration::from_millis(80)).await;
            d1.fetch_add(1, Ordering::SeqCst);
        });
        // Queued behind the first one for the same sandbox.
        s.spawn("a", async move {
            d2.fetch_add(10, Ordering::SeqCst);
        });
        assert!(s.lock().contains_key("a"));
        // Nothing pending for another sandbox: returns at once.
        tokio::time::timeout(Duration::from_millis(20), s.settle("b"))
            .await
            .expect("settle of an idle sandbox returns at once");
        s.settle("a").await;
        assert_eq!(done.load(Ordering::SeqCst), 11);
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(!s.lock().contains_key("a"), "finished work is forgotten");
    }

    #[tokio::test]
    async fn settle_waits_for_work_held_in_the_foreground() {
        let s = Settling::default();
        let held = s.hold("a");
        assert!(s.pending("a"));
        let waiter = tokio::spawn({
            let s = s.clone();
            async move { s.settle("a").await }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(
            !waiter.is_finished(),
            "settle returned while the work was held"
        );
        drop(held);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("settle returns once the guard is dropped")
            .unwrap();
        assert!(!s.pending("a"), "released work is forgotten");
    }
}
