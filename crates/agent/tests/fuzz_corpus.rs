//! The agent's fuzz entry points (`kiln_agent::fuzz`, behind the `cargo fuzz` targets in
//! `fuzz/`) on stable Rust: every seed in `fuzz/seeds/<target>/` and every regression input in
//! `fuzz/regressions/<target>/`, then bounded runs of mutated seeds and random inputs. Each
//! entry point panics when one of its invariants breaks.

use std::path::PathBuf;

type Entry = fn(&[u8]);

const TARGETS: [(&str, Entry); 4] = [
    ("agent_multipart", kiln_agent::fuzz::multipart_upload),
    ("connect_envelope", kiln_agent::fuzz::connect_envelopes),
    ("connect_message", kiln_agent::fuzz::connect_messages),
    ("files_query", kiln_agent::fuzz::files_query),
];

/// The crate's directory: where `cargo test` runs this binary from (a build directory kept
/// from a checkout elsewhere holds a binary naming that checkout), else where it was built.
fn crate_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn inputs(kind: &str, target: &str) -> Vec<Vec<u8>> {
    let dir = crate_dir().join("../../fuzz").join(kind).join(target);
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    files.sort();
    files
        .iter()
        .map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

fn xorshift(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

#[test]
fn seeds_and_regressions_pass() {
    for (name, run) in TARGETS {
        let seeds = inputs("seeds", name);
        assert!(!seeds.is_empty(), "no seeds for {name} in fuzz/seeds/");
        for input in seeds.iter().chain(&inputs("regressions", name)) {
            run(input);
        }
    }
}

#[test]
fn mutated_and_random_inputs_keep_the_invariants() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for (name, run) in TARGETS {
        let seeds = inputs("seeds", name);
        for i in 0..3000 {
            let mut input = if i % 4 == 3 || seeds.is_empty() {
                let n = (xorshift(&mut seed) % 512) as usize;
                (0..n).map(|_| xorshift(&mut seed) as u8).collect()
            } else {
                seeds[(xorshift(&mut seed) as usize) % seeds.len()].clone()
            };
            for _ in 0..1 + xorshift(&mut seed) % 8 {
                if input.is_empty() {
                    break;
                }
                let at = (xorshift(&mut seed) as usize) % input.len();
                match xorshift(&mut seed) % 4 {
                    0 => input[at] = xorshift(&mut seed) as u8,
                    1 => input[at] ^= 1 << (xorshift(&mut seed) % 8),
                    2 => {
                        input.remove(at);
                    }
                    _ => input.insert(
                        at,
                        *b"%+-\r\n\0\"{"
                            .get((xorshift(&mut seed) % 8) as usize)
                            .unwrap_or(&0),
                    ),
                }
            }
            run(&input);
        }
    }
}
