//! Observability: per-sandbox metrics history ([`ring`], kept on disk by [`persist`]), the server's Prometheus counters
//! ([`prom`]), webhook signatures ([`sign`]) and the webhook delivery worker ([`webhooks`]).
//! See docs/observability.md.

pub mod persist;
pub mod prom;
pub mod ring;
pub mod sign;
pub mod webhooks;

pub use prom::Telemetry;
