//! Templates on a cluster: each node reports the templates it holds with its registration
//! ([`NodeTemplate`]); a replica lists their union (`GET /templates`), and a create goes to a
//! node that holds its template, as does a paused sandbox moving to another node and a fork's
//! child started away from its parent, and a create from a snapshot borrowed from the bucket.
//! When no node that holds it can take the sandbox (all full or draining), a node with object
//! storage can: a holder stores the template in the bucket and the chosen node fetches it
//! ([`crate::node::templates`]).

use std::collections::BTreeMap;
use std::path::PathBuf;

use kiln_server::manager::TemplateView;
use kiln_server::store::TemplateRecord;
use kiln_server::templates::{check_name, TemplateInfo};
use kiln_server::Error;

use super::service::ClusterService;
use crate::nodes::{NodeInfo, NodeTemplate};
use crate::template_files::{name_of, TemplateFilesDoc};
use kiln_template::Template;

type Result<T, E = Error> = std::result::Result<T, E>;

impl ClusterService {
    /// Every template some live node holds, or whose files are in object storage, by name.
    pub(super) async fn cluster_templates(&self) -> Result<Vec<TemplateView>> {
        let mut all = union(&self.cache.nodes());
        for doc in self.stored_templates().await? {
            if !all.contains_key(&doc.name) {
                let t = self.stored_view(&doc);
                all.insert(t.name.clone(), t);
            }
        }
        Ok(all.values().map(view).collect())
    }

    /// Template `name`, as the live nodes that hold it report it, else as object storage
    /// keeps it.
    pub(super) async fn cluster_template(&self, name: &str) -> Result<TemplateView> {
        check_name(name)?;
        if let Some(t) = union(&self.cache.nodes()).get(name) {
            return Ok(view(t));
        }
        match self.stored(name).await? {
            Some(doc) => Ok(view(&self.stored_view(&doc))),
            None => Err(not_held(name)),
        }
    }

    /// Of `nodes`, those that hold template `template` (a name, or `name:tag`): a create's
    /// candidates. None of them when no live node holds it but its files are in object
    /// storage ([`Self::fetchers`] then finds the nodes that fetch it); 404 when neither.
    pub(super) async fn holding(
        &self,
        mut nodes: Vec<NodeInfo>,
        template: &str,
    ) -> Result<Vec<NodeInfo>> {
        let name = name_of(template);
        check_name(name)?;
        if !self.cache.nodes().iter().any(|n| n.has_template(name)) {
            return match self.stored(name).await? {
                Some(_) => Ok(Vec::new()),
                None => Err(not_held(name)),
            };
        }
        nodes.retain(|n| n.has_template(name));
        Ok(nodes)
    }

    /// The nodes that can take a create of `template` when none that holds it can: those with
    /// object storage that lack it, once a node that holds it stored it there, or when its
    /// files are there already and no live node holds it (the chosen node fetches it before
    /// the create). Empty when neither.
    pub(super) async fn fetchers(&self, template: &str) -> Vec<NodeInfo> {
        let name = name_of(template);
        let mut nodes = self.candidates();
        nodes.retain(|n| !n.has_template(name));
        self.fetchers_among(nodes, name).await
    }

    /// Of `nodes` (none holding template `name`), those with object storage, once a live
    /// holder stored the template there (or, with no live holder, once some node did); empty
    /// when none could.
    async fn fetchers_among(&self, mut nodes: Vec<NodeInfo>, name: &str) -> Vec<NodeInfo> {
        nodes.retain(|n| n.objects);
        if nodes.is_empty() {
            return nodes;
        }
        let live = self.cache.nodes();
        let holders: Vec<&NodeInfo> = live.iter().filter(|h| h.has_template(name)).collect();
        if holders.is_empty() {
            return match self.stored(name).await {
                Ok(Some(_)) => nodes,
                Ok(None) => Vec::new(),
                Err(e) => {
                    tracing::warn!(template = name, error = %e, "reading where a template's files are");
                    Vec::new()
                }
            };
        }
        for h in holders.into_iter().filter(|h| h.objects) {
            match self.nodes.share_template(&h.address, name).await {
                Ok(()) => return nodes,
                Err(e) => {
                    tracing::warn!(node = %h.name, template = name, error = %e, "storing a template for another node");
                }
            }
        }
        Vec::new()
    }

    /// Of `nodes`, those that can run a sandbox made from `template`: those that hold it; when
    /// none of them does, those that fetch it from object storage ([`Self::fetchers`]); all of
    /// them when the cluster knows no template of that name (a sandbox started from a snapshot
    /// names the snapshot; its node decides).
    pub(super) async fn able_to_run(&self, nodes: Vec<NodeInfo>, template: &str) -> Vec<NodeInfo> {
        let name = name_of(template);
        let held = self.cache.nodes().iter().any(|n| n.has_template(name));
        if !held && !matches!(self.stored(name).await, Ok(Some(_))) {
            return nodes;
        }
        let (holders, others): (Vec<_>, Vec<_>) =
            nodes.into_iter().partition(|n| n.has_template(name));
        if !holders.is_empty() {
            return holders;
        }
        self.fetchers_among(others, name).await
    }

    /// Where template `name`'s files are in object storage, if some node stored them.
    async fn stored(&self, name: &str) -> Result<Option<TemplateFilesDoc>> {
        self.etcd.template_files(name).await.map_err(|e| {
            Error::Unavailable(format!(
                "reading where template \"{name}\"'s files are: {e}"
            ))
        })
    }

