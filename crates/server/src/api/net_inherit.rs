//! Network settings that carry over to a sandbox's descendants. A fork child starts under its
//! parent's egress policy (the manager puts it in force before the child runs); here its rules
//! and egress proxy are also recorded for a server restart ([`fork_child`]). A snapshot records
//! its source's settings at capture ([`snapshot_taken`]): internet access, `allowOut`,
//! `denyOut`, `dnsServers`, `httpsPorts`, `allowPublicTraffic`, `maskRequestHost`, `rules` and
//! `egressProxy` (sealed by the vault, as a sandbox's are), and a create from the snapshot that
//! names no `allowInternetAccess` and no `network` of its own gets them ([`of_snapshot`]; a
//! cluster's replica opens those the snapshot's node recorded, kept with the snapshot's record
//! in the cluster: [`crate::SandboxService::snapshot_network`]).
//! Workload identity tokens (`iam`) never carry over.

use serde_json::{json, Map, Value};

use super::net_persist::snapshot_row;
use super::{ApiError, ApiResult, AppState};

fn seal_id(row: &str) -> String {
    format!("network/{row}")
}

fn internal(what: &str) -> impl Fn(String) -> ApiError + '_ {
    move |e| ApiError::internal(format!("{what}: {e}"))
}

/// The opened settings recorded under `row` for `team` (`None`: none, or another team's).
pub(super) async fn read(st: &AppState, row: &str, team: &str) -> ApiResult<Option<Value>> {
    let Some((vault, db)) = st.settings_db() else {
        return Ok(None);
    };
    let got = db
        .get_network(row)
        .await
        .map_err(|e| internal("reading network settings")(e.to_string()))?;
    let Some((_, sealed)) = got.filter(|(t, _)| t == team) else {
        return Ok(None);
    };
    open(vault, row, team, &sealed).map(Some)
}

/// The settings `sealed` recorded under `row` for `team`, opened.
fn open(vault: &crate::vault::Vault, row: &str, team: &str, sealed: &[u8]) -> ApiResult<Value> {
    let clear = vault
        .unseal(team, &seal_id(row), sealed)
        .map_err(|e| internal("opening stored network settings")(e.to_string()))?;
    serde_json::from_slice(&clear)
        .map_err(|e| internal("reading stored network settings")(e.to_string()))
}

/// Records `v` under `row` for `team` (None: forgets the row); answers it sealed as kept
/// (None: nothing kept).
async fn write(
    st: &AppState,
    row: &str,
    team: &str,
    v: Option<&Value>,
) -> ApiResult<Option<Vec<u8>>> {
    let Some((vault, db)) = st.settings_db() else {
        return Ok(None);
    };
    let sealed = v.map(|v| vault.seal(team, &seal_id(row), v.to_string().as_bytes()));
    db.put_network(row, team, sealed.clone())
        .await
        .map_err(|e| internal("storing network settings")(e.to_string()))?;
    Ok(sealed)
}

/// Records the rules and egress proxy of fork `parent` (of `team`) for its `child`, so a
/// restarted server applies them again; never its `iam`.
pub async fn fork_child(st: &AppState, parent: &str, child: &str, team: &str) -> ApiResult<()> {
    let Some(mut v) = read(st, parent, team).await? else {
        return Ok(());
    };
    if let Some(m) = v.as_object_mut() {
        m.remove("iam");
    }
    super::net_persist::remember(st, child, team, Some(&v), None).await
}

/// Records the network settings of sandbox `source` (of `team`) for its snapshot `snap`;
/// answers them sealed as kept (None: none), for a record of the snapshot beyond this server
/// (a cluster's: [`of_snapshot`] on any replica opens them with the same vault key).
pub async fn snapshot_taken(
    st: &AppState,
    source: &str,
    snap: &str,
    team: &str,
) -> ApiResult<Option<Vec<u8>>> {
    // A server that keeps no settings (a cluster's replica: the snapshot's node records them).
    if st.settings_db().is_none() {
        return Ok(None);
    }
    let Ok(Some(policy)) = st.manager.network(source).await else {
        return Ok(None);
    };
    let ingress = st
        .manager
        .get(source)
        .map(|r| r.ingress)
        .unwrap_or_default();
    let (internet, mut net) = super::network::info(Some(&policy), &ingress);
    // The rules and egress proxy as the requests gave them (placeholders; the password).
    let stored = read(st, source, team).await?.unwrap_or(Value::Null);
    if let Some(m) = net.as_object_mut() {
        for k in ["rules", "egressProxy"] {
            m.remove(k);
            if let Some(x) = stored.get(k).filter(|x| !x.is_null()) {
                m.insert(k.to_string(), x.clone());
            }
        }
    }
    let v = json!({ "allowInternetAccess": internet, "network": net });
    write(st, &snapshot_row(snap), team, Some(&v)).await
}

/// Forgets the settings of snapshot `snap`.
pub async fn snapshot_deleted(st: &AppState, snap: &str, team: &str) -> ApiResult<()> {
    write(st, &snapshot_row(snap), team, None).await.map(drop)
}

/// The `(allowInternetAccess, network)` a create from `template_id` inherits, when it names a
/// snapshot of `team` with recorded settings.
pub async fn of_snapshot(
    st: &AppState,
    team: &str,
    template_id: &str,
) -> ApiResult<Option<(bool, Value)>> {
    let Some(snap) = st.manager.snapshot_for(template_id, team).await? else {
        return Ok(None);
    };
    let row = snapshot_row(&snap.id);
    let v = match read(st, &row, team).await? {
        Some(v) => v,
        // Recorded where the snapshot was taken (a cluster's node), kept by the lifecycle.
        None => match (
            st.manager.snapshot_network(&snap.id, team).await?,
            &st.vault,
        ) {
            (Some(sealed), Some(vault)) => open(vault, &row, team, &sealed)?,
            _ => return Ok(None),
        },
    };
    let internet = v
        .get("allowInternetAccess")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let net = v
        .get("network")
        .cloned()
        .unwrap_or_else(|| Value::Object(Map::new()));
    Ok(Some((internet, net)))
}
