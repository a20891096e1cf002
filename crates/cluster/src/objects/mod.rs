//! Checkpoint bytes in S3-compatible object storage, content-addressed in chunks so a node
//! fetches only what it lacks. A file is stored as fixed-size chunks under `chunks/<sha256>`
//! and a manifest (its size, chunk size and ordered chunk hashes, as JSON) under
//! `manifests/<sha256 of the manifest>`; the manifest's id is the file's handle.

pub mod error;
mod fetch;
pub mod manifest;
mod store;

pub use error::ObjectError;
pub use fetch::GetReport;
pub use manifest::Manifest;
pub use store::{ChunkStore, PutReport, S3Config, DEFAULT_CHUNK_SIZE};
