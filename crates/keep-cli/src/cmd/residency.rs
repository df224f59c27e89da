//! `keep residency`: replay recorded routes through expert hot-set policies and say, per
//! hot-set size, whether a hot set plus SSD reads can be fast enough.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use keep_residency::cost::{model_bytes, CostModel};
use keep_residency::report::{read_reap, Options, PolicyRow, Report, REAP_FILE};
use keep_residency::synth::SynthSpec;
use keep_residency::{HotSizes, PolicyKind, WarmStart};

use crate::util::{human, parse_bytes};

/// Replay the routes recorded in RUN (by `keep calibrate` or `keep run --record-routes`)
/// through a hot set of experts per layer — static (a fixed ranking by REAP saliency,
/// frequency or first use), LRU, decayed use counts, and Belady's optimum as the ceiling, the
/// first three exactly as `keep run --memory-budget` runs them — and report, per
/// hot-set size, each policy's miss rate, bytes read per token and a tokens/s bound, with the
/// verdict: KILL if the best realizable policy that fetches every miss still misses more than
/// 5% of routed slots, else PASS. Residency resets at each session (file); counts pool over
/// sessions. `--fetch-threshold W` adds hybrid rows that drop misses with gate weight < W
/// and reports the gate mass dropped. RUN is a directory of session files or one file.
///
/// Cost model (per token): misses × expert bytes at --ssd-gbps, plus hits × expert bytes
/// and, with --model, the model's resident bytes (all but routed experts, embedding, MTP and
/// vision tensors) at --mem-gbps; tok/s = 1 / seconds. No compute time, no overlap: a bound.
///
/// Example: keep residency runs/calib --hot 16,32,64 --model DIR --plot residency.svg
/// Example: keep residency /tmp/synth --make-synthetic layers=8,experts=256,top_k=6 --expert-bytes 13.4MB
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct ResidencyArgs {
    /// Run directory (every *.safetensors with `routes.*` tensors is a session) or one trace file.
    run: PathBuf,
    /// Hot experts per layer, comma list (default: powers of two up to the layer's experts).
    #[arg(long, value_delimiter = ',', conflicts_with = "hot_frac")]
    hot: Vec<usize>,
    /// Hot-set sizes as fractions of each layer's experts, comma list.
    #[arg(long, value_delimiter = ',')]
    hot_frac: Vec<f64>,
    /// Policies to replay: static, lru, decay, belady (comma list).
    #[arg(long, value_delimiter = ',', default_value = "static,lru,decay,belady")]
    policy: Vec<String>,
    /// Half-life of the decayed use counts, in tokens (decoded tokens are forward passes, so
    /// the default is `keep run --policy decay`'s).
    #[arg(long, default_value_t = keep_residency::policy::DEFAULT_HALF_LIFE)]
    half_life: f64,
    /// Warm start: reap (RUN/reap-stats.safetensors), frequency (counts of the trace), none
    /// (empty hot sets), or auto (reap when the file exists, else frequency).
    #[arg(long, default_value = "auto")]
    warm_start: String,
    /// Also replay a hybrid that drops misses whose gate weight is below W.
    #[arg(long, value_name = "W")]
    fetch_threshold: Option<f32>,
    /// SSD read bandwidth, GB/s.
    #[arg(long, default_value_t = 7.0)]
    ssd_gbps: f64,
    /// Memory read bandwidth, GB/s.
    #[arg(long, default_value_t = 100.0)]
    mem_gbps: f64,
    /// Model checkpoint to take expert and resident byte sizes from.
    #[arg(long, conflicts_with = "expert_bytes")]
    model: Option<PathBuf>,
    /// Bytes of one routed expert (e.g. 13.4MB, 8MiB), instead of --model.
    #[arg(long, value_name = "B")]
    expert_bytes: Option<String>,
    /// Print the report as JSON (format keep-residency-report, version 1).
    #[arg(long)]
    json: bool,
    /// Draw miss rate against hot-set size per policy (.png or .svg).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Replace an existing --plot file.
    #[arg(long)]
    force: bool,
    /// First write a synthetic run with temporal locality into RUN (a new directory), then
    /// replay it. SPEC: key=value list over layers, experts, top_k, tokens, sessions, seed,
    /// working_set, locality, drift, zipf ("" for the defaults).
    #[arg(long, value_name = "SPEC", num_args = 0..=1, default_missing_value = "")]
    make_synthetic: Option<String>,
    /// Precision tiers: a routed slot with gate weight ≥ TAU wants its expert's upper stage
    /// (what lies above its allocated rung: the residual codes --model carries above an
    /// `e8p2` base, or with --upper-from the shipped expert above the top quantized rung); it
    /// gets it only if it is in the residual cache, else it is served at the base rung and the
    /// stage is admitted, usable --admit-delay tokens later. Adds a tier row per policy row.
    #[arg(long, value_name = "TAU", requires = "model", value_parser = parse_tau)]
    tau: Option<f32>,
    /// The precision allocation --model holds (ALLOC.json; checked against its residual
    /// codes). Without it every E8P expert's base is its `e8p2` codes.
    #[arg(long, value_name = "FILE", requires = "tau")]
    alloc: Option<PathBuf>,
    /// The original checkpoint: experts at the top quantized rung (`e8p2+e81`, `e8p2+e8p2`),
    /// and `e8p2` ones without residual codes, upgrade to its shipped expert (sizes from it).
    #[arg(long, value_name = "DIR", requires = "tau")]
    upper_from: Option<PathBuf>,
    /// Tokens at the start of each session that the run computed as one prefill forward
    /// (keep run's prompt): their admissions serve only after it (0: token by token).
    #[arg(long, default_value_t = 0, value_name = "N", requires = "tau")]
    prefill_tokens: usize,
    /// Bytes of the residual cache (what `keep run --tiers` reports as its residual cache).
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES", default_value = "256MiB")]
    residual_cache: u64,
    /// Tokens after a residual miss from which the admitted stage serves (≥ 1).
    #[arg(long, default_value_t = 1, value_name = "K")]
    admit_delay: usize,
    /// Also predict the tokens/s of speculative decoding at each hot-set size: the acceptance
    /// at each draft position (comma list, one per draft: `keep run --draft mtp|dspark` prints
    /// it), K = its length (for DSpark at most its block size). Each verify forward reads the
    /// union of its K + 1 rows' experts (LRU slots) and the drafter (with --model): the MTP
    /// module once per draft and once for the fed pairs, or DSpark's one pass per window (its
    /// block through every stage, the union of its own experts over the block's rows); and
    /// replays the kept rows on a rejection. Needs --model or --expert-bytes. Replay a trace
    /// recorded with --draft none.
    #[arg(long, value_delimiter = ',', value_name = "A1,A2,..")]
    draft_acceptance: Vec<f64>,
    /// The drafter --draft-acceptance predicts: mtp (DeepSeek-V4's MTP module) or dspark
    /// (DeepSeek-V4.1's DSpark). Default: the one --model carries, DSpark when it carries it
    /// (as `keep run --draft auto`), else mtp.
    #[arg(long, value_enum, requires = "draft_acceptance")]
    drafter: Option<DrafterArg>,
    /// With --draft-acceptance: add the measured compute of drafting to the prediction. A short
    /// probe on --model (weights in memory, after a prompt of --draft-probe-context tokens)
    /// times a decode forward, verify forwards of 1..K + 1 rows, the replay, the cache snapshot
    /// and the drafter's passes (MTP: a draft, the fed pairs, its cache snapshot; DSpark: a
    /// block, the projection of the kept rows); these seconds replace the memory-read term on
    /// both sides (they include reading the weights from memory). Without it the prediction
    /// counts reads only.
    #[arg(long, requires = "draft_acceptance")]
    draft_probe: bool,
    /// Prompt tokens before the probe's forwards (the context the decode runs at).
    #[arg(long, default_value_t = 64, value_name = "N")]
    draft_probe_context: usize,
    /// Runs of each probed forward (the median is used).
    #[arg(long, default_value_t = 9, value_name = "N")]
    draft_probe_reps: usize,
    /// Kernels the probe runs (as `keep run --kernels`, whose default is fast).
    #[arg(long, value_enum, default_value_t = super::KernelsArg::Fast)]
    draft_probe_kernels: super::KernelsArg,
}

