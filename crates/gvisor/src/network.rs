//! The gVisor driver's sandbox network: each sandbox gets a [`kiln_net`] slot; runsc runs with
//! `--network=sandbox` in the slot's sandbox namespace (the OCI spec's network namespace
//! path), so gVisor's netstack takes over its interface. The sandbox's resolv.conf points at
//! the slot's DNS forwarder.
//!
//! Per sandbox, `net.json` in its directory records the slot and the policy, so a restarted
//! server adopts the slots of sandboxes still running and frees the others.
//!
//! Debian's runsc builds (2022-12 and 2024-07) refuse any namespace but the root one on recent
//! kernels: they test for `/proc/sys/net/core/rmem_default`, which recent kernels show in
//! every namespace. A probe ([`needs_sysctl_workaround`]) looks at that file from inside a
//! slot; when it is there, runsc runs in a private mount namespace with an empty tmpfs over
//! `/proc/sys/net` (a runsc with the upstream fix works either way).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_net::dns::DnsForwarder;
use kiln_net::egress::EgressProxy;
use kiln_net::flows::FlowLog;
use kiln_net::{EgressPolicy, Ingress, NetConfig, Slot, SlotPool, GATEWAY_ADDR, GUEST_ADDR};
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;

use crate::driver::{io_err, BoxIo, DriverError, Result};

const NET_FILE: &str = "net.json";
/// How a refused connection's reason starts.
pub const REFUSED: &str = "nothing is listening";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// An egress policy as the API gives it: lists of targets (CIDRs, addresses, domains), as
/// `net.json` keeps it and as it moves with a paused sandbox to another host
/// ([`super::portable`]).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct PolicyLists {
    allow_internet_access: bool,
    allow_out: Vec<String>,
    deny_out: Vec<String>,
    dns_servers: Vec<String>,
    #[serde(default)]
    https_ports: Vec<u16>,
}

impl PolicyLists {
    pub(super) fn of(p: &EgressPolicy) -> Self {
        Self {
            allow_internet_access: p.allow_internet_access,
            allow_out: EgressPolicy::list_strings(&p.allow_out),
            deny_out: EgressPolicy::list_strings(&p.deny_out),
            dns_servers: p.dns_servers.iter().map(|a| a.to_string()).collect(),
            https_ports: p.https_ports.clone(),
        }
    }

    pub(super) fn policy(&self) -> kiln_net::Result<EgressPolicy> {
        let mut p = EgressPolicy::from_lists(
            self.allow_internet_access,
            &self.allow_out,
            &self.deny_out,
            &self.dns_servers,
        )?;
        p.https_ports = self.https_ports.clone();
        Ok(p)
    }
}

/// `net.json`: what a restarted server needs to adopt a sandbox's slot.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetFile {
    slot: u32,
    #[serde(flatten)]
    policy: PolicyLists,
    /// Ingress as kilns before the sandbox record held it wrote it: read, never written.
    #[serde(default, skip_serializing)]
    traffic_token: Option<String>,
    #[serde(default, skip_serializing)]
    mask_request_host: Option<String>,
}

impl NetFile {
    fn new(slot: u32, p: &EgressPolicy) -> Self {
        Self {
            slot,
            policy: PolicyLists::of(p),
            traffic_token: None,
            mask_request_host: None,
        }
    }
    /// The ingress an older kiln recorded here (`None`: none).
    fn legacy_ingress(&self) -> Option<Ingress> {
        let i = Ingress {
            traffic_token: self.traffic_token.clone(),
            mask_request_host: self.mask_request_host.clone(),
        };
        (i != Ingress::default()).then_some(i)
    }
    fn policy(&self) -> Option<EgressPolicy> {
        self.policy.policy().ok()
    }
}

struct Lease {
    slot: Slot,
    policy: EgressPolicy,
    dns: DnsForwarder,
    egress: EgressProxy,
    /// With egress audited: the UDP/ICMP flow log.
    flows: Option<FlowLog>,
}

/// A slot's services, started together.
type Services = (DnsForwarder, EgressProxy, Option<FlowLog>);

