//! Reading and writing checkpoints: round trips, agreement with the `safetensors` crate, and
//! every kind of bad input the issue names giving a typed error (never a panic).

use std::path::Path;

use keep_checkpoint::safetensors::read_header;
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{Checkpoint, CheckpointError, Dtype};

fn raw_file(path: &Path, header: &str, data: &[u8]) {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    std::fs::write(path, v).unwrap();
}

fn header_err(header: &str, data: &[u8]) -> String {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("x.safetensors");
    raw_file(&p, header, data);
    let e = read_header(&p).unwrap_err();
    let s = e.to_string();
    assert!(s.contains("x.safetensors"), "error must name the file: {s}");
    s
}

#[test]
fn hostile_headers_are_errors() {
    let ok = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("ok.safetensors");
    raw_file(&p, ok, &[0; 8]);
    assert!(read_header(&p).is_ok());

    let cases: &[(&str, &[u8], &str)] = &[
        // Truncated data.
        (ok, &[0; 4], "past the end"),
        // Shape whose bytes do not match.
        (
            r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            &[0; 8],
            "needs 12 bytes",
        ),
        // Unknown dtype.
        (
            r#"{"a":{"dtype":"F12","shape":[2],"data_offsets":[0,8]}}"#,
            &[0; 8],
            "unknown dtype",
        ),
        // Duplicate names.
        (
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
            &[0; 2],
            "twice",
        ),
        // Overlap.
        (
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#,
            &[0; 4],
            "overlaps",
        ),
        // Reversed offsets.
        (
            r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#,
            &[0; 4],
            "reversed",
        ),
        // Negative shape.
        (
            r#"{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}}"#,
            &[],
            "non-negative",
        ),
        // Not an object.
        ("[1,2]", &[], "not a JSON object"),
        // Metadata not strings.
        (r#"{"__metadata__":{"a":1}}"#, &[], "not a string"),
        // Extra field.
        (
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}}"#,
            &[0],
            "unexpected field",
        ),
        // Sub-byte count that does not fill bytes.
        (
            r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#,
            &[0; 2],
            "whole bytes",
        ),
        // Overflowing shape.
        (
            r#"{"a":{"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#,
            &[],
            "overflows",
        ),
    ];
    for (h, data, want) in cases {
        let s = header_err(h, data);
        assert!(s.contains(want), "{h}: expected `{want}` in `{s}`");
    }

    // Header longer than the file, and longer than 100 MB.
    let p = d.path().join("long.safetensors");
    let mut v = 1000u64.to_le_bytes().to_vec();
    v.extend_from_slice(b"{}");
    std::fs::write(&p, &v).unwrap();
    assert!(read_header(&p)
        .unwrap_err()
        .to_string()
        .contains("truncated"));
    let mut v = (200u64 << 20).to_le_bytes().to_vec();
    v.extend_from_slice(b"{}");
    std::fs::write(&p, &v).unwrap();
    assert!(read_header(&p).unwrap_err().to_string().contains("limit"));
    std::fs::write(&p, [1u8, 2, 3]).unwrap();
    assert!(read_header(&p).is_err());

    // Non-UTF-8 names.
    let p = d.path().join("utf.safetensors");
    let h = b"{\"\xff\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}";
    let mut v = (h.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(h);
    std::fs::write(&p, &v).unwrap();
    assert!(read_header(&p).unwrap_err().to_string().contains("UTF-8"));
}

