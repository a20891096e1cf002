//! The slot pool: slots are built ahead of time in the background, handed out on create and
//! torn down on release (a fresh slot replaces it), so no sandbox ever inherits another's
//! conntrack entries, addresses or rules.

use std::collections::{BTreeSet, VecDeque};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;

use crate::addr::{slot_capacity, slot_pair};
use crate::policy::EgressPolicy;
use crate::rules::HostFacts;
use crate::{host, Cidr, NetError, Result, Slot};

/// Networking settings of a kiln server.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Host-side range: each slot takes a /31 of it.
    pub range: Cidr,
    /// How many slots to keep ready.
    pub pool_size: usize,
    /// Name prefix of this server's namespaces, veths and host table ([`host::prefix_for`]).
    pub prefix: String,
    /// Private ranges sandboxes may reach (on-prem services); subject to each policy.
    pub operator_allow: Vec<Cidr>,
    /// Default upstream resolvers of the DNS forwarders.
    pub dns_upstreams: Vec<Ipv4Addr>,
    /// Most connections a sandbox may have open at once (0: no cap).
    pub max_connections: u32,
    /// Egress bandwidth cap of a sandbox, MiB/s (0: none).
    pub egress_mib_per_sec: u32,
    /// Send every TCP connection leaving a sandbox through its egress proxy, which tells its
    /// observer (kiln's audit log) about it; else only what domain rules need goes there.
    pub proxy_all_tcp: bool,
}

impl NetConfig {
    /// The default range: 10.231.0.0/16 (32,768 slots).
    pub fn default_range() -> Cidr {
        Cidr::new(Ipv4Addr::new(10, 231, 0, 0), 16).expect("valid")
    }
}

#[derive(Default)]
struct Inner {
    ready: VecDeque<Slot>,
    /// Every index in use: ready, leased, being built or being torn down.
    taken: BTreeSet<u32>,
    /// Indices handed out (acquired or adopted) and not yet released. Releasing an index that
    /// is not here does nothing: a second release of the same lease must not tear down the
    /// slot that a rebuild put at that index meanwhile.
    leased: BTreeSet<u32>,
    building: usize,
    /// Set by [`SlotPool::shutdown`]: build nothing more.
    closed: bool,
}

pub struct SlotPool {
    cfg: NetConfig,
    facts: HostFacts,
    inner: Mutex<Inner>,
    refill: Arc<Notify>,
    /// Held for the pool's life (see [`host::lock_prefix`]).
    _lock: std::fs::File,
}