/// The network side of the gVisor driver.
pub struct Network {
    cfg: NetConfig,
    sandboxes_dir: PathBuf,
    pool: OnceCell<Arc<SlotPool>>,
    leases: Mutex<HashMap<String, Lease>>,
    /// Slots recorded by sandboxes of an earlier run whose services could not be restarted:
    /// still leased (the sandbox may run), released when the sandbox stops.
    orphans: Mutex<HashMap<String, u32>>,
    workaround: OnceCell<bool>,
    /// Told of each connection and DNS query (set once by the server: the audit log).
    observer: Arc<std::sync::OnceLock<crate::driver::NetObserver>>,
}

fn net_err(e: kiln_net::NetError) -> DriverError {
    DriverError::Other(format!("sandbox network: {e}"))
}

impl Network {
    pub fn new(cfg: NetConfig, sandboxes_dir: PathBuf) -> Arc<Self> {
        let n = Arc::new(Self {
            cfg,
            sandboxes_dir,
            pool: OnceCell::new(),
            leases: Mutex::new(HashMap::new()),
            orphans: Mutex::new(HashMap::new()),
            workaround: OnceCell::new(),
            observer: Arc::default(),
        });
        // Start the pool now when there is a runtime (cleanup and pre-creation happen at start
        // rather than on the first create).
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            let n2 = n.clone();
            h.spawn(async move {
                if let Err(e) = n2.pool().await {
                    tracing::error!(error = %e, "starting the sandbox network pool");
                }
            });
        }
        n
    }

    /// Sets the observer of every sandbox's connections and DNS queries (the first call wins).
    pub fn set_observer(&self, o: crate::driver::NetObserver) {
        let _ = self.observer.set(o);
    }

    /// Sandbox `id`'s view of the observer (which may be set later: a restarted server adopts
    /// slots before it has its audit log).
    fn observer_of(&self, id: &str) -> kiln_net::observe::Observer {
        let (cell, id) = (self.observer.clone(), id.to_string());
        Arc::new(move |e| match cell.get() {
            Some(o) => o(&id, e),
            None => Box::pin(async {}),
        })
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<String, Lease>> {
        lock(&self.leases)
    }

    fn read_file(&self, id: &str) -> Option<NetFile> {
        let text = std::fs::read(self.sandboxes_dir.join(id).join(NET_FILE)).ok()?;
        serde_json::from_slice(&text).ok()
    }

    fn write_file(&self, id: &str, f: &NetFile) -> Result<()> {
        let path = self.sandboxes_dir.join(id).join(NET_FILE);
        let text = serde_json::to_vec(f).map_err(|e| DriverError::Other(e.to_string()))?;
        std::fs::write(&path, text).map_err(io_err(format!("writing {}", path.display())))
    }

    fn upstreams(&self, p: &EgressPolicy) -> Vec<std::net::Ipv4Addr> {
        if p.dns_servers.is_empty() {
            self.cfg.dns_upstreams.clone()
        } else {
            p.dns_servers.clone()
        }
    }

    /// The pool, started on first use: adopts the slots recorded by sandboxes on the host.
    async fn pool(&self) -> Result<&Arc<SlotPool>> {
        self.pool
            .get_or_try_init(|| async {
                let mut adopted = Vec::new();
                for e in std::fs::read_dir(&self.sandboxes_dir).into_iter().flatten() {
                    let Ok(e) = e else { continue };
                    let id = e.file_name().to_string_lossy().into_owned();
                    if let Some(f) = self.read_file(&id) {
                        adopted.push((id, f));
                    }
                }
                let keep: Vec<u32> = adopted.iter().map(|(_, f)| f.slot).collect();
                let pool = SlotPool::start(self.cfg.clone(), &keep)
                    .await
                    .map_err(net_err)?;
                for (id, f) in adopted {
                    let (Some(slot), Some(policy)) = (pool.adopt(f.slot), f.policy()) else {
                        continue;
                    };
                    // (Again: /run may have been emptied since.)
                    let dir = self.sandboxes_dir.join(&id);
                    if let Err(e) = kiln_net::sweep::record_lease(&self.cfg.prefix, f.slot, &dir) {
                        tracing::warn!(sandbox = %id, error = %e, "recording a slot's lease");
                    }
                    match self.services(&id, &pool, &slot, &policy).await {
                        Ok((dns, egress, flows)) => {
                            self.leases().insert(
                                id,
                                Lease {
                                    slot,
                                    policy,
                                    dns,
                                    egress,
                                    flows,
                                },
                            );
                        }
                        Err(e) => {
                            tracing::warn!(sandbox = %id, error = %e, "adopting a slot");
                            lock(&self.orphans).insert(id, slot.index);
                        }
                    }
                }
                Ok(pool)
            })
            .await
    }

    /// The slot's DNS forwarder, egress proxy and (egress audited) flow log.
    async fn services(
        &self,
        id: &str,
        pool: &SlotPool,
        slot: &Slot,
        policy: &EgressPolicy,
    ) -> Result<Services> {
        let ns = slot.router_ns_path();
        let facts = pool.host_facts().clone();
        let audited = facts.proxy_all_tcp;
        // Each binds its sockets from a thread of its own in the router namespace: together.
        let (dns, egress, flows) = tokio::try_join!(
            DnsForwarder::start(&ns, self.upstreams(policy)),
            EgressProxy::start(&ns, policy.clone(), facts.clone()),
            async {
                match audited {
                    true => FlowLog::start(&ns, policy.clone(), facts).await.map(Some),
                    false => Ok(None),
                }
            },
        )
        .map_err(net_err)?;
        let o = self.observer_of(id);
        dns.set_observer(Some(o.clone()));
        if let Some(f) = &flows {
            f.set_observer(Some(o.clone()));
        }
        egress.set_observer(Some(o));
        Ok((dns, egress, flows))
    }

    /// Gives sandbox `id` a slot under `policy` (`None`: the default), its DNS forwarder and
    /// egress proxy; writes its resolv.conf into `rootfs`. Returns the namespace path for the
    /// OCI spec.
    pub async fn attach(
        &self,
        id: &str,
        rootfs: &Path,
        policy: Option<&EgressPolicy>,
    ) -> Result<PathBuf> {
        let t0 = std::time::Instant::now();
        let pool = self.pool().await?;
        let policy = policy.cloned().unwrap_or_default();
        let slot = pool.acquire(&policy).await.map_err(net_err)?;
        let t_slot = t0.elapsed();
        let services = self.services(id, pool, &slot, &policy).await;
        tracing::debug!(
            sandbox = id,
            slot = slot.index,
            slot_us = t_slot.as_micros() as u64,
            services_us = (t0.elapsed() - t_slot).as_micros() as u64,
            "network slot taken, DNS forwarder and egress proxy started"
        );
        let (dns, egress, flows) = match services {
            Ok(s) => s,
            Err(e) => {
                pool.release(slot).await;
                return Err(e);
            }
        };
        let path = slot.sandbox_ns_path();
        let recorded = self
            .write_file(id, &NetFile::new(slot.index, &policy))
            .and_then(|()| {
                kiln_net::sweep::record_lease(
                    &self.cfg.prefix,
                    slot.index,
                    &self.sandboxes_dir.join(id),
                )
                .map_err(net_err)
            });
        if let Err(e) = recorded {
            pool.release(slot).await;
            return Err(e);
        }
        self.leases().insert(
            id.to_string(),
            Lease {
                slot,
                policy,
                dns,
                egress,
                flows,
            },
        );
        write_resolv_conf(rootfs)?;
        Ok(path)
    }

    /// Replaces the egress policy of sandbox `id` (one nftables transaction).
    pub async fn set_policy(&self, id: &str, policy: &EgressPolicy) -> Result<()> {
        let pool = self.pool().await?;
        let slot = self
            .leases()
            .get(id)
            .map(|l| l.slot.clone())
            .ok_or_else(|| DriverError::NotFound(id.to_string()))?;
        pool.set_policy(&slot, policy).await.map_err(net_err)?;
        self.write_file(id, &NetFile::new(slot.index, policy))?;
        if let Some(l) = self.leases().get_mut(id) {
            l.policy = policy.clone();
            l.dns.set_upstreams(self.upstreams(policy));
            l.egress.set_policy(policy.clone());
            if let Some(f) = &l.flows {
                f.set_policy(policy.clone());
            }
        }
        Ok(())
    }

    /// Addresses sandbox `id`'s slot again (runsc's netstack took the address when the sandbox
    /// stopped): before its checkpoint is restored into the same slot.
    pub async fn readdress(&self, id: &str) -> Result<()> {
        let slot = self.leased(id, |l| l.slot.clone()).await;
        match slot {
            Some(slot) => slot.address_guest().await.map_err(net_err),
            None => Ok(()),
        }
    }

    /// `f` of sandbox `id`'s lease. Waits for the pool's start first: a restarted server
    /// adopts the leases of its sandboxes there, and a resume or a port connect may come
    /// before it is done.
    async fn leased<T>(&self, id: &str, f: impl FnOnce(&Lease) -> T) -> Option<T> {
        let _ = self.pool().await;
        self.leases().get(id).map(f)
    }

    /// Waits for the pool's start, where a restarted server adopts its sandboxes' slots and
    /// starts their DNS forwarders and egress proxies again (with connections audited, all of
    /// a sandbox's TCP egress needs its proxy).
    pub async fn ready(&self) {
        let _ = self.pool().await;
    }

    /// The sandbox namespace of sandbox `id`'s slot.
    pub async fn sandbox_ns(&self, id: &str) -> Option<PathBuf> {
        self.leased(id, |l| l.slot.sandbox_ns_path()).await
    }

    pub async fn policy(&self, id: &str) -> Option<EgressPolicy> {
        self.leased(id, |l| l.policy.clone()).await
    }

    /// Sandbox `id`'s egress policy lists as they go with the sandbox, paused, to another
    /// host: None for the default. Its network rules and egress proxy are not in them (the
    /// host taking it over attaches them from its caller's record of them,
    /// [`kiln_driver::Checkpoint::adopt_paused`]); a sandbox whose slot this host does not hold
    /// does not move.
    pub async fn movable_policy(&self, id: &str) -> Result<Option<EgressPolicy>> {
        match self.policy(id).await {
            Some(mut p) => {
                p.transforms = None;
                p.egress_proxy = None;
                Ok((p != EgressPolicy::default()).then_some(p))
            }
            None if self.read_file(id).is_some() => Err(DriverError::Other(format!(
                "the network slot of sandbox {id} is not held by this server"
            ))),
            None => Ok(None),
        }
    }

    /// The ingress settings an older kiln kept in sandbox `id`'s `net.json` (see
    /// [`kiln_driver::Driver::legacy_ingress`]).
    pub fn legacy_ingress(&self, id: &str) -> Option<Ingress> {
        self.read_file(id)?.legacy_ingress()
    }

    /// Frees the slot of sandbox `id` (whether this run or an earlier one leased it). Only the
    /// first of several detaches of one sandbox frees anything: the lease (or orphan record)
    /// is taken out atomically, so a repeated stop never tears down a slot that was rebuilt at
    /// the same index and leased to another sandbox meanwhile.
    pub async fn detach(&self, id: &str) {
        // Start (or wait for) the pool first: its start adopts the slots recorded on the host,
        // this sandbox's included, so the lease removed below is really gone.
        let pool = self.pool().await.ok();
        let lease = self.leases().remove(id);
        let index = lease
            .as_ref()
            .map(|l| l.slot.index)
            .or_else(|| lock(&self.orphans).remove(id));
        // Flows still open end with the sandbox: recorded as closed, with their bytes.
        if let Some(mut l) = lease {
            if let Some(f) = l.flows.take() {
                f.finish().await;
            }
        }
        if let (Some(pool), Some(index)) = (pool, index) {
            // Forgotten first: once released, the index may be leased (and recorded) again.
            kiln_net::sweep::forget_lease(&self.cfg.prefix, index);
            pool.release_index(index).await;
        }
        let _ = std::fs::remove_file(self.sandboxes_dir.join(id).join(NET_FILE));
    }

    /// A TCP connection to `port` of sandbox `id`, made from its router namespace.
    pub async fn connect(&self, id: &str, port: u16) -> Result<BoxIo> {
        let ns = self
            .leased(id, |l| l.slot.router_ns_path())
            .await
            .ok_or_else(|| DriverError::NotFound(id.to_string()))?;
        let unreachable = |reason: String| DriverError::Unreachable {
            id: id.to_string(),
            port,
            reason,
        };
        let s = kiln_net::netns::connect_tcp(
            &ns,
            SocketAddr::from((GUEST_ADDR, port)),
            CONNECT_TIMEOUT,
        )
        .await
        .map_err(|e| match e {
            kiln_net::NetError::Io { source, .. } => unreachable(match source.kind() {
                std::io::ErrorKind::ConnectionRefused => {
                    format!("{REFUSED} on port {port} in the sandbox")
                }
                std::io::ErrorKind::TimedOut => format!("connecting to port {port} timed out"),
                k => format!("connecting to port {port}: {k}"),
            }),
            other => unreachable(other.to_string()),
        })?;
        s.set_nonblocking(true)
            .map_err(io_err("setting a socket non-blocking"))?;
        let s = tokio::net::TcpStream::from_std(s).map_err(io_err("registering a socket"))?;
        Ok(Box::new(s))
    }

    /// Whether runsc needs the `/proc/sys/net` workaround on this host (probed once, from
    /// inside the slot's sandbox namespace).
    pub async fn needs_sysctl_workaround(&self, ns: &Path) -> bool {
        *self
            .workaround
            .get_or_init(|| async {
                kiln_net::netns::in_netns(ns, || {
                    Ok(Path::new("/proc/sys/net/core/rmem_default").exists())
                })
                .await
                .unwrap_or(true)
            })
            .await
    }

    /// Tears down the ready slots (server shutdown).
    pub async fn shutdown(&self) {
        if let Some(p) = self.pool.get() {
            p.shutdown().await;
            // With no sandbox left, the host table goes too.
            if self.leases().is_empty() {
                let _ = kiln_net::host::remove_table(&self.cfg.prefix).await;
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Points the sandbox's resolver at its DNS forwarder (the slot's gateway).
fn write_resolv_conf(rootfs: &Path) -> Result<()> {
    let etc = rootfs.join("etc");
    std::fs::create_dir_all(&etc).map_err(io_err("creating /etc in the sandbox"))?;
    let path = etc.join("resolv.conf");
    // A symlink (e.g. to systemd-resolved's file) would point outside the sandbox's files.
    if path.is_symlink() {
        std::fs::remove_file(&path).map_err(io_err("replacing the sandbox's resolv.conf"))?;
    }
    std::fs::write(&path, format!("nameserver {GATEWAY_ADDR}\n"))
        .map_err(io_err("writing the sandbox's resolv.conf"))
}

/// Points the OCI spec's network namespace at `ns`.
pub fn set_netns_path(spec: &mut serde_json::Value, ns: &Path) {
    if let Some(list) = spec["linux"]["namespaces"].as_array_mut() {
        for n in list.iter_mut() {
            if n["type"] == "network" {
                n["path"] = serde_json::json!(ns);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netns_path_goes_into_the_spec() {
        let mut v =
            serde_json::json!({"linux": {"namespaces": [{"type": "pid"}, {"type": "network"}]}});
        set_netns_path(&mut v, Path::new("/run/netns/k1-0s"));
        assert_eq!(v["linux"]["namespaces"][1]["path"], "/run/netns/k1-0s");
        assert!(v["linux"]["namespaces"][0].get("path").is_none());
    }

    #[test]
    fn ingress_is_read_from_an_older_net_json_and_never_written() {
        let old = br#"{"slot":3,"allowInternetAccess":true,"allowOut":[],"denyOut":[],
            "dnsServers":[],"trafficToken":"abc","maskRequestHost":"h:${PORT}"}"#;
        let f: NetFile = serde_json::from_slice(old).unwrap();
        let i = f.legacy_ingress().unwrap();
        assert_eq!(i.traffic_token.as_deref(), Some("abc"));
        assert_eq!(i.mask_request_host.as_deref(), Some("h:${PORT}"));
        assert!(f.policy().is_some());
        let new = serde_json::to_value(NetFile::new(3, &EgressPolicy::default())).unwrap();
        assert!(new.get("trafficToken").is_none() && new.get("maskRequestHost").is_none());
        let f: NetFile = serde_json::from_value(new).unwrap();
        assert!(f.legacy_ingress().is_none());
    }

    #[test]
    fn resolv_conf_points_at_the_gateway() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("etc")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", d.path().join("etc/resolv.conf")).unwrap();
        write_resolv_conf(d.path()).unwrap();
        let text = std::fs::read_to_string(d.path().join("etc/resolv.conf")).unwrap();
        assert_eq!(text, "nameserver 169.254.0.22\n");
    }
}
