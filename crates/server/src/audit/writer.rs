//! The one writer of the audit log: a thread that takes records from a bounded channel (a full
//! channel makes senders wait: records are never dropped), appends them to their chains in
//! the [`AuditStore`] in batches of one atomic write, then publishes them to followers, hands
//! them to the rule engine's tap (without waiting: see [`RulesTap`]) and answers flushes. A
//! writer over a remote store (each write a call to another host) lingers after a batch's
//! first record, so the records of one request (an exec's start and end) travel together.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, mpsc, oneshot};

use super::record::{Append, AuditRecord, NewRecord};
use crate::store::AuditStore;

/// Most messages written in one transaction.
const BATCH: usize = 1024;
/// Attempts at writing one batch before its records are given up.
const RETRIES: u32 = 50;
/// How often retention runs.
const PRUNE_EVERY: Duration = Duration::from_secs(60);
/// How long a writer over a remote store waits after a batch's first message for more.
pub(super) const REMOTE_LINGER: Duration = Duration::from_millis(25);

pub(super) enum Msg {
    /// A record, or a chain's start linking to another chain's head.
    Append(Append),
    /// Records made elsewhere; answered once written with those not kept (their chains are
    /// another host's now).
    Handed(Vec<NewRecord>, oneshot::Sender<Vec<NewRecord>>),
    /// Answered once everything sent before it is stored.
    Flush(oneshot::Sender<()>),
    /// Runs retention now; answers how many records went.
    Prune(oneshot::Sender<usize>),
}

/// Retention settings.
#[derive(Debug, Clone, Copy, Default)]
pub struct Retention {
    pub max_age: Option<Duration>,
    pub max_records: Option<u64>,
}

/// Where stored records go for evaluation (the rule engine): a bounded channel the writer
/// never waits on. A record that finds it full is counted in `dropped` and not evaluated (the
/// write path is never slowed by the rules).
#[derive(Default)]
pub struct RulesTap {
    tx: std::sync::OnceLock<mpsc::Sender<Arc<AuditRecord>>>,
    dropped: std::sync::atomic::AtomicU64,
}

impl RulesTap {
    /// Sets the channel (once; later calls are ignored).
    pub fn set(&self, tx: mpsc::Sender<Arc<AuditRecord>>) {
        let _ = self.tx.set(tx);
    }

    /// Records the tap could not take.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn offer(&self, r: &Arc<AuditRecord>) {
        if let Some(tx) = self.tx.get() {
            if tx.try_send(r.clone()).is_err() && !tx.is_closed() {
                let n = self
                    .dropped
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if (n + 1).is_power_of_two() {
                    tracing::warn!(
                        dropped = n + 1,
                        "the rule engine is behind; audit records were not evaluated"
                    );
                }
            }
        }
    }
}

pub(super) struct Writer {
    pub store: Arc<dyn AuditStore>,
    pub rx: mpsc::Receiver<Msg>,
    pub live: broadcast::Sender<Arc<AuditRecord>>,
    pub retention: Retention,
    pub rules_tap: Arc<RulesTap>,
    /// Waited after a batch's first message (zero: none).
    pub linger: Duration,
}

impl Writer {
    pub fn run(mut self) {
        let mut last_prune = Instant::now();
        let mut batch = Vec::with_capacity(BATCH);
        while let Some(first) = self.rx.blocking_recv() {
            batch.push(first);
            if !self.linger.is_zero() {
                std::thread::sleep(self.linger);
            }
            while batch.len() < BATCH {
                match self.rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            let mut appends = Vec::with_capacity(batch.len());
            let mut flushes = Vec::new();
            let mut prunes = Vec::new();
            let mut handed = Vec::new();
            for m in batch.drain(..) {
                match m {
                    Msg::Append(a) => appends.push(a),
                    Msg::Handed(records, answer) => {
                        appends.extend(records.iter().cloned().map(Append::Record));
                        handed.push((records, answer));
                    }
                    Msg::Flush(f) => flushes.push(f),
                    Msg::Prune(p) => prunes.push(p),
                }
            }
            let written = self.write(&appends);
            // A chain is kept or refused whole within one write (a write given up on refuses
            // nothing: its records are lost, and logged).
            let kept: Option<std::collections::HashSet<&str>> = written
                .as_ref()
                .map(|w| w.iter().map(|r| r.sandbox_id.as_str()).collect());
            for (records, answer) in handed {
                let refused = match &kept {
                    Some(kept) => records
                        .into_iter()
                        .filter(|r| !kept.contains(r.sandbox_id.as_str()))
                        .collect(),
                    None => Vec::new(),
                };
                let _ = answer.send(refused);
            }
            for r in written.unwrap_or_default() {
                let r = Arc::new(r);
                self.rules_tap.offer(&r);
                let _ = self.live.send(r);
            }
            for f in flushes {
                let _ = f.send(());
            }
            let due = last_prune.elapsed() >= PRUNE_EVERY;
            if due || !prunes.is_empty() {
                last_prune = Instant::now();
                let n = self.prune();
                for p in prunes {
                    let _ = p.send(n);
                }
            }
        }
    }

    /// Appends `appends` in one write. A failed write is retried (a record is never dropped
    /// while the database can still be written); each attempt waits for the store's lock up
    /// to its busy timeout. None: given up on.
    fn write(&self, appends: &[Append]) -> Option<Vec<AuditRecord>> {
        if appends.is_empty() {
            return Some(Vec::new());
        }
        let mut attempt = 0;
        loop {
            match self.store.append(appends) {
                Ok(w) => return Some(w),
                Err(e) => {
                    attempt += 1;
                    if attempt >= RETRIES {
                        tracing::error!(error = %e, records = appends.len(), "writing audit records failed for good; they are lost");
                        return None;
                    }
                    tracing::warn!(error = %e, attempt, "writing audit records; retrying");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn prune(&self) -> usize {
        let r = self.retention;
        if r.max_age.is_none() && r.max_records.is_none() {
            return 0;
        }
        let now = crate::store::now_ms();
        let before = r.max_age.map(|a| now - a.as_millis() as i64);
        match self.store.prune(before, r.max_records, now) {
            Ok(n) => {
                if n > 0 {
                    tracing::info!(records = n, "audit retention pruned old records");
                }
                n
            }
            Err(e) => {
                tracing::error!(error = %e, "audit retention");
                0
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(cursor: i64) -> Arc<AuditRecord> {
        Arc::new(AuditRecord {
            cursor,
            sandbox_id: "sbx".into(),
            seq: cursor,
            ts_ms: cursor,
            kind: "api".into(),
            body: "{}".into(),
            prev_hash: String::new(),
            hash: String::new(),
        })
    }

    #[test]
    fn a_full_tap_counts_what_it_could_not_take() {
        let tap = RulesTap::default();
        // No engine: nothing is offered, nothing is counted.
        tap.offer(&record(1));
        assert_eq!(tap.dropped(), 0);
        let (tx, mut rx) = mpsc::channel(2);
        tap.set(tx);
        for c in 2..=5 {
            tap.offer(&record(c));
        }
        assert_eq!(tap.dropped(), 2, "a queue of 2 takes two of four");
        assert_eq!(rx.try_recv().unwrap().cursor, 2);
        tap.offer(&record(6));
        assert_eq!(tap.dropped(), 2, "room again");
        // An engine that stopped is not a backlog.
        drop(rx);
        tap.offer(&record(7));
        assert_eq!(tap.dropped(), 2);
    }
}
