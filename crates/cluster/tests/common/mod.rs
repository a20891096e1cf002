pub mod contract;
pub mod contract_events;
pub mod etcd;
