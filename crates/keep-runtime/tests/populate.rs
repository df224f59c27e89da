//! A mapped run faults its files in at load when they fit ([`populate_if_it_fits`]): the
//! resident pages of each shard's mapping, read from `/proc/self/smaps`, cover the file right
//! after `RunModel::load`, before any forward touched a routed expert. Linux only (procfs and
//! `MADV_POPULATE_READ`, Linux 5.14); skipped where either is missing.

mod common;

use keep_checkpoint::Checkpoint;
use keep_runtime::run::{RunModel, POPULATE_MAX_FRACTION};

/// Resident bytes (`Rss:`) of the mapping that starts at `addr`, from `/proc/self/smaps`.
fn mapping_rss(addr: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.ends_with(':') {
            if inside && first == "Rss:" {
                let kb = line.split_whitespace().nth(1)?.parse::<u64>().ok()?;
                return Some(kb * 1024);
            }
        } else if let Some((start, _)) = first.split_once('-') {
            inside = usize::from_str_radix(start, 16).ok() == Some(addr);
        }
    }
    None
}

#[test]
fn a_mapped_run_is_faulted_in_at_load() {
    let dir = tempfile::tempdir().unwrap();
    // 96 experts of width 512: ~80 MB, almost all of it routed experts no load step reads.
    let path = common::synth_tiny(dir.path(), "mapped", Some(96), Some(512));
    let ck = Checkpoint::open(&path).unwrap();
    let shards: Vec<(usize, u64)> = ck
        .shards()
        .iter()
        .filter_map(|s| Some((s.mapping()?.as_ptr() as usize, s.len())))
        .collect();
    assert!(!shards.is_empty());
    let Some(before) = mapping_rss(shards[0].0) else {
        eprintln!("no /proc/self/smaps here: skipped");
        return;
    };
    let file = shards[0].1;
    assert!(
        before < file / 2,
        "the freshly opened mapping is already resident ({before} of {file} B)"
    );
    let _m = RunModel::load(&ck, keep_kernels::Kernels::Exact, None).unwrap();
    let fits = keep_runtime::runtime::mem_available()
        .is_some_and(|a| ck.file_bytes() as f64 <= a as f64 * POPULATE_MAX_FRACTION);
    if !fits {
        eprintln!("too little memory available to populate: skipped");
        return;
    }
    for &(addr, len) in &shards {
        let rss = mapping_rss(addr).unwrap();
        if rss + 4096 < len && !ck.shards()[0].populate() {
            eprintln!("MADV_POPULATE_READ refused here: skipped");
            return;
        }
        // Every page of the file (the last one partial) is mapped.
        assert!(
            rss + 4096 >= len,
            "after load only {rss} of the shard's {len} B are resident"
        );
    }
}
