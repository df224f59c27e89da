//! Applying a plan: the checkpoint it runs (the model, or the derived checkpoint — built on
//! request with keep-convert's `prune` from the prune plan beside the fit plan, else refused
//! with the exact command), the runtime's options (budget, policy, warm start from the route
//! profile when it exists, drafting) and the session they make up (keep-runtime's
//! `SessionSpec`), and saving the route profile at the end of a run.
//!
//! A plan is trusted no further than it can be checked: the model it names must have the
//! fingerprint it records, and every file it names is resolved relative to the plan's own
//! directory, where the files it writes (the route profile, the derived checkpoint, the prune
//! plan) must stay. Route profile updates are merged holding an exclusive lock on the plan
//! file, so concurrent runs of one plan each fold their routes in.

use std::path::{Path, PathBuf};

use keep_artifacts::fit_plan::FitPlan;
use keep_artifacts::plan::PrunePlan;
use keep_artifacts::route_profile::{RouteProfile, DEFAULT_HALF_LIFE};
use keep_model::Kernels;
use keep_runtime::run::DraftMode;
use keep_runtime::{Draft, Policy, RouteLog, RuntimeOptions, SessionSpec};

use crate::{FitError, Result};

/// A file the plan names: relative names are beside the plan.
pub fn resolve(plan_path: &Path, name: &str) -> PathBuf {
    let p = Path::new(name);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        plan_path
            .parent()
            .map(|d| d.join(p))
            .unwrap_or_else(|| p.to_path_buf())
    }
}

/// A file the plan's field `field` names that a run may write: resolved beside the plan, and
/// refused when it lies outside the plan's directory (an absolute path elsewhere, or `..`).
pub fn resolve_inside(plan_path: &Path, field: &str, name: &str) -> Result<PathBuf> {
    let p = resolve(plan_path, name);
    let dir = keep_checkpoint::atomic::resolve(plan_path.parent().unwrap_or(Path::new(".")));
    if !keep_checkpoint::atomic::resolve(&p).starts_with(&dir) {
        return Err(FitError::File {
            path: plan_path.to_path_buf(),
            msg: format!(
                "`{field}` names {name}, outside the plan's directory {}; the files a plan writes lie beside it: fit the plan again there",
                dir.display()
            ),
        });
    }
    Ok(p)
}

/// Check that `model` is the model the plan was fitted to (its fingerprint).
pub fn check_model(plan_path: &Path, plan: &FitPlan, model: &Path) -> Result<()> {
    let fp = keep_checkpoint::fingerprint::model_fingerprint(model)?;
    if fp != plan.model_fingerprint {
        return Err(FitError::File {
            path: plan_path.to_path_buf(),
            msg: format!(
                "the plan was fitted to a model with fingerprint {}, but {} has {fp}; fit a plan for this model (keep fit)",
                plan.model_fingerprint,
                model.display()
            ),
        });
    }
    Ok(())
}

/// The plan's kernels.
pub fn kernels(plan: &FitPlan) -> Kernels {
    match plan.kernels.as_str() {
        "exact" => Kernels::Exact,
        _ => Kernels::Fast,
    }
}

/// Tokens drafted per verify forward by a plan that drafts with the MTP module.
pub const DRAFT_TOKENS: usize = 2;

/// The plan's drafting on checkpoint `ck`: the mode and the tokens drafted per verify forward
/// (0 when the run does not draft): `mtp` drafts [`DRAFT_TOKENS`] with the MTP module, `dspark`
/// a whole block with the DSpark drafter (its `dspark_block_size`, at most
/// [`keep_model::mtp::MAX_DRAFT`], as `keep run --draft dspark`), each only on a checkpoint that
/// carries that drafter. `keep run --plan`, `keep serve --plan` and `keep fit --check` all
/// draft this way, and [`runtime_options`] holds the drafter's tensors and the cache copy in
/// the budget exactly when it drafts.
pub fn draft(plan: &FitPlan, ck: &keep_checkpoint::Checkpoint) -> (DraftMode, usize) {
    match plan.draft.as_str() {
        "mtp" if keep_model::mtp::present(ck) => (DraftMode::Mtp, DRAFT_TOKENS),
        "dspark" if keep_model::dspark::present(ck) => {
            let block = ck
                .config()
                .and_then(|c| c.dspark())
                .map_or(0, |k| k.block_size);
            match block.min(keep_model::mtp::MAX_DRAFT) {
                0 => (DraftMode::None, 0),
                k => (DraftMode::DSpark, k),
            }
        }
        _ => (DraftMode::None, 0),
    }
}

/// The checkpoint directory the plan runs. A derived checkpoint that does not exist is built
/// when `build` (pruned by the plan's prune plan; `progress` gets bytes done and total), else
/// refused with the commands that build it.
pub fn checkpoint(
    plan_path: &Path,
    plan: &FitPlan,
    build: bool,
    progress: &dyn Fn(u64, u64),
) -> Result<PathBuf> {
    let model = resolve(plan_path, &plan.model);
    let Some(d) = &plan.derived else {
        check_model(plan_path, plan, &model)?;
        return Ok(model);
    };
    // Relative names lie beside the plan; an absolute one is read where it is (the user gave
    // it to `keep fit --derived-dir`) but built there only by the commands the plan lists.
    let dir = resolve(plan_path, &d.dir);
    if !Path::new(&d.dir).is_absolute() {
        resolve_inside(plan_path, "derived.dir", &d.dir)?;
    }
    if model.join("config.json").is_file() {
        check_model(plan_path, plan, &model)?;
    }
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    if build {
        resolve_inside(plan_path, "derived.dir", &d.dir)?;
    }
    if !build {
        return Err(FitError::NotBuilt {
            dir,
            commands: d.commands.clone(),
        });
    }
    let pp = d.prune_plan.as_ref().ok_or_else(|| FitError::NotBuilt {
        dir: dir.clone(),
        commands: d.commands.clone(),
    })?;
    let pp = resolve_inside(plan_path, "derived.prune_plan", pp)?;
    check_model(plan_path, plan, &model)?;
    let prune = PrunePlan::read(&pp)?;
    let opts = keep_convert::prune::PruneOptions {
        force: false,
        sync: true,
    };
    let (out, _) = keep_convert::prune::prune(&model, &prune, &dir, &opts, progress)?;
    Ok(out)
}

