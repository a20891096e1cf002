//! A control replica's view of the cluster, fed by one etcd watch on the store's prefix:
//! the live sandboxes (starting, running, paused), which node runs each, the live nodes, the
//! nodes marked draining ([`crate::drain`]) and those restarting ([`crate::restarts`]);
//! the lifecycle events nodes publish are passed on as they come ([`Cache::subscribe`]).
//! The service's synchronous reads answer from it; after a call it forwarded, a replica waits
//! until the watch has reached the revision the node published at ([`Cache::wait_for`]), so
//! a client's next request sees what its last one did.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use etcd_client::{EventType, KeyValue, WatchOptions, WatchRequestSender};
use kiln_server::manager::LifecycleEvent;
use kiln_server::store::{SandboxRecord, SandboxState};
use tokio::sync::{broadcast, watch};

use crate::docs::{parse, EventDoc, SandboxDoc};
use crate::nodes::{node_of, NodeInfo};
use crate::store::EtcdStore;

#[derive(Default)]
struct View {
    sandboxes: HashMap<String, SandboxRecord>,
    owners: HashMap<String, String>,
    nodes: HashMap<String, NodeInfo>,
    draining: HashSet<String>,
    restarting: HashSet<String>,
    /// Live sandboxes per owning node, kept in step with `sandboxes` and `owners`, so that a
    /// placement reads counts instead of walking every sandbox.
    on_node: HashMap<String, usize>,
    /// Running and paused sandboxes per team, kept in step with `sandboxes`.
    of_team: HashMap<String, usize>,
}

fn add(counts: &mut HashMap<String, usize>, key: &str, by: isize) {
    let n = counts.entry(key.to_string()).or_default();
    *n = n.saturating_add_signed(by);
    if *n == 0 {
        counts.remove(key);
    }
}

/// Whether a sandbox counts against its team's quota.
fn counted(r: &SandboxRecord) -> bool {
    use kiln_server::store::SandboxState::{Paused, Running};
    matches!(r.state, Running | Paused)
}

impl View {
    /// Sandbox `id` is now `rec` (None: not live).
    fn set_sandbox(&mut self, id: String, rec: Option<SandboxRecord>) {
        let is = rec.is_some();
        if let Some(r) = rec.as_ref().filter(|r| counted(r)) {
            add(&mut self.of_team, &r.team, 1);
        }
        let old = match rec {
            Some(r) => self.sandboxes.insert(id.clone(), r),
            None => self.sandboxes.remove(&id),
        };
        if let Some(o) = old.as_ref().filter(|o| counted(o)) {
            add(&mut self.of_team, &o.team, -1);
        }
        if old.is_some() != is {
            if let Some(node) = self.owners.get(&id) {
                add(&mut self.on_node, node, if is { 1 } else { -1 });
            }
        }
    }

    /// Sandbox `id` is now run by `node` (None: no owner recorded).
    fn set_owner(&mut self, id: String, node: Option<String>) {
        let live = self.sandboxes.contains_key(&id);
        if let Some(n) = node.as_ref().filter(|_| live) {
            add(&mut self.on_node, n, 1);
        }
        let old = match node {
            Some(n) => self.owners.insert(id, n),
            None => self.owners.remove(&id),
        };
        if let Some(o) = old.filter(|_| live) {
            add(&mut self.on_node, &o, -1);
        }
    }
}

/// Which directory of the store a key is in, and its last segment.
enum Entry {
    Sandbox(String),
    Owner(String),
    Node,
    Draining(String),
    Restarting(String),
    Event,
    Other,
}

/// The replica's cluster view.
pub struct Cache {
    view: RwLock<View>,
    revision: watch::Sender<i64>,
    /// Lifecycle events as nodes publish them.
    events: broadcast::Sender<LifecycleEvent>,
    dirs: [String; 6],
    /// The watch's request half, to ask etcd for a progress notice ([`Cache::catch_up`]).
    progress: tokio::sync::Mutex<Option<WatchRequestSender>>,
}

