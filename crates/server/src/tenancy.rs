//! Tenancy: every API key belongs to a team, and everything a key creates (sandboxes,
//! snapshots, their envd tokens) belongs to that team. A request sees only its own team's
//! things: anything else answers 404, as if it did not exist. Templates built with
//! `kiln template build` are shared by every team.
//!
//! The API's auth layer puts the caller's [`Caller`] in each request's extensions, so any
//! handler or layer can tell who is asking (`Extension<Caller>`).

use crate::error::{Error, Result};
use crate::store::TeamRecord;

/// The team of keys made without one, and of everything from before teams existed.
pub use crate::store::DEFAULT_TEAM;

/// Who is making an API request: the key it presented and that key's team.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub key_id: String,
    pub team: String,
}

/// Team names: 1-64 lowercase letters, digits, `-` or `_`, starting with a letter or digit.
pub fn check_team_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(Error::bad_request(format!(
            "invalid team name {name:?}: use 1-64 lowercase letters, digits, '-' or '_'"
        )))
    }
}

/// Per-team quotas. The server's defaults apply to every team; a team's own row in the store
/// overrides them field by field.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TeamQuota {
    /// Sandboxes (running, paused or being created) at once.
    pub max_sandboxes: Option<u32>,
    /// Largest timeout, seconds.
    pub max_timeout_secs: Option<u64>,
    /// Creates accepted per minute (a sliding window).
    pub creates_per_minute: Option<u32>,
    /// Volumes held.
    pub max_volumes: Option<u32>,
}

impl TeamQuota {
    /// The quota of a team: its own values where set, else `self` (the server's defaults).
    pub fn for_team(&self, own: Option<&TeamRecord>) -> TeamQuota {
        let Some(t) = own else { return *self };
        TeamQuota {
            max_sandboxes: t.max_sandboxes.or(self.max_sandboxes),
            max_timeout_secs: t.max_timeout_secs.or(self.max_timeout_secs),
            creates_per_minute: t.creates_per_minute.or(self.creates_per_minute),
            max_volumes: t.max_volumes.or(self.max_volumes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn team_names_are_strict() {
        for ok in ["default", "a", "team-1", "x_y", &"a".repeat(64)] {
            assert!(check_team_name(ok).is_ok(), "{ok:?}");
        }
        for bad in ["", "-a", "A", "a b", "a/b", "../x", &"a".repeat(65), "é"] {
            assert!(check_team_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn team_rows_override_defaults_field_by_field() {
        let defaults = TeamQuota {
            max_sandboxes: Some(10),
            max_timeout_secs: Some(3600),
            creates_per_minute: None,
            max_volumes: Some(100),
        };
        assert_eq!(defaults.for_team(None), defaults);
        let row = TeamRecord {
            name: "t".into(),
            max_sandboxes: Some(2),
            creates_per_minute: Some(5),
            max_volumes: Some(1),
            ..Default::default()
        };
        assert_eq!(
            defaults.for_team(Some(&row)),
            TeamQuota {
                max_sandboxes: Some(2),
                max_timeout_secs: Some(3600),
                creates_per_minute: Some(5),
                max_volumes: Some(1),
            }
        );
    }
}