    async fn stored_templates(&self) -> Result<Vec<TemplateFilesDoc>> {
        self.etcd.all_template_files().await.map_err(|e| {
            Error::Unavailable(format!("reading the templates in object storage: {e}"))
        })
    }

    /// What a node would report of the template build `doc` stored (its sizes as this
    /// replica's defaults fill them in).
    fn stored_view(&self, doc: &TemplateFilesDoc) -> NodeTemplate {
        let meta: Option<Template> = serde_json::from_value(doc.meta.clone()).ok();
        let (memory_mb, disk_mb, built_at_unix, size_bytes) = match &meta {
            Some(t) => (t.memory_mb, t.disk_mb, t.built_at_unix, t.size_bytes),
            None => (None, None, 0, doc.bytes),
        };
        NodeTemplate {
            name: doc.name.clone(),
            key: doc.key.clone(),
            cpu_count: self.cfg.default_cpu_count,
            memory_mb: memory_mb.unwrap_or(self.cfg.default_memory_mb),
            disk_mb: u64::from(disk_mb.unwrap_or(self.cfg.default_disk_mb)),
            built_at_unix,
            size_bytes,
            spawn_count: 0,
            last_spawned_ms: None,
        }
    }
}

fn not_held(name: &str) -> Error {
    Error::NotFound(format!(
        "template \"{name}\" is on no node of the cluster; build it on the nodes with \
         `kiln template build {name}`"
    ))
}

/// Per template name over `nodes`: the newest build any of them holds, with the sandboxes
/// started from the name on every node counted together.
pub(super) fn union(nodes: &[NodeInfo]) -> BTreeMap<String, NodeTemplate> {
    let mut out: BTreeMap<String, NodeTemplate> = BTreeMap::new();
    for t in nodes.iter().flat_map(|n| &n.templates) {
        let Some(seen) = out.get_mut(&t.name) else {
            out.insert(t.name.clone(), t.clone());
            continue;
        };
        let spawn_count = seen.spawn_count + t.spawn_count;
        let last_spawned_ms = seen.last_spawned_ms.max(t.last_spawned_ms);
        if (t.built_at_unix, &t.key) > (seen.built_at_unix, &seen.key) {
            *seen = t.clone();
        }
        seen.spawn_count = spawn_count;
        seen.last_spawned_ms = last_spawned_ms;
    }
    out
}

/// What the API shows of `t` (a replica has none of its files).
fn view(t: &NodeTemplate) -> TemplateView {
    TemplateView {
        info: TemplateInfo {
            name: t.name.clone(),
            key: t.key.clone(),
            rootfs: PathBuf::new(),
            image: None,
            user: String::new(),
            workdir: String::new(),
            env: BTreeMap::new(),
            start_cmd: None,
            ready_cmd: None,
            memory_mb: Some(t.memory_mb),
            disk_mb: u32::try_from(t.disk_mb).ok(),
            built_at_unix: t.built_at_unix,
            size_bytes: t.size_bytes,
        },
        record: Some(TemplateRecord {
            name: t.name.clone(),
            key: t.key.clone(),
            built_at_ms: (t.built_at_unix as i64).saturating_mul(1000),
            size_bytes: t.size_bytes,
            spawn_count: t.spawn_count,
            last_spawned_ms: t.last_spawned_ms,
            image: None,
        }),
        cpu_count: t.cpu_count,
        memory_mb: t.memory_mb,
        disk_mb: t.disk_mb,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodes::{NodeCapacity, NodeLoad};

    fn template(name: &str, key: &str, built: u64, spawns: u64, last: Option<i64>) -> NodeTemplate {
        NodeTemplate {
            name: name.into(),
            key: key.into(),
            cpu_count: 2,
            memory_mb: 512,
            disk_mb: 2048,
            built_at_unix: built,
            size_bytes: 1,
            spawn_count: spawns,
            last_spawned_ms: last,
        }
    }

    fn node(name: &str, templates: Vec<NodeTemplate>) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            address: format!("{name}:1"),
            capacity: NodeCapacity::default(),
            load: NodeLoad::default(),
            joined_at_ms: 0,
            leaving: false,
            templates,
            objects: false,
            builds: false,
            lease_id: 1,
        }
    }

    #[test]
    fn the_union_keeps_the_newest_build_and_counts_every_nodes_spawns() {
        let nodes = [
            node(
                "a",
                vec![
                    template("base", "k1", 100, 3, Some(5)),
                    template("solo", "s1", 50, 1, None),
                ],
            ),
            node("b", vec![template("base", "k2", 200, 4, Some(9))]),
            node("c", vec![template("base", "k1", 100, 0, None)]),
        ];
        let u = union(&nodes);
        assert_eq!(u.keys().collect::<Vec<_>>(), ["base", "solo"]);
        let base = &u["base"];
        assert_eq!((base.key.as_str(), base.built_at_unix), ("k2", 200));
        assert_eq!((base.spawn_count, base.last_spawned_ms), (7, Some(9)));
        assert_eq!(u["solo"].spawn_count, 1);
        let v = view(base);
        assert_eq!((v.info.name.as_str(), v.info.key.as_str()), ("base", "k2"));
        assert_eq!((v.cpu_count, v.memory_mb, v.disk_mb), (2, 512, 2048));
        assert_eq!(v.record.map(|r| r.spawn_count), Some(7));
    }

    #[test]
    fn a_node_holds_only_the_templates_it_reports() {
        let n = node("a", vec![template("base", "k", 1, 0, None)]);
        assert!(n.has_template("base"));
        assert!(!n.has_template("bas"));
        assert!(!node("b", Vec::new()).has_template("base"));
    }
}
