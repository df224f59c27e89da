//! `keep-run-stats` v1: the numbers of one `keep run` (`--stats-json FILE`) — the command, the
//! budget split, prefill and decode speeds, the expert cache's and the Engram row cache's
//! counters per phase, peak resident memory — as a JSON object, read by the budget and Engram
//! benchmark scripts (`dev/bench-budget.sh`, `dev/bench-engram.sh`).
//!
//! Its one typed writer ([`write`], atomic through keep-checkpoint, an existing file refused
//! without `force`) and one typed reader ([`read`], which checks `format` and `version`). The
//! fields are declared in alphabetical order so the file lists them in the order readers have
//! always seen; fields that do not apply to a run (a plan and cache counters without a memory
//! budget, Engram counters without Engram layers) are `null`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{ArtifactError, Result};

/// The `format` field of a run-stats file.
pub const FORMAT: &str = "keep-run-stats";
/// The `version` field this module writes and reads.
pub const VERSION: u32 = 1;
/// Largest run-stats file the reader accepts (a few kilobytes in practice; a `--profile` run
/// adds about a kilobyte per forward pass).
pub const MAX_BYTES: u64 = 64 << 20;

/// One run's numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunStats {
    /// The command line, space-joined.
    pub command: String,
    /// Expert cache counters of the decode (`None` without a memory budget).
    pub decode_cache: Option<CacheCounters>,
    /// Engram row cache counters of the decode (`None` without Engram layers or a budget).
    pub decode_engram: Option<EngramCounters>,
    pub decode_secs: f64,
    /// Decode forwards (sampled tokens fed back).
    pub decode_tokens: u64,
    pub decode_tps: f64,
    /// Speculative decoding with the MTP module (`None`: the run did not draft).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<DraftNumbers>,
    /// Memory a run may use beyond its budget (binary, stacks, activations, short KV cache).
    pub fixed_overhead_bytes: u64,
    /// [`FORMAT`].
    pub format: String,
    pub io_threads: u64,
    pub load_secs: f64,
    /// The model directory.
    pub model: String,
    /// Peak resident set size (`None` where the system does not report it).
    pub peak_rss_bytes: Option<u64>,
    /// How the budget was split (`None` without a memory budget).
    pub plan: Option<PlanNumbers>,
    /// The slot policy (`None` without a memory budget).
    pub policy: Option<String>,
    pub prefill_cache: Option<CacheCounters>,
    pub prefill_engram: Option<EngramCounters>,
    pub prefill_secs: f64,
    pub prefill_tps: f64,
    /// Where each forward pass's time went (`keep run --profile`; absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<ProfileNumbers>,
    pub prompt_tokens: u64,
    /// Compute threads of the run's parallel kernels (`--threads`, else `RAYON_NUM_THREADS`,
    /// else one per core; 0 in files that predate the field).
    #[serde(default)]
    pub threads: u64,
    /// [`VERSION`].
    pub version: u32,
}

/// What speculative decoding did in a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DraftNumbers {
    /// Acceptance rate at each draft position (position 0 = the first drafted token).
    pub acceptance: Vec<f64>,
    /// Drafts accepted at each position.
    pub accepted: Vec<u64>,
    /// `--draft auto` turned drafting off during the run (it did not pay then).
    pub auto_off: bool,
    /// `--draft auto`: times drafting was switched off, and back on.
    #[serde(default)]
    pub auto_offs: u64,
    #[serde(default)]
    pub auto_ons: u64,
    /// `--draft auto` stopped drafting for the rest of the run.
    #[serde(default)]
    pub auto_stopped: bool,
    /// Tokens drafted per verify forward.
    pub k: u64,
    /// Tokens decoded without drafts while `--draft auto` had drafting off.
    #[serde(default)]
    pub plain_tokens: u64,
    /// Drafts proposed at each position.
    pub proposed: Vec<u64>,
    /// Verify forwards after which the cache was restored and the kept rows replayed.
    pub replays: u64,
    /// Tokens per verify forward (accepted drafts plus the corrected or bonus token).
    pub tokens_per_forward: f64,
    pub verify_forwards: u64,
    /// Distinct routed experts per MoE layer per verify forward, on average (the window's
    /// expert union; one decode step asks for `top_k`).
    #[serde(default)]
    pub window_experts: f64,
}

