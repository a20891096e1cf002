//! Checkpoint bytes in S3-compatible object storage, content-addressed in chunks so a node
//! fetches only what it lacks. A file is stored as fixed-size chunks under `chunks/<sha256>`
//! and a manifest (its size, chunk size and ordered chunk hashes, as JSON) under
//! `manifests/<sha256 of the manifest>`; the manifest's id is the file's handle. What no
//! checkpoint needs any more is collected ([`gc`]); a node's cache of fetched chunks is capped
//! ([`cache`]).

pub mod cache;
pub mod error;
mod fetch;
pub mod gc;
pub mod manifest;
mod store;

pub use cache::{ChunkCache, Trimmed, DEFAULT_CACHE_MAX_BYTES};
pub use error::ObjectError;
pub use fetch::GetReport;
pub use gc::GcReport;
pub use manifest::Manifest;
pub use store::{ChunkStore, PutReport, S3Config, DEFAULT_CHUNK_SIZE};
