//! `kiln node`'s object store settings: the S3-compatible bucket its paused sandboxes'
//! checkpoints go to (docs/cluster.md). Credentials are read from the environment only, never
//! from the command line.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use kiln_cluster::gc::GcConfig;
use kiln_cluster::node::NodeObjects;
use kiln_cluster::objects::{ChunkCache, ChunkStore, S3Config};

/// The environment variable holding the bucket's access key id.
pub const ACCESS_KEY_ENV: &str = "KILN_S3_ACCESS_KEY_ID";
/// The environment variable holding the bucket's secret access key.
pub const SECRET_KEY_ENV: &str = "KILN_S3_SECRET_ACCESS_KEY";

#[derive(clap::Args)]
pub struct ObjectArgs {
    /// The S3-compatible endpoint (`http(s)://host:port`) of the bucket that holds paused
    /// sandboxes' checkpoints, so that a sandbox paused here resumes on any node (and this
    /// node's paused sandboxes outlive it). Without it, they resume only on this node. The
    /// credentials come from the environment only: KILN_S3_ACCESS_KEY_ID and
    /// KILN_S3_SECRET_ACCESS_KEY.
    #[arg(long, env = "KILN_S3_ENDPOINT")]
    s3_endpoint: Option<String>,
    /// The bucket (it must exist; every node of a cluster names the same one).
    #[arg(long, env = "KILN_S3_BUCKET", default_value = "kiln")]
    s3_bucket: String,
    /// The bucket's region.
    #[arg(long, env = "KILN_S3_REGION", default_value = "us-east-1")]
    s3_region: String,
    /// Virtual-hosted-style requests (`bucket.host/key`) instead of path-style
    /// (`host/bucket/key`, what most self-hosted S3 servers want).
    #[arg(long, env = "KILN_S3_VIRTUAL_HOSTED")]
    s3_virtual_hosted: bool,
    /// Seconds between two garbage collections of the bucket (manifests no paused sandbox's
    /// checkpoint names, chunks no kept manifest names). One node of the cluster collects at a
    /// time; 0: this node never does.
    #[arg(long, env = "KILN_S3_GC_EVERY", default_value_t = 600)]
    s3_gc_every: u64,
    /// Seconds an object of the bucket is kept, whatever names it (longer than any upload).
    #[arg(long, env = "KILN_S3_GC_GRACE", default_value_t = 3600)]
    s3_gc_grace: u64,
    /// The most MiB of fetched chunks this node keeps in its chunk cache; the least
    /// recently used beyond it are evicted after each fetch.
    #[arg(long, env = "KILN_CHUNK_CACHE_MAX_MB", default_value_t = 10240)]
    chunk_cache_max_mb: u64,
}

impl ObjectArgs {
    /// Where checkpoints go, for the node's start-up line (no credentials).
    pub fn describe(&self) -> String {
        let endpoint = self.s3_endpoint.as_deref().unwrap_or_default();
        // (A user:password@ in the URL is never printed.)
        let shown = match endpoint.split_once("://") {
            Some((scheme, rest)) => {
                let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
                format!("{scheme}://{host}")
            }
            None => endpoint.to_string(),
        };
        format!("bucket {} at {shown}", self.s3_bucket)
    }

    /// The node's object store (None without an endpoint), its chunk cache in `state_dir`.
    pub fn node_objects(&self, state_dir: &Path) -> anyhow::Result<Option<NodeObjects>> {
        let Some(endpoint) = self.s3_endpoint.clone().filter(|e| !e.is_empty()) else {
            return Ok(None);
        };
        let env = |name: &str| {
            std::env::var(name)
                .ok()
                .filter(|v| !v.is_empty())
                .with_context(|| format!("--s3-endpoint is set but {name} is not"))
        };
        let config = S3Config {
            endpoint,
            bucket: self.s3_bucket.clone(),
            region: self.s3_region.clone(),
            access_key_id: env(ACCESS_KEY_ENV)?,
            secret_access_key: env(SECRET_KEY_ENV)?,
            path_style: !self.s3_virtual_hosted,
        };
        let chunks = ChunkStore::connect(&config).context("the object store settings")?;
        let gc = (self.s3_gc_every > 0).then(|| GcConfig {
            every: Duration::from_secs(self.s3_gc_every),
            grace: Duration::from_secs(self.s3_gc_grace),
            ..GcConfig::default()
        });
        Ok(Some(NodeObjects {
            chunks,
            cache: ChunkCache::new(
                state_dir.join("chunk-cache"),
                self.chunk_cache_max_mb.saturating_mul(1 << 20),
            ),
            gc,
        }))
    }
}

/// Checks that the node's bucket answers, so a wrong setting stops the node at start
/// instead of at its first pause.
pub async fn check(objects: &NodeObjects) -> anyhow::Result<()> {
    tokio::time::timeout(Duration::from_secs(20), objects.chunks.check())
        .await
        .context("the object store did not answer within 20 s")?
        .context("reaching the object store's bucket")
}
