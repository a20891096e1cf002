//! libFuzzer target: the agent's multipart upload parser (`POST /files`), through `kiln_agent::fuzz::multipart_upload`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kiln_agent::fuzz::multipart_upload(data));
