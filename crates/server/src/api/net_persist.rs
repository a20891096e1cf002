//! Keeping a sandbox's `network.rules`, `egressProxy` and `iam` (workload identity tokens)
//! across a server restart and between updates. The driver restores the rest of its egress
//! policy from its own files, but rules need the server's vault, interception CA and identity
//! key and the proxy's password must not sit in clear on disk: the objects, as the requests
//! gave them (placeholders, never secret values), are sealed by the vault and stored per
//! sandbox ([`remember`]); an update, which carries no `iam`, reads the sandbox's from there
//! ([`stored_iam`]); once recovery is over, [`reapply`] puts them back on every running
//! sandbox's policy, and on each sandbox paused across the restart as it resumes. Until then
//! (the first moments after a restart or a resume) the sandbox's egress runs on the policy's
//! lists alone.

use serde_json::{json, Map, Value};

use super::network::{policy_of, NetworkJson};
use super::{ApiError, ApiResult, AppState};
use crate::manager::END_EVENTS;
use crate::store::SandboxState;

/// The row id of snapshot `id`'s settings, beside the sandboxes' in the same table (see
/// `net_inherit`).
pub fn snapshot_row(id: &str) -> String {
    format!("snapshot:{id}")
}

/// Whether a settings row is a snapshot's.
pub fn is_snapshot_row(id: &str) -> bool {
    id.starts_with("snapshot:")
}

/// The id the seal of sandbox `id`'s settings is bound to.
fn seal_id(id: &str) -> String {
    format!("network/{id}")
}

