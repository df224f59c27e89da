//! cargo-fuzz target: config.json text into keep-model's ModelConfig (families, layer roles, Engram layout); it must return, never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| keep_model::fuzzing::run("model-config", data));
