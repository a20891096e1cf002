//! The key layout under the store's prefix (default `/kiln`). Every variable segment is
//! escaped, so an id never contains the `/` that ends its segment; numbers in keys are
//! fixed-width so that key order is number order.
//!
//! | key | value |
//! | --- | --- |
//! | `sandboxes/{id}` | the sandbox (JSON) |
//! | `expiry/{end_at}/{id}` | empty; exists while the sandbox is running |
//! | `snapshots/{id}` | the snapshot (JSON) |
//! | `snapshot-names/{name}` | the snapshot id |
//! | `snapshot-files/{id}` | where a snapshot's files are in object storage (JSON, as a checkpoint's) |
//! | `snapshot-drops/{node}/{id}` | a snapshot deleted while its node was away (JSON: id, team) |
//! | `events/{sandbox}/{ts}-{uuid}` | one event (JSON); its seq is the key's create revision |
//! | `webhooks/{id}` | one webhook (JSON, with its team) |
//! | `keys/{id}` | an API key (JSON) |
//! | `key-hashes/{hash}` | the API key's id |
//! | `templates/{name}` | a template (JSON) |
//! | `teams/{name}` | a team's quotas (JSON) |
//! | `idempotency/{scope}/{key}` | an idempotent answer (JSON, body in base64) |
//! | `idempotency-at/{created_at}/{scope}/{key}` | empty; finds old answers without a scan |
//! | `deliveries/{webhook}/{id}` | one webhook delivery (JSON) |
//! | `delivery-ids/{id}` | the delivery's webhook id |
//! | `due/{next_attempt}/{id}` | the delivery's webhook id; exists while it is pending |
//! | `delivery-seq` | the last delivery id given out |
//! | `webhook-cursor` | the sequence number of the last event queued for the webhooks |
//! | `nodes/{name}` | a node (JSON), attached to its lease |
//! | `draining/{name}` | a drained node's mark (JSON); stays until `kiln node undrain` |
//! | `restarting/{name}` | a restarting node's mark (JSON), on a lease lasting its restart grace ([`crate::restarts`]) |
//! | `owners/{id}` | the name of the node that owns the sandbox |
//! | `checkpoints/{id}` | where a paused sandbox's checkpoint is in object storage (JSON) |
//! | `audit-heads/{id}` | the head of the sandbox's audit chain, the node extending it, the nodes keeping it (JSON) ([`crate::heads`]) |
//! | `template-files/{name}` | where a template's files are in object storage (JSON) |
//! | `secrets/{team}/{id}` | a team's secret (JSON), its value sealed by the vault ([`crate::secrets`]) |
//! | `secret-names/{team}/{name}` | the secret's id (names are unique in a team) |
//! | `volumes/{id}` | a volume (JSON, with the node that keeps its files) ([`crate::volumes`]) |
//! | `volume-names/{team}/{name}` | the volume's id (names are unique in a team) |
//! | `volume-counts/{team}` | how many volumes the team holds |
//! | `cluster-keys/{name}` | a key of the whole cluster, sealed by its vault (`identity`, `interception-ca`: [`crate::cluster_keys`]) |
//! | `console-sessions/{hash}` | a console session (JSON), attached to a lease ending with it |
//! | `console-sign-ins/{address}/{ms}-{uuid}` | a failed console sign-in, on a lease of a minute |
//! | `placements/{token}` | the node a create with an idempotency key went to, on a lease |
//! | `seats/{team}/{uuid}` | empty; a create of the team under way, on its lease ([`crate::seats`]) |
//! | `seat-gates/{team}` | empty; rewritten by every seat taken, so racing takers serialise |
//! | `leader` | the control replica leading the cluster's singletons, on its lease |
//! | `gc-leader` | the node running the bucket's garbage collection, on its lease |
//! | `gc-round` | `running` (on the collector's lease) while a collection round runs, else `idle` |