/// `--drafter`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DrafterArg {
    Mtp,
    Dspark,
}

/// The drafter `--draft-acceptance` predicts and its K: `--drafter`, else what `model`
/// carries (DSpark preferred); DSpark's K is at most its block size.
fn drafter(a: &ResidencyArgs) -> anyhow::Result<(keep_residency::draft::Drafter, u64)> {
    use keep_residency::draft::{dspark_pass_bytes, mtp_pass_bytes, Drafter};
    let Some(dir) = &a.model else {
        let d = match a.drafter {
            Some(DrafterArg::Dspark) => Drafter::DSpark,
            _ => Drafter::Mtp,
        };
        return Ok((d, 0));
    };
    let ck = keep_checkpoint::Checkpoint::open(dir)?;
    let (dspark, mtp) = (
        keep_model::dspark::present(&ck),
        keep_model::mtp::present(&ck),
    );
    let d = match a.drafter {
        Some(DrafterArg::Dspark) if !dspark => bail!(
            "--drafter dspark: {} has no DSpark drafter (dspark_* keys in config.json and \
             mtp.0.main_proj.weight); use --drafter mtp for a DeepSeek-V4 MTP module",
            dir.display()
        ),
        Some(DrafterArg::Mtp) if dspark && !mtp => bail!(
            "--drafter mtp: {} carries a DSpark drafter, not an MTP module (mtp.0.e_proj); \
             use --drafter dspark",
            dir.display()
        ),
        Some(DrafterArg::Dspark) => Drafter::DSpark,
        Some(DrafterArg::Mtp) => Drafter::Mtp,
        None if dspark => Drafter::DSpark,
        None => Drafter::Mtp,
    };
    if d == Drafter::DSpark {
        let block = ck
            .config()
            .and_then(|c| c.dspark())
            .map_or(0, |k| k.block_size);
        anyhow::ensure!(
            a.draft_acceptance.len() <= block,
            "--draft-acceptance: {} rates, but the DSpark drafter of {} drafts blocks of {block}; \
             give at most {block}",
            a.draft_acceptance.len(),
            dir.display()
        );
        return Ok((d, dspark_pass_bytes(dir)?));
    }
    Ok((d, mtp_pass_bytes(dir)?))
}