fn write_dir(out: &Path, tensors: &[(&str, Dtype, Vec<u64>, Vec<u8>)], max_shard: u64) {
    let metas = tensors
        .iter()
        .map(|(n, d, s, _)| TensorMeta::new(*n, *d, s))
        .collect();
    let opts = WriterOptions {
        max_shard_bytes: max_shard,
        ..Default::default()
    };
    let mut w = CheckpointWriter::create(out, metas, opts).unwrap();
    for (n, _, _, b) in tensors {
        // Write in two chunks to exercise chunking.
        let (a, c) = b.split_at(b.len() / 2);
        w.write_chunk(n, a).unwrap();
        if !c.is_empty() {
            w.write_chunk(n, c).unwrap();
        }
    }
    w.add_file("config.json", br#"{"hidden_size": 8}"#).unwrap();
    w.finish().unwrap();
}

fn sample() -> Vec<(&'static str, Dtype, Vec<u64>, Vec<u8>)> {
    vec![
        ("embed.weight", Dtype::BF16, vec![4, 8], (0..64).collect()),
        (
            "layers.0.attn.wkv.weight",
            Dtype::F8_E4M3,
            vec![32, 32],
            (0..1024).map(|i| i as u8).collect(),
        ),
        (
            "layers.0.attn.wkv.scale",
            Dtype::F8_E8M0,
            vec![1, 1],
            vec![127],
        ),
        (
            "layers.0.ffn.experts.0.w1.weight",
            Dtype::I8,
            vec![8, 16],
            vec![0x21; 128],
        ),
        ("empty", Dtype::F32, vec![0], vec![]),
        (
            "layers.0.attn.attn_sink",
            Dtype::F32,
            vec![2],
            vec![0, 0, 128, 63, 0, 0, 0, 64],
        ),
    ]
}

#[test]
fn writer_round_trip_single_and_sharded() {
    for max_shard in [1 << 30, 100] {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("ck");
        write_dir(&out, &sample(), max_shard);
        let ck = Checkpoint::open(&out).unwrap();
        assert!(ck.warnings().is_empty(), "{:?}", ck.warnings());
        assert_eq!(ck.len(), sample().len());
        for (n, dt, s, b) in sample() {
            let t = ck.tensor(n).unwrap();
            assert_eq!(t.dtype, dt);
            assert_eq!(t.shape, s.as_slice());
            assert_eq!(t.bytes, b.as_slice(), "{n}");
        }
        assert_eq!(ck.config().unwrap().hidden_size, 8);
        let rep = keep_checkpoint::sums::verify_dir(&out).unwrap();
        assert!(rep.passed());
        assert!(rep.unlisted.is_empty(), "{:?}", rep.unlisted);
        if max_shard == 100 {
            assert!(ck.shards().len() > 1);
            assert!(ck.index().is_some());
        } else {
            assert_eq!(ck.shards().len(), 1);
        }
        // The safetensors crate reads what we wrote, with the same bytes.
        for sf in ck.shards() {
            let bytes = std::fs::read(sf.path()).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                assert_eq!(view.data(), ck.tensor(&name).unwrap().bytes);
            }
        }
        // No temporary directories are left beside the output.
        let left: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left.len(), 1, "{left:?}");
    }
}

#[test]
fn existing_output_is_refused_unless_forced_and_drop_cleans_up() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("ck");
    write_dir(&out, &sample(), 1 << 30);
    let metas = vec![TensorMeta::new("a", Dtype::U8, &[1])];
    let e = CheckpointWriter::create(&out, metas.clone(), WriterOptions::default());
    assert!(matches!(e, Err(CheckpointError::OutputExists { .. })));
    {
        // An interrupted writer leaves nothing behind.
        let opts = WriterOptions {
            force: true,
            ..Default::default()
        };
        let _w = CheckpointWriter::create(&out, metas.clone(), opts).unwrap();
    }
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    // The old output is untouched.
    assert!(Checkpoint::open(&out).unwrap().contains("embed.weight"));
    let opts = WriterOptions {
        force: true,
        ..Default::default()
    };
    let mut w = CheckpointWriter::create(&out, metas, opts).unwrap();
    assert!(w.write_chunk("b", &[1]).is_err());
    assert!(w.write_chunk("a", &[1, 2]).is_err());
    w.write_chunk("a", &[7]).unwrap();
    w.finish().unwrap();
    assert_eq!(
        Checkpoint::open(&out).unwrap().tensor("a").unwrap().bytes,
        &[7]
    );
}

#[test]
fn a_missing_shard_or_a_lying_index_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("ck");
    write_dir(&out, &sample(), 100);
    let ck = Checkpoint::open(&out).unwrap();
    let victim = ck.shards()[1].path().to_path_buf();
    drop(ck);
    let name = victim.file_name().unwrap().to_string_lossy().to_string();
    std::fs::remove_file(&victim).unwrap();
    let e = Checkpoint::open(&out).unwrap_err().to_string();
    assert!(e.contains(&name) && e.contains("missing"), "{e}");

    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("ck");
    write_dir(&out, &sample(), 1 << 30);
    std::fs::write(
        out.join("model.safetensors.index.json"),
        r#"{"weight_map":{"ghost":"model.safetensors"}}"#,
    )
    .unwrap();
    let e = Checkpoint::open(&out).unwrap_err().to_string();
    assert!(e.contains("ghost"), "{e}");
}

#[test]
fn fuzz_corpus_replays_without_panic() {
    // The committed corpus of `cargo fuzz run <target>` (fuzz/corpus: seeds and the inputs the
    // fuzzer kept, minimised) and every input that once crashed (fuzz/regressions), replayed
    // as a normal test.
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    for target in keep_checkpoint::fuzzing::TARGETS {
        let n = keep_checkpoint::fuzzing::replay_corpus(
            &fuzz.join("corpus"),
            &[target],
            &keep_checkpoint::fuzzing::run,
        );
        assert!(
            n >= 5,
            "expected a committed corpus for `{target}`, found {n} inputs"
        );
    }
    keep_checkpoint::fuzzing::replay_corpus(
        &fuzz.join("regressions"),
        &keep_checkpoint::fuzzing::TARGETS,
        &keep_checkpoint::fuzzing::run,
    );
}