/// `keep run --profile`: each forward pass's time split into exclusive parts (they sum to the
/// pass's total), the bytes each part read and the time threads waited on each other inside
/// it. Every per-part array is in the order of `parts`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileNumbers {
    /// The decode's steps summed (one step per decoded token or verify window).
    pub decode: ProfileStep,
    /// The part names, the order of every per-part array.
    pub parts: Vec<String>,
    /// The prompt's steps summed (one step per prefill chunk).
    pub prefill: ProfileStep,
    /// Every step in order.
    pub steps: Vec<ProfileStep>,
}

/// One forward pass's profile (or a phase's sum of them): a step runs from the start of its
/// forward to the start of the next, so a decoded token's step also holds the sampling and
/// the handing on of the token after it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileStep {
    /// Bytes read per part: weights, and the KV rows for `attn_scores`.
    pub bytes: Vec<u64>,
    /// Exclusive nanoseconds per part (they sum to `total_ns`).
    pub ns: Vec<u64>,
    /// `prefill` or `decode`.
    pub phase: String,
    /// Parallel regions the kernels ran.
    pub regions: u64,
    /// Steps summed (1 for one step).
    pub steps: u64,
    /// Tokens the forward passes ran.
    pub tokens: u64,
    pub total_ns: u64,
    /// Nanoseconds threads waited on each other in the part's parallel regions (from the
    /// dispatch to the first task's start, plus from the first worker finishing to the
    /// last): inside `ns`, not added to it.
    pub wait_ns: Vec<u64>,
}

/// How a memory budget was split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanNumbers {
    /// Bytes of one prefill pass's activations reserved in the budget.
    pub activation_bytes: u64,
    pub budget: u64,
    /// Bytes of the decoding cache reserved for `context` positions.
    pub cache_bytes: u64,
    /// Positions the run was planned for (prompt + generated tokens).
    pub context: u64,
    /// Whether every shard is read with direct I/O.
    pub direct_io: bool,
    /// Bytes of the Engram row cache (`None` without Engram layers).
    pub engram_cache_bytes: Option<u64>,
    /// Bytes of one routed expert.
    pub expert_bytes: u64,
    pub n_experts: u64,
    pub n_layers: u64,
    /// Tokens per forward pass of a long prompt.
    pub prefill_chunk: u64,
    /// Bytes of the resident weights (with the Engram row cache).
    pub residents: u64,
    /// Bytes of all routed experts of all layers.
    pub routed_expert_bytes: u64,
    /// Bytes of one slot (one expert's aligned reads).
    pub slot_bytes: u64,
    pub slots_per_layer: u64,
    pub top_k: u64,
}

/// The expert cache's counters over one phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheCounters {
    pub bytes_read: u64,
    pub experts_read: u64,
    pub guess: GuessCounters,
    pub hash_layers: HashLayerCounters,
    pub hit_rate: f64,
    pub hits: u64,
    pub io_busy_secs: f64,
    pub misses: u64,
    pub read_gbps: f64,
    /// Precision tiers (`None`: the run had no `--tiers`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiers: Option<TierCounters>,
    pub wait_secs: f64,
    pub warm_bytes: u64,
}

/// Precision tiers over one phase: routed slots per rung and the residual cache's traffic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TierCounters {
    /// Residual reads issued.
    pub admissions: u64,
    /// Routed slots with gate weight ≥ τ.
    pub above_tau: u64,
    /// Routed slots computed at the base rung.
    pub base: u64,
    /// Residual bytes read.
    pub bytes_read: u64,
    /// Bytes of the residual cache (inside the budget).
    pub cache_bytes: u64,
    pub evictions: u64,
    /// Residual reads that failed (their slots stayed at the base rung).
    pub failed: u64,
    /// Wanted-upper slots whose stage was already being read.
    pub in_flight: u64,
    /// Wanted-upper slots not admitted for lack of room.
    pub no_room: u64,
    pub tau: f32,
    /// Routed slots computed at the upper rung.
    pub upper: u64,
    /// `upper / (upper + upper_misses)`.
    pub upper_hit_rate: f64,
    /// Slots with gate ≥ τ whose expert has an upper stage not in memory (served at base).
    pub upper_misses: u64,
    /// Seconds a forward waited for a residual read (none ever does).
    pub wait_secs: f64,
}

