//! Legacy port-I/O devices.

pub mod i8042;
pub mod serial;
