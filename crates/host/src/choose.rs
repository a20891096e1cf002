//! The one choice of isolation driver: `kiln doctor` reports it, `kiln serve --driver auto` runs
//! it, and the microvm driver refuses with the same words, so the three agree by construction.
//!
//! The choice looks only at a [`HostProbe`] (what KVM and gVisor can do here), so it is tested
//! with faked probes. It never picks a driver that cannot start: the microvm driver is picked
//! only when [`microvm_readiness`] says it can serve sandboxes on this host, which it cannot
//! while kiln-vmm does not boot Linux guests for sandboxes — so a host whose KVM runs at
//! hardware speed gets gVisor, and the reason says why.

use std::path::Path;

use serde::Serialize;

/// An isolation driver kiln can run sandboxes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverChoice {
    Microvm,
    Gvisor,
}

impl DriverChoice {
    /// The driver's name, as `--driver` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Microvm => "microvm",
            Self::Gvisor => "gvisor",
        }
    }
}

/// Which isolation driver to use (`--driver`): a named one, or what [`choose`] picks here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DriverKind {
    /// What `kiln doctor` recommends for this host.
    #[default]
    Auto,
    Gvisor,
    Microvm,
}

impl std::str::FromStr for DriverKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "gvisor" => Ok(Self::Gvisor),
            "microvm" => Ok(Self::Microvm),
            other => Err(format!(
                "unknown driver {other:?}: use gvisor, microvm or auto"
            )),
        }
    }
}

/// What this host's KVM can do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvmState {
    /// No `/dev/kvm`.
    Absent,
    /// KVM runs guest kernel code at hardware speed (the probe's verdict).
    HardwareSpeed(String),
    /// KVM works, far below hardware speed (nested without acceleration; the probe's verdict,
    /// which says so).
    Emulated(String),
    /// The probe did not tell (it failed or was skipped: why).
    Unknown(String),
}

impl KvmState {
    /// Runs the KVM speed probe (about a second where /dev/kvm exists).
    pub fn probe() -> Self {
        if !Path::new("/dev/kvm").exists() {
            return Self::Absent;
        }
        match crate::kvm::probe() {
            Ok(p) if p.hardware_speed() => Self::HardwareSpeed(p.verdict()),
            Ok(p) => Self::Emulated(p.verdict()),
            Err(e) => Self::Unknown(format!("the probe failed: {e}")),
        }
    }
}

/// What the choice looks at: KVM, and whether gVisor runs here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostProbe {
    pub kvm: KvmState,
    /// The gVisor platform sandboxes run on here (the fastest that works), or why none does.
    pub gvisor: Result<String, String>,
}

/// The driver to use and why; `driver` is `None` when no driver can run sandboxes here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub driver: Option<DriverChoice>,
    pub reason: String,
}

/// Whether the microvm driver can serve sandboxes on a host with this KVM, and why not.
pub fn microvm_readiness(kvm: &KvmState) -> Result<(), String> {
    match kvm {
        KvmState::Absent => Err("there is no /dev/kvm".into()),
        KvmState::Emulated(v) => Err(format!(
            "KVM is not usable for Linux guests: {v}, so a Linux guest cannot boot"
        )),
        KvmState::Unknown(why) => Err(format!(
            "KVM is not usable for Linux guests: its speed is unknown ({why})"
        )),
        KvmState::HardwareSpeed(v) => Err(format!(
            "KVM runs guest kernel code at hardware speed ({v}), but the microvm driver cannot \
             boot Linux guests for sandboxes yet (serving sandboxes from kiln-vmm is not wired \
             into kiln serve)"
        )),
    }
}

/// Picks the driver for `auto`: microvm where it can serve sandboxes, else gVisor where it
/// runs, else none (with what to do).
pub fn choose(probe: &HostProbe) -> Choice {
    let microvm_why = match microvm_readiness(&probe.kvm) {
        Ok(()) => {
            return Choice {
                driver: Some(DriverChoice::Microvm),
                reason: "the microvm driver can serve sandboxes here".into(),
            }
        }
        Err(why) => why,
    };
    match &probe.gvisor {
        Ok(platform) => Choice {
            driver: Some(DriverChoice::Gvisor),
            reason: format!("microvm: {microvm_why}; gVisor works with --platform={platform}"),
        },
        Err(why) => Choice {
            driver: None,
            reason: format!(
                "microvm: {microvm_why}; and gVisor cannot run ({why}). Get runsc with \
                 `kiln runtime ensure` on a host that allows it"
            ),
        },
    }
}