fn present(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

/// The `rules` and `egressProxy` of `net` (a create's `network` object, or the body of
/// `PUT .../network`) and `iam`, those present, as one object (None: none is).
pub fn settings_of(net: Option<&Value>, iam: Option<&Value>) -> Option<Value> {
    let mut kept = Map::new();
    for k in ["rules", "egressProxy"] {
        if let Some(v) = net.and_then(|n| n.get(k)).filter(|v| present(Some(v))) {
            kept.insert(k.to_string(), v.clone());
        }
    }
    if let Some(v) = iam.filter(|v| present(Some(v))) {
        kept.insert("iam".to_string(), v.clone());
    }
    (!kept.is_empty()).then_some(Value::Object(kept))
}

/// Records the `rules` and `egressProxy` of `net` (a create's `network` object, or the body
/// of `PUT .../network`) and the `iam` of its create for sandbox `id` of `team`; none of
/// them: forgets what was recorded.
pub async fn remember(
    st: &AppState,
    id: &str,
    team: &str,
    net: Option<&Value>,
    iam: Option<&Value>,
) -> ApiResult<()> {
    let Some((vault, db)) = st.settings_db() else {
        return Ok(());
    };
    let sealed = settings_of(net, iam)
        .map(|kept| vault.seal(team, &seal_id(id), kept.to_string().as_bytes()));
    db.put_network(id, team, sealed)
        .await
        .map_err(|e| ApiError::internal(format!("storing the sandbox's network settings: {e}")))
}

/// The recorded settings of sandbox `id` of `team`, opened.
fn open(st: &AppState, id: &str, team: &str, sealed: &[u8]) -> ApiResult<Value> {
    let Some(vault) = &st.vault else {
        return Ok(Value::Null);
    };
    let clear = vault
        .unseal(team, &seal_id(id), sealed)
        .map_err(|e| ApiError::internal(format!("opening the stored settings: {e}")))?;
    serde_json::from_slice(&clear)
        .map_err(|e| ApiError::internal(format!("reading the stored settings: {e}")))
}

/// The `iam` sandbox `id` of `team` was created with (`None`: none).
pub async fn stored_iam(st: &AppState, id: &str, team: &str) -> ApiResult<Option<Value>> {
    let Some((_, db)) = st.settings_db() else {
        return Ok(None);
    };
    let row = db
        .get_network(id)
        .await
        .map_err(|e| ApiError::internal(format!("reading the sandbox's network settings: {e}")))?;
    match row {
        Some((t, sealed)) if t == team => Ok(open(st, id, team, &sealed)?.get("iam").cloned()),
        _ => Ok(None),
    }
}

/// Puts the recorded rules, egress proxy and identity tokens back on sandbox `id`'s policy.
async fn apply_one(st: &AppState, id: &str, team: &str, sealed: &[u8]) -> ApiResult<()> {
    let v = open(st, id, team, sealed)?;
    let Some(base) = st.manager.network(id).await? else {
        return Ok(());
    };
    let policy = attach(st, team, base, &v).await?;
    st.manager.set_network(id, policy).await?;
    Ok(())
}

/// `base` (a sandbox's lists) with the `rules`, `egressProxy` and `iam` tokens of `settings`
/// (as [`settings_of`] makes them) attached for `team`; they are checked as a create's are.
pub async fn attach(
    st: &AppState,
    team: &str,
    mut base: kiln_net::EgressPolicy,
    settings: &Value,
) -> ApiResult<kiln_net::EgressPolicy> {
    let tokens = crate::identity::parse_iam(settings.get("iam")).map_err(ApiError::bad_request)?;
    let n: NetworkJson = serde_json::from_value(json!({
        "rules": settings.get("rules"), "egressProxy": settings.get("egressProxy")
    }))
    .map_err(|e| ApiError::bad_request(format!("network settings: {e}")))?;
    let extra = policy_of(Some(base.allow_internet_access), Some(&n))?;
    let extra = super::rules::with_rules(st, team, Some(&n), &tokens, extra).await?;
    let extra = extra.unwrap_or_default();
    base.transforms = extra.transforms;
    base.egress_proxy = extra.egress_proxy;
    Ok(base)
}

/// Applies the recorded rules and egress proxies to the running sandboxes (after recovery),
/// forgets those of sandboxes that are gone, and puts those of sandboxes paused across the
/// restart back when each resumes (watching the lifecycle events until none is left).
pub async fn reapply(st: &AppState) {
    let Some((_, db)) = st.settings_db() else {
        return;
    };
    // Subscribed before the table is read, so no resume falls between.
    let mut events = st.manager.subscribe();
    let all = match db.networks().await {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(error = %e, "reading sandboxes' network settings");
            return;
        }
    };
    let mut paused = std::collections::HashMap::new();
    for (id, team, sealed) in all {
        // A snapshot's settings wait for creates from it.
        if is_snapshot_row(&id) {
            continue;
        }
        match st.manager.get(&id).map(|r| r.state) {
            Ok(SandboxState::Running) => apply_logged(st, &id, &team, &sealed).await,
            Ok(_) => {
                paused.insert(id, (team, sealed));
            }
            Err(_) => {
                let _ = db.put_network(&id, &team, None).await;
            }
        }
    }
    while !paused.is_empty() {
        let id = match events.recv().await {
            Ok(e) if e.kind == "resumed" || END_EVENTS.contains(&e.kind.as_str()) => e.sandbox_id,
            Ok(_) => continue,
            // Events were missed: look at every sandbox still waiting.
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                let ids: Vec<String> = paused.keys().cloned().collect();
                for id in ids {
                    settle_paused(st, &mut paused, &id).await;
                }
                continue;
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        };
        settle_paused(st, &mut paused, &id).await;
    }
}

type Waiting = std::collections::HashMap<String, (String, Vec<u8>)>;

/// Sandbox `id`, paused across the restart: once it runs again its settings are applied;
/// once it is gone they are no longer waited for (the table forgets them when it is killed).
async fn settle_paused(st: &AppState, paused: &mut Waiting, id: &str) {
    let state = st.manager.get(id).map(|r| r.state);
    if matches!(state, Ok(SandboxState::Paused)) {
        return;
    }
    let Some((team, sealed)) = paused.remove(id) else {
        return;
    };
    if matches!(state, Ok(SandboxState::Running)) {
        apply_logged(st, id, &team, &sealed).await;
    }
}

async fn apply_logged(st: &AppState, id: &str, team: &str, sealed: &[u8]) {
    if let Err(e) = apply_one(st, id, team, sealed).await {
        tracing::warn!(sandbox = %id, error = %e.body().message,
            "network rules and egress proxy not applied again after the restart");
    }
}
