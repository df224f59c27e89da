//! cargo-fuzz target: arbitrary bytes into keep's index parser; it must return, never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| keep_checkpoint::fuzzing::run("index", data));
