//! API keys, templates, teams and idempotent answers on etcd.

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use kiln_server::store::{now_ms, IdempotentAnswer, KeyRecord, TeamRecord, TemplateRecord};

use crate::docs::{json, parse, IdempotentDoc, KeyDoc, TeamDoc, TemplateDoc};
use crate::error::{ClusterError, Result};
use crate::retry::Kind;
use crate::store::{EtcdStore, Step};

/// How many old idempotent answers one lookup deletes at most.
const SWEEP: i64 = 64;

impl EtcdStore {
    pub(crate) async fn insert_key_doc(&self, k: &KeyRecord) -> Result<()> {
        let (id_key, hash_key) = (self.keys().key(&k.id), self.keys().key_hash(&k.hash));
        let ops = vec![
            TxnOp::put(id_key.as_str(), json(&KeyDoc::from(k)), None),
            TxnOp::put(hash_key.as_str(), k.id.as_bytes(), None),
        ];
        if !self.create(&[id_key, hash_key], ops).await? {
            return Err(ClusterError::Exists {
                what: "API key",
                id: k.id.clone(),
            });
        }
        Ok(())
    }

    pub(crate) async fn list_key_docs(&self) -> Result<Vec<KeyRecord>> {
        let mut out: Vec<KeyRecord> = Vec::new();
        for kv in self.get_prefix(&self.keys().dir("keys"), 0).await? {
            out.push(parse::<KeyDoc>(kv.key(), kv.value())?.into());
        }
        out.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(out)
    }

    pub(crate) async fn key_doc_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>> {
        let Some(id) = self.get_one(&self.keys().key_hash(hash)).await? else {
            return Ok(None);
        };
        let id = String::from_utf8_lossy(id.value()).into_owned();
        let Some(kv) = self.get_one(&self.keys().key(&id)).await? else {
            return Ok(None);
        };
        Ok(Some(parse::<KeyDoc>(kv.key(), kv.value())?.into()))
    }

    /// Changes the key `id` with `f` (revision-checked); false when there is no such key or
    /// `f` changed nothing.
    async fn update_key(&self, id: &str, f: impl Fn(&mut KeyDoc) -> bool) -> Result<bool> {
        let key = self.keys().key(id);
        self.read_modify_write(std::slice::from_ref(&key), |seen| {
            let Some(kv) = &seen[0] else {
                return Ok(Step::Done(false));
            };
            let mut doc: KeyDoc = parse(kv.key(), kv.value())?;
            if !f(&mut doc) {
                return Ok(Step::Done(false));
            }
            Ok(Step::Write(
                vec![TxnOp::put(key.as_str(), json(&doc), None)],
                true,
            ))
        })
        .await
    }

    pub(crate) async fn touch_key_doc(&self, id: &str) -> Result<()> {
        self.update_key(id, |k| {
            k.last_used_ms = Some(now_ms());
            true
        })
        .await
        .map(drop)
    }

    pub(crate) async fn revoke_key_doc(&self, id: &str) -> Result<bool> {
        self.update_key(id, |k| {
            if k.revoked_at_ms.is_some() {
                return false;
            }
            k.revoked_at_ms = Some(now_ms());
            true
        })
        .await
    }

    /// Records a template, keeping the spawn counters of the one it replaces.
    pub(crate) async fn upsert_template_doc(&self, t: &TemplateRecord) -> Result<()> {
        let key = self.keys().template(&t.name);
        self.read_modify_write(std::slice::from_ref(&key), |seen| {
            let mut doc = TemplateDoc::from(t);
            if let Some(kv) = &seen[0] {
                let old: TemplateDoc = parse(kv.key(), kv.value())?;
                doc.spawn_count = old.spawn_count;
                doc.last_spawned_ms = old.last_spawned_ms;
            }
            Ok(Step::Write(
                vec![TxnOp::put(key.as_str(), json(&doc), None)],
                (),
            ))
        })
        .await
    }

    pub(crate) async fn get_template_doc(&self, name: &str) -> Result<Option<TemplateRecord>> {
        self.get_one(&self.keys().template(name))
            .await?
            .map(|kv| Ok(parse::<TemplateDoc>(kv.key(), kv.value())?.into()))
            .transpose()
    }

    /// Records a team's quotas, keeping the creation time of the one it replaces.
    pub(crate) async fn upsert_team_doc(&self, t: &TeamRecord) -> Result<()> {
        let key = self.keys().team(&t.name);
        self.read_modify_write(std::slice::from_ref(&key), |seen| {
            let mut doc = TeamDoc::from(t);
            if let Some(kv) = &seen[0] {
                doc.created_at_ms = parse::<TeamDoc>(kv.key(), kv.value())?.created_at_ms;
            }
            Ok(Step::Write(
                vec![TxnOp::put(key.as_str(), json(&doc), None)],
                (),
            ))
        })
        .await
    }

