//! The metrics history on disk: the samples each sandbox's [`super::ring::MetricRing`] keeps,
//! in a [`MetricsStore`] (SQLite: the state database's `metric_samples` table, migration 7),
//! so a restarted server still has the history of its live and paused sandboxes. Written as
//! the ring keeps a sample (and rewritten when the ring thins itself out, so the store holds at
//! most a ring's bound per sandbox); read when a sandbox's ring is first needed in this
//! process; deleted with the sandbox.

use std::sync::Arc;

use super::ring::MetricSample;
use crate::store::{MetricsStore, StoreError};

/// The metrics history as the sampler uses it: errors are logged, not returned (the history in
/// memory stays authoritative while the server runs).
#[derive(Clone)]
pub struct MetricsDb(Arc<dyn MetricsStore>);

fn logged<T>(what: &'static str, r: Result<T, StoreError>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!(error = %e, "metrics history: {what}");
            None
        }
    }
}

impl MetricsDb {
    pub fn new(store: Arc<dyn MetricsStore>) -> Self {
        Self(store)
    }

    /// Adds a sample of `id`.
    pub async fn add(&self, id: &str, s: MetricSample) {
        logged("adding a sample", self.0.add_sample(id, s).await);
    }

    /// Replaces the samples of `id` with `samples` (after its ring thinned itself out).
    pub async fn replace(&self, id: &str, samples: Vec<MetricSample>) {
        logged(
            "rewriting a history",
            self.0.replace_samples(id, samples).await,
        );
    }

    /// The samples of `id`, oldest first.
    pub async fn load(&self, id: &str) -> Vec<MetricSample> {
        logged("reading a history", self.0.samples(id).await).unwrap_or_default()
    }

    /// Deletes the histories of `ids`.
    pub async fn delete(&self, ids: Vec<String>) {
        if ids.is_empty() {
            return;
        }
        logged("deleting histories", self.0.delete_samples(ids).await);
    }

    /// Deletes every history but those of `live` (sandboxes that ended while no server ran).
    pub async fn keep_only(&self, live: Vec<String>) {
        logged(
            "deleting ended sandboxes' histories",
            self.0.keep_only(live).await,
        );
    }
}
