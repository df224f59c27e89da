//! Tidy checks over the whole workspace: every Rust source file opens with a `//!` paragraph
//! that says what it is, and the repository speaks of the product only — no tracker numbers,
//! development history or names of who worked when, in code, docs, scripts or file names.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut all = vec![];
    repo_files(dir, &mut all);
    out.extend(
        all.into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "rs")),
    );
}

#[test]
fn every_rust_file_opens_with_a_module_doc() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![];
    rust_files(&root.join("crates"), &mut files);
    rust_files(&root.join("fuzz/fuzz_targets"), &mut files);
    assert!(files.len() > 20, "found only {} files", files.len());
    let missing: Vec<_> = files
        .iter()
        .filter(|p| {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            !text.trim_start().starts_with("//!")
        })
        .collect();
    assert!(
        missing.is_empty(),
        "files without a leading //! doc: {missing:?}"
    );
}

/// Text files the product-language check reads (code, docs, scripts, configs).
const TEXT_EXTENSIONS: &[&str] = &["rs", "md", "py", "sh", "toml", "txt", "json", "yml", "yaml"];

/// Phrases that speak of how keep was made rather than what it is. Matched case-insensitively
/// on each line; `issue`/`session`/`PR` only when a number follows, because a calibration
/// session is a product concept.
fn history_phrase(line: &str) -> Option<&'static str> {
    let l = line.to_ascii_lowercase();
    for (needle, what) in [
        ("the seed", "the project's origin"),
        ("seed-pr", "the project's origin"),
        (concat!("first", " session"), "development history"),
        (concat!("second", " session"), "development history"),
        (concat!("this", " session"), "development history"),
        ("guide §", "a guide that is not in the repository"),
        ("pull request", "development history"),
        ("fixes #", "a tracker number"),
        ("closes #", "a tracker number"),
    ] {
        if l.contains(needle) {
            return Some(what);
        }
    }
    for word in ["issue", "issues", "session", "pr"] {
        let mut rest = l.as_str();
        while let Some(i) = rest.find(word) {
            let before_ok = i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric();
            let after = rest[i + word.len()..].trim_start_matches([' ', '#', '-', '_']);
            if before_ok && after.starts_with(|c: char| c.is_ascii_digit()) {
                return Some("a tracker number or development history");
            }
            rest = &rest[i + word.len()..];
        }
    }
    None
}

fn repo_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if p.is_dir() {
            let skip = matches!(name.as_str(), "target" | "logs" | "corpus" | "artifacts")
                || name.starts_with('.')
                || name == "__pycache__";
            if !skip {
                repo_files(&p, out);
            }
        } else {
            out.push(p);
        }
    }
}

#[test]
fn the_repository_speaks_of_the_product_only() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![];
    repo_files(&root, &mut files);
    assert!(files.len() > 50, "found only {} files", files.len());
    let mut found = vec![];
    for p in &files {
        let rel = p.strip_prefix(&root).unwrap_or(p).display().to_string();
        if rel.ends_with("keep-cli/tests/tidy.rs") {
            continue; // this file names the phrases it looks for
        }
        if let Some(what) = history_phrase(&rel.replace(['/', '.'], " ")) {
            found.push(format!("{rel}: file name ({what})"));
        }
        let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !TEXT_EXTENSIONS.contains(&ext) && !rel.starts_with(".ci") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(p) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            // A model's sampled text quoted as evidence (`keep eval --tasks --json`) is not the
            // repository speaking.
            if rel.starts_with("dev/evidence/") && line.trim_start().starts_with("\"completion\":")
            {
                continue;
            }
            if let Some(what) = history_phrase(line) {
                found.push(format!("{rel}:{}: {what}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "history in the product:\n{}",
        found.join("\n")
    );
}

#[test]
fn history_phrases_are_recognised() {
    assert!(history_phrase("// fixed for issue 6").is_some());
    assert!(history_phrase("see Issue #12").is_some());
    assert!(history_phrase("bench-budget-2g-session2 json").is_some());
    assert!(history_phrase("as the seed did").is_some());
    assert!(history_phrase("one calibration session per group").is_none());
    assert!(history_phrase("sessions 0..4").is_none());
    assert!(history_phrase("tissue 3").is_none());
    assert!(history_phrase("merged in PR #12").is_some());
    assert!(history_phrase("see the pull request").is_some());
    assert!(history_phrase("closes #4").is_some());
    assert!(history_phrase("prefill 3 tokens").is_none());
}

/// A run of spaces inside a one-line string literal, the mark of a message wrapped over two
/// lines without the `\` continuation (the next line's indentation lands in the text the user
/// reads). Returns the run's start column.
fn wrapped_string_gap(line: &str) -> Option<usize> {
    let t = line.trim_start();
    if t.starts_with("//") {
        return None;
    }
    let q = line.find('"')?;
    let lit = &line[q + 1..];
    let end = lit.find('"').unwrap_or(lit.len());
    let lit = &lit[..end];
    // A newline escape before the run is a deliberate layout (templates, multi-line text).
    if lit.contains("\\n") {
        return None;
    }
    let b = lit.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b' ' && i > 0 && b[i - 1] != b' ' {
            let run = b[i..].iter().take_while(|&&c| c == b' ').count();
            if run >= 6 && i + run < b.len() {
                return Some(q + 1 + i);
            }
            i += run;
        } else {
            i += 1;
        }
    }
    None
}

#[test]
fn no_message_carries_the_indentation_of_a_wrapped_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![];
    rust_files(&root.join("crates"), &mut files);
    let mut found = vec![];
    for p in &files {
        let text = std::fs::read_to_string(p).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            if let Some(c) = wrapped_string_gap(line) {
                found.push(format!("{}:{}:{}", p.display(), n + 1, c + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "string literals with a run of spaces from a line wrapped without `\\`: {found:?}"
    );
}

#[test]
fn wrapped_string_gaps_are_recognised() {
    assert!(
        wrapped_string_gap(r#"    "give the checkpoint                  the allocation","#)
            .is_some()
    );
    assert!(wrapped_string_gap(r#"    "give the checkpoint \"#).is_none());
    assert!(wrapped_string_gap(r#"    // "a comment                 with a gap""#).is_none());
    assert!(wrapped_string_gap(r#"    "{%- if x -%}\n    {{ y }}""#).is_none());
    assert!(wrapped_string_gap(r#"    format!("{:>8}  {:>8}", a, b)"#).is_none());
}
