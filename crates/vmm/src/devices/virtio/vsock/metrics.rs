//! vsock counters.

use serde::Serialize;

#[derive(Debug, Default, Clone, Serialize)]
pub struct VsockMetrics {
    pub host_connections: u64,
    pub guest_connections: u64,
    pub connect_failures: u64,
    pub rx_bytes_to_guest: u64,
    pub tx_bytes_from_guest: u64,
    pub rx_packets: u64,
    pub tx_packets: u64,
    pub resets_sent: u64,
    pub transport_resets: u64,
    pub errors: u64,
}
