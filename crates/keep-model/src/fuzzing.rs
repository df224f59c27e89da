//! Entry point of the `model-config` fuzz target (in `fuzz/`) and of the test that replays its
//! committed corpus: `config.json` text through keep-checkpoint's parser and validation, then
//! [`ModelConfig::from_deepseek`] (per-layer roles, V4 / V4.1 families, the Engram layout with
//! its bucket primes and multipliers), then the accessors the model calls. It must return,
//! never panic, hang or abort on an allocation.

use std::path::Path;

use crate::config::ModelConfig;

/// Targets of this crate.
pub const TARGETS: [&str; 1] = ["model-config"];

/// Run the target named `target` on `data`.
pub fn run(target: &str, data: &[u8]) {
    if target != "model-config" {
        return;
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(c) = keep_checkpoint::DeepSeekConfig::from_json(Path::new("config.json"), text) else {
        return;
    };
    let Ok(m) = ModelConfig::from_deepseek(&c) else {
        return;
    };
    for l in 0..m.n_layers.min(64) {
        let _ = (m.is_hash(l), m.rope(l));
    }
    if let Some(e) = &m.engram {
        let _ = e.cols();
        for l in 0..m.n_layers.min(64) {
            let _ = e.slot_of(l);
        }
        // Hash a short token sequence (ids from the input's bytes, some out of range).
        let toks: Vec<u32> = data.iter().take(16).map(|&b| u32::from(b) * 997).collect();
        let mut history = vec![];
        let _ = e.hash(&mut history, &toks);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn fuzz_corpus_replays_without_panic() {
        let n = keep_checkpoint::fuzzing::replay_committed(
            env!("CARGO_MANIFEST_DIR"),
            &super::TARGETS,
            &super::run,
        );
        assert!(
            n >= 5,
            "expected a committed model-config corpus, found {n}"
        );
    }
}
