//! cargo-fuzz target: arbitrary bytes into keep's header parser; it must return, never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| keep_checkpoint::fuzzing::run("header", data));
