//! The `secrets` table (migration 10): one row per secret of a team, holding its current
//! version's value sealed by [`crate::vault`] (never in clear), its metadata and version
//! number. [`SecretsDb`] has a connection of its own to the state database, like the audit
//! log and the metrics history.

use std::collections::BTreeMap;
use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, Row};

use super::side_db::SideDb;
use super::Result;

/// One secret as stored: the value only sealed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRecord {
    /// `sec_…`.
    pub id: String,
    pub team: String,
    /// Lower-cased, unique within the team.
    pub name: String,
    /// 1 for a new secret, one more per update.
    pub version: i64,
    pub metadata: BTreeMap<String, String>,
    /// The current value, sealed (nonce and ciphertext).
    pub sealed: Vec<u8>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// Where a page of secrets starts: after this secret (creation time, id).
pub type SecretCursor = (i64, String);

/// A connection to the state database for secrets.
#[derive(Clone)]
pub struct SecretsDb(SideDb);

fn from_row(r: &Row<'_>) -> rusqlite::Result<SecretRecord> {
    let meta: String = r.get("metadata")?;
    Ok(SecretRecord {
        id: r.get("id")?,
        team: r.get("team")?,
        name: r.get("name")?,
        version: r.get("version")?,
        metadata: serde_json::from_str(&meta).unwrap_or_default(),
        sealed: r.get("sealed")?,
        created_at_ms: r.get("created_at")?,
        updated_at_ms: r.get("updated_at")?,
    })
}

/// The secret of `team` whose id or (lower-cased) name is `key`.
fn get(c: &Connection, team: &str, key: &str) -> rusqlite::Result<Option<SecretRecord>> {
    c.query_row(
        "SELECT * FROM secrets WHERE team = ?1 AND (id = ?2 OR name = lower(?2))",
        params![team, key],
        from_row,
    )
    .optional()
}

impl SecretsDb {
    /// Opens the state database at `path` (already migrated by the state store).
    pub fn open(path: &Path) -> Result<Self> {
        SideDb::open(path).map(Self)
    }