/// Next-layer guesses (all zero unless the run prefetched the next layer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuessCounters {
    pub guessed: u64,
    pub passes: u64,
    pub reads: u64,
    pub right: u64,
    pub routed: u64,
    pub saved: u64,
}

/// The hash-routed layers' share of the counters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HashLayerCounters {
    pub exact_passes: u64,
    pub hits: u64,
    pub misses: u64,
    pub wait_secs: f64,
}

/// The Engram row cache's counters over one phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngramCounters {
    /// The alignment of the row reads: the tables' device's logical block size (0 in files
    /// written before it was recorded).
    #[serde(default)]
    pub block_bytes: u64,
    /// How `block_bytes` was found: `statx` (STATX_DIOALIGN), `sysfs` (the device's
    /// `queue/logical_block_size`) or `default` (4096).
    #[serde(default)]
    pub block_source: String,
    /// Bytes read from the files (whole blocks).
    pub bytes_read: u64,
    pub hit_rate: f64,
    pub hits: u64,
    pub misses: u64,
    pub read_amplification: f64,
    pub reads: u64,
    pub rows_requested: u64,
    pub sync_rows: u64,
    /// Bytes of the rows read (what was asked of the files); `bytes_read / useful_bytes` is
    /// `read_amplification`.
    pub useful_bytes: u64,
    pub wait_secs: f64,
}

/// The file's bytes: pretty-printed JSON and a final newline.
pub fn to_json(s: &RunStats) -> Result<String> {
    check(Path::new("run stats"), s)?;
    serde_json::to_string_pretty(s)
        .map(|j| j + "\n")
        .map_err(|e| ArtifactError::Config(format!("run stats: {e}")))
}

/// Write `s` to `path` atomically (temporary sibling, renamed when complete); an existing file
/// is refused unless `force`.
pub fn write(path: &Path, s: &RunStats, force: bool) -> Result<()> {
    keep_checkpoint::atomic::write_file(path, to_json(s)?.as_bytes(), force)?;
    Ok(())
}

