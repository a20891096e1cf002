//! Container images as template sources.
//!
//! - [`reference`]: image names (Docker Hub normalisation) and `--registry-mirror`s.
//! - [`registry`]: pulling from a registry (the `oci-client` crate: token and Basic auth,
//!   manifest lists, Docker schema 2 and OCI manifests), layers fetched in parallel.
//! - [`archive`]: importing a `docker save` or OCI-layout tarball.
//! - [`blobs`]: the content-addressed blob cache shared by every image (digests checked).
//! - [`image`]: what kiln keeps of an image (layers, runtime config).
//! - [`unpack`]: applying layers to a root filesystem (whiteouts, opaque dirs, no escapes),
//!   with [`rootpath`] resolving paths inside the root.
//! - [`users`]: what kiln adds (user `user`, sudo through the agent, kiln-agent).
//! - [`template`]: image → template, through the same cache as recipes.

pub mod archive;
pub mod blobs;
pub mod image;
pub mod reference;
pub mod registry;
pub mod rootpath;
pub mod template;
pub mod unpack;
pub mod users;

pub use image::Image;
pub use reference::Mirrors;
pub use registry::{Credentials, Progress, PullOptions};
pub use template::{build_from_image, ImageBuildOptions, ImageSource};

/// Errors from pulling, importing and unpacking images.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("image name {name:?} is invalid: {why}")]
    BadName { name: String, why: String },
    #[error("{image}: registry {registry} answered: {answer}")]
    NotFound {
        image: String,
        registry: String,
        answer: String,
    },
    #[error("{image}: registry {registry} refused {}: {answer}; check --registry-user and --registry-password (or KILN_REGISTRY_USER and KILN_REGISTRY_PASSWORD)", user.as_ref().map_or("anonymous access".to_string(), |u| format!("the credentials of user {u:?}")))]
    Auth {
        image: String,
        registry: String,
        user: Option<String>,
        answer: String,
    },
    #[error("{image}: registry {registry}: {msg}")]
    Registry {
        image: String,
        registry: String,
        msg: String,
    },
    #[error("{what}: digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },
    #[error("layer {layer}: entry {entry:?} is refused: {why}")]
    Unsafe {
        layer: String,
        entry: String,
        why: String,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl OciError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> OciError {
        OciError::Io {
            what: what.into(),
            source,
        }
    }
}
