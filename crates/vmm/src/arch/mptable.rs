//! Intel MultiProcessor Specification 1.4 table: one processor entry per vCPU, an ISA bus, the
//! IOAPIC and the 16 legacy IRQs plus the virtio IRQs routed to it. Written into the EBDA.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::layout::{APIC_ADDR, IOAPIC_ADDR, MPTABLE_START};

#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    #[error("too many vCPUs for the MP table: {0} (at most 254)")]
    TooManyCpus(u8),
    #[error("writing the MP table into guest memory failed: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

fn checksum(b: &[u8]) -> u8 {
    0u8.wrapping_sub(b.iter().fold(0u8, |a, &x| a.wrapping_add(x)))
}

/// Builds the MP floating pointer + configuration table for `cpus` vCPUs and IRQs `0..irqs`.
pub fn build(cpus: u8, irqs: u8) -> Result<Vec<u8>, MptableError> {
    if cpus == 0 || cpus > 254 {
        return Err(MptableError::TooManyCpus(cpus));
    }
    let ioapic_id = cpus + 1;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for i in 0..cpus {
        // processor entry: type 0, apic id, apic version, flags (EN, BP), signature, features
        let mut e = [0u8; 20];
        e[0] = 0;
        e[1] = i;
        e[2] = 0x14;
        e[3] = 1 | if i == 0 { 2 } else { 0 };
        e[4..8].copy_from_slice(&0x600u32.to_le_bytes());
        e[8..12].copy_from_slice(&0x201u32.to_le_bytes());
        entries.extend_from_slice(&e);
        count += 1;
    }
    // bus entry: type 1, bus id 0, "ISA   "
    entries.extend_from_slice(&[1, 0, b'I', b'S', b'A', b' ', b' ', b' ']);
    count += 1;
    // IOAPIC entry: type 2, id, version 0x11, flags EN, address
    let mut e = [2u8, ioapic_id, 0x11, 1, 0, 0, 0, 0];
    e[4..8].copy_from_slice(&IOAPIC_ADDR.to_le_bytes());
    entries.extend_from_slice(&e);
    count += 1;
    for irq in 0..irqs {
        // I/O interrupt entry: type 3, INT, flags (conforming), src bus 0, src irq, dst apic, pin
        entries.extend_from_slice(&[3, 0, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    // local interrupt entries: ExtINT on LINT0, NMI on LINT1 of all local APICs
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let table_addr = MPTABLE_START as u32 + 16;
    let mut hdr = [0u8; 44];
    hdr[0..4].copy_from_slice(b"PCMP");
    let len = (44 + entries.len()) as u16;
    hdr[4..6].copy_from_slice(&len.to_le_bytes());
    hdr[6] = 4; // spec revision 1.4
    hdr[8..16].copy_from_slice(b"KILN    ");
    hdr[16..28].copy_from_slice(b"KILN-VMM    ");
    hdr[34..36].copy_from_slice(&count.to_le_bytes());
    hdr[36..40].copy_from_slice(&APIC_ADDR.to_le_bytes());
    let mut table = hdr.to_vec();
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp = [0u8; 16];
    fp[0..4].copy_from_slice(b"_MP_");
    fp[4..8].copy_from_slice(&table_addr.to_le_bytes());
    fp[8] = 1; // length in 16-byte units
    fp[9] = 4;
    fp[10] = checksum(&fp);
    let mut out = fp.to_vec();
    out.extend_from_slice(&table);
    Ok(out)
}

/// Writes the MP table at [`MPTABLE_START`].
pub fn setup(mem: &GuestMemoryMmap, cpus: u8, irqs: u8) -> Result<(), MptableError> {
    let t = build(cpus, irqs)?;
    mem.write_slice(&t, GuestAddress(MPTABLE_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_are_valid_and_cpus_listed() {
        let t = build(3, 24).unwrap();
        assert_eq!(&t[0..4], b"_MP_");
        assert_eq!(t[..16].iter().fold(0u8, |a, &x| a.wrapping_add(x)), 0);
        let len = u16::from_le_bytes([t[20], t[21]]) as usize;
        assert_eq!(
            t[16..16 + len].iter().fold(0u8, |a, &x| a.wrapping_add(x)),
            0
        );
        let cpus = t[16 + 44..]
            .chunks(1)
            .take(60)
            .step_by(20)
            .filter(|c| c[0] == 0)
            .count();
        assert_eq!(cpus, 3);
        assert!(matches!(build(0, 1), Err(MptableError::TooManyCpus(0))));
    }
}
