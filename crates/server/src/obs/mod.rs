//! Observability: per-sandbox metrics history ([`ring`]), the server's Prometheus counters
//! ([`prom`]), webhook signatures ([`sign`]) and the webhook delivery worker ([`webhooks`]).
//! See docs/observability.md.

pub mod prom;
pub mod ring;
pub mod sign;
pub mod webhooks;

pub use prom::Telemetry;
