//! [`Session`]: one run assembled in one place from a [`SessionSpec`] — the checkpoint, its
//! config, the run options (kernels, prefill chunk), the memory budget (precision tiers and the
//! original checkpoint of their upper stages included) and drafting — for `keep run`,
//! `keep serve`, `keep eval --tasks`, `keep fit --check` and `keep logits`. The run options stay
//! apart from the model's config ([`keep_model::RunOptions`]); the config is what the checkpoint
//! says.
//!
//! [`Session::open`] opens the checkpoint, reads its config and resolves the drafting (which
//! needs to know what the checkpoint carries); [`Session::load`] plans the memory for a context
//! (refusing one the budget or the machine cannot hold) and builds the model on the session's
//! checkpoint, and [`Session::attach_draft`] attaches the drafter the budget was planned for.
//! Compute threads are process-wide ([`crate::set_threads`]) and sized by the caller before
//! anything runs. It never prints.

use std::path::{Path, PathBuf};
use std::time::Instant;

use keep_checkpoint::Checkpoint;
use keep_kernels::Kernels;
use keep_model::{ModelConfig, RunOptions, DEFAULT_PREFILL_CHUNK};

use crate::run::{DraftMode, RunModel};
use crate::runtime::RuntimeOptions;
use crate::{Result, RuntimeError};

/// Tokens drafted per verify forward with the MTP module when none are asked for.
pub const DEFAULT_MTP_DRAFT: usize = 2;

/// How a session drafts: a mode and the drafts per verify forward asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draft {
    pub mode: DraftMode,
    /// Drafts per verify forward (`None`: [`DEFAULT_MTP_DRAFT`] with the MTP module, a whole
    /// block with the DSpark drafter; at most the block and [`keep_model::mtp::MAX_DRAFT`]).
    pub tokens: Option<usize>,
    /// Refuse a checkpoint without the drafter the mode names (`false`: draft nothing there).
    /// [`DraftMode::Auto`] never refuses.
    pub required: bool,
}

impl Draft {
    /// No drafting.
    pub const NONE: Draft = Draft {
        mode: DraftMode::None,
        tokens: None,
        required: false,
    };
}

/// What a session runs (see the module documentation).
#[derive(Debug, Clone)]
pub struct SessionSpec {
    /// The checkpoint directory.
    pub model: PathBuf,
    /// Which kernels the products run on.
    pub kernels: Kernels,
    /// Tokens per forward pass of a long prompt (`None`: [`DEFAULT_PREFILL_CHUNK`]; under a
    /// budget, the prompt's length where that is less: [`Session::load`]). At least 1.
    pub prefill_chunk: Option<usize>,
    /// Routed experts in budgeted slots (`None`: the model mapped whole). Its `kernels`,
    /// `prefill_chunk`, `context` and `draft_tokens` are the session's: a `context` or
    /// `draft_tokens` set here is the least the budget is planned for.
    pub budget: Option<RuntimeOptions>,
    pub draft: Draft,
    /// Verify only the DSpark drafts whose predicted chance of all being accepted is at least
    /// this ([`RunModel::set_dspark_confidence`]); refused unless the session drafts with a
    /// DSpark drafter.
    pub draft_confidence: Option<f32>,
}

impl SessionSpec {
    /// The model at `dir` mapped whole on `kernels`, without drafting.
    pub fn new(dir: impl Into<PathBuf>, kernels: Kernels) -> SessionSpec {
        SessionSpec {
            model: dir.into(),
            kernels,
            prefill_chunk: None,
            budget: None,
            draft: Draft::NONE,
            draft_confidence: None,
        }
    }
}

