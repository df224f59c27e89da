//! cargo-fuzz target: a calibration pack directory into Pack::open; it must return, never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| keep_calib::fuzzing::run("pack", data));
