//! cargo-fuzz target: a multi-file checkpoint directory (config, index, three shards) into Checkpoint::open; it must return, never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| keep_checkpoint::fuzzing::run("checkpoint", data));