impl Cache {
    /// Loads the view and keeps it current in the background.
    pub async fn start(etcd: EtcdStore) -> crate::error::Result<Arc<Self>> {
        let k = etcd.keys();
        let cache = Arc::new(Self {
            view: RwLock::new(View::default()),
            revision: watch::channel(0).0,
            events: broadcast::channel(256).0,
            dirs: [
                k.dir("sandboxes"),
                k.dir("owners"),
                k.dir("nodes"),
                k.dir("draining"),
                k.dir("events"),
                k.dir("restarting"),
            ],
            progress: tokio::sync::Mutex::new(None),
        });
        let rev = cache.load(&etcd).await?;
        let c = cache.clone();
        tokio::spawn(async move { c.follow(etcd, rev).await });
        Ok(cache)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, View> {
        self.view.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, View> {
        self.view.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The live sandbox `id`.
    pub fn sandbox(&self, id: &str) -> Option<SandboxRecord> {
        self.read().sandboxes.get(id).cloned()
    }

    /// Every live sandbox, oldest first.
    pub fn sandboxes(&self) -> Vec<SandboxRecord> {
        let mut v: Vec<_> = self.read().sandboxes.values().cloned().collect();
        v.sort_by(|a, b| (a.started_at_ms, &a.id).cmp(&(b.started_at_ms, &b.id)));
        v
    }

    /// The live node that runs sandbox `id`.
    pub fn owner(&self, id: &str) -> Option<NodeInfo> {
        let v = self.read();
        v.owners.get(id).and_then(|n| v.nodes.get(n)).cloned()
    }

    /// The name of the node recorded as owning sandbox `id` (live or not).
    pub fn owner_name(&self, id: &str) -> Option<String> {
        self.read().owners.get(id).cloned()
    }

    /// The cluster's lifecycle events from now on, as nodes publish them.
    pub fn subscribe(&self) -> broadcast::Receiver<LifecycleEvent> {
        self.events.subscribe()
    }

    /// How many live sandboxes each node runs, by node name.
    pub fn counts_by_node(&self) -> HashMap<String, usize> {
        self.read().on_node.clone()
    }

    /// How many running or paused sandboxes team `team` has.
    pub fn count_for_team(&self, team: &str) -> usize {
        self.read().of_team.get(team).copied().unwrap_or(0)
    }

    /// Whether node `name` is restarting (its sandboxes are held until it is back).
    pub fn restarting(&self, name: &str) -> bool {
        self.read().restarting.contains(name)
    }

    /// The nodes that own live sandboxes but are neither live nor restarting.
    pub fn lost_owners(&self) -> Vec<String> {
        let v = self.read();
        let mut lost: Vec<String> = v
            .sandboxes
            .values()
            .filter(|r| r.state != kiln_server::store::SandboxState::Paused)
            .filter_map(|r| v.owners.get(&r.id))
            .filter(|n| !v.nodes.contains_key(*n) && !v.restarting.contains(*n))
            .cloned()
            .collect();
        lost.sort();
        lost.dedup();
        lost
    }

    /// The live nodes.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        let mut v: Vec<_> = self.read().nodes.values().cloned().collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// The paused sandboxes recorded as owned by node `name`, oldest first by id.
    pub fn paused_on(&self, name: &str) -> Vec<String> {
        let v = self.read();
        let mut ids: Vec<String> = v
            .owners
            .iter()
            .filter(|(id, owner)| {
                owner.as_str() == name
                    && v.sandboxes
                        .get(*id)
                        .is_some_and(|r| r.state == SandboxState::Paused)
            })
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// Whether node `name` is marked draining.
    pub fn is_draining(&self, name: &str) -> bool {
        self.read().draining.contains(name)
    }

    /// Waits (at most `limit`) until the view includes revision `rev`.
    pub async fn wait_for(&self, rev: i64, limit: Duration) -> bool {
        let mut rx = self.revision.subscribe();
        let reached = tokio::time::timeout(limit, rx.wait_for(|r| *r >= rev)).await;
        matches!(reached, Ok(Ok(_)))
    }

    /// Waits (at most `limit`) until the view includes every change committed to the store
    /// before the call: the store's revision now, read from `etcd`, reached by the watch's
    /// events or by the progress notice asked for (the revision may be another prefix's
    /// write, which this watch never sees). False when the store cannot be read or the wait
    /// ran out (logged: the caller answers from the view as it is).
    pub async fn catch_up(&self, etcd: &EtcdStore, limit: Duration) -> bool {
        let rev = match etcd.revision().await {
            Ok(rev) => rev,
            Err(e) => {
                tracing::debug!(error = %e, "reading the store's revision");
                return false;
            }
        };
        if *self.revision.borrow() >= rev {
            return true;
        }
        if let Some(watch) = self.progress.lock().await.as_mut() {
            if let Err(e) = watch.request_progress().await {
                tracing::debug!(error = %e, "asking the cluster watch for progress");
            }
        }
        let reached = self.wait_for(rev, limit).await;
        if !reached {
            tracing::warn!(rev, "this replica's view did not reach the store's revision within {limit:?}: answering from it as it is");
        }
        reached
    }

    fn entry(&self, key: &[u8]) -> Entry {
        let Ok(key) = std::str::from_utf8(key) else {
            return Entry::Other;
        };
        let seg = |dir: &str| key.strip_prefix(dir).and_then(crate::keys::unescape);
        if let Some(id) = seg(&self.dirs[0]) {
            Entry::Sandbox(id)
        } else if let Some(id) = seg(&self.dirs[1]) {
            Entry::Owner(id)
        } else if key.starts_with(&self.dirs[2]) {
            Entry::Node
        } else if let Some(name) = seg(&self.dirs[3]) {
            Entry::Draining(name)
        } else if key.starts_with(&self.dirs[4]) {
            Entry::Event
        } else if let Some(name) = seg(&self.dirs[5]) {
            Entry::Restarting(name)
        } else {
            Entry::Other
        }
    }

    fn apply(&self, v: &mut View, kv: &KeyValue, deleted: bool) {
        match self.entry(kv.key()) {
            Entry::Sandbox(id) => {
                let live = (!deleted)
                    .then(|| parse::<SandboxDoc>(kv.key(), kv.value()).ok())
                    .flatten()
                    .map(SandboxRecord::from)
                    .filter(|r| r.state.is_live());
                v.set_sandbox(id, live);
            }
            Entry::Owner(id) if deleted => v.set_owner(id, None),
            Entry::Owner(id) => {
                v.set_owner(id, Some(String::from_utf8_lossy(kv.value()).into_owned()));
            }
            Entry::Node if deleted => {
                let name = std::str::from_utf8(kv.key())
                    .ok()
                    .and_then(|k| k.strip_prefix(&self.dirs[2]))
                    .and_then(crate::keys::unescape);
                if let Some(name) = name {
                    v.nodes.remove(&name);
                }
            }
            Entry::Node => {
                if let Ok(n) = node_of(kv) {
                    v.nodes.insert(n.name.clone(), n);
                }
            }
            Entry::Draining(name) if deleted => {
                v.draining.remove(&name);
            }
            Entry::Draining(name) => {
                v.draining.insert(name);
            }
            Entry::Restarting(name) if deleted => {
                v.restarting.remove(&name);
            }
            Entry::Restarting(name) => {
                v.restarting.insert(name);
            }
            Entry::Event if !deleted && kv.version() == 1 => {
                if let Ok(e) = parse::<EventDoc>(kv.key(), kv.value()) {
                    let _ = self.events.send(LifecycleEvent {
                        ts_ms: e.ts_ms,
                        sandbox_id: e.sandbox_id,
                        kind: e.kind,
                        detail: e.detail,
                    });
                }
            }
            Entry::Event | Entry::Other => {}
        }
    }

    /// Reads the directories of the view at one revision and replaces the view with them.
    async fn load(&self, etcd: &EtcdStore) -> crate::error::Result<i64> {
        let (mut kvs, rev) = etcd.get_prefix_at(&self.dirs[0], 0).await?;
        // Every directory but the events (passed on as they come, never loaded).
        for dir in self.dirs[1..4].iter().chain(&self.dirs[5..]) {
            kvs.extend(etcd.get_prefix(dir, rev).await?);
        }
        let mut v = View::default();
        for kv in &kvs {
            self.apply(&mut v, kv, false);
        }
        *self.write() = v;
        self.revision.send_replace(rev);
        Ok(rev)
    }

    /// Applies every change after `rev`; reloads when the watch breaks.
    async fn follow(&self, etcd: EtcdStore, mut rev: i64) {
        loop {
            if let Err(e) = self.watch_from(&etcd, &mut rev).await {
                tracing::warn!(error = %e, "cluster watch broke; reloading");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            match self.load(&etcd).await {
                Ok(r) => rev = r,
                Err(e) => tracing::warn!(error = %e, "reloading the cluster view"),
            }
        }
    }

    async fn watch_from(&self, etcd: &EtcdStore, rev: &mut i64) -> crate::error::Result<()> {
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(*rev + 1)
            .with_progress_notify();
        let prefix = format!("{}/", etcd.keys().prefix());
        let (progress, mut stream) = etcd.client().watch(prefix, Some(opts)).await?.split();
        *self.progress.lock().await = Some(progress);
        while let Some(resp) = stream.message().await? {
            if resp.canceled() {
                break;
            }
            // The creation's answer carries the store's revision, not the watch's progress:
            // the changes from `rev` on come after it.
            if resp.created() && resp.events().is_empty() {
                continue;
            }
            let mut seen = *rev;
            {
                let mut v = self.write();
                for e in resp.events() {
                    if let Some(kv) = e.kv() {
                        self.apply(&mut v, kv, e.event_type() == EventType::Delete);
                        seen = seen.max(kv.mod_revision());
                    }
                }
            }
            // A progress notice (no events) says every change up to its revision was sent.
            if resp.events().is_empty() {
                seen = seen.max(resp.header().map_or(0, |h| h.revision()));
            }
            *rev = seen;
            self.revision.send_replace(seen);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, team: &str, state: SandboxState) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            state,
            team: team.into(),
            ..Default::default()
        }
    }

    /// The counts as a walk over the whole view finds them.
    fn walked(v: &View) -> (HashMap<String, usize>, HashMap<String, usize>) {
        let (mut on_node, mut of_team) = (HashMap::new(), HashMap::new());
        for (id, r) in &v.sandboxes {
            if let Some(n) = v.owners.get(id) {
                *on_node.entry(n.clone()).or_default() += 1;
            }
            if counted(r) {
                *of_team.entry(r.team.clone()).or_default() += 1;
            }
        }
        (on_node, of_team)
    }

    #[test]
    fn counts_follow_records_and_owners_in_any_order() {
        use SandboxState::{Paused, Running, Starting};
        let mut v = View::default();
        let check = |v: &View| assert_eq!((v.on_node.clone(), v.of_team.clone()), walked(v));
        // Owner before record, record before owner.
        v.set_owner("a".into(), Some("n1".into()));
        check(&v);
        v.set_sandbox("a".into(), Some(rec("a", "t", Starting)));
        v.set_sandbox("b".into(), Some(rec("b", "t", Running)));
        check(&v);
        v.set_owner("b".into(), Some("n2".into()));
        v.set_sandbox("a".into(), Some(rec("a", "t", Running)));
        check(&v);
        assert_eq!(
            (v.on_node["n1"], v.on_node["n2"], v.of_team["t"]),
            (1, 1, 2)
        );
        // A move to another node, a pause, a team change, an end, an owner removed.
        v.set_owner("a".into(), Some("n2".into()));
        v.set_sandbox("b".into(), Some(rec("b", "u", Paused)));
        check(&v);
        v.set_sandbox("a".into(), None);
        check(&v);
        v.set_owner("b".into(), None);
        v.set_owner("a".into(), None);
        check(&v);
        v.set_sandbox("b".into(), None);
        check(&v);
        assert!(v.on_node.is_empty() && v.of_team.is_empty());
    }
}