/// Read a run-stats file, refusing another format or version.
pub fn read(path: &Path) -> Result<RunStats> {
    let text = keep_checkpoint::small_file::read_text(path, MAX_BYTES)?;
    let bad = |msg: String| ArtifactError::Trace {
        path: path.to_path_buf(),
        msg,
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    match (v.get("format"), v.get("version")) {
        (Some(f), _) if *f != FORMAT => {
            return Err(bad(format!("format {f} is not `{FORMAT}`")));
        }
        (_, Some(n)) if *n != VERSION => {
            return Err(bad(format!(
                "version {n} of {FORMAT}: this keep reads version {VERSION}"
            )));
        }
        (None, _) | (_, None) => {
            return Err(bad(format!("no `format`/`version`: not a {FORMAT} file")));
        }
        _ => {}
    }
    serde_json::from_value(v).map_err(|e| bad(format!("{FORMAT} v{VERSION}: {e}")))
}

fn check(path: &Path, s: &RunStats) -> Result<()> {
    if s.format != FORMAT || s.version != VERSION {
        return Err(ArtifactError::Config(format!(
            "{}: run stats must be {FORMAT} v{VERSION}, not {} v{}",
            path.display(),
            s.format,
            s.version
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(k: u64) -> CacheCounters {
        CacheCounters {
            tiers: None,
            bytes_read: 4096 * k,
            experts_read: k,
            guess: GuessCounters {
                guessed: 1,
                passes: 2,
                reads: 3,
                right: 4,
                routed: 5,
                saved: 6,
            },
            hash_layers: HashLayerCounters {
                exact_passes: 7,
                hits: 8,
                misses: 9,
                wait_secs: 0.25,
            },
            hit_rate: 0.75,
            hits: 3 * k,
            io_busy_secs: 0.5,
            misses: k,
            read_gbps: 1.5,
            wait_secs: 0.125,
            warm_bytes: 0,
        }
    }

    fn stats() -> RunStats {
        RunStats {
            command: "keep run m --memory-budget 2GiB".into(),
            decode_cache: Some(cache(2)),
            decode_engram: Some(EngramCounters {
                block_bytes: 512,
                block_source: "statx".into(),
                bytes_read: 8192,
                hit_rate: 0.5,
                hits: 2,
                misses: 2,
                read_amplification: 3.0,
                reads: 2,
                rows_requested: 4,
                sync_rows: 0,
                useful_bytes: 2048,
                wait_secs: 0.01,
            }),
            decode_secs: 1.25,
            decode_tokens: 10,
            decode_tps: 8.0,
            draft: None,
            fixed_overhead_bytes: 64 << 20,
            format: FORMAT.into(),
            io_threads: 8,
            load_secs: 0.5,
            model: "/m".into(),
            peak_rss_bytes: None,
            plan: Some(PlanNumbers {
                activation_bytes: 1 << 16,
                budget: 2 << 30,
                cache_bytes: 1 << 18,
                context: 40,
                direct_io: true,
                engram_cache_bytes: None,
                expert_bytes: 1000,
                n_experts: 64,
                n_layers: 4,
                prefill_chunk: 128,
                residents: 1 << 20,
                routed_expert_bytes: 256_000,
                slot_bytes: 4096,
                slots_per_layer: 10,
                top_k: 6,
            }),
            policy: Some("lru".into()),
            prefill_cache: Some(cache(1)),
            prefill_engram: None,
            prefill_secs: 0.0,
            prefill_tps: 0.0,
            profile: None,
            prompt_tokens: 3,
            threads: 2,
            version: VERSION,
        }
    }

    #[test]
    fn round_trip_and_refusals() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("run.json");
        let s = stats();
        write(&p, &s, false).unwrap();
        assert_eq!(read(&p).unwrap(), s);
        // An existing file is refused without force and replaced with it.
        let e = write(&p, &s, false).unwrap_err();
        assert!(e.to_string().contains("exists"), "{e}");
        let mut t = stats();
        t.plan = None;
        t.policy = None;
        t.prefill_cache = None;
        t.decode_cache = None;
        t.decode_engram = None;
        write(&p, &t, true).unwrap();
        assert_eq!(read(&p).unwrap(), t);
        // The fields readers use, in the file's alphabetical order.
        let text = std::fs::read_to_string(&p).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["plan"], serde_json::Value::Null);
        assert_eq!(v["format"], "keep-run-stats");
        let keys: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("  \""))
            .filter_map(|l| l.split('"').next())
            .collect();
        assert_eq!(
            keys,
            [
                "command",
                "decode_cache",
                "decode_engram",
                "decode_secs",
                "decode_tokens",
                "decode_tps",
                "fixed_overhead_bytes",
                "format",
                "io_threads",
                "load_secs",
                "model",
                "peak_rss_bytes",
                "plan",
                "policy",
                "prefill_cache",
                "prefill_engram",
                "prefill_secs",
                "prefill_tps",
                "prompt_tokens",
                "threads",
                "version"
            ]
        );
        // A profiled run's steps round-trip; the field is absent without one (above).
        let step = |phase: &str, steps: u64| ProfileStep {
            bytes: vec![10, 0],
            ns: vec![7, 3],
            phase: phase.into(),
            regions: 2,
            steps,
            tokens: steps,
            total_ns: 10,
            wait_ns: vec![1, 0],
        };
        let mut prof = stats();
        prof.profile = Some(ProfileNumbers {
            decode: step("decode", 1),
            parts: vec!["head".into(), "other".into()],
            prefill: step("prefill", 0),
            steps: vec![step("decode", 1)],
        });
        write(&p, &prof, true).unwrap();
        assert_eq!(read(&p).unwrap(), prof);
        let mut w = serde_json::to_value(stats()).unwrap();
        w["version"] = 2.into();
        std::fs::write(&p, w.to_string()).unwrap();
        assert!(read(&p).unwrap_err().to_string().contains("version 2"));
        w["format"] = "keep-routes".into();
        std::fs::write(&p, w.to_string()).unwrap();
        assert!(read(&p).unwrap_err().to_string().contains("keep-routes"));
        std::fs::write(&p, "{").unwrap();
        assert!(read(&p).unwrap_err().to_string().contains("not JSON"));
        let mut bad = stats();
        bad.format = "other".into();
        assert!(write(&p, &bad, true).is_err());
    }
}