    /// An in-memory database with the current schema (tests).
    pub fn open_in_memory() -> Result<Self> {
        SideDb::open_in_memory().map(Self)
    }

    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.0.run(f).await
    }

    /// Stores a new secret; false when its team already has one of that name.
    pub async fn insert(&self, s: &SecretRecord) -> Result<bool> {
        let s = s.clone();
        self.run(move |c| {
            let n = c.execute(
                "INSERT INTO secrets (id, team, name, version, metadata, sealed, created_at,
                   updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                 ON CONFLICT (team, name) DO NOTHING",
                params![
                    s.id,
                    s.team,
                    s.name,
                    s.version,
                    serde_json::to_string(&s.metadata)?,
                    s.sealed,
                    s.created_at_ms,
                    s.updated_at_ms,
                ],
            )?;
            Ok(n == 1)
        })
        .await
    }

    /// The secret of `team` whose id or name is `key`.
    pub async fn get(&self, team: &str, key: &str) -> Result<Option<SecretRecord>> {
        let (team, key) = (team.to_string(), key.to_string());
        self.run(move |c| Ok(get(c, &team, &key)?)).await
    }

    /// Up to `limit` secrets of `team` in creation order, after `after` when given.
    pub async fn list(
        &self,
        team: &str,
        after: Option<SecretCursor>,
        limit: u32,
    ) -> Result<Vec<SecretRecord>> {
        let team = team.to_string();
        self.run(move |c| {
            let (at, id) = after.unwrap_or((i64::MIN, String::new()));
            let mut st = c.prepare_cached(
                "SELECT * FROM secrets WHERE team = ?1 AND (created_at, id) > (?2, ?3)
                 ORDER BY created_at, id LIMIT ?4",
            )?;
            let rows = st.query_map(params![team, at, id, limit], from_row)?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }

    /// Makes `sealed` the next version of the secret of `team` named by `key` (and `metadata`
    /// its metadata when given); the record after the change, `None` when there is none.
    /// `seal` seals the value for the secret's id.
    pub async fn new_version(
        &self,
        team: &str,
        key: &str,
        seal: impl FnOnce(&str) -> Vec<u8> + Send + 'static,
        metadata: Option<BTreeMap<String, String>>,
        now_ms: i64,
    ) -> Result<Option<SecretRecord>> {
        let (team, key) = (team.to_string(), key.to_string());
        self.run(move |c| {
            // IMMEDIATE: a read that upgrades to a write in WAL mode fails at once (no busy
            // wait) when another connection wrote in between; take the write lock first.
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let Some(mut s) = get(&tx, &team, &key)? else {
                return Ok(None);
            };
            s.version += 1;
            s.sealed = seal(&s.id);
            if let Some(m) = metadata {
                s.metadata = m;
            }
            s.updated_at_ms = now_ms.max(s.created_at_ms);
            tx.execute(
                "UPDATE secrets SET version = ?2, sealed = ?3, metadata = ?4, updated_at = ?5
                 WHERE id = ?1",
                params![
                    s.id,
                    s.version,
                    s.sealed,
                    serde_json::to_string(&s.metadata)?,
                    s.updated_at_ms
                ],
            )?;
            tx.commit()?;
            Ok(Some(s))
        })
        .await
    }

    /// Deletes the secret of `team` whose id or name is `key` (its value is gone with the
    /// row); false when there is none.
    pub async fn delete(&self, team: &str, key: &str) -> Result<bool> {
        let (team, key) = (team.to_string(), key.to_string());
        self.run(move |c| {
            let n = c.execute(
                "DELETE FROM secrets WHERE team = ?1 AND (id = ?2 OR name = lower(?2))",
                params![team, key],
            )?;
            Ok(n > 0)
        })
        .await
    }
}

#[async_trait::async_trait]
impl super::SecretStore for SecretsDb {
    async fn insert(&self, s: &SecretRecord) -> Result<bool> {
        SecretsDb::insert(self, s).await
    }
    async fn get(&self, team: &str, key: &str) -> Result<Option<SecretRecord>> {
        SecretsDb::get(self, team, key).await
    }
    async fn list(
        &self,
        team: &str,
        after: Option<SecretCursor>,
        limit: u32,
    ) -> Result<Vec<SecretRecord>> {
        SecretsDb::list(self, team, after, limit).await
    }
    async fn new_version(
        &self,
        team: &str,
        key: &str,
        seal: super::aggregates::Sealer,
        metadata: Option<BTreeMap<String, String>>,
        now_ms: i64,
    ) -> Result<Option<SecretRecord>> {
        SecretsDb::new_version(self, team, key, move |id| seal(id), metadata, now_ms).await
    }
    async fn delete(&self, team: &str, key: &str) -> Result<bool> {
        SecretsDb::delete(self, team, key).await
    }
}

/// The `mcp` field of a sandbox's create request, kept on the same connection (the
/// `sandbox_mcp` table of migration 10).
impl SecretsDb {
    /// Records sandbox `id`'s `mcp` configuration.
    pub async fn put_mcp(&self, id: &str, mcp: &serde_json::Value) -> Result<()> {
        let (id, text) = (id.to_string(), mcp.to_string());
        self.run(move |c| {
            c.execute(
                "INSERT OR REPLACE INTO sandbox_mcp (sandbox_id, mcp) VALUES (?1, ?2)",
                params![id, text],
            )?;
            Ok(())
        })
        .await
    }

    /// Records the sealed `network` settings sandbox `id` of `team` runs with (None: none).
    pub async fn put_network(&self, id: &str, team: &str, sealed: Option<Vec<u8>>) -> Result<()> {
        let (id, team) = (id.to_string(), team.to_string());
        self.run(move |c| {
            match sealed {
                Some(b) => c.execute(
                    "INSERT OR REPLACE INTO sandbox_network (sandbox_id, team, sealed)
                     VALUES (?1, ?2, ?3)",
                    params![id, team, b],
                )?,
                None => c.execute("DELETE FROM sandbox_network WHERE sandbox_id = ?1", [id])?,
            };
            Ok(())
        })
        .await
    }

    /// Every sandbox's sealed `network` settings: (sandbox id, team, sealed).
    pub async fn networks(&self) -> Result<Vec<(String, String, Vec<u8>)>> {
        self.run(|c| {
            let mut st = c.prepare("SELECT sandbox_id, team, sealed FROM sandbox_network")?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }

    /// Sandbox `id`'s sealed `network` settings, if it has any: (team, sealed).
    pub async fn get_network(&self, id: &str) -> Result<Option<(String, Vec<u8>)>> {
        let id = id.to_string();
        self.run(move |c| {
            Ok(c.query_row(
                "SELECT team, sealed FROM sandbox_network WHERE sandbox_id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
        })
        .await
    }

    /// Sandbox `id`'s `mcp` configuration, if it was created with one.
    pub async fn get_mcp(&self, id: &str) -> Result<Option<serde_json::Value>> {
        let id = id.to_string();
        self.run(move |c| {
            let text: Option<String> = c
                .query_row(
                    "SELECT mcp FROM sandbox_mcp WHERE sandbox_id = ?1",
                    [id],
                    |r| r.get(0),
                )
                .optional()?;
            Ok(text.map(|t| serde_json::from_str(&t)).transpose()?)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, team: &str, name: &str, at: i64) -> SecretRecord {
        SecretRecord {
            id: id.into(),
            team: team.into(),
            name: name.into(),
            version: 1,
            metadata: BTreeMap::from([("k".into(), "v".into())]),
            sealed: vec![1, 2, 3],
            created_at_ms: at,
            updated_at_ms: at,
        }
    }

    #[tokio::test]
    async fn secrets_are_per_team_paged_versioned_and_deleted() {
        let db = SecretsDb::open_in_memory().unwrap();
        assert!(db.insert(&rec("sec_a", "red", "one", 1)).await.unwrap());
        assert!(!db.insert(&rec("sec_b", "red", "one", 2)).await.unwrap());
        assert!(db.insert(&rec("sec_c", "blue", "one", 2)).await.unwrap());
        assert!(db.insert(&rec("sec_d", "red", "two", 3)).await.unwrap());
        assert!(db.get("blue", "sec_a").await.unwrap().is_none());
        assert_eq!(db.get("red", "ONE").await.unwrap().unwrap().id, "sec_a");
        let page = db.list("red", None, 1).await.unwrap();
        assert_eq!(page.len(), 1);
        let after = (page[0].created_at_ms, page[0].id.clone());
        let rest = db.list("red", Some(after), 10).await.unwrap();
        assert_eq!(
            rest.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["sec_d"]
        );
        let s = db
            .new_version("red", "one", |id| id.as_bytes().to_vec(), None, 9)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((s.version, s.sealed.as_slice()), (2, &b"sec_a"[..]));
        assert_eq!(s.metadata.len(), 1, "metadata kept when not given");
        let s = db
            .new_version("red", "sec_a", |_| vec![9], Some(BTreeMap::new()), 10)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((s.version, s.metadata.len(), s.updated_at_ms), (3, 0, 10));
        assert!(db
            .new_version("blue", "sec_a", |_| vec![], None, 1)
            .await
            .unwrap()
            .is_none());
        assert!(!db.delete("blue", "sec_a").await.unwrap());
        assert!(db.delete("red", "one").await.unwrap());
        assert!(db.get("red", "sec_a").await.unwrap().is_none());
        assert_eq!(db.get("blue", "one").await.unwrap().unwrap().id, "sec_c");
    }

    #[tokio::test]
    async fn mcp_configurations_round_trip() {
        let db = SecretsDb::open_in_memory().unwrap();
        assert!(db.get_mcp("s1").await.unwrap().is_none());
        let m = serde_json::json!({"github/o/r": {"run_cmd": "x"}});
        db.put_mcp("s1", &m).await.unwrap();
        assert_eq!(db.get_mcp("s1").await.unwrap(), Some(m));
    }
}
