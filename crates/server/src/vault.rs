//! Secrets' values at rest: sealed with ChaCha20-Poly1305 (ring's AEAD) under a server key
//! kept in `<state>/secrets.key` (32 random bytes, mode 0600, made at first start), with the
//! team and the secret's id as associated data, so a sealed value moved to another row or
//! team does not open. The clear value exists only in the server's memory, for the egress proxy
//! to inject ([`Vault::value`]); nothing answers it to a client. Opened values are kept in a
//! small in-memory cache (zeroised when dropped), so an intercepted request costs no SQLite
//! read and no AEAD open: every write through the vault ([`Vault::insert`],
//! [`Vault::new_version`], [`Vault::delete`]) empties it, and so does [`Vault::forget`] (a
//! cluster node calls it when another process changed a secret), and an entry is read again
//! after [`CACHE_TTL`] whatever happens, which bounds how long a change made past the vault can
//! go unseen. The records live behind [`SecretStore`]: the state database on one host, etcd on
//! a cluster (whose processes share one key, [`Vault::with_store`]); the sealed settings of the
//! host's own sandboxes stay in its state database ([`Vault::db`]).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};

use zeroize::Zeroizing;

use crate::store::{SecretRecord, SecretStore, SecretsDb};

/// File name of the server key in the state directory.
pub const KEY_FILE: &str = "secrets.key";
const KEY_LEN: usize = 32;
/// How long an opened value is used before it is read from the database again.
pub const CACHE_TTL: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum VaultError {
    #[error("secrets key {path}: {source}")]
    Key {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("secrets key {0} is not {KEY_LEN} bytes long: restore it from a backup or remove it (every stored secret then has to be set again)")]
    KeyLength(String),
    #[error("a stored secret does not open with this server's key (the key file was replaced?)")]
    Open,
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

/// The key, the secrets' records and the host's sealed per-sandbox settings.
pub struct Vault {
    key: LessSafeKey,
    rng: SystemRandom,
    records: Arc<dyn SecretStore>,
    local: Option<SecretsDb>,
    cache: Mutex<Cache>,
}

/// Opened values by (team, lower-case name). `generation` moves on every write, so a read that
/// began before a write does not put the value it read back after the write emptied the cache.
#[derive(Default)]
struct Cache {
    generation: u64,
    values: HashMap<(String, String), (Zeroizing<String>, Instant)>,
}

/// Writes a new key file at `path`: owner-only (0600) from its creation, synced, and put in
/// place by a rename, so a crash never leaves half a key under its name. The vault's and the
/// identity issuer's keys are written so.
pub(crate) fn write_key_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("key.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes).and_then(|()| f.sync_all())?;
    std::fs::rename(&tmp, path)
}

/// Reads the key at `path`, making a new random one (mode 0600) when there is none.
fn load_or_make_key(path: &Path) -> Result<Vec<u8>, VaultError> {
    let err = |source| VaultError::Key {
        path: path.display().to_string(),
        source,
    };
    match std::fs::read(path) {
        Ok(k) if k.len() == KEY_LEN => {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
            Ok(k)
        }
        Ok(_) => Err(VaultError::KeyLength(path.display().to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut k = vec![0u8; KEY_LEN];
            SystemRandom::new()
                .fill(&mut k)
                .map_err(|_| err(std::io::Error::other("no system randomness")))?;
            write_key_file(path, &k).map_err(err)?;
            Ok(k)
        }
        Err(e) => Err(err(e)),
    }
}

fn aad(team: &str, id: &str) -> Vec<u8> {
    format!("kiln-secret\0{team}\0{id}").into_bytes()
}

impl Vault {
    /// Opens the vault of the state directory `state_dir` (making its key on first use).
    /// Its secrets and the sandboxes' sealed settings are both kept in `db`.
    pub fn open(state_dir: &Path, db: SecretsDb) -> Result<Self, VaultError> {
        let k = load_or_make_key(&state_dir.join(KEY_FILE))?;
        Self::with_store(&k, Arc::new(db.clone()), Some(db))
    }

    /// A vault sealing with `k` (32 bytes), its secrets kept in `records` and the host's
    /// sandboxes' sealed settings in `local` (None: a process that runs no sandbox).
    pub fn with_store(
        k: &[u8],
        records: Arc<dyn SecretStore>,
        local: Option<SecretsDb>,
    ) -> Result<Self, VaultError> {
        let key = UnboundKey::new(&CHACHA20_POLY1305, k)
            .map_err(|_| VaultError::KeyLength("(in memory)".into()))?;
        Ok(Self {
            key: LessSafeKey::new(key),
            rng: SystemRandom::new(),
            records,
            local,
            cache: Mutex::new(Cache::default()),
        })
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets every opened value (after a write: the key of the write may be an id; or told
    /// that another process changed a secret).
    pub fn forget(&self) {
        let mut c = self.cache();
        c.generation += 1;
        c.values.clear();
    }

    /// Stores a new secret (false: its name is taken).
    pub async fn insert(&self, s: &SecretRecord) -> Result<bool, VaultError> {
        let r = self.records.insert(s).await;
        self.forget();
        Ok(r?)
    }

    /// Makes the value `seal` seals the next version of `team`'s secret `key` (id or name); see
    /// [`SecretStore::new_version`].
    pub async fn new_version(
        &self,
        team: &str,
        key: &str,
        seal: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static,
        metadata: Option<BTreeMap<String, String>>,
        now_ms: i64,
    ) -> Result<Option<SecretRecord>, VaultError> {
        let r = self
            .records
            .new_version(team, key, Box::new(seal), metadata, now_ms)
            .await;
        self.forget();
        Ok(r?)
    }

    /// Deletes `team`'s secret `key` (id or name); false when there is none.
    pub async fn delete(&self, team: &str, key: &str) -> Result<bool, VaultError> {
        let r = self.records.delete(team, key).await;
        self.forget();
        Ok(r?)
    }

    /// The secrets' records.
    pub fn records(&self) -> &dyn SecretStore {
        self.records.as_ref()
    }

    /// The host's table of its sandboxes' sealed settings (None: this process runs none).
    pub fn db(&self) -> Option<&SecretsDb> {
        self.local.as_ref()
    }

    /// `value` sealed for secret `id` of `team`: a random nonce, then ciphertext and tag.
    pub fn seal(&self, team: &str, id: &str, value: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        // The system RNG failing is not recoverable; ring's only failure mode here.
        self.rng.fill(&mut nonce).expect("system randomness");
        let mut out = value.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(team, id)),
                &mut out,
            )
            .expect("sealing a bounded value");
        let mut sealed = nonce.to_vec();
        sealed.extend(out);
        sealed
    }

    /// The clear value of a sealed secret.
    pub fn unseal(&self, team: &str, id: &str, sealed: &[u8]) -> Result<Vec<u8>, VaultError> {
        if sealed.len() < NONCE_LEN {
            return Err(VaultError::Open);
        }
        let (n, ct) = sealed.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(n).map_err(|_| VaultError::Open)?;
        let mut buf = ct.to_vec();
        let len = self
            .key
            .open_in_place(nonce, Aad::from(aad(team, id)), &mut buf)
            .map_err(|_| VaultError::Open)?
            .len();
        buf.truncate(len);
        Ok(buf)
    }

    /// The current value of `team`'s secret named `name`; `None` when it has none.
    pub async fn value(&self, team: &str, name: &str) -> Result<Option<String>, VaultError> {
        let key = (team.to_string(), name.to_ascii_lowercase());
        let generation = {
            let c = self.cache();
            if let Some((v, at)) = c.values.get(&key) {
                if at.elapsed() < CACHE_TTL {
                    return Ok(Some(v.to_string()));
                }
            }
            c.generation
        };
        let Some(s) = self.records.get(team, &key.1).await? else {
            return Ok(None);
        };
        if s.name != key.1 {
            return Ok(None);
        }
        let clear = Zeroizing::new(self.unseal(team, &s.id, &s.sealed)?);
        let v = Zeroizing::new(String::from_utf8_lossy(&clear).into_owned());
        let out = v.to_string();
        let mut c = self.cache();
        if c.generation == generation {
            c.values.insert(key, (v, Instant::now()));
        }
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_file_is_made_once_with_mode_0600_and_seals_bind_team_and_id() {
        let dir = tempfile::tempdir().unwrap();
        let v = Vault::open(dir.path(), SecretsDb::open_in_memory().unwrap()).unwrap();
        let path = dir.path().join(KEY_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let key = std::fs::read(&path).unwrap();
        let sealed = v.seal("red", "sec_1", b"hunter2");
        assert!(!sealed.windows(7).any(|w| w == b"hunter2"));
        assert_eq!(v.unseal("red", "sec_1", &sealed).unwrap(), b"hunter2");
        assert!(v.unseal("blue", "sec_1", &sealed).is_err());
        assert!(v.unseal("red", "sec_2", &sealed).is_err());
        // Reopened: the same key, so old values still open.
        let v2 = Vault::open(dir.path(), SecretsDb::open_in_memory().unwrap()).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), key);
        assert_eq!(v2.unseal("red", "sec_1", &sealed).unwrap(), b"hunter2");
        std::fs::write(&path, b"short").unwrap();
        assert!(matches!(
            Vault::open(dir.path(), SecretsDb::open_in_memory().unwrap()),
            Err(VaultError::KeyLength(_))
        ));
    }

    fn record(v: &Vault, team: &str, id: &str, name: &str, value: &str) -> SecretRecord {
        SecretRecord {
            id: id.into(),
            team: team.into(),
            name: name.into(),
            version: 1,
            metadata: BTreeMap::new(),
            sealed: v.seal(team, id, value.as_bytes()),
            created_at_ms: 1,
            updated_at_ms: 1,
        }
    }

    #[tokio::test]
    async fn opened_values_are_cached_until_a_write_through_the_vault() {
        let dir = tempfile::tempdir().unwrap();
        let v = Vault::open(dir.path(), SecretsDb::open_in_memory().unwrap()).unwrap();
        assert!(v
            .insert(&record(&v, "red", "sec_1", "svc", "one"))
            .await
            .unwrap());
        assert_eq!(v.value("red", "SVC").await.unwrap().as_deref(), Some("one"));
        assert_eq!(v.value("blue", "svc").await.unwrap(), None);
        // A change made past the vault is not seen while the entry is fresh: the value comes
        // from memory, not from the database.
        let sealed = v.seal("red", "sec_1", b"two");
        v.records()
            .new_version("red", "svc", Box::new(move |_| sealed.clone()), None, 2)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(v.value("red", "svc").await.unwrap().as_deref(), Some("one"));
        // A write through the vault is seen at once, by id as by name.
        let v2 = std::sync::Arc::new(v);
        let sealer = v2.clone();
        v2.new_version(
            "red",
            "sec_1",
            move |id| sealer.seal("red", id, b"three"),
            None,
            3,
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(
            v2.value("red", "svc").await.unwrap().as_deref(),
            Some("three")
        );
        assert!(v2.delete("red", "sec_1").await.unwrap());
        assert_eq!(v2.value("red", "svc").await.unwrap(), None);
        assert!(v2
            .insert(&record(&v2, "red", "sec_2", "svc", "four"))
            .await
            .unwrap());
        assert_eq!(
            v2.value("red", "svc").await.unwrap().as_deref(),
            Some("four")
        );
    }
}
