//! `network.rules` at create and in `PUT /sandboxes/{id}/network`: parsed, every
//! `${e2b.secrets.NAME}` checked against the caller's team and every
//! `${e2b.identity.tokens.NAME}` against the sandbox's `iam.tokens` (an unknown one is a 400
//! naming it), and attached to the egress policy with what the egress proxy needs to apply them
//! ([`kiln_net::intercept`]). Every sandbox trusts the server's interception CA from create
//! on, rules or not ([`super::host_trust`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_net::intercept::{RuleSet, SecretSource, TokenSource, Transforms};
use kiln_net::EgressPolicy;

use super::network::NetworkJson;
use super::{ApiError, ApiResult, AppState};
use crate::identity::{SandboxTokens, TokenSpec};
use crate::vault::Vault;

impl SecretSource for Vault {
    fn value<'a>(
        &'a self,
        team: &'a str,
        name: &'a str,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Option<String>, String>> + Send + 'a>,
    > {
        Box::pin(async move {
            Vault::value(self, team, name)
                .await
                .map_err(|e| e.to_string())
        })
    }
}

/// Refuses a rule naming a secret `team` does not have or a token not among `tokens`.
async fn check_names(
    vault: &Vault,
    team: &str,
    rules: &RuleSet,
    tokens: &BTreeMap<String, TokenSpec>,
) -> ApiResult<()> {
    check_secret_names(vault, team, rules).await?;
    check_token_names(rules, tokens)
}

/// Refuses a rule naming a secret `team` does not have.
async fn check_secret_names(vault: &Vault, team: &str, rules: &RuleSet) -> ApiResult<()> {
    for name in rules.secret_names() {
        let known = vault
            .records()
            .get(team, &name)
            .await
            .map_err(|e| ApiError::internal(format!("reading secrets: {e}")))?
            .is_some_and(|s| s.name == name);
        if !known {
            return Err(ApiError::bad_request(format!(
                "network.rules: secret {name:?} does not exist in this team; create it first \
                 (Secret.create / POST /secrets)"
            )));
        }
    }
    Ok(())
}

/// Refuses a rule naming a workload identity token not among `tokens`.
fn check_token_names(rules: &RuleSet, tokens: &BTreeMap<String, TokenSpec>) -> ApiResult<()> {
    for name in rules.token_names() {
        if !tokens.contains_key(&name) {
            let defined: Vec<&String> = tokens.keys().collect();
            return Err(ApiError::bad_request(format!(
                "network.rules: workload identity token {name:?} is not defined in the \
                 sandbox's iam.tokens (defined: {defined:?}); define it at create: \
                 iam: {{tokens: {{{name:?}: {{audience, tokenType: \"JWT-SVID\"}}}}}}"
            )));
        }
    }
    Ok(())
}

fn rules_of(net: Option<&NetworkJson>) -> ApiResult<Option<RuleSet>> {
    let Some(v) = net.and_then(|n| n.rules.as_ref()) else {
        return Ok(None);
    };
    let rules = RuleSet::parse(v).map_err(ApiError::bad_request)?;
    Ok((!rules.is_empty()).then_some(rules))
}

/// `policy` with the request's `network.rules` attached (checked for `team` and for the
/// sandbox's workload identity `tokens`), its `egressProxy` (if any) checked to resolve to a
/// public address.
pub async fn with_rules(
    st: &AppState,
    team: &str,
    net: Option<&NetworkJson>,
    tokens: &BTreeMap<String, TokenSpec>,
    policy: Option<EgressPolicy>,
) -> ApiResult<Option<EgressPolicy>> {
    if let Some(p) = policy.as_ref().and_then(|p| p.egress_proxy.as_ref()) {
        p.check_public().await.map_err(ApiError::bad_request)?;
    }
    let Some(rules) = rules_of(net)? else {
        return Ok(policy);
    };
    if st.manager.forwards_network_settings() {
        // Secrets are checked here; the node that attaches the rules checks the tokens
        // against those the sandbox has (an update carries none; see `net_forwarded`).
        let Some(vault) = &st.vault else {
            return Err(ApiError::not_implemented("network rules"));
        };
        check_secret_names(vault, team, &rules).await?;
        return Ok(policy);
    }
    let (Some(vault), Some(interceptor)) = (&st.vault, &st.interceptor) else {
        return Err(ApiError::not_implemented(
            "network rules on a server without its interception CA (see the server log)",
        ));
    };
    check_names(vault, team, &rules, tokens).await?;
    let minter: Option<Arc<dyn TokenSource>> = match (tokens.is_empty(), &st.identity) {
        (true, _) => None,
        (false, Some(issuer)) => Some(Arc::new(SandboxTokens::new(
            issuer.clone(),
            team,
            tokens.clone(),
        ))),
        (false, None) => {
            return Err(ApiError::not_implemented(
                "workload identity tokens on a server without its identity key",
            ))
        }
    };
    let mut policy = policy.unwrap_or_default();
    policy.transforms = Some(Arc::new(Transforms {
        rules,
        team: team.to_string(),
        secrets: vault.clone(),
        tokens: minter,
        interceptor: interceptor.clone(),
    }));
    Ok(Some(policy))
}