fn write_synthetic(dir: &Path, spec: &str) -> anyhow::Result<()> {
    let spec = SynthSpec::parse(spec).map_err(|e| anyhow::anyhow!("--make-synthetic: {e}"))?;
    keep_residency::synth::write_run(dir, &spec)?;
    eprintln!(
        "wrote {} synthetic sessions ({} layers, {} experts, top-{}, {} tokens each) to {}",
        spec.sessions,
        spec.layers,
        spec.n_experts,
        spec.top_k,
        spec.tokens,
        dir.display()
    );
    Ok(())
}

pub fn run(a: ResidencyArgs) -> anyhow::Result<()> {
    if let Some(p) = &a.plot {
        let ext = p
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        if ext != "png" && ext != "svg" {
            bail!("--plot {}: name the file *.png or *.svg", p.display());
        }
        crate::util::check_out_file(p, a.force, &[])?;
    }
    if let Some(spec) = &a.make_synthetic {
        write_synthetic(&a.run, spec)?;
    }
    let trace = keep_artifacts::routes::read_run(&a.run)?;
    let first = &trace.sessions[0];
    let n_max = first.layers.iter().map(|l| l.n_experts).max().unwrap_or(1);
    let layers = trace.layers();

    let mut policies = vec![];
    for p in &a.policy {
        policies.push(PolicyKind::parse(p).with_context(|| {
            format!("unknown policy `{p}`; choose from static, lru, decay, belady")
        })?);
    }
    let hot = if !a.hot_frac.is_empty() {
        HotSizes::Fractions(a.hot_frac.clone())
    } else if !a.hot.is_empty() {
        HotSizes::Experts(a.hot.clone())
    } else {
        let mut v = vec![];
        let mut h = 1;
        while h < n_max {
            v.push(h);
            h *= 2;
        }
        v.push(n_max);
        HotSizes::Experts(v)
    };
    let reap_path = if a.run.is_dir() {
        a.run.join(REAP_FILE)
    } else {
        a.run
            .parent()
            .map(|p| p.join(REAP_FILE))
            .unwrap_or_else(|| PathBuf::from(REAP_FILE))
    };
    let warm = match a.warm_start.as_str() {
        "auto" => {
            if reap_path.is_file() {
                WarmStart::Reap
            } else {
                WarmStart::Frequency
            }
        }
        w => WarmStart::parse(w).with_context(|| {
            format!("unknown warm start `{w}`; choose reap, frequency, none or auto")
        })?,
    };
    let reap_scores = match warm {
        WarmStart::Reap => Some(read_reap(&a.run, &trace)?),
        _ => None,
    };
    let (cost, bytes_from) = if let Some(dir) = &a.model {
        // Each expert at the bytes the runtime reads for it: with its residual stage, unless
        // precision tiers (--tau) read that stage apart (priced by the tiers' report).
        let mb = model_bytes(dir, &layers, n_max, a.tau.is_none())?;
        (
            Some(CostModel {
                expert_bytes: mb.expert_bytes,
                resident_bytes: mb.resident_bytes,
                engram: mb.engram,
                ssd_gbps: a.ssd_gbps,
                mem_gbps: a.mem_gbps,
            }),
            format!("from {}", dir.display()),
        )
    } else if let Some(b) = &a.expert_bytes {
        let b = parse_bytes(b).map_err(|e| anyhow::anyhow!("--expert-bytes: {e}"))?;
        (
            Some(CostModel {
                expert_bytes: vec![b; layers.len()],
                resident_bytes: 0,
                engram: vec![],
                ssd_gbps: a.ssd_gbps,
                mem_gbps: a.mem_gbps,
            }),
            "given".to_string(),
        )
    } else {
        (None, String::new())
    };
    let opts = Options {
        hot,
        policies,
        half_life: a.half_life,
        warm_start: warm,
        fetch_threshold: a.fetch_threshold,
        cost,
        reap_scores,
    };
    anyhow::ensure!(
        a.draft_acceptance.is_empty()
            || (a.draft_acceptance.len() <= 8
                && a.draft_acceptance.iter().all(|x| (0.0..=1.0).contains(x))),
        "--draft-acceptance: 1 to 8 acceptance rates in [0, 1]"
    );
    anyhow::ensure!(
        a.draft_acceptance.is_empty() || opts.cost.is_some(),
        "--draft-acceptance needs byte sizes: give --model DIR or --expert-bytes B"
    );
    let mut report = keep_residency::simulate(&trace, &opts)?;
    report.command = std::env::args().collect::<Vec<_>>().join(" ");
    if let (Some(tau), Some(dir)) = (a.tau, &a.model) {
        let residual = keep_residency::tiers::residual_bytes(dir, &layers)?;
        let alloc = match &a.alloc {
            Some(f) => Some(keep_artifacts::alloc::Alloc::read(f)?),
            None => None,
        };
        let shipped = match &a.upper_from {
            Some(d) => {
                let ck = keep_checkpoint::Checkpoint::open(dir)?;
                let cfg = keep_model::ModelConfig::from_checkpoint(&ck)?;
                let (_, _, bytes) =
                    keep_runtime::runtime::check_original(d, &cfg, alloc.as_ref(), &layers)?;
                Some(bytes)
            }
            None => None,
        };
        let stages = keep_residency::tiers::upper_stages(
            alloc.as_ref(),
            &layers,
            &residual,
            shipped.as_deref(),
        )
        .with_context(|| match &a.alloc {
            Some(f) => format!("--alloc {}", f.display()),
            None => "--model's residual codes".into(),
        })?;
        let spec = keep_residency::tiers::TierSpec {
            tau,
            cache_bytes: a.residual_cache,
            admit_delay: a.admit_delay,
            upper_bytes: keep_residency::tiers::stage_bytes(&stages),
            prefill_tokens: a.prefill_tokens,
        };
        keep_residency::tiers::attach(&mut report, &trace, &spec)?;
        if let Some(t) = &mut report.tiers {
            let (r, s, _) = keep_residency::tiers::stage_mix(&stages);
            t.experts_upper_residual = r as u64;
            t.experts_upper_shipped = s as u64;
        }
    }
    let drafting = match (&opts.cost, a.draft_acceptance.is_empty()) {
        (Some(cost), false) => {
            let (drafter, pass_bytes) = drafter(&a)?;
            let spec = keep_residency::draft::DraftSpec {
                k: a.draft_acceptance.len(),
                acceptance: a.draft_acceptance.clone(),
                drafter,
                pass_bytes,
                seed: 0,
                compute: if a.draft_probe {
                    let Some(d) = &a.model else {
                        bail!("--draft-probe needs --model DIR (the model to probe)");
                    };
                    let ck = keep_checkpoint::Checkpoint::open(d)?;
                    Some(
                        keep_runtime::probe::draft_compute(
                            &ck,
                            a.draft_probe_kernels.into(),
                            drafter,
                            a.draft_acceptance.len(),
                            a.draft_probe_context,
                            a.draft_probe_reps,
                        )
                        .context("--draft-probe")?,
                    )
                } else {
                    None
                },
            };
            let hots: Vec<usize> = report.sizes.iter().map(|s| s.hot).collect();
            Some((
                spec.clone(),
                keep_residency::draft::predict(&trace, &hots, cost, &spec),
            ))
        }
        _ => None,
    };
    if let Some(p) = &a.plot {
        keep_residency::plot::plot(&report, p)?;
    }
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        if let (Some((spec, rows)), Some(m)) = (&drafting, v.as_object_mut()) {
            m.insert(
                "drafting".into(),
                serde_json::json!({"spec": spec, "sizes": rows}),
            );
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print_table(&report, &bytes_from);
        if let Some((spec, rows)) = &drafting {
            println!(
                "drafting ({}, K = {}, acceptance {:?}, LRU slots, {} pass {} bytes, {}): predicted tokens/s",
                spec.drafter.name(),
                spec.k,
                spec.acceptance,
                match spec.drafter {
                    keep_residency::draft::Drafter::Mtp => "MTP",
                    keep_residency::draft::Drafter::DSpark => "DSpark",
                },
                spec.pass_bytes,
                match &spec.compute {
                    Some(c) => format!(
                        "measured compute: decode {:.2} ms, verify {:?} ms",
                        c.plain_s * 1e3,
                        c.verify_s.iter().map(|v| (v * 1e5).round() / 1e2).collect::<Vec<_>>()
                    ),
                    None => "reads only".into(),
                }
            );
            println!(
                "  {:>6} {:>12} {:>12} {:>8} {:>14} {:>16}",
                "hot", "none tok/s", "draft tok/s", "speedup", "tokens/forward", "experts/layer/fw"
            );
            for r in rows {
                println!(
                    "  {:>6} {:>12.2} {:>12.2} {:>8.3} {:>14.2} {:>16.2}",
                    r.hot,
                    r.plain.tokens_per_sec,
                    r.drafting.tokens_per_sec,
                    r.speedup,
                    r.tokens_per_forward,
                    r.drafting.experts_per_layer_forward
                );
            }
        }
        if let Some(p) = &a.plot {
            println!("plot: {}", p.display());
        }
    }
    Ok(())
}