/// What [`Session::load`] plans for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadFor {
    /// Tokens the run holds, drafts aside (prompt + generated): the session adds its drafts.
    /// `None`: the model's whole context under a budget, and no check of the machine's memory
    /// when mapped.
    pub context: Option<usize>,
    /// The prompt's tokens, when known: a budget without a set prefill chunk then holds the
    /// activations of the largest forward the run makes — the prompt, or a verify window —
    /// rather than a whole chunk.
    pub prompt: Option<usize>,
    /// What the context is called where the machine cannot hold it (`None`: "this run's
    /// context").
    pub label: Option<&'static str>,
    /// The caller runs no verify forward and attaches no drafter: the context is not extended
    /// by drafts (the budget still holds the drafter the session resolved, as a plan that
    /// drafts was fitted with it).
    pub undrafted: bool,
}

/// One assembled run: the open checkpoint, its config, and the resolved options.
pub struct Session {
    dir: PathBuf,
    ck: Checkpoint,
    cfg: ModelConfig,
    opts: RunOptions,
    /// The prefill chunk the spec set (`None`: the default, or the prompt under a budget).
    chunk: Option<usize>,
    budget: Option<RuntimeOptions>,
    draft: (DraftMode, usize),
    draft_confidence: Option<f32>,
}

impl Session {
    /// Open the checkpoint of `spec`, read its config, and resolve the drafting.
    pub fn open(spec: SessionSpec) -> Result<Session> {
        if spec.prefill_chunk == Some(0) {
            return Err(RuntimeError::Invalid(
                "the prefill chunk must be at least 1 token".into(),
            ));
        }
        let ck = Checkpoint::open(&spec.model)?;
        let cfg = ModelConfig::from_checkpoint(&ck)?;
        let draft = resolve_draft(&ck, &spec.model, spec.draft)?;
        if let Some(p) = spec.draft_confidence {
            if !dspark(&ck) || draft.1 == 0 {
                return Err(RuntimeError::Invalid(format!(
                    "--draft-confidence {p}: it applies to the DSpark drafter, and this run does \
                     not draft with one (use --draft dspark on a checkpoint that carries it)"
                )));
            }
        }
        Ok(Session {
            opts: RunOptions {
                kernels: spec.kernels,
                prefill_chunk: spec.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK),
            },
            chunk: spec.prefill_chunk,
            dir: spec.model,
            ck,
            cfg,
            budget: spec.budget,
            draft,
            draft_confidence: spec.draft_confidence,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The open checkpoint.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ck
    }

    /// The model's config (what the checkpoint says).
    pub fn cfg(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The options a model mapped whole runs with.
    pub fn options(&self) -> RunOptions {
        self.opts
    }

    /// The drafting mode and the drafts per verify forward (0: the session does not draft).
    pub fn draft(&self) -> (DraftMode, usize) {
        self.draft
    }

    /// Whether the model runs under a memory budget.
    pub fn budgeted(&self) -> bool {
        self.budget.is_some()
    }

    /// The runtime's options for a load planned for `what` (`None`: mapped whole).
    pub fn runtime_options(&self, what: LoadFor) -> Option<RuntimeOptions> {
        let k = self.draft.1;
        let b = self.budget.as_ref()?;
        let context = what.context.map(|c| c + self.drafts_in_context(what));
        let o = RuntimeOptions {
            kernels: self.opts.kernels,
            prefill_chunk: match (self.chunk, what.prompt) {
                (None, Some(p)) => Some(self.opts.prefill_chunk.min(p.max(k + 1)).max(1)),
                (c, _) => c,
            },
            context: match (context, b.context) {
                (Some(c), Some(least)) => Some(c.max(least)),
                (c, least) => c.or(least),
            },
            draft_tokens: b.draft_tokens.max(k),
            ..b.clone()
        };
        Some(o)
    }

    /// Refuse a model mapped whole whose context (`what`) the machine's memory cannot hold
    /// ([`crate::check_machine`]); a budget is checked when it is planned.
    pub fn check_memory(&self, what: LoadFor) -> Result<()> {
        if let (false, Some(c)) = (self.budgeted(), what.context) {
            let total = self
                .cfg
                .memory_estimate(c + self.drafts_in_context(what), self.opts.prefill_chunk)
                .total();
            crate::check_machine(total, what.label.unwrap_or("this run's context"))?;
        }
        Ok(())
    }

    /// Plan the memory for `what` and build the model on the session's checkpoint: the model
    /// and the seconds loading took. Mapped whole, the context is first checked against the
    /// machine's memory ([`Session::check_memory`]).
    pub fn load(&self, what: LoadFor) -> Result<(RunModel<'_>, f64)> {
        self.check_memory(what)?;
        let budget = self.runtime_options(what);
        let t = Instant::now();
        let model = RunModel::load_opts(&self.ck, self.opts, budget.as_ref())?;
        Ok((model, t.elapsed().as_secs_f64()))
    }

    /// The draft tokens a context planned for `what` adds: a drafting run's last verify
    /// forward may feed drafts past the last token handed on.
    fn drafts_in_context(&self, what: LoadFor) -> usize {
        if what.undrafted {
            0
        } else {
            self.draft.1
        }
    }

    /// The whole model mapped on the session's checkpoint with its options, as keep-model
    /// builds it (no budget, no drafter, no Engram row store): for tools that need the model
    /// itself (`keep logits`).
    pub fn whole_model(&self) -> Result<keep_model::Model<'_>> {
        Ok(keep_model::Model::load_opts(&self.ck, self.opts)?)
    }

    /// Attach the session's drafter to `model` (loaded by [`Session::load`]), with its DSpark
    /// confidence: the drafts per verify forward in use (0: none). A mode whose drafter the
    /// checkpoint lacks is refused here ([`RunModel::set_draft`]).
    pub fn attach_draft<'s>(&'s self, model: &mut RunModel<'s>) -> Result<usize> {
        let (mode, k) = self.draft;
        let n = model.set_draft(&self.ck, mode, k.max(1))?;
        if let Some(p) = self.draft_confidence {
            model.set_dspark_confidence(Some(p));
        }
        Ok(n)
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("dir", &self.dir)
            .field("opts", &self.opts)
            .field("budget", &self.budget)
            .field("draft", &self.draft)
            .finish_non_exhaustive()
    }
}

