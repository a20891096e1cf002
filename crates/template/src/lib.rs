//! kiln-template: sandbox templates.
//!
//! - [`recipe`]: the declarative recipe format (`templates/*.toml` in the repo): a Debian base
//!   plus ordered steps (run, file, env, user, workdir) — a shape that can grow into a Dockerfile
//!   subset.
//! - [`store`]: the content-addressed cache of built templates (`<cache>/templates/<name>/<key>`),
//!   with atomic insertion.
//! - [`build`]: the builder (mmdebstrap + steps → rootfs directory + ext4 image), with progress.
//! - [`oci`]: container images as template sources (registry pulls, `docker save`/OCI-layout
//!   imports, layer unpacking), through the same cache.
//! - [`adopt`]: a version built elsewhere (another host's copy) taken into the store.

pub mod adopt;
pub mod build;
pub mod oci;
pub mod recipe;
pub mod store;

pub use build::{build, ensure_base, BuildOptions, BuildOutcome};
pub use recipe::Recipe;
pub use store::{Store, Template};

/// Errors from recipes, the store and the builder.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("recipe {path}: {msg}")]
    Recipe { path: String, msg: String },
    #[error("no template named {0:?} has been built; build it with `kiln template build {0}`")]
    NotBuilt(String),
    #[error("no recipe named {name:?}: looked for {looked}")]
    NoRecipe { name: String, looked: String },
    #[error("kiln-agent binary: {0}")]
    Agent(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("template build failed at {step}.\nLast lines of the log ({log}):\n{tail}")]
    BuildFailed {
        step: String,
        log: String,
        tail: String,
    },
    #[error(transparent)]
    Oci(#[from] oci::OciError),
    #[error(transparent)]
    Prereq(#[from] kiln_host::prereq::PrereqError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}