/// Builds the keys of one store (one prefix).
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// `prefix` without a trailing slash, e.g. `/kiln` (a trailing slash is dropped).
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The directory `name/` (a range prefix).
    pub fn dir(&self, name: &str) -> String {
        format!("{}/{name}/", self.prefix)
    }

    fn one(&self, dir: &str, seg: &str) -> String {
        format!("{}/{dir}/{}", self.prefix, escape(seg))
    }

    pub fn sandbox(&self, id: &str) -> String {
        self.one("sandboxes", id)
    }
    pub fn expiry(&self, end_at_ms: i64, id: &str) -> String {
        format!(
            "{}{}/{}",
            self.dir("expiry"),
            ordered(end_at_ms),
            escape(id)
        )
    }
    /// The first expiry key after every end time at or before `now_ms`.
    pub fn expiry_end(&self, now_ms: i64) -> String {
        match now_ms.checked_add(1) {
            Some(next) => format!("{}{}", self.dir("expiry"), ordered(next)),
            None => range_end(&self.dir("expiry")),
        }
    }
    pub fn snapshot(&self, id: &str) -> String {
        self.one("snapshots", id)
    }
    pub fn snapshot_name(&self, name: &str) -> String {
        self.one("snapshot-names", name)
    }
    pub fn snapshot_files(&self, id: &str) -> String {
        self.one("snapshot-files", id)
    }
    /// The notes left for `node` (a range prefix).
    pub fn snapshot_drops_of(&self, node: &str) -> String {
        format!("{}/", self.one("snapshot-drops", node))
    }
    pub fn snapshot_drop(&self, node: &str, id: &str) -> String {
        format!("{}{}", self.snapshot_drops_of(node), escape(id))
    }
    /// Where the events of one sandbox live (a range prefix).
    pub fn events_of(&self, sandbox_id: &str) -> String {
        format!("{}/", self.one("events", sandbox_id))
    }
    pub fn new_event(&self, sandbox_id: &str, ts_ms: i64) -> String {
        format!(
            "{}{}-{}",
            self.events_of(sandbox_id),
            ordered(ts_ms),
            uuid::Uuid::new_v4().simple()
        )
    }
    pub fn webhook(&self, id: &str) -> String {
        self.one("webhooks", id)
    }
    pub fn key(&self, id: &str) -> String {
        self.one("keys", id)
    }
    pub fn key_hash(&self, hash: &str) -> String {
        self.one("key-hashes", hash)
    }
    pub fn template(&self, name: &str) -> String {
        self.one("templates", name)
    }
    pub fn team(&self, name: &str) -> String {
        self.one("teams", name)
    }
    pub fn placement(&self, token: &str) -> String {
        self.one("placements", token)
    }
    pub fn idempotent(&self, scope: &str, key: &str) -> String {
        format!("{}/{}", self.one("idempotency", scope), escape(key))
    }
    pub fn idempotent_at(&self, created_at_ms: i64, scope: &str, key: &str) -> String {
        format!(
            "{}{}/{}/{}",
            self.dir("idempotency-at"),
            ordered(created_at_ms),
            escape(scope),
            escape(key)
        )
    }
    /// The first `idempotency-at` key at or after `since_ms`.
    pub fn idempotent_at_start(&self, since_ms: i64) -> String {
        format!("{}{}", self.dir("idempotency-at"), ordered(since_ms))
    }
    /// Scope and key of an `idempotency-at` key.
    pub fn parse_idempotent_at(&self, k: &str) -> Option<(String, String)> {
        let rest = k.strip_prefix(&self.dir("idempotency-at"))?;
        let mut parts = rest.splitn(3, '/');
        let (_at, scope, key) = (parts.next()?, parts.next()?, parts.next()?);
        Some((unescape(scope)?, unescape(key)?))
    }
    pub fn deliveries_of(&self, webhook_id: &str) -> String {
        format!("{}/", self.one("deliveries", webhook_id))
    }
    pub fn delivery(&self, webhook_id: &str, id: i64) -> String {
        format!("{}{}", self.deliveries_of(webhook_id), ordered(id))
    }
    pub fn delivery_id(&self, id: i64) -> String {
        format!("{}{}", self.dir("delivery-ids"), ordered(id))
    }
    pub fn due(&self, next_attempt_ms: i64, id: i64) -> String {
        format!(
            "{}{}/{}",
            self.dir("due"),
            ordered(next_attempt_ms),
            ordered(id)
        )
    }
    /// The first `due` key after every attempt time at or before `now_ms`.
    pub fn due_end(&self, now_ms: i64) -> String {
        match now_ms.checked_add(1) {
            Some(next) => format!("{}{}", self.dir("due"), ordered(next)),
            None => range_end(&self.dir("due")),
        }
    }
    pub fn delivery_seq(&self) -> String {
        format!("{}/delivery-seq", self.prefix)
    }
    pub fn webhook_cursor(&self) -> String {
        format!("{}/webhook-cursor", self.prefix)
    }
    pub fn node(&self, name: &str) -> String {
        self.one("nodes", name)
    }
    /// The name of the node that runs sandbox `id`.
    pub fn owner(&self, id: &str) -> String {
        self.one("owners", id)
    }
    /// Where paused sandbox `id`'s checkpoint is in object storage.
    pub fn checkpoint(&self, id: &str) -> String {
        self.one("checkpoints", id)
    }
    /// The head of sandbox `id`'s audit chain.
    pub fn audit_head(&self, id: &str) -> String {
        self.one("audit-heads", id)
    }
    /// Where template `name`'s files are in object storage.
    pub fn template_files(&self, name: &str) -> String {
        self.one("template-files", name)
    }
    /// The restart mark of node `name`.
    pub fn restarting(&self, name: &str) -> String {
        self.one("restarting", name)
    }
    /// The drain mark of node `name`.
    pub fn draining(&self, name: &str) -> String {
        self.one("draining", name)
    }
    /// The directory of `team`'s secrets (a range prefix).
    pub fn secrets_of(&self, team: &str) -> String {
        format!("{}/", self.one("secrets", team))
    }
    /// `team`'s secret `id`.
    pub fn secret(&self, team: &str, id: &str) -> String {
        format!("{}{}", self.secrets_of(team), escape(id))
    }
    /// The id of `team`'s secret named `name`.
    pub fn secret_name(&self, team: &str, name: &str) -> String {
        format!("{}/{}", self.one("secret-names", team), escape(name))
    }
    /// Volume `id`.
    pub fn volume(&self, id: &str) -> String {
        self.one("volumes", id)
    }
    /// The id of `team`'s volume named `name`.
    pub fn volume_name(&self, team: &str, name: &str) -> String {
        format!("{}/{}", self.one("volume-names", team), escape(name))
    }
    /// How many volumes `team` holds.
    pub fn volume_count(&self, team: &str) -> String {
        self.one("volume-counts", team)
    }
    /// The cluster's key `name` (sealed).
    pub fn cluster_key(&self, name: &str) -> String {
        self.one("cluster-keys", name)
    }
    /// A console session, by the SHA-256 of its id.
    pub fn console_session(&self, id_hash: &str) -> String {
        self.one("console-sessions", id_hash)
    }
    /// The directory of the failed console sign-ins of one address bucket (a range prefix).
    pub fn console_sign_ins(&self, bucket: &str) -> String {
        format!("{}/", self.one("console-sign-ins", bucket))
    }
    /// The key of the control replica leading the cluster's singletons.
    pub fn leader(&self) -> String {
        format!("{}/leader", self.prefix)
    }
    /// The key of the node running the bucket's garbage collection.
    pub fn gc_leader(&self) -> String {
        format!("{}/gc-leader", self.prefix)
    }
    /// Whether a round of the bucket's garbage collection runs (`running`, on the collector's
    /// lease) or not (`idle`).
    pub fn gc_round(&self) -> String {
        format!("{}/gc-round", self.prefix)
    }
}

