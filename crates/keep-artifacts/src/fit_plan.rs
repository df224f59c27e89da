//! Fit plans: how to run a model inside a memory budget, written by `keep fit` and applied by
//! `keep run --plan`, `keep serve --plan` and `keep fit --check`.
//!
//! JSON, `format` = `keep-fit-plan`, `version` = 1. Every field, in file order:
//! - `command`: the `keep fit` command line that wrote the plan.
//! - `model`: the source model directory; `model_fingerprint`: its keep-checkpoint fingerprint.
//! - `derived`: the checkpoint the plan runs when it is not the model itself (pruned experts):
//!   `dir`, `experts_kept` / `experts_total` per layer, `rung` (a quantized rung such as
//!   `e8p2`, or null for the shipped weights), `prune_plan` (the `keep-prune-plan` file `keep
//!   fit` wrote beside the plan) and `commands`, the exact commands that build `dir`, in order.
//!   `null`: the plan runs `model` as it is.
//! - `memory`: the budget the plan was fitted to — `bytes`, `auto` (true when it was the
//!   machine's available memory minus `margin`), `available` (MemAvailable when read).
//! - `budget`: `keep run --memory-budget` bytes, or null when the whole checkpoint fits mapped;
//!   `context`: the positions of context (prompt + generated) the budget was split for — a run
//!   is planned for at least this many, so that it gets the plan's hot set.
//! - `policy` (lru, decay, static), `half_life` (decay's, in tokens), `hot_set` (expert slots
//!   per layer the budget leaves).
//! - `warm_start`: the file the slots are filled from before the run (REAP statistics, a route
//!   file or a route profile), or null; `profile`: the persistent route profile the runtime
//!   updates at exit and warm-starts from when it exists (a `keep-route-profile` file).
//! - `kernels` (fast or exact), `draft` (none, mtp or dspark), `tiers` (reserved for per-expert
//!   precision tiers: null in this version).
//! - `probes`: what `keep fit` measured on this machine (read bandwidth of the model's own
//!   expert bytes with direct I/O, compute seconds per token, memory).
//! - `prediction`: the chosen candidate's predicted tok/s, KL and bytes, each with its
//!   provenance (`measured`, `interpolated`, `simulated`, `synthetic`, `definition`, `unknown`).
//! - `candidates`: the best candidates the search found, the chosen one first.
//! - `check_set` (optional): the token sequences the probes decoded and whose routes the
//!   prediction replays — `source`, `prompt_tokens`, `sequences` — which `keep fit --check`
//!   decodes again.
//!
//! [`FitPlan::read`] is the one reader (format, version and ranges checked);
//! [`FitPlan::write`] validates and writes atomically, refusing an existing file without
//! `force`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::Result;

/// The format tag.
pub const FORMAT: &str = "keep-fit-plan";
/// The version this crate reads and writes.
pub const VERSION: u32 = 1;

/// The checkpoint a plan runs when it is not the model itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Derived {
    /// Where the derived checkpoint is (or will be) written.
    pub dir: String,
    /// Routed experts kept per pruned layer, of `experts_total`.
    pub experts_kept: usize,
    pub experts_total: usize,
    /// A quantized rung of the routed experts (`keep quant --format`), or `None`.
    pub rung: Option<String>,
    /// The `keep-prune-plan` file the derived checkpoint is pruned by, if it is pruned.
    pub prune_plan: Option<String>,
    /// The exact commands that build `dir`, in order.
    pub commands: Vec<String>,
}

/// The memory a plan was fitted to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    /// Bytes the plan must fit in.
    pub bytes: u64,
    /// `--memory auto`: `available − margin`.
    pub auto: bool,
    /// MemAvailable when it was read.
    pub available: Option<u64>,
    /// What `auto` leaves to the rest of the machine.
    pub margin: u64,
}

/// What `keep fit` measured on the machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probes {
    /// Read bandwidth of the model's own expert bytes with direct I/O, GB/s (10⁹ bytes).
    pub ssd_gbps: f64,
    /// Bytes the read probe read, and whether it was direct I/O.
    pub ssd_probe_bytes: u64,
    pub direct_io: bool,
    /// Seconds a miss costs the runtime (waited per expert read in the compute probe).
    pub miss_secs: f64,
    /// Compute seconds per decoded token (decode time minus I/O waits), from a short budgeted
    /// decode at the model's own shapes with the plan's kernels.
    pub compute_secs_per_token: f64,
    /// Tokens the compute probe decoded.
    pub compute_probe_tokens: u64,
    /// The kernels the compute probe ran.
    pub kernels: String,
    /// Seconds a decoder layer waits once it has any miss, whatever the number (the read's
    /// latency the forward cannot overlap); with [`Probes::miss_transfer_secs`] per miss this
    /// prices a token's misses. 0 in plans written before the term existed.
    #[serde(default)]
    pub layer_latency_secs: f64,
    /// Seconds each waited miss adds beyond the layer's latency (its bytes at the read rate
    /// the probe saw). 0 in plans written before the term existed (then `miss_secs` alone).
    #[serde(default)]
    pub miss_transfer_secs: f64,
    /// How `compute_secs_per_token` was measured: `all-resident` (a decode with every expert
    /// in memory) or `minimum-budget` (decode time minus waits with every expert read).
    #[serde(default)]
    pub compute_provenance: String,
}

