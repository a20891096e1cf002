//! libFuzzer target: unary Connect request bodies (JSON and protobuf) and the `/init` body, through `kiln_agent::fuzz::connect_messages`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kiln_agent::fuzz::connect_messages(data));
