//! cargo-fuzz target: arbitrary bytes into keep's config parser; it must return, never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| keep_checkpoint::fuzzing::run("config", data));