impl SlotPool {
    /// Checks the range against the host's routes, removes this prefix's leftovers (except the
    /// slots in `keep`, which live sandboxes still use), sets the host up and starts filling
    /// the pool in the background.
    pub async fn start(cfg: NetConfig, keep: &[u32]) -> Result<Arc<Self>> {
        if cfg.range.prefix_len() > 30 {
            return Err(NetError::Config(format!(
                "the host range {} is too small (at most /30)",
                cfg.range
            )));
        }
        let lock = host::lock_prefix(&cfg.prefix)?;
        // Claim the range for this pool's life (see [`crate::range`]).
        let claim = format!("{}/{}.range", host::LOCK_DIR, cfg.prefix);
        std::fs::write(&claim, crate::range::claim_text(&cfg.range))
            .map_err(crate::io_err(format!("writing {claim}")))?;
        host::reclaim_stale(&cfg.range, &cfg.prefix).await?;
        match crate::sweep::sweep_dead(&cfg.prefix).await {
            Ok(r) if !r.dead.is_empty() => tracing::info!(
                servers = ?r.dead,
                removed = r.slots_removed,
                kept = r.slots_kept,
                "removed network slots that killed kiln servers left behind"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "removing what killed kiln servers left behind"),
        }
        host::check_range(&cfg.range, &format!("{}h", cfg.prefix)).await?;
        for i in host::leftover_indices(&cfg.prefix) {
            if !keep.contains(&i) {
                host::remove_slot(&cfg.prefix, i).await?;
            }
        }
        host::setup(&cfg.prefix, &cfg.range).await?;
        let mut host_deny: Vec<Cidr> = host::host_addresses()
            .await?
            .into_iter()
            .map(|a| Cidr::new(a, 32).expect("valid"))
            .collect();
        host_deny.push(cfg.range);
        let facts = HostFacts {
            host_deny,
            operator_allow: cfg.operator_allow.clone(),
            max_connections: cfg.max_connections,
            egress_mib_per_sec: cfg.egress_mib_per_sec,
            proxy_all_tcp: cfg.proxy_all_tcp,
        };
        let pool = Arc::new(Self {
            cfg,
            facts,
            inner: Mutex::new(Inner {
                taken: keep.iter().copied().collect(),
                leased: keep.iter().copied().collect(),
                ..Default::default()
            }),
            refill: Arc::new(Notify::new()),
            _lock: lock,
        });
        tokio::spawn(refill(Arc::downgrade(&pool), pool.refill.clone()));
        pool.refill.notify_one();
        Ok(pool)
    }

    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    pub fn host_facts(&self) -> &HostFacts {
        &self.facts
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The slot with `index` (names and addresses; says nothing about whether it exists).
    pub fn slot(&self, index: u32) -> Option<Slot> {
        let (host_addr, slot_addr) = slot_pair(&self.cfg.range, index)?;
        Some(Slot {
            index,
            prefix: self.cfg.prefix.clone(),
            host_addr,
            slot_addr,
        })
    }

    /// How many slots are ready now.
    pub fn ready(&self) -> usize {
        self.lock().ready.len()
    }

    fn reserve_index(&self) -> Result<u32> {
        let mut g = self.lock();
        let cap = slot_capacity(&self.cfg.range);
        let i = (0..cap)
            .find(|i| !g.taken.contains(i))
            .ok_or(NetError::Exhausted(cap))?;
        g.taken.insert(i);
        Ok(i)
    }

    async fn build(&self, policy: &EgressPolicy) -> Result<Slot> {
        let index = self.reserve_index()?;
        let slot = self.slot(index).ok_or(NetError::Exhausted(index))?;
        if let Err(e) = slot.setup(&self.facts, policy).await {
            let _ = slot.teardown().await;
            self.lock().taken.remove(&index);
            return Err(e);
        }
        Ok(slot)
    }

    /// A slot with `policy` in force: a ready one if any (else one built now).
    pub async fn acquire(&self, policy: &EgressPolicy) -> Result<Slot> {
        let ready = {
            let mut g = self.lock();
            let s = g.ready.pop_front();
            if let Some(s) = &s {
                g.leased.insert(s.index);
            }
            s
        };
        self.refill.notify_one();
        match ready {
            Some(slot) => {
                if *policy != EgressPolicy::default() {
                    if let Err(e) = slot.apply(&self.facts, policy).await {
                        self.release(slot).await;
                        return Err(e);
                    }
                }
                Ok(slot)
            }
            None => {
                let slot = self.build(policy).await?;
                self.lock().leased.insert(slot.index);
                Ok(slot)
            }
        }
    }

    /// Replaces the policy of a leased slot (atomically).
    pub async fn set_policy(&self, slot: &Slot, policy: &EgressPolicy) -> Result<()> {
        slot.apply(&self.facts, policy).await
    }

    /// Tears a leased slot down and frees its index; errors are logged (the next start of the
    /// pool removes whatever is left). Releasing a slot that is not leased (released already)
    /// does nothing.
    pub async fn release(&self, slot: Slot) {
        if !self.lock().leased.remove(&slot.index) {
            tracing::debug!(slot = slot.index, "slot released twice; ignored");
            return;
        }
        self.destroy(slot).await;
    }

    /// Whether slot `index` is leased now.
    pub fn is_leased(&self, index: u32) -> bool {
        self.lock().leased.contains(&index)
    }

    /// Tears a slot down and frees its index.
    async fn destroy(&self, slot: Slot) {
        if let Err(e) = slot.teardown().await {
            tracing::warn!(slot = slot.index, error = %e, "tearing a network slot down");
        }
        self.lock().taken.remove(&slot.index);
    }

    /// Releases the leased slot with `index` (see [`SlotPool::release`]).
    pub async fn release_index(&self, index: u32) {
        match self.slot(index) {
            Some(s) => self.release(s).await,
            None => {
                let mut g = self.lock();
                if g.leased.remove(&index) {
                    g.taken.remove(&index);
                }
            }
        }
    }

    /// Marks `index` as leased (a slot found on the host after a restart).
    pub fn adopt(&self, index: u32) -> Option<Slot> {
        let mut g = self.lock();
        g.taken.insert(index);
        g.leased.insert(index);
        drop(g);
        self.slot(index)
    }

    /// Stops refilling and tears down the ready slots, waiting for slots being built (leased
    /// ones stay with their sandboxes).
    pub async fn shutdown(&self) {
        self.lock().closed = true;
        loop {
            let (slots, building) = {
                let mut g = self.lock();
                (g.ready.drain(..).collect::<Vec<_>>(), g.building)
            };
            for s in slots {
                self.destroy(s).await;
            }
            if building == 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

async fn refill(pool: Weak<SlotPool>, wake: Arc<Notify>) {
    loop {
        let Some(p) = pool.upgrade() else { return };
        let need = {
            let mut g = p.lock();
            let need = !g.closed && g.ready.len() + g.building < p.cfg.pool_size;
            if need {
                g.building += 1;
            }
            need
        };
        if need {
            let r = p.build(&EgressPolicy::default()).await;
            let failed = {
                let mut g = p.lock();
                g.building -= 1;
                match r {
                    Ok(slot) => {
                        g.ready.push_back(slot);
                        None
                    }
                    Err(e) => Some(e),
                }
            };
            if let Some(e) = failed {
                tracing::warn!(error = %e, "building a network slot");
                drop(p);
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            continue;
        }
        drop(p);
        let notified = wake.notified();
        // Wake up now and then to notice the pool being dropped.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), notified).await;
    }
}