/// The smallest key after every key that starts with `prefix` (etcd's range end of a prefix).
pub fn range_end(prefix: &str) -> String {
    let mut b = prefix.as_bytes().to_vec();
    while let Some(last) = b.pop() {
        if last < 0xff {
            b.push(last + 1);
            // Only ASCII prefixes are built here, so the result is still UTF-8.
            return String::from_utf8_lossy(&b).into_owned();
        }
    }
    "\0".to_string()
}

/// An i64 as 20 digits whose text order is the numbers' order (negative ones included).
pub fn ordered(v: i64) -> String {
    format!("{:020}", (v as u64) ^ (1 << 63))
}

/// The number an [`ordered`] text stands for.
pub fn from_ordered(text: &str) -> Option<i64> {
    let n: u64 = text.parse().ok()?;
    Some((n ^ (1 << 63)) as i64)
}

/// A key segment with `%` and `/` (and control bytes) escaped as `%XX`.
pub fn escape(seg: &str) -> String {
    let mut out = String::with_capacity(seg.len());
    for c in seg.chars() {
        match c {
            '%' | '/' => out.push_str(&format!("%{:02X}", c as u32)),
            c if c.is_ascii_control() => out.push_str(&format!("%{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// The inverse of [`escape`]; None for a malformed escape.
pub fn unescape(seg: &str) -> Option<String> {
    let b = seg.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = seg.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_numbers_sort_as_text() {
        let mut v = [i64::MIN, -5, -1, 0, 1, 99, 1_700_000_000_000, i64::MAX];
        let mut texts: Vec<String> = v.iter().map(|&n| ordered(n)).collect();
        texts.sort();
        v.sort();
        assert_eq!(texts, v.iter().map(|&n| ordered(n)).collect::<Vec<_>>());
        assert!(texts.iter().all(|t| t.len() == 20));
        assert!(v.iter().all(|&n| from_ordered(&ordered(n)) == Some(n)));
    }

    #[test]
    fn segments_escape_and_round_trip() {
        for s in ["plain", "a/b", "100%", "x\ny", "é/%2F"] {
            let e = escape(s);
            assert!(!e.contains('/'), "{e}");
            assert_eq!(unescape(&e).as_deref(), Some(s));
        }
        let k = Keys::new("/kiln/");
        assert_eq!(k.sandbox("a/b"), "/kiln/sandboxes/a%2Fb");
        assert!(k.events_of("a").starts_with("/kiln/events/a/"));
        assert!(!k.new_event("ab", 1).starts_with(&k.events_of("a")));
        let at = k.idempotent_at(5, "team/route", "k/1");
        assert_eq!(
            k.parse_idempotent_at(&at),
            Some(("team/route".to_string(), "k/1".to_string()))
        );
    }

    #[test]
    fn expiry_range_covers_exactly_the_due() {
        let k = Keys::new("/kiln");
        let end = k.expiry_end(100);
        assert!(k.expiry(100, "z") < end && k.expiry(-3, "a") < end);
        assert!(k.expiry(101, "a") >= end);
        assert_eq!(k.expiry_end(i64::MAX), range_end("/kiln/expiry/"));
        assert_eq!(range_end("/kiln/a/"), "/kiln/a0");
    }
}
