//! Async work waited on from a plain thread (the audit writer's): [`on_runtime`] runs it as
//! a task on the process's runtime and waits for its answer, so a runtime shutting down drops
//! the task and the wait ends with None, where `Handle::block_on` would panic in a timer or
//! I/O call made during the shutdown.

use std::future::Future;

/// `fut`'s output, run on `rt`; None when the runtime dropped it (shutting down). Called from
/// a thread outside the runtime only.
pub fn on_runtime<T: Send + 'static>(
    rt: &tokio::runtime::Handle,
    fut: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    rt.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.blocking_recv().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_while_the_runtime_runs_and_none_once_it_is_gone() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let h = rt.handle().clone();
        let got = on_runtime(&h, async {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            7
        });
        assert_eq!(got, Some(7));
        drop(rt);
        let gone = on_runtime(&h, async {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            7
        });
        assert_eq!(gone, None, "no panic, no answer");
    }
}
