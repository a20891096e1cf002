//! Where a template's files are in object storage: `template-files/{name}` names the build
//! (its key and metadata) and the manifest of one tar archive of its root filesystem, so a
//! node that lacks the template fetches it ([`crate::node::templates`]). A newer build
//! recorded under the name replaces the older record.

use etcd_client::{Txn, TxnOp};
use serde::{Deserialize, Serialize};

use crate::docs::{json, parse};
use crate::error::Result;
use crate::retry::Kind;
use crate::store::EtcdStore;

/// The template name of a create's `templateID` (`name` or `name:tag`).
pub fn name_of(template: &str) -> &str {
    template.split_once(':').map_or(template, |(name, _)| name)
}

/// One template's files in object storage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateFilesDoc {
    pub name: String,
    /// The build the archive holds, and its `template.json` (user, workdir, env, commands,
    /// sizes).
    pub key: String,
    pub meta: serde_json::Value,
    /// The chunk store's manifest id of the archive.
    pub manifest: String,
    /// The archive's bytes, and those its upload sent (the bucket lacked them).
    pub bytes: u64,
    pub bytes_uploaded: u64,
    /// The node that stored it, when, and how long packing and the upload took (ms).
    pub node: String,
    pub at_ms: i64,
    pub upload_ms: u64,
}

impl EtcdStore {
    /// Records where template `doc.name`'s files are.
    pub async fn put_template_files(&self, doc: &TemplateFilesDoc) -> Result<()> {
        let put = TxnOp::put(self.keys().template_files(&doc.name), json(doc), None);
        self.txn(Kind::Write, Txn::new().and_then([put])).await?;
        Ok(())
    }

    /// Where template `name`'s files are in object storage, if some node stored them.
    pub async fn template_files(&self, name: &str) -> Result<Option<TemplateFilesDoc>> {
        match self.get_one(&self.keys().template_files(name)).await? {
            Some(kv) => Ok(Some(parse(kv.key(), kv.value())?)),
            None => Ok(None),
        }
    }

    /// Every template whose files are in object storage.
    pub async fn all_template_files(&self) -> Result<Vec<TemplateFilesDoc>> {
        self.get_prefix(&self.keys().dir("template-files"), 0)
            .await?
            .iter()
            .map(|kv| parse(kv.key(), kv.value()))
            .collect()
    }

    /// The manifests every template's files record names (what the bucket's collection keeps).
    pub(crate) async fn template_manifests(&self) -> Result<Vec<String>> {
        Ok(self
            .all_template_files()
            .await?
            .into_iter()
            .map(|d| d.manifest)
            .collect())
    }
}
