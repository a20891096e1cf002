pub mod contract;
pub mod etcd;
