//! KVM VM and vCPU state.

pub mod vcpu;
pub mod vm;
