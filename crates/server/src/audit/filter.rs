//! What a query of the audit log asks for.

use super::cursor::Cursor;
use super::record::Kind;

/// What a query asks for.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Filter {
    pub sandbox_id: Option<String>,
    /// Only the sandboxes of this team (running, paused or ended).
    pub team: Option<String>,
    /// Any of these kinds (all when empty).
    pub kinds: Vec<Kind>,
    /// Records at or after this time (ms).
    pub since_ms: Option<i64>,
    /// Records before this time (ms).
    pub until_ms: Option<i64>,
    /// Records after this position.
    pub after: Option<Cursor>,
    pub limit: usize,
}