fn dspark(ck: &Checkpoint) -> bool {
    keep_model::dspark::present(ck)
}

/// The mode and drafts per verify forward `d` comes to on `ck` (at `dir`).
fn resolve_draft(ck: &Checkpoint, dir: &Path, d: Draft) -> Result<(DraftMode, usize)> {
    let (has_dspark, has_mtp) = (dspark(ck), keep_model::mtp::present(ck));
    Ok(match d.mode {
        DraftMode::None => (DraftMode::None, 0),
        DraftMode::DSpark if !has_dspark && d.required => {
            return Err(RuntimeError::Invalid(format!(
                "--draft dspark: {} has no DSpark drafter (dspark_* keys in config.json and \
                 mtp.0.main_proj.weight); use --draft mtp for a DeepSeek-V4 MTP module, or \
                 --draft none",
                dir.display()
            )))
        }
        DraftMode::DSpark if !has_dspark => (DraftMode::None, 0),
        DraftMode::DSpark | DraftMode::Auto if has_dspark => {
            let block = ck
                .config()
                .and_then(|c| c.dspark())
                .map_or(1, |k| k.block_size);
            let most = block.min(keep_model::mtp::MAX_DRAFT);
            match d.tokens.map_or(most, |k| k.min(most)) {
                0 if !d.required => (DraftMode::None, 0),
                k => (d.mode, k),
            }
        }
        mode if has_mtp => (mode, d.tokens.unwrap_or(DEFAULT_MTP_DRAFT)),
        _ if !d.required => (DraftMode::None, 0),
        // Refused by `RunModel::set_draft` (`Mtp`) or drafting nothing (`Auto`).
        mode => (mode, 0),
    })
}
