//! Volumes' records in etcd. A volume's files live on one node (its **home**): `volumes/{id}`
//! holds the server's volume record and that node's name, `volume-names/{team}/{name}` takes
//! its name, and `volume-counts/{team}` counts the team's volumes, so that a create checks the
//! team's cap and takes the name in one revision-checked txn (creates racing through replicas
//! never pass the cap together). A delete removes the three in one txn too.

use etcd_client::TxnOp;
use kiln_server::store::{Inserted, VolumeRecord};
use serde::{Deserialize, Serialize};

use crate::error::{ClusterError, Result};
use crate::store::{EtcdStore, Step};

/// A volume as the cluster records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeDoc {
    pub id: String,
    pub team: String,
    pub name: String,
    /// Bearer token of the volume-content API.
    pub token: String,
    pub size_mb: u32,
    pub created_at_ms: i64,
    /// The node that keeps its files.
    pub node: String,
}

impl VolumeDoc {
    pub fn record(&self) -> VolumeRecord {
        VolumeRecord {
            id: self.id.clone(),
            team: self.team.clone(),
            name: self.name.clone(),
            token: self.token.clone(),
            size_mb: self.size_mb,
            created_at_ms: self.created_at_ms,
        }
    }
}

fn parse(key: &str, value: &[u8]) -> Result<VolumeDoc> {
    serde_json::from_slice(value).map_err(|source| ClusterError::Corrupt {
        key: key.to_string(),
        source,
    })
}

fn count_of(v: Option<&etcd_client::KeyValue>) -> u64 {
    v.and_then(|kv| std::str::from_utf8(kv.value()).ok()?.parse().ok())
        .unwrap_or(0)
}

impl EtcdStore {
    /// Records volume `d` unless its team has one of its name or holds `cap` volumes already.
    pub async fn insert_volume(&self, d: &VolumeDoc, cap: Option<u32>) -> Result<Inserted> {
        let keys = self.keys();
        let (rec, name, count) = (
            keys.volume(&d.id),
            keys.volume_name(&d.team, &d.name),
            keys.volume_count(&d.team),
        );
        let value = serde_json::to_vec(d).map_err(|source| ClusterError::Corrupt {
            key: rec.clone(),
            source,
        })?;
        self.read_modify_write(&[name.clone(), count.clone(), rec.clone()], |seen| {
            if seen[0].is_some() {
                return Ok(Step::Done(Inserted::NameTaken));
            }
            let held = count_of(seen[1].as_ref());
            if cap.is_some_and(|c| held >= u64::from(c)) {
                return Ok(Step::Done(Inserted::Full(held)));
            }
            let ops = vec![
                TxnOp::put(rec.as_str(), value.clone(), None),
                TxnOp::put(name.as_str(), d.id.as_str(), None),
                TxnOp::put(count.as_str(), (held + 1).to_string(), None),
            ];
            Ok(Step::Write(ops, Inserted::Done))
        })
        .await
    }

    /// Volume `id`, of any team.
    pub async fn volume_doc(&self, id: &str) -> Result<Option<VolumeDoc>> {
        let key = self.keys().volume(id);
        match self.get_one(&key).await? {
            Some(kv) => Ok(Some(parse(&key, kv.value())?)),
            None => Ok(None),
        }
    }

    /// `team`'s volume whose id or name is `key`.
    pub async fn volume_for(&self, team: &str, key: &str) -> Result<Option<VolumeDoc>> {
        if let Some(d) = self.volume_doc(key).await?.filter(|d| d.team == team) {
            return Ok(Some(d));
        }
        let Some(id) = self.get_one(&self.keys().volume_name(team, key)).await? else {
            return Ok(None);
        };
        let id = String::from_utf8_lossy(id.value()).into_owned();
        Ok(self.volume_doc(&id).await?.filter(|d| d.team == team))
    }

    /// The volumes of `team` (of every team when None), oldest first.
    pub async fn volumes_of(&self, team: Option<&str>) -> Result<Vec<VolumeDoc>> {
        let dir = self.keys().dir("volumes");
        let mut out = Vec::new();
        for kv in self.get_prefix(&dir, 0).await? {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let d = parse(&key, kv.value())?;
            if team.is_none_or(|t| t == d.team) {
                out.push(d);
            }
        }
        out.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(out)
    }

    /// Forgets volume `d` (its record, its name, one less for its team); false when it was
    /// gone already.
    pub async fn remove_volume(&self, d: &VolumeDoc) -> Result<bool> {
        let keys = self.keys();
        let (rec, name, count) = (
            keys.volume(&d.id),
            keys.volume_name(&d.team, &d.name),
            keys.volume_count(&d.team),
        );
        self.read_modify_write(&[rec.clone(), name.clone(), count.clone()], |seen| {
            if seen[0].is_none() {
                return Ok(Step::Done(false));
            }
            let mut ops = vec![TxnOp::delete(rec.as_str(), None)];
            if seen[1]
                .as_ref()
                .is_some_and(|kv| kv.value() == d.id.as_bytes())
            {
                ops.push(TxnOp::delete(name.as_str(), None));
            }
            let held = count_of(seen[2].as_ref()).saturating_sub(1);
            ops.push(TxnOp::put(count.as_str(), held.to_string(), None));
            Ok(Step::Write(ops, true))
        })
        .await
    }
}
