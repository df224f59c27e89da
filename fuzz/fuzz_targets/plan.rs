//! cargo-fuzz target: a prune plan file into PrunePlan::read and the accessors keep prune uses; it must return, never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| keep_convert::fuzzing::run("plan", data));
