//! cargo-fuzz target: route-trace session files into keep's route-trace reader, one by one and as a run; it must return, never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| keep_artifacts::fuzzing::run("routes", data));
