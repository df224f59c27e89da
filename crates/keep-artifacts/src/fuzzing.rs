//! Entry point of the `routes` fuzz target (in `fuzz/`) and of the test that replays its
//! committed corpus: up to three route-trace session files (one multi-file input, see
//! `keep_checkpoint::fuzzing::split_files`) read one by one with [`routes::read_session`] and
//! together as a run with [`routes::read_run`] and [`routes::check_consistent`], as
//! `keep residency` and the runtime's warm start read them. It must return, never panic.

use crate::routes;

/// Targets of this crate.
pub const TARGETS: [&str; 1] = ["routes"];

const FILES: [&str; 3] = ["a.safetensors", "b.safetensors", "c.safetensors"];

/// Run the target named `target` on `data`.
pub fn run(target: &str, data: &[u8]) {
    if target != "routes" {
        return;
    }
    let parts = keep_checkpoint::fuzzing::split_files(data, FILES.len());
    let files: Vec<(&str, Option<&[u8]>)> = FILES
        .iter()
        .zip(&parts)
        .map(|(n, b)| (*n, Some(*b)))
        .collect();
    let Some(dir) = keep_checkpoint::fuzzing::write_scratch(&files) else {
        return;
    };
    for (name, _) in &files {
        let p = dir.join(name);
        let _ = routes::has_routes(&p);
        if let Ok(s) = routes::read_session(&p) {
            let _ = s.layers.iter().map(|l| l.tokens()).sum::<usize>();
            let _ = routes::session_metadata(&s);
            let _ = routes::session_tensors(&s).map(|t| t.len());
        }
    }
    if let Ok(t) = routes::read_run(&dir) {
        let _ = (t.slots(), t.tokens());
        let _ = routes::check_consistent(&t);
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
        assert!(n >= 5, "expected a committed routes corpus, found {n}");
    }
}
