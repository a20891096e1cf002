//! kiln-host: everything kiln needs to know about (and prepare on) the machine it runs on.
//!
//! - [`paths`]: where kiln keeps its cache (templates, images) and its state (database, sandboxes).
//! - [`prereq`]: the host packages each job needs, and installing them with apt when allowed.
//! - [`kvm`]: a probe that runs a tiny VM to measure whether guest kernel code runs at hardware speed.
//! - [`capacity`]: how many more sandboxes the host's limits allow.
//! - [`apt_sources`]: the Debian mirror the host's own apt sources use (`KILN_DEBIAN_MIRROR` overrides).
//! - [`runsc`]: which runsc kiln runs, fetching a recent one from bookworm-backports, platforms.
//! - [`choose`]: the one choice of isolation driver, shared by `kiln doctor` and `kiln serve`.
//! - [`names`]: making sandbox host names (`{port}-{id}.localhost`) resolve on the host.
//! - [`doctor`]: the `kiln doctor` report built from all of the above.

pub mod apt_sources;
pub mod capacity;
pub mod choose;
pub mod doctor;
pub mod kvm;
pub mod names;
pub mod paths;
pub mod prereq;
pub mod runsc;
