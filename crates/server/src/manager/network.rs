//! Sandbox egress policy: applied at create (before the sandbox runs), replaced while it
//! runs, reported by get_info. The driver enforces it. (Ingress settings are the sandbox
//! record's, see [`crate::store::Ingress`].)

use kiln_net::EgressPolicy;

use super::Manager;
use crate::driver::DriverError;
use crate::error::Result;

/// The `kilnExtraCas` an `/init` carries: `cas`, or nothing when there are none.
pub(super) fn extra_cas_field(cas: &[String]) -> Option<Vec<String>> {
    (!cas.is_empty()).then(|| cas.to_vec())
}

/// An `/init` that only gives a running agent `cas` to trust; none when there are none.
pub fn trust_init(cas: &[String]) -> Option<kiln_proto::envd::InitRequest> {
    extra_cas_field(cas).map(|c| kiln_proto::envd::InitRequest {
        extra_cas: Some(c),
        ..Default::default()
    })
}

/// Whether a driver without networking can honour `policy`: it denies everything anyway.
fn no_network_suffices(policy: &EgressPolicy) -> bool {
    !policy.allow_internet_access && policy.allow_out.is_empty()
}

impl Manager {
    /// Refuses (501) a policy that needs a network on a driver without one, before anything
    /// is created.
    pub(super) fn check_network(&self, policy: Option<&EgressPolicy>) -> Result<()> {
        match policy {
            Some(p) if !self.driver.has_network() && !no_network_suffices(p) => {
                Err(DriverError::NotImplemented(
                    "sandbox internet access (this server runs sandboxes without a network: \
                     it was started with --network off, or the host cannot do networking; \
                     its startup output and `kiln doctor` say which)",
                )
                .into())
            }
            _ => Ok(()),
        }
    }

    /// Puts `policy` in force for sandbox `id` (created or running). A driver without
    /// networking accepts a policy that denies everything (its sandboxes reach nothing anyway).
    pub(super) async fn apply_network(&self, id: &str, policy: &EgressPolicy) -> Result<()> {
        // Workload identity tokens name the sandbox they are minted for.
        if let Some(t) = policy.transforms.as_ref().and_then(|t| t.tokens.as_ref()) {
            t.bind(id);
        }
        match self.driver.set_network(id, policy).await {
            Err(DriverError::NotImplemented(_)) if no_network_suffices(policy) => Ok(()),
            r => Ok(r?),
        }
    }

    /// `PUT /sandboxes/{id}/network`: replaces the egress policy of a running sandbox; new
    /// connections see it at once.
    pub async fn set_network(&self, id: &str, policy: EgressPolicy) -> Result<()> {
        self.get(id)?;
        self.apply_network(id, &policy).await?;
        self.event(
            id,
            "network-policy-changed",
            format!(
                "egress policy: internet {}, allowOut {:?}, denyOut {:?}",
                if policy.allow_internet_access {
                    "on"
                } else {
                    "off"
                },
                EgressPolicy::list_strings(&policy.allow_out),
                EgressPolicy::list_strings(&policy.deny_out)
            ),
        )
        .await;
        Ok(())
    }

    /// Sets the CA certificates (PEM) every sandbox trusts besides its template's roots.
    pub fn set_extra_cas(&self, cas: Vec<String>) {
        let _ = self.extra_cas.set(cas);
    }

    /// The CA certificates every sandbox trusts besides its template's roots.
    pub fn extra_cas(&self) -> &[String] {
        self.extra_cas.get().map(Vec::as_slice).unwrap_or_default()
    }

    /// The egress policy a child of sandbox `id` (a fork) starts with: its parent's, lists,
    /// rules and egress proxy alike, without the parent's workload identity tokens (children
    /// mint none: a rule naming one fails its requests closed). `None`: the parent has no
    /// network. (The child's record takes its parent's ingress settings.)
    pub(super) async fn network_for_child(&self, id: &str) -> Option<EgressPolicy> {
        let mut p = self.driver.network(id).await?;
        if let Some(t) = p.transforms.as_ref().filter(|t| t.tokens.is_some()) {
            p.transforms = Some(std::sync::Arc::new(kiln_net::intercept::Transforms {
                tokens: None,
                ..(**t).clone()
            }));
        }
        Some(p)
    }

    /// The egress policy in force (`None`: the sandbox has no network).
    pub async fn network(&self, id: &str) -> Result<Option<EgressPolicy>> {
        self.get(id)?;
        Ok(self.driver.network(id).await)
    }
}