/// The route profile's path (beside the plan; refused outside its directory).
pub fn profile_path(plan_path: &Path, plan: &FitPlan) -> Result<PathBuf> {
    resolve_inside(plan_path, "profile", &plan.profile)
}

/// The runtime options of the plan for a run of `context` positions (planned for at least the
/// plan's context, so that a shorter run gets the plan's hot set, not a larger one): budget,
/// policy, the plan's kernels, its drafting ([`draft`], `draft_tokens`), and the warm start —
/// the route profile when it exists, else the plan's `warm_start`. `None` when the plan maps
/// the whole checkpoint.
pub fn runtime_options(
    plan_path: &Path,
    plan: &FitPlan,
    ck: &keep_checkpoint::Checkpoint,
    context: usize,
) -> Result<Option<RuntimeOptions>> {
    Ok(budget(plan_path, plan)?.map(|o| RuntimeOptions {
        context: Some(context.max(plan.context)),
        draft_tokens: draft(plan, ck).1,
        ..o
    }))
}

/// The plan's budget as a session takes it ([`session_spec`]): [`runtime_options`] for at
/// least the plan's context, the drafter's tokens left to the session (which resolves them on
/// the checkpoint as [`draft`] does). `None` when the plan maps the whole checkpoint.
pub fn budget(plan_path: &Path, plan: &FitPlan) -> Result<Option<RuntimeOptions>> {
    let Some(budget) = plan.budget else {
        return Ok(None);
    };
    let policy = match plan.policy.as_str() {
        "decay" => Policy::Decay {
            half_life: plan.half_life,
        },
        p => p.parse().map_err(FitError::Invalid)?,
    };
    let prof = profile_path(plan_path, plan)?;
    let warm = if prof.is_file() {
        Some(prof)
    } else {
        plan.warm_start.as_ref().map(|w| resolve(plan_path, w))
    };
    Ok(Some(RuntimeOptions {
        policy,
        warm_start: warm,
        kernels: kernels(plan),
        context: Some(plan.context),
        ..RuntimeOptions::new(budget)
    }))
}

/// The plan's drafting as a session asks for it: the plan's drafter where the checkpoint
/// carries it, none elsewhere — what [`draft`] comes to on the checkpoint.
pub fn draft_spec(plan: &FitPlan) -> Draft {
    let mode = match plan.draft.as_str() {
        "mtp" => DraftMode::Mtp,
        "dspark" => DraftMode::DSpark,
        _ => return Draft::NONE,
    };
    Draft {
        mode,
        tokens: (mode == DraftMode::Mtp).then_some(DRAFT_TOKENS),
        required: false,
    }
}

/// The session the plan runs on its checkpoint at `dir` ([`checkpoint`]): the plan's kernels,
/// budget ([`budget`]) and drafting ([`draft_spec`]), the default prefill chunk.
pub fn session_spec(plan_path: &Path, plan: &FitPlan, dir: PathBuf) -> Result<SessionSpec> {
    Ok(SessionSpec {
        budget: budget(plan_path, plan)?,
        draft: draft_spec(plan),
        ..SessionSpec::new(dir, kernels(plan))
    })
}

/// Fold a run's routes into the plan's route profile and write it back atomically (created on
/// the first run), holding an exclusive lock on the plan file from the read to the rename, so
/// that concurrent runs each add theirs. Returns the profile's path.
pub fn save_profile(
    plan_path: &Path,
    plan: &FitPlan,
    log: &RouteLog,
    n_layers: usize,
    n_experts: usize,
) -> Result<PathBuf> {
    let path = profile_path(plan_path, plan)?;
    if log.tokens() == 0 {
        return Ok(path);
    }
    let lock = std::fs::File::open(plan_path)
        .and_then(|f| f.lock().map(|_| f))
        .map_err(|e| keep_checkpoint::CheckpointError::io(plan_path, e))?;
    let mut prof = if path.is_file() {
        let p = RouteProfile::read(&path)?;
        if !p.model_fingerprint.starts_with(&plan.model_fingerprint) {
            return Err(FitError::File {
                path,
                msg: format!(
                    "the profile is of the model with fingerprint {}, the plan's is {}; remove it",
                    p.model_fingerprint, plan.model_fingerprint
                ),
            });
        }
        if p.n_layers != n_layers || p.n_experts != n_experts {
            return Err(FitError::File {
                path,
                msg: format!(
                    "the profile is of {} layers × {} experts, the plan's checkpoint {n_layers} × {n_experts}; remove it",
                    p.n_layers, p.n_experts
                ),
            });
        }
        p
    } else {
        RouteProfile::new(
            plan.model_fingerprint.clone(),
            n_layers,
            n_experts,
            DEFAULT_HALF_LIFE,
        )
    };
    prof.fold(log.layer_routes(), log.top_k())
        .map_err(FitError::Invalid)?;
    prof.write(&path, true)?;
    drop(lock);
    Ok(path)
}