fn pct(x: f64) -> String {
    format!("{:.2}%", x * 100.0)
}

fn rate(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.1} M", x / 1e6)
    } else {
        format!("{x:.0}")
    }
}

fn print_row(hot: &str, r: &PolicyRow, hybrid: bool) {
    let (ssd, mem, tps) = match &r.cost {
        Some(c) => (
            human(c.ssd_bytes_per_token.round() as u64),
            human(c.mem_bytes_per_token.round() as u64),
            format!("{:.2}", c.tokens_per_sec),
        ),
        None => ("-".into(), "-".into(), "-".into()),
    };
    let name = if hybrid {
        format!("{}+thr", r.policy.name())
    } else {
        r.policy.name().to_string()
    };
    let extra = if hybrid {
        format!(
            "  dropped {} of slots, {} of gate mass",
            pct(r.dropped_rate),
            pct(r.dropped_gate_mass_frac)
        )
    } else {
        String::new()
    };
    println!(
        "  {:>6} {:<11} {:>8} {:>8} {:>12} {:>12} {:>9}{extra}",
        hot,
        name,
        pct(r.miss_rate),
        pct(r.hit_rate),
        ssd,
        mem,
        tps
    );
}

fn print_table(r: &Report, bytes_from: &str) {
    let i = &r.inputs;
    println!("{}", i.run.display());
    println!(
        "  {} session(s), {} layer(s), {} experts, top-{}, {} tokens, {} routed slots",
        i.sessions.len(),
        i.layers.len(),
        i.n_experts,
        i.top_k,
        i.tokens,
        i.routed_slots
    );
    let cost = match &i.cost {
        Some(c) => format!(
            "expert {} ({bytes_from}), resident {}, SSD {} GB/s, memory {} GB/s",
            // The first routed layer's (a dense layer's is 0).
            human(c.expert_bytes.iter().copied().find(|&b| b > 0).unwrap_or(0)),
            human(c.resident_bytes),
            c.ssd_gbps,
            c.mem_gbps
        ),
        None => "no expert sizes (pass --model or --expert-bytes for bytes and tok/s)".into(),
    };
    println!(
        "  warm start {}, decay half-life {} tokens, {cost}",
        i.warm_start.name(),
        i.half_life_tokens
    );
    if let Some(c) = i.cost.as_ref().filter(|c| !c.engram.is_empty()) {
        let used: f64 = c.engram.iter().map(|e| e.row_bytes_per_token()).sum();
        let read: f64 = c.engram.iter().map(|e| e.ssd_bytes_per_token()).sum();
        let layers: Vec<String> = c.engram.iter().map(|e| e.layer.to_string()).collect();
        println!(
            "  engram layers {}: {} rows a token use {} of tables, read as {} of 4 KiB pages \
             (no row cache; prefetched from the token ids, in SSD/token)",
            layers.join(", "),
            c.engram.iter().map(|e| e.rows_per_token).sum::<usize>(),
            human(used as u64),
            human(read as u64)
        );
    }
    if let Some(t) = i.fetch_threshold {
        println!("  hybrid rows (+thr): misses with gate weight < {t} dropped, not read");
    }
    println!();
    println!(
        "  {:>6} {:<11} {:>8} {:>8} {:>12} {:>12} {:>9}",
        "hot", "policy", "miss", "hit", "SSD/token", "mem/token", "tok/s"
    );
    for s in &r.sizes {
        let hot = s.hot.to_string();
        for row in &s.policies {
            print_row(&hot, row, false);
        }
        for row in &s.hybrid {
            print_row(&hot, row, true);
        }
        let mem = s
            .hot_set_bytes
            .map(|b| format!(", hot sets take {}", human(b)))
            .unwrap_or_default();
        match (s.best_policy, s.best_miss_rate) {
            (Some(p), Some(m)) => println!(
                "  {:>6} verdict {} (best {} misses {} {} 5%{mem})",
                hot,
                s.verdict,
                p.name(),
                pct(m),
                if m > 0.05 { ">" } else { "≤" }
            ),
            _ => println!("  {:>6} verdict {}", hot, s.verdict),
        }
        println!();
    }
    println!("  rule: {}", r.verdict_rule);
    let per: Vec<String> = r
        .replay
        .by_policy
        .iter()
        .map(|p| format!("{} {}", p.policy.name(), rate(p.slots_per_sec)))
        .collect();
    println!(
        "  replay: {} slots/s on one core ({} slots in {:.3} s; {})",
        rate(r.replay.replay_slots_per_sec),
        r.replay.slots_replayed,
        r.replay.seconds,
        per.join(", ")
    );
    for n in &r.notes {
        println!("  note: {n}");
    }
    if let Some(t) = &r.tiers {
        println!();
        println!(
            "  tiers: τ {}, residual cache {}, admit delay {} token(s), prefill {} token(s); {} of {} experts have an upper stage ({} residual codes, {} shipped; the rest none)",
            t.tau,
            human(t.residual_cache_bytes),
            t.admit_delay_tokens,
            t.prefill_tokens,
            t.experts_with_upper,
            t.experts,
            t.experts_upper_residual,
            t.experts_upper_shipped
        );
        let c = &t.counts;
        println!(
            "  routed slots: {} upper, {} base ({} wanted upper: {} in flight, {} admitted, {} no room); upper hit rate {}; {} evictions",
            c.upper,
            c.base,
            c.upper_misses,
            c.in_flight,
            c.admissions,
            c.no_room,
            pct(t.upper_hit_rate),
            c.evictions
        );
        println!(
            "  residual bytes per token: {} from SSD, {} from memory",
            human(t.residual_ssd_bytes_per_token.round() as u64),
            human(t.residual_mem_bytes_per_token.round() as u64)
        );
        for row in &t.rows {
            println!(
                "  {:>6} {:<11} {:>12} {:>12} {:>9.2} tok/s with tiers",
                row.hot,
                row.policy,
                human(row.ssd_bytes_per_token.round() as u64),
                human(row.mem_bytes_per_token.round() as u64),
                row.tokens_per_sec
            );
        }
    }
}

/// `--tau`: a gate threshold from 0 to 1.
fn parse_tau(s: &str) -> Result<f32, String> {
    crate::util::parse_tau(s).map(|t| t as f32)
}