/// The token sequences `keep fit` probed and `keep fit --check` decodes: each a prompt of
/// `prompt_tokens` ids, then the rest fed one token at a time (the decode of a known text,
/// so its routes, and the hit rate a plan gets on them, are the same on every run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckSet {
    /// Where the sequences come from (a pack's held-out records, or synthetic ids).
    pub source: String,
    pub prompt_tokens: usize,
    pub sequences: Vec<Vec<u32>>,
}

/// A predicted number and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Predicted {
    /// The value (`None` when unknown).
    pub value: Option<f64>,
    /// `measured`, `interpolated`, `simulated`, `synthetic` or `unknown`.
    pub provenance: String,
    /// One sentence on where the number comes from.
    pub source: String,
}

/// One candidate of the search (the chosen plan is one of them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// A short name: `offload`, `prune-50%`, `prune-75%+offload`...
    pub name: String,
    pub experts_kept: usize,
    pub experts_total: usize,
    pub rung: Option<String>,
    /// `None`: the whole checkpoint is mapped.
    pub budget: Option<u64>,
    pub policy: String,
    pub hot_set: usize,
    pub kernels: String,
    pub draft: String,
    /// Simulated hit rate of the routed experts (1 when mapped).
    pub hit_rate: f64,
    /// Expert bytes read from SSD per token.
    pub ssd_bytes_per_token: f64,
    pub tokens_per_sec: Predicted,
    pub kl: Predicted,
    /// Bytes in memory (the budget, or the mapped checkpoint's resident and expert bytes).
    pub bytes_in_memory: u64,
    /// Routed-expert bytes left on SSD (read on demand).
    pub bytes_on_ssd: u64,
    /// Whether the candidate meets `--min-quality` (always true without it).
    pub meets_quality: bool,
}

/// A fit plan (see the module documentation for every field).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitPlan {
    pub format: String,
    pub version: u32,
    pub command: String,
    pub model: String,
    pub model_fingerprint: String,
    pub derived: Option<Derived>,
    pub memory: Memory,
    pub budget: Option<u64>,
    pub context: usize,
    pub policy: String,
    pub half_life: f64,
    pub hot_set: usize,
    pub warm_start: Option<String>,
    pub profile: String,
    pub kernels: String,
    pub draft: String,
    pub tiers: Option<serde_json::Value>,
    pub probes: Probes,
    pub prediction: Candidate,
    pub candidates: Vec<Candidate>,
    /// The sequences the prediction's routes were recorded on and the check decodes (absent
    /// in plans written before; the check then decodes one synthetic prompt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check_set: Option<CheckSet>,
}

const POLICIES: [&str; 3] = ["lru", "decay", "static"];
const KERNELS: [&str; 2] = ["fast", "exact"];
const DRAFTS: [&str; 3] = ["none", "mtp", "dspark"];

/// How a fit plan file is named in errors.
const KIND: crate::json::Kind = crate::json::Kind {
    a: "a fit plan",
    name: "fit plan",
};

impl FitPlan {
    /// Check the format tag and every field's range.
    pub fn validate(&self) -> std::result::Result<(), String> {
        crate::json::check_format(&self.format, self.version, FORMAT, VERSION)?;
        if !POLICIES.contains(&self.policy.as_str()) {
            return Err(format!(
                "policy `{}` is not lru, decay or static",
                self.policy
            ));
        }
        if !(self.half_life.is_finite() && self.half_life > 0.0) {
            return Err(format!(
                "half_life {} is not a positive number",
                self.half_life
            ));
        }
        if !KERNELS.contains(&self.kernels.as_str()) {
            return Err(format!("kernels `{}` is not fast or exact", self.kernels));
        }
        if !DRAFTS.contains(&self.draft.as_str()) {
            return Err(format!("draft `{}` is not none, mtp or dspark", self.draft));
        }
        if self.context == 0 {
            return Err("context is 0 positions".into());
        }
        if self.budget == Some(0) {
            return Err("budget is 0 bytes".into());
        }
        if self.budget.is_some() && self.hot_set == 0 {
            return Err("a budgeted plan has no expert slots (hot_set 0)".into());
        }
        if self.profile.is_empty() {
            return Err("profile names no file".into());
        }
        if let Some(d) = &self.derived {
            if d.experts_kept == 0 || d.experts_kept > d.experts_total {
                return Err(format!(
                    "derived keeps {} of {} experts",
                    d.experts_kept, d.experts_total
                ));
            }
            if d.dir.is_empty() || d.commands.is_empty() {
                return Err("derived names no directory or no command that builds it".into());
            }
        }
        if self.tiers.is_some() {
            return Err("tiers are not supported by this version".into());
        }
        if let Some(c) = &self.check_set {
            if c.sequences.is_empty()
                || c.sequences.iter().any(|s| s.len() <= c.prompt_tokens)
                || c.prompt_tokens == 0
            {
                return Err(format!(
                    "check_set: every sequence must be longer than its {}-token prompt",
                    c.prompt_tokens
                ));
            }
        }
        Ok(())
    }

