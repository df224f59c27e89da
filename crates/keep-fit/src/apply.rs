//! Applying a plan: the checkpoint it runs (the model, or the derived checkpoint — built on
//! request with keep-convert's `prune` from the prune plan beside the fit plan, else refused
//! with the exact command), the runtime's options (budget, policy, warm start from the route
//! profile when it exists), and saving the route profile at the end of a run.

use std::path::{Path, PathBuf};

use keep_artifacts::fit_plan::FitPlan;
use keep_artifacts::plan::PrunePlan;
use keep_artifacts::route_profile::{RouteProfile, DEFAULT_HALF_LIFE};
use keep_model::Kernels;
use keep_runtime::{Policy, RouteLog, RuntimeOptions};

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

/// The plan's kernels.
pub fn kernels(plan: &FitPlan) -> Kernels {
    match plan.kernels.as_str() {
        "exact" => Kernels::Exact,
        _ => Kernels::Fast,
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
    let Some(d) = &plan.derived else {
        return Ok(PathBuf::from(&plan.model));
    };
    let dir = PathBuf::from(&d.dir);
    if dir.join("config.json").is_file() {
        return Ok(dir);
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
    let pp = resolve(plan_path, pp);
    let prune = PrunePlan::read(&pp)?;
    let opts = keep_convert::prune::PruneOptions {
        force: false,
        sync: true,
    };
    let (out, _) =
        keep_convert::prune::prune(Path::new(&plan.model), &prune, &dir, &opts, progress)?;
    Ok(out)
}

/// The route profile's path.
pub fn profile_path(plan_path: &Path, plan: &FitPlan) -> PathBuf {
    resolve(plan_path, &plan.profile)
}

/// The runtime options of the plan for a run of `context` positions (planned for at least the
/// plan's context, so that a shorter run gets the plan's hot set, not a larger one): budget,
/// policy, the plan's kernels, and the warm start — the route profile when it exists, else the
/// plan's `warm_start`. `None` when the plan maps the whole checkpoint.
pub fn runtime_options(
    plan_path: &Path,
    plan: &FitPlan,
    context: usize,
) -> Result<Option<RuntimeOptions>> {
    let Some(budget) = plan.budget else {
        return Ok(None);
    };
    let policy = match plan.policy.as_str() {
        "decay" => Policy::Decay {
            half_life: plan.half_life,
        },
        p => p.parse().map_err(FitError::Invalid)?,
    };
    let prof = profile_path(plan_path, plan);
    let warm = if prof.is_file() {
        Some(prof)
    } else {
        plan.warm_start.as_ref().map(|w| resolve(plan_path, w))
    };
    Ok(Some(RuntimeOptions {
        policy,
        warm_start: warm,
        kernels: kernels(plan),
        context: Some(context.max(plan.context)),
        ..RuntimeOptions::new(budget)
    }))
}

/// Fold a run's routes into the plan's route profile and write it back atomically (created on
/// the first run). Returns the profile's path.
pub fn save_profile(
    plan_path: &Path,
    plan: &FitPlan,
    log: &RouteLog,
    n_layers: usize,
    n_experts: usize,
) -> Result<PathBuf> {
    let path = profile_path(plan_path, plan);
    let mut prof = if path.is_file() {
        let p = RouteProfile::read(&path)?;
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
    if log.tokens() == 0 {
        return Ok(path);
    }
    prof.fold(log.layer_routes(), log.top_k())
        .map_err(FitError::Invalid)?;
    prof.write(&path, true)?;
    Ok(path)
}
