//! x86_64 specifics: guest physical layout, boot protocol structures, CPU register setup.

pub mod cpuid;
pub mod layout;
pub mod mptable;
pub mod regs;