    /// Read and validate a plan file.
    pub fn read(path: &Path) -> Result<FitPlan> {
        crate::json::read(path, KIND, FitPlan::validate)
    }

    /// Parse and validate the text of a plan; `path` only names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<FitPlan> {
        crate::json::parse(path, text, KIND, FitPlan::validate)
    }

    /// Validate and write the plan atomically; an existing `path` is refused unless `force`.
    pub fn write(&self, path: &Path, force: bool) -> Result<()> {
        crate::json::write(self, path, force, true, KIND, FitPlan::validate)
    }

    /// The checkpoint directory the plan runs (derived, else the model).
    pub fn checkpoint_dir(&self) -> &str {
        match &self.derived {
            Some(d) => &d.dir,
            None => &self.model,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn sample() -> FitPlan {
        let cand = Candidate {
            name: "prune-50%+offload".into(),
            experts_kept: 16,
            experts_total: 32,
            rung: None,
            budget: Some(1 << 20),
            policy: "lru".into(),
            hot_set: 8,
            kernels: "fast".into(),
            draft: "none".into(),
            hit_rate: 0.9,
            ssd_bytes_per_token: 1000.0,
            tokens_per_sec: Predicted {
                value: Some(100.0),
                provenance: "simulated".into(),
                source: "replay".into(),
            },
            kl: Predicted {
                value: Some(0.01),
                provenance: "interpolated".into(),
                source: "between 25% and 75%".into(),
            },
            bytes_in_memory: 1 << 20,
            bytes_on_ssd: 1 << 19,
            meets_quality: true,
        };
        FitPlan {
            format: FORMAT.into(),
            version: VERSION,
            command: "keep fit --memory 1MiB".into(),
            model: "/m".into(),
            model_fingerprint: "abc".into(),
            derived: Some(Derived {
                dir: "/m-50".into(),
                experts_kept: 16,
                experts_total: 32,
                rung: None,
                prune_plan: Some("/p.json".into()),
                commands: vec!["keep prune /m /m-50 --plan /p.json".into()],
            }),
            memory: Memory {
                bytes: 1 << 20,
                auto: false,
                available: None,
                margin: 0,
            },
            budget: Some(1 << 20),
            context: 64,
            policy: "lru".into(),
            half_life: 32.0,
            hot_set: 8,
            warm_start: None,
            profile: "/plan.profile.json".into(),
            kernels: "fast".into(),
            draft: "none".into(),
            tiers: None,
            probes: Probes {
                ssd_gbps: 1.0,
                ssd_probe_bytes: 4096,
                direct_io: true,
                miss_secs: 1e-4,
                compute_secs_per_token: 1e-3,
                compute_probe_tokens: 8,
                kernels: "fast".into(),
                layer_latency_secs: 1e-4,
                miss_transfer_secs: 1e-5,
                compute_provenance: "all-resident".into(),
            },
            prediction: cand.clone(),
            candidates: vec![cand],
            check_set: Some(CheckSet {
                source: "synthetic".into(),
                prompt_tokens: 2,
                sequences: vec![vec![1, 2, 3, 4]],
            }),
        }
    }

    #[test]
    fn round_trip_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("plan.json");
        let plan = sample();
        plan.write(&p, false).unwrap();
        assert!(plan.write(&p, false).is_err(), "existing file refused");
        assert_eq!(FitPlan::read(&p).unwrap(), plan);
        assert_eq!(plan.checkpoint_dir(), "/m-50");

        let mut bad = plan.clone();
        bad.policy = "fifo".into();
        assert!(bad.write(&dir.path().join("b.json"), false).is_err());
        let mut bad = plan.clone();
        bad.version = 2;
        let text = serde_json::to_string(&bad).unwrap();
        let e = FitPlan::parse(&p, &text).unwrap_err().to_string();
        assert!(e.contains("keep-fit-plan"), "{e}");
        let mut bad = plan.clone();
        bad.derived.as_mut().unwrap().experts_kept = 40;
        assert!(bad.validate().is_err());
        let e = FitPlan::parse(&p, "{\"format\": 1}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a fit plan"), "{e}");
    }
}
