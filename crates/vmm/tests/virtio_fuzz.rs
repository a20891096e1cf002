//! The virtio queue fuzz harness (`kiln_vmm::devices::virtio::fuzz`, also behind the `cargo fuzz`
//! target `virtio_queue` in `fuzz/`) on stable Rust: a fixed corpus of valid requests that must be
//! served correctly, then bounded runs of mutated and random inputs that must keep every
//! invariant.

use kiln_vmm::devices::virtio::fuzz::{Harness, Outcome};

// Queue q's tables (size 16): descriptors at 0x100 + q * 0x1000, available ring at 0x200 + ..,
// used ring at 0x300 + ..; buffers from 0x8000.
const DESC: usize = 0x100;
const AVAIL: usize = 0x200;
const STRIDE: usize = 0x1000;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

/// A guest memory image with descriptor tables and available rings laid out as above.
struct Image(Vec<u8>);

impl Image {
    fn new() -> Self {
        Image(vec![0u8; 0xb000])
    }
    fn put(&mut self, at: usize, b: &[u8]) {
        self.0[at..at + b.len()].copy_from_slice(b);
    }
    fn desc(&mut self, q: usize, i: usize, addr: u64, len: u32, flags: u16, next: u16) {
        let at = DESC + q * STRIDE + 16 * i;
        self.put(at, &addr.to_le_bytes());
        self.put(at + 8, &len.to_le_bytes());
        self.put(at + 12, &flags.to_le_bytes());
        self.put(at + 14, &next.to_le_bytes());
    }
    fn avail(&mut self, q: usize, heads: &[u16]) {
        let at = AVAIL + q * STRIDE;
        self.put(at + 2, &(heads.len() as u16).to_le_bytes());
        for (i, h) in heads.iter().enumerate() {
            self.put(at + 4 + 2 * i, &h.to_le_bytes());
        }
    }
    /// Input: `kind`, queue size 16, the table pages above, all features, this image, then
    /// `ops`.
    fn input(&self, kind: u8, ops: &[u8]) -> Vec<u8> {
        let mut v = vec![kind, 4, 0x01, 0x02, 0x03, 0xff];
        v.extend_from_slice(&(self.0.len() as u16).to_le_bytes());
        v.extend_from_slice(&self.0);
        v.extend_from_slice(ops);
        v
    }
}

/// A block read of sector 1 into 0x9000, status at 0xa000; queue 0 notified.
fn block_read() -> Vec<u8> {
    let mut m = Image::new();
    m.put(0x8000, &0u32.to_le_bytes()); // VIRTIO_BLK_T_IN
    m.put(0x8008, &1u64.to_le_bytes()); // sector 1
    m.put(0xa000, &[0xff]);
    m.desc(0, 0, 0x8000, 16, F_NEXT, 1);
    m.desc(0, 1, 0x9000, 512, F_NEXT | F_WRITE, 2);
    m.desc(0, 2, 0xa000, 1, F_WRITE, 0);
    m.avail(0, &[0]);
    m.input(0, &[0, 0])
}

/// 32 bytes of entropy into 0x8000; queue 0 notified.
fn rng_request() -> Vec<u8> {
    let mut m = Image::new();
    m.desc(0, 0, 0x8000, 32, F_WRITE, 0);
    m.avail(0, &[0]);
    m.input(1, &[0, 0])
}

/// A descriptor chain that loops on itself, and one pointing outside guest memory.
fn block_hostile() -> Vec<u8> {
    let mut m = Image::new();
    m.put(0xa000, &[0xff]);
    m.desc(0, 0, 0x8000, 16, F_NEXT, 0);
    m.desc(0, 1, 0xffff_ffff_0000, 16, F_NEXT, 2);
    m.desc(0, 2, 0xa000, 0xffff_ffff, F_WRITE, 0);
    m.avail(0, &[0, 1]);
    m.input(0, &[0, 0, 0, 0])
}

/// A vsock TX packet (REQUEST to host port 5000, which nobody serves) and RX buffers.
fn vsock_request() -> Vec<u8> {
    let mut m = Image::new();
    let mut hdr = [0u8; 44];
    hdr[0..8].copy_from_slice(&3u64.to_le_bytes());
    hdr[8..16].copy_from_slice(&2u64.to_le_bytes());
    hdr[16..20].copy_from_slice(&1000u32.to_le_bytes());
    hdr[20..24].copy_from_slice(&5000u32.to_le_bytes());
    hdr[28..30].copy_from_slice(&1u16.to_le_bytes());
    hdr[30..32].copy_from_slice(&1u16.to_le_bytes());
    m.put(0x8000, &hdr);
    m.desc(1, 0, 0x8000, 44, 0, 0);
    m.avail(1, &[0]);
    // notify the TX queue, then a host event
    m.input(2, &[0, 1, 4])
}

fn xorshift(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

#[test]
fn corpus_requests_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let h = Harness::new(dir.path()).unwrap();

    let o: Outcome = h.run(&block_read());
    assert_eq!(o.used_idx, vec![1], "{o:?}");
    assert_eq!(o.errors, 0);
    assert_eq!(o.memory[0xa000], 0, "status OK");
    let want: Vec<u8> = (512..1024).map(|i| (i % 251) as u8).collect();
    assert_eq!(&o.memory[0x9000..0x9200], &want[..], "sector 1 of the base");
    assert_eq!(o.metrics["reads"], 1, "{}", o.metrics);

    let o = h.run(&rng_request());
    assert_eq!(o.used_idx, vec![1], "{o:?}");
    assert!(o.memory[0x8000..0x8020].iter().any(|&b| b != 0));

    // malformed chains (a loop, memory outside the guest) are completed as rejected requests
    let o = h.run(&block_hostile());
    assert_eq!(o.used_idx, vec![2], "{o:?}");
    assert_eq!(o.metrics["errors"], 2, "{}", o.metrics);
    assert_eq!(o.metrics["reads"], 0, "{}", o.metrics);
    assert_eq!(o.memory[0xa000], 0xff, "nothing was written for them");

    // a vsock REQUEST to a host port nobody serves is consumed from the TX queue
    let o = h.run(&vsock_request());
    assert_eq!(o.used_idx.len(), 3);
    assert_eq!(o.used_idx[1], 1, "{o:?}");
    assert_eq!(o.metrics["connect_failures"], 1, "{}", o.metrics);
}

#[test]
fn mutated_and_random_inputs_keep_the_invariants() {
    let dir = tempfile::tempdir().unwrap();
    let h = Harness::new(dir.path()).unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let corpus = [
        block_read(),
        rng_request(),
        block_hostile(),
        vsock_request(),
    ];
    for round in 0..2000 {
        // mutations of the corpus: flipped bytes in the image and the operations
        let mut input = corpus[round % corpus.len()].clone();
        for _ in 0..1 + xorshift(&mut seed) % 16 {
            let i = (xorshift(&mut seed) as usize) % input.len();
            input[i] = xorshift(&mut seed) as u8;
        }
        // random operations appended
        for _ in 0..xorshift(&mut seed) % 64 {
            input.push(xorshift(&mut seed) as u8);
        }
        h.run(&input);
    }
    for _ in 0..2000 {
        let len = (xorshift(&mut seed) % 512) as usize;
        let input: Vec<u8> = (0..len).map(|_| xorshift(&mut seed) as u8).collect();
        h.run(&input);
    }
}