    pub(crate) async fn get_team_doc(&self, name: &str) -> Result<Option<TeamRecord>> {
        self.get_one(&self.keys().team(name))
            .await?
            .map(|kv| Ok(parse::<TeamDoc>(kv.key(), kv.value())?.into()))
            .transpose()
    }

    pub(crate) async fn list_team_docs(&self) -> Result<Vec<TeamRecord>> {
        let mut out: Vec<TeamRecord> = Vec::new();
        for kv in self.get_prefix(&self.keys().dir("teams"), 0).await? {
            out.push(parse::<TeamDoc>(kv.key(), kv.value())?.into());
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn idempotent_ops(&self, a: &IdempotentAnswer) -> Vec<TxnOp> {
        let k = self.keys();
        vec![
            TxnOp::put(
                k.idempotent(&a.scope, &a.key),
                json(&IdempotentDoc::from(a)),
                None,
            ),
            TxnOp::put(
                k.idempotent_at(a.created_at_ms, &a.scope, &a.key),
                Vec::new(),
                None,
            ),
        ]
    }

    /// Records an answer, replacing an older one of the same scope and key.
    pub(crate) async fn put_idempotent_doc(&self, a: &IdempotentAnswer) -> Result<()> {
        self.commit(self.idempotent_ops(a)).await
    }

    /// Records `a` only when its scope and key have no answer yet. Of two replicas racing to
    /// record an answer for one key, exactly one gets `None` (it recorded); the other gets the
    /// winner's answer.
    pub async fn claim_idempotent(&self, a: &IdempotentAnswer) -> Result<Option<IdempotentAnswer>> {
        let key = self.keys().idempotent(&a.scope, &a.key);
        // One txn: record when absent, else read the answer that is there.
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then(self.idempotent_ops(a))
            .or_else([TxnOp::get(key.as_str(), None)]);
        let r = self.txn(Kind::Write, txn).await?;
        if r.succeeded() {
            return Ok(None);
        }
        // The compare failed because the key existed at the txn's revision, which the read in
        // the same txn sees: a missing answer here is etcd misbehaving, reported as contention.
        let Some(TxnOpResponse::Get(mut got)) = r.op_responses().into_iter().next() else {
            return Err(ClusterError::Contended { key, tries: 1 });
        };
        let Some(kv) = got.take_kvs().into_iter().next() else {
            return Err(ClusterError::Contended { key, tries: 1 });
        };
        let doc: IdempotentDoc = parse(kv.key(), kv.value())?;
        Ok(Some(doc.into_answer(kv.key())?))
    }

    /// The answer for `scope` and `key` recorded at or after `since_ms`. Answers older than
    /// that are deleted on the way (a bounded batch per call, found through their time keys).
    pub(crate) async fn get_idempotent_doc(
        &self,
        scope: &str,
        key: &str,
        since_ms: i64,
    ) -> Result<Option<IdempotentAnswer>> {
        self.sweep_idempotent(since_ms).await?;
        let Some(kv) = self.get_one(&self.keys().idempotent(scope, key)).await? else {
            return Ok(None);
        };
        let doc: IdempotentDoc = parse(kv.key(), kv.value())?;
        if doc.created_at_ms < since_ms {
            return Ok(None);
        }
        Ok(Some(doc.into_answer(kv.key())?))
    }

    /// Deletes up to [`SWEEP`] answers recorded before `since_ms` and their time keys. An
    /// answer recorded again meanwhile (a newer time) keeps its value.
    async fn sweep_idempotent(&self, since_ms: i64) -> Result<()> {
        let k = self.keys();
        let old = self
            .get_range(
                &k.dir("idempotency-at"),
                &k.idempotent_at_start(since_ms),
                SWEEP,
                true,
            )
            .await?;
        for at in old {
            let at_key = String::from_utf8_lossy(at.key()).into_owned();
            let Some((scope, key)) = k.parse_idempotent_at(&at_key) else {
                self.commit(vec![TxnOp::delete(at_key.as_str(), None)])
                    .await?;
                continue;
            };
            let answer = k.idempotent(&scope, &key);
            self.read_modify_write(std::slice::from_ref(&answer), |seen| {
                let mut ops = vec![TxnOp::delete(at_key.as_str(), None)];
                if let Some(kv) = &seen[0] {
                    let doc: IdempotentDoc = parse(kv.key(), kv.value())?;
                    if doc.created_at_ms < since_ms {
                        ops.push(TxnOp::delete(answer.as_str(), None));
                    }
                }
                Ok(Step::Write(ops, ()))
            })
            .await?;
        }
        Ok(())
    }
}
