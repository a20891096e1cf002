//! A bench's own gVisor driver and manager, in a temporary state directory under the bench
//! work dir, with or without sandbox networking (the net and rich benches).

use std::path::Path;
use std::sync::Arc;

use anyhow::bail;
use kiln_gvisor::{GvisorConfig, GvisorDriver};
use kiln_server::driver::Driver;
use kiln_server::manager::CreateParams;
use kiln_server::store::SqliteStore;
use kiln_server::templates::Templates;
use kiln_server::{LifecycleConfig, Manager};

pub(crate) struct Side {
    pub manager: Arc<Manager>,
    pub driver: Arc<dyn Driver>,
    pub gvisor: Arc<GvisorDriver>,
    _dir: tempfile::TempDir,
}

impl Side {
    /// The side's state directory (its `kiln.db`).
    pub fn dir(&self) -> &Path {
        self._dir.path()
    }
}

/// Sandbox networking of a [`side`]: the host-side range and the slots kept ready.
pub(crate) struct Net<'a> {
    pub range: &'a str,
    pub pool_size: usize,
}

/// A driver on `runsc`/`platform` with its manager; `prefix` names the state directory (short:
/// agent socket paths under it must fit in 108 bytes).
pub(crate) fn side(
    work_root: &Path,
    prefix: &str,
    runsc: &Path,
    platform: &str,
    net: Option<Net<'_>>,
    templates: &Arc<dyn Templates>,
) -> anyhow::Result<Side> {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .rand_bytes(4)
        .tempdir_in(work_root)?;
    let store = Arc::new(SqliteStore::open(&dir.path().join("kiln.db"))?);
    let mut cfg = GvisorConfig::new(dir.path());
    cfg.platform = platform.to_string();
    cfg.runsc = runsc.to_path_buf();
    let networked = net.is_some();
    if let Some(n) = net {
        cfg.network = Some(kiln_net::NetConfig {
            range: n.range.parse()?,
            pool_size: n.pool_size,
            prefix: kiln_gvisor::net_config::prefix_for_state(dir.path()),
            operator_allow: Vec::new(),
            dns_upstreams: kiln_net::dns::system_resolvers(),
            max_connections: 0,
            egress_mib_per_sec: 0,
            proxy_all_tcp: false,
        });
    }
    let gvisor = Arc::new(GvisorDriver::new(cfg)?);
    let driver: Arc<dyn Driver> = gvisor.clone();
    if driver.has_network() != networked {
        bail!("sandbox networking could not be set up as the bench needs it");
    }
    let manager = Manager::new(
        LifecycleConfig::default(),
        store,
        driver.clone(),
        templates.clone(),
    );
    Ok(Side {
        manager,
        driver,
        gvisor,
        _dir: dir,
    })
}

/// A create from `template` as the benches make it (no token, 10 minutes).
pub(crate) fn params(template: &str) -> CreateParams {
    CreateParams {
        template_id: template.to_string(),
        timeout_secs: Some(600),
        secure: false,
        ..Default::default()
    }
}