#[test]
fn force_replaces_only_a_directory_keep_wrote() {
    use keep_checkpoint::writer::{check_dir_target, CheckpointWriter, WriterOptions};
    let d = tempfile::tempdir().unwrap();
    let write = |out: &std::path::Path, force: bool| {
        let mut w = CheckpointWriter::create(
            out,
            vec![],
            WriterOptions {
                force,
                ..WriterOptions::default()
            },
        )?;
        w.add_file("a.json", b"{}")?;
        w.finish()
    };
    // A directory of someone else's: refused with force, naming it and its file; untouched.
    let theirs = d.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::write(theirs.join("notes.txt"), b"mine").unwrap();
    let e = write(&theirs, true).unwrap_err().to_string();
    assert!(
        e.contains("theirs") && e.contains("notes.txt") && e.contains("SHA256SUMS"),
        "{e}"
    );
    assert_eq!(std::fs::read(theirs.join("notes.txt")).unwrap(), b"mine");
    // An empty directory is used; keep's own output is replaced with force.
    let ours = d.path().join("ours");
    std::fs::create_dir(&ours).unwrap();
    write(&ours, true).unwrap();
    write(&ours, true).unwrap();
    check_dir_target(&ours, true, &[]).unwrap();
    // A file added beside keep's makes it someone else's again.
    std::fs::write(ours.join("extra"), b"x").unwrap();
    let e = check_dir_target(&ours, true, &[]).unwrap_err().to_string();
    assert!(e.contains("extra"), "{e}");
    // A SHA256SUMS that lists nothing does not make a directory keep's.
    std::fs::write(theirs.join("SHA256SUMS"), b"").unwrap();
    let e = check_dir_target(&theirs, true, &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("notes.txt"), "{e}");
}

/// An output that takes shards of its source whole: they are hard links of the source's files
/// (same inode), listed in its index and `SHA256SUMS`, the output reads the same bytes as the
/// source, and replacing or deleting the output leaves the source intact. A name declared both
/// written and reused is refused.
#[test]
fn reused_shards_are_linked_listed_and_independent_of_the_source() {
    use std::os::unix::fs::MetadataExt;
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    write_dir(&src, &sample(), 100);
    let ck = Checkpoint::open(&src).unwrap();
    let n_src = ck.shards().len();
    assert!(n_src >= 3, "{n_src} shards");
    // Take every shard without an expert tensor whole; write the rest.
    let reused = ck.whole_shards(|t| !t.name.contains("experts"));
    assert!(!reused.is_empty() && reused.len() < n_src);
    let reused_names: Vec<String> = reused
        .iter()
        .flat_map(|r| r.tensors.iter().map(|t| t.name.clone()))
        .collect();
    let written: Vec<_> = sample()
        .into_iter()
        .filter(|(n, ..)| !reused_names.iter().any(|r| r == n))
        .collect();
    let metas: Vec<TensorMeta> = written
        .iter()
        .map(|(n, dt, s, _)| TensorMeta::new(*n, *dt, s))
        .collect();
    let out = d.path().join("out");
    let opts = WriterOptions {
        max_shard_bytes: 100,
        ..Default::default()
    };
    // The same tensor both reused and written is refused.
    let mut twice = metas.clone();
    twice.push(reused[0].tensors[0].clone());
    let e = CheckpointWriter::create_reusing(&out, twice, reused.clone(), opts.clone());
    assert!(e.err().unwrap().to_string().contains("declared twice"));
    let mut w =
        CheckpointWriter::create_reusing(&out, metas, reused.clone(), opts.clone()).unwrap();
    for (n, _, _, b) in &written {
        w.write_tensor(n, b).unwrap();
    }
    let stats = w.reuse_stats();
    w.add_file("config.json", br#"{"hidden_size": 8}"#).unwrap();
    w.finish().unwrap();
    assert_eq!(stats.linked_shards + stats.copied_shards, reused.len());
    let o = Checkpoint::open(&out).unwrap();
    assert!(o.warnings().is_empty(), "{:?}", o.warnings());
    for (n, dt, s, b) in sample() {
        let t = o.tensor(n).unwrap();
        assert_eq!(
            (t.dtype, t.shape, t.bytes),
            (dt, s.as_slice(), b.as_slice()),
            "{n}"
        );
    }
    assert!(keep_checkpoint::sums::verify_dir(&out).unwrap().passed());
    // Same file system: each reused shard is the source's file under a second name.
    assert_eq!(stats.linked_shards, reused.len(), "{stats:?}");
    let inodes = |dir: &Path| -> Vec<u64> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().ino())
            .collect()
    };
    let (si, oi) = (inodes(&src), inodes(&out));
    assert_eq!(oi.iter().filter(|i| si.contains(i)).count(), reused.len());
    // Replacing the output (--force) and deleting it leave the source as it was.
    let mut w = CheckpointWriter::create_reusing(
        &out,
        vec![],
        reused,
        WriterOptions {
            force: true,
            ..opts
        },
    )
    .unwrap();
    w.add_file("config.json", br#"{"hidden_size": 8}"#).unwrap();
    w.finish().unwrap();
    std::fs::remove_dir_all(&out).unwrap();
    assert!(keep_checkpoint::sums::verify_dir(&src).unwrap().passed());
    assert_eq!(Checkpoint::open(&src).unwrap().len(), sample().len());
}
