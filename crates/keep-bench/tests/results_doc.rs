//! The published results match their evidence: every rendered table of `docs/results.md`
//! equals what the evidence files it cites render (`keep bench report docs/results.md`), and
//! every evidence file is listed in `dev/README.md` and cited by a document.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn results_tables_match_their_evidence() {
    let doc = root().join("docs/results.md");
    let (_, mismatches) = keep_bench::report::render(&doc, &root()).unwrap();
    let text: Vec<String> = mismatches.iter().map(|m| m.to_string()).collect();
    assert!(
        mismatches.is_empty(),
        "docs/results.md differs from its evidence (render it with `keep bench report \
         docs/results.md --write` after checking the evidence):\n{}",
        text.join("\n")
    );
}

#[test]
fn every_evidence_file_is_listed_and_cited() {
    let root = root();
    let index = std::fs::read_to_string(root.join("dev/README.md")).unwrap();
    let mut docs = String::new();
    for d in ["README.md", "ARCHITECTURE.md"] {
        docs += &std::fs::read_to_string(root.join(d)).unwrap();
    }
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            docs += &std::fs::read_to_string(&p).unwrap();
        }
    }
    let mut problems = Vec::new();
    for e in std::fs::read_dir(root.join("dev/evidence")).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        let listed = index
            .lines()
            .filter(|l| l.contains(&format!("`{name}`")))
            .count();
        if listed != 1 {
            problems.push(format!(
                "{name}: listed {listed} times in dev/README.md (want 1)"
            ));
        }
        if !docs.contains(&name) {
            problems.push(format!(
                "{name}: cited by no document (cite it or delete it)"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