/// The driver a `--driver` setting resolves to on this host, and, for `auto`, why.
pub fn resolve(kind: DriverKind, probe: impl FnOnce() -> HostProbe) -> Result<Choice, String> {
    match kind {
        DriverKind::Gvisor => Ok(Choice {
            driver: Some(DriverChoice::Gvisor),
            reason: "--driver gvisor".into(),
        }),
        DriverKind::Microvm => Ok(Choice {
            driver: Some(DriverChoice::Microvm),
            reason: "--driver microvm".into(),
        }),
        DriverKind::Auto => {
            let c = choose(&probe());
            match c.driver {
                Some(_) => Ok(c),
                None => Err(c.reason),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(kvm: KvmState, gvisor: Result<&str, &str>) -> HostProbe {
        HostProbe {
            kvm,
            gvisor: gvisor.map(str::to_string).map_err(str::to_string),
        }
    }

    #[test]
    fn hardware_kvm_with_gvisor_picks_gvisor_and_names_microvms_state() {
        let c = choose(&probe(
            KvmState::HardwareSpeed("hardware speed".into()),
            Ok("systrap"),
        ));
        assert_eq!(c.driver, Some(DriverChoice::Gvisor));
        assert!(
            c.reason.contains("microvm") && c.reason.contains("cannot boot Linux guests"),
            "{}",
            c.reason
        );
        assert!(c.reason.contains("--platform=systrap"), "{}", c.reason);
    }

    #[test]
    fn no_kvm_picks_gvisor() {
        let c = choose(&probe(KvmState::Absent, Ok("ptrace")));
        assert_eq!(c.driver, Some(DriverChoice::Gvisor));
        assert!(c.reason.contains("no /dev/kvm"), "{}", c.reason);
        let c = choose(&probe(KvmState::Emulated("emulated".into()), Ok("ptrace")));
        assert_eq!(c.driver, Some(DriverChoice::Gvisor));
        assert!(c.reason.contains("not usable"), "{}", c.reason);
        let c = choose(&probe(KvmState::Unknown("timeout".into()), Ok("ptrace")));
        assert_eq!(c.driver, Some(DriverChoice::Gvisor));
    }

    #[test]
    fn nothing_working_is_a_refusal_saying_what_to_do() {
        for kvm in [
            KvmState::Absent,
            KvmState::HardwareSpeed("hardware speed".into()),
        ] {
            let c = choose(&probe(kvm, Err("runsc is not installed")));
            assert_eq!(c.driver, None);
            assert!(
                c.reason.contains("runsc is not installed")
                    && c.reason.contains("kiln runtime ensure"),
                "{}",
                c.reason
            );
        }
        let e = resolve(DriverKind::Auto, || {
            probe(KvmState::Absent, Err("no platform works"))
        })
        .unwrap_err();
        assert!(e.contains("no platform works"), "{e}");
    }

    #[test]
    fn microvm_is_never_ready_while_it_cannot_boot_linux_guests() {
        for kvm in [
            KvmState::Absent,
            KvmState::HardwareSpeed("v".into()),
            KvmState::Emulated("v".into()),
            KvmState::Unknown("e".into()),
        ] {
            assert!(microvm_readiness(&kvm).is_err(), "{kvm:?}");
        }
    }

    #[test]
    fn auto_resolves_to_gvisor_on_hardware_kvm_and_named_drivers_skip_the_probe() {
        let c = resolve(DriverKind::Auto, || {
            probe(KvmState::HardwareSpeed("v".into()), Ok("kvm"))
        })
        .unwrap();
        assert_eq!(c.driver, Some(DriverChoice::Gvisor));
        for (kind, want) in [
            (DriverKind::Gvisor, DriverChoice::Gvisor),
            (DriverKind::Microvm, DriverChoice::Microvm),
        ] {
            let c = resolve(kind, || panic!("a named driver needs no probe")).unwrap();
            assert_eq!(c.driver, Some(want));
        }
        assert_eq!("auto".parse::<DriverKind>(), Ok(DriverKind::Auto));
        assert!("xen".parse::<DriverKind>().is_err());
    }
}
