//! keep's Engram token compression map against the published `CompressedTokenizer` (transcribed
//! in tools/oracle/engram_ref.py): the committed fixture `fixtures/keep-tiny/engram_token_map.json`
//! (made by tools/oracle/engram_tokmap_fixture.py from the bundled keep-tiny tokenizer) holds the
//! reference's map id for id, and the reference normaliser's output on probe texts that reach
//! every normalisation step.

use std::path::PathBuf;

use keep_model::engram_tokens::{compressed_token_map_from_file, TokenNormalizer};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture() -> serde_json::Value {
    let p = root().join("fixtures/keep-tiny/engram_token_map.json");
    serde_json::from_slice(&std::fs::read(&p).expect("fixture")).expect("fixture json")
}

#[test]
fn keep_tiny_map_equals_the_reference_id_for_id() {
    let fx = fixture();
    let want: Vec<u32> = fx["map"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let got = compressed_token_map_from_file(&root().join("models/keep-tiny/tokenizer.json"))
        .expect("map");
    assert_eq!(got.size as u64, fx["size"].as_u64().unwrap());
    assert_eq!(got.map.len(), want.len());
    let diffs: Vec<usize> = (0..want.len()).filter(|&i| got.map[i] != want[i]).collect();
    assert!(
        diffs.is_empty(),
        "{} ids differ, first {:?}",
        diffs.len(),
        &diffs[..diffs.len().min(10)]
    );
    // The map really merges tokens (a test that could not fail otherwise).
    assert!(got.size < got.map.len());
}

#[test]
fn normaliser_equals_the_reference_on_probe_texts() {
    let fx = fixture();
    let probes = fx["normalised"].as_array().unwrap();
    assert!(probes.len() > 20);
    let norm = TokenNormalizer::new().unwrap();
    for p in probes {
        let (input, want) = (p[0].as_str().unwrap(), p[1].as_str().unwrap());
        assert_eq!(
            norm.normalize(input).unwrap(),
            want,
            "normalising {input:?} ({:?})",
            input.chars().map(|c| c as u32).collect::<Vec<_>>()
        );
    }
}
