//! A cluster node's side of `network.rules` and `egressProxy`. The control replica checked
//! them (every secret a rule names exists in the team) and hands them on as the client gave
//! them ([`crate::SandboxService::forwards_network_settings`]); the node, which holds the
//! interception CA, the egress proxy and its sandboxes' sealed settings, attaches them to the
//! sandbox's policy before the sandbox starts ([`create_policy`]), keeps them sealed for its
//! own restarts ([`created`]) and applies them in a network update ([`update`]); a paused
//! sandbox moving to another node carries them there sealed ([`moving`], [`arriving`]). A secret's
//! value is read from the vault (the cluster's) when each request is sent, as on one host.

use kiln_net::EgressPolicy;
use serde_json::Value;

use super::{net_persist, ApiError, ApiResult, AppState};

/// The policy a forwarded create of `team` starts under: its lists `base` (None: the
/// default) with `settings` attached.
pub async fn create_policy(
    st: &AppState,
    team: &str,
    base: Option<EgressPolicy>,
    settings: &Value,
) -> ApiResult<EgressPolicy> {
    net_persist::attach(st, team, base.unwrap_or_default(), settings).await
}

/// Records the `settings` sandbox `id` of `team` was created with, sealed, for the node's
/// restarts.
pub async fn created(st: &AppState, id: &str, team: &str, settings: &Value) -> ApiResult<()> {
    net_persist::remember(st, id, team, Some(settings), settings.get("iam")).await
}

/// Replaces sandbox `id`'s (of `team`) policy with `lists` and `settings` (None: no rules, no
/// egress proxy), records them, and checks the sandbox trusts the interception CA when rules
/// need it.
pub async fn update(
    st: &AppState,
    id: &str,
    team: &str,
    lists: EgressPolicy,
    settings: Option<&Value>,
) -> ApiResult<()> {
    let iam = net_persist::stored_iam(st, id, team).await?;
    let mut all = settings
        .cloned()
        .unwrap_or_else(|| Value::Object(Default::default()));
    if let (Some(v), Value::Object(m)) = (&iam, &mut all) {
        m.insert("iam".to_string(), v.clone());
    }
    let policy = net_persist::attach(st, team, lists, &all).await?;
    let rules = policy.transforms.is_some();
    st.manager.set_network(id, policy).await?;
    net_persist::remember(st, id, team, settings, iam.as_ref()).await?;
    if rules {
        // Trusted since create; a sandbox from an older snapshot may lack it.
        let token = st.manager.get_for(id, team)?.envd_token;
        super::host_trust::install(st.manager.as_ref(), id, token).await?;
    }
    Ok(())
}

/// The `rules` and `egressProxy` sandbox `id` of `team` runs with, as recorded (None: none),
/// for a fork's children that run on another node; never its `iam`.
pub async fn of_sandbox(st: &AppState, id: &str, team: &str) -> ApiResult<Option<Value>> {
    let Some(mut v) = super::net_inherit::read(st, id, team).await? else {
        return Ok(None);
    };
    if let Some(m) = v.as_object_mut() {
        m.remove("iam");
    }
    Ok(net_persist::settings_of(Some(&v), None))
}

/// The associated data's id of a moving sandbox's sealed settings.
fn moving_id(id: &str) -> String {
    format!("moving/{id}")
}

fn vault(st: &AppState) -> ApiResult<&crate::vault::Vault> {
    st.vault
        .as_deref()
        .ok_or_else(|| ApiError::internal("this server keeps no vault for network settings"))
}

/// The network settings (`rules`, `egressProxy`, `iam`) sandbox `id` of `team` runs with,
/// sealed by the vault (the cluster's: every node opens them) for the node it moves to, paused
/// (None: it has none).
pub async fn moving(st: &AppState, id: &str, team: &str) -> ApiResult<Option<Vec<u8>>> {
    let Some(v) = super::net_inherit::read(st, id, team).await? else {
        return Ok(None);
    };
    Ok(Some(vault(st)?.seal(
        team,
        &moving_id(id),
        v.to_string().as_bytes(),
    )))
}

/// What paused sandbox `id` of `team` arrives with from another node (`sealed`, as [`moving`]
/// made it): its rules and egress proxy attached for this node (the policy the sandbox is
/// adopted under, its lists completed by what moved with its files), recorded for the node's
/// restarts. Checked as a create's are: a secret deleted meanwhile is a 400.
pub async fn arriving(
    st: &AppState,
    id: &str,
    team: &str,
    sealed: &[u8],
) -> ApiResult<EgressPolicy> {
    let clear = vault(st)?
        .unseal(team, &moving_id(id), sealed)
        .map_err(|e| ApiError::internal(format!("opening a moved sandbox's settings: {e}")))?;
    let v: Value = serde_json::from_slice(&clear)
        .map_err(|e| ApiError::internal(format!("reading a moved sandbox's settings: {e}")))?;
    let policy = net_persist::attach(st, team, EgressPolicy::default(), &v).await?;
    net_persist::remember(st, id, team, Some(&v), v.get("iam")).await?;
    Ok(policy)
}

/// Records the network settings of sandbox `source` (of `team`) for its snapshot `snap`, as
/// one host does, and answers them sealed by the vault (the cluster's), for the snapshot's
/// record in the cluster: a create from it through any replica inherits them (None: none).
pub async fn snapshot_taken(
    st: &AppState,
    source: &str,
    snap: &str,
    team: &str,
) -> ApiResult<Option<Vec<u8>>> {
    super::net_inherit::snapshot_taken(st, source, snap, team).await
}

/// Forgets the settings recorded for snapshot `snap` of `team`.
pub async fn snapshot_deleted(st: &AppState, snap: &str, team: &str) -> ApiResult<()> {
    super::net_inherit::snapshot_deleted(st, snap, team).await
}

/// Records for fork `child` the settings of its `parent` (of `team`), as a fork on one host
/// does.
pub async fn forked(st: &AppState, parent: &str, child: &str, team: &str) -> ApiResult<()> {
    super::net_inherit::fork_child(st, parent, child, team).await
}
