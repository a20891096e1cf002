//! libFuzzer target: Connect envelope framing and the agent's streaming-request reader, through `kiln_agent::fuzz::connect_envelopes`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kiln_agent::fuzz::connect_envelopes(data));
