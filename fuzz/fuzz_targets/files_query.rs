//! libFuzzer target: the `/files` query string (percent-decoding, signature parameters), through `kiln_agent::fuzz::files_query`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kiln_agent::fuzz::files_query(data));
