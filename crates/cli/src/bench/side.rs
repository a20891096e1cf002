//! A bench's own driver and manager, in a temporary state directory under the bench work dir,
//! with or without sandbox networking (the net, rich and volume benches).

use std::path::Path;
use std::sync::Arc;

use anyhow::bail;
use kiln_server::driver::Driver;
use kiln_server::manager::CreateParams;
use kiln_server::store::SqliteStore;
use kiln_server::templates::Templates;
use kiln_server::{LifecycleConfig, Manager};

use crate::drivers::BenchRuntime;

pub(crate) struct Side {
    pub manager: Arc<Manager>,
    pub driver: Arc<dyn Driver>,
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

/// A driver on `runtime` with its manager; `prefix` names the state directory (short: agent
/// socket paths under it must fit in 108 bytes).
pub(crate) fn side(
    work_root: &Path,
    prefix: &str,
    runtime: &BenchRuntime,
    net: Option<Net<'_>>,
    templates: &Arc<dyn Templates>,
) -> anyhow::Result<Side> {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .rand_bytes(4)
        .tempdir_in(work_root)?;
    let store = Arc::new(SqliteStore::open(&dir.path().join("kiln.db"))?);
    let mut cfg = runtime.driver_config();
    let networked = net.is_some();
    if let Some(n) = net {
        cfg.set_network(Some(crate::drivers::bench_network(
            dir.path(),
            n.range,
            n.pool_size,
            kiln_net::dns::system_resolvers(),
        )?));
    }
    let driver = runtime.driver(&cfg, dir.path())?.driver;
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
