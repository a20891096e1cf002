//! Tests' second connection writing events in a loop: what a store's read-then-write
//! transaction must wait beside (for the write lock), never fail on ("database is locked").

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::{EventStore, SqliteStore};

pub(crate) struct BusyWriter {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl BusyWriter {
    /// Starts writing events through `other` (a connection of its own) until stopped.
    pub(crate) fn start(other: SqliteStore) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    other
                        .add_event("sbx", "created", &format!("e{n}"))
                        .await
                        .expect("the busy writer's event");
                    n += 1;
                }
                n
            }
        });
        Self { stop, task }
    }

    /// Stops it; how many events it wrote.
    pub(crate) async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the busy writer's task")
    }
}
