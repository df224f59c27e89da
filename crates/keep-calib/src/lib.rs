//! keep-calib: calibration of a DeepSeek-V4.1 MoE model — packs of tokenized text, one
//! layer-streamed pass of the full model per group that leaves imatrix, REAP, route traces and
//! teacher logits behind, the sums of those sessions, and the choice of surviving experts.
//!
//! What it is: [`pack`] (local text → `keep-pack` directory), [`calibrate`] (a run directory of
//! session files, sharded across processes, resumable), [`finalize`] (`imatrix.safetensors`,
//! `reap-stats.safetensors`), [`select`] (a `keep-prune-plan` with the REAP-vs-frequency kill
//! test and super-expert candidates), [`sidecar`] (reduced-rank ridge sidecars of a plan, fitted
//! layer by layer against the teacher) and [`plot`]. The observer [`stats::Collector`] only reads
//! what keep-model's forward reports, so the forward is bit-identical with it attached.
//!
//! What it is not: no printing, no CLI, no model code (keep-model computes, this crate watches),
//! no pruning (keep-convert's `prune` applies the plan).
//!
//! Depends on: keep-model (forward, observers), keep-checkpoint (safetensors reading, atomic
//! writer), keep-artifacts (the session files, REAP statistics and prune plans — their formats,
//! readers and writers; this crate gathers and sums what goes in them), `tokenizers`,
//! `plotters`, `faer` (the sidecars' f64 linear algebra).
//!
//! # Files
//!
//! **Pack** (`keep-pack` v1): see [`pack`]: `pack.json` + `records.jsonl` + `SHA256SUMS`.
//!
//! **Run directory**: `run.json` (`keep-calib-run` v1: fingerprints, split, shapes, the list of
//! sessions) and one `{group}.safetensors` per session (`keep-calib-session` v1; metadata
//! `format`, `version`, `session`, `split`, `n_experts`, `top_k`, `n_layers`, `layers`,
//! `hidden`, `hash_layers`, `model_fingerprint`, `pack_fingerprint`, `records`, `tokens`,
//! `teacher_topk` (eval), `complete` = `true`; the file is renamed into place only when written
//! and synced). Tensors per layer `L`:
//!
//! | name | dtype, shape | what |
//! |---|---|---|
//! | `imatrix.{L}.{key}` | F32 `[cols]` | Σ x² per input column of linear `key` |
//! | `imatrix.{L}.attn.wo_a` | F32 `[o_groups, cols]` | the grouped output projection, per group |
//! | `imatrix.{L}.{key}.count` | I64 `[1]` (`[o_groups]`) | rows (tokens) summed |
//! | `reap.{L}.count` | I64 `[E]` | routes to each expert |
//! | `reap.{L}.sum_g`, `sum_norm`, `sum_g_norm` | F64 `[E]` | Σ g, Σ ‖f‖₂, Σ g·‖f‖₂ |
//! | `reap.{L}.max_f`, `min_f` | F32 `[E, hidden]` | per output channel extremes of f (0 if never routed) |
//! | `reap.{L}.dist` | F64 `[E, E]` | hash-routed layers: Σ over routes to r of ‖f_r − f_j‖₂² at (r, j) |
//! | `routes.{L}.experts` | I16 `[T, top_k]` | chosen experts, router order, first ≤ 2048 tokens |
//! | `routes.{L}.weights` | F16 `[T, top_k]` | final gate weights |
//! | `teacher.{i}.topk_ids` / `topk_logprobs` | I32 / F32 `[T, 64]` | eval split: top-64 log-probs of record i |
//! | `teacher.{i}.next_logprob` | F32 `[T-1]` | eval split: log-prob of the true next token |
//!
//! Linear keys are the model's names: `attn.wq_a`, `attn.wq_b`, `attn.wkv`, `attn.wo_a`,
//! `attn.wo_b`, `attn.compressor.wkv`, `attn.compressor.wgate`, `attn.indexer.wq_b`,
//! `attn.indexer.wk`, `ffn.gate`, `ffn.shared_experts.w1`/`w2`/`w3`, and routed experts
//! `ffn.experts.{e}.w1`/`w2`/`w3` (counted over the tokens routed to expert e, so
//! `imatrix.{L}.ffn.experts.{e}.w1.count` equals `reap.{L}.count[e]`). g is the model's own
//! gate weight (sqrtsoftplus scores, selection by scores + correction bias, weights from the
//! unbiased scores, renormalised, times `routed_scaling_factor`); f the expert's output before
//! gating.
//!
//! **Finalized** (`keep finalize`): `imatrix.safetensors` (`keep-imatrix` v1, the same
//! `imatrix.*` names summed, every routed expert present) and `reap-stats.safetensors`
//! (`keep-reap-stats` v1, the `reap.*` names summed plus `reap.{L}.score` F64 `[E]` =
//! Σ g·‖f‖ / count, 0 for never-routed experts). See [`finalize`].
//!
//! **Plan**: `keep_artifacts::plan::PrunePlan` with extra fields; see [`select`].

pub mod calibrate;
pub mod error;
pub mod eval;
pub mod eval_metrics;
pub mod finalize;
pub mod fingerprint;
pub mod fuzzing;
pub mod pack;
pub mod plot;
pub mod select;
pub mod session;
pub mod sidecar;
pub mod st;
pub mod stats;
pub mod tasks;
pub mod tiers;

pub use error::CalibError;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, CalibError>;
