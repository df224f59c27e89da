//! `keep eval --tasks`: sample each task's completions from the teacher and every student with
//! the same seeds, check them (keep-calib's `tasks`), and print the pass rates with their
//! intervals, the teacher beside each student.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::Context;
use keep_calib::tasks::{self, ModelResult, Report, Spec};
use keep_model::generate::{load_tokenizer, GenerateOptions, Healed, Piece, Prompt, SamplerConfig};
use keep_runtime::{LoadFor, Session, SessionSpec};

/// What `keep eval --tasks` was asked.
pub struct TasksRun<'a> {
    pub spec: &'a Path,
    pub teacher: &'a Path,
    pub students: &'a [PathBuf],
    pub kernels: keep_model::Kernels,
    pub json: bool,
    pub plot: Option<&'a Path>,
}

pub fn run(a: TasksRun) -> anyhow::Result<()> {
    let spec = Spec::read(a.spec)?;
    let python = if spec.needs_python() {
        Some(tasks::find_python().with_context(|| format!("the spec {}", a.spec.display()))?)
    } else {
        None
    };
    if let Some(p) = a.plot {
        crate::util::check_out_file(p, true, &[])?;
    }
    let mut models: Vec<(&str, &Path)> = vec![("teacher", a.teacher)];
    models.extend(a.students.iter().map(|s| ("student", s.as_path())));
    let mut results: Vec<ModelResult> = Vec::new();
    for (role, dir) in models {
        results.push(
            one_model(&spec, python.as_ref(), role, dir, a.kernels)
                .with_context(|| format!("the task check on {}", dir.display()))?,
        );
    }
    let report = Report {
        format: tasks::REPORT_FORMAT.into(),
        version: 1,
        spec,
        python,
        models: results,
    };
    if let Some(p) = a.plot {
        tasks::plot(&report, p)?;
        eprintln!("plot written to {}", p.display());
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_table(&report);
    Ok(())
}

fn one_model(
    spec: &Spec,
    python: Option<&tasks::Python>,
    role: &str,
    dir: &Path,
    kernels: keep_model::Kernels,
) -> anyhow::Result<ModelResult> {
    let session = Session::open(SessionSpec::new(dir, kernels))
        .map_err(|e| crate::util::open_error(e, dir))?;
    let tok = load_tokenizer(dir).with_context(|| format!("the tokenizer of {}", dir.display()))?;
    let (mut model, _) = session
        .load(LoadFor::default())
        .with_context(|| format!("loading the model from {}", dir.display()))?;
    let bar = crate::util::count_bar(0, role);
    // Each prompt's healed form, built once (it decodes the vocabulary).
    let mut heal: std::collections::HashMap<String, Healed> = Default::default();
    let r = tasks::run(
        spec,
        python,
        role,
        &dir.display().to_string(),
        &mut |prompt, seed| {
            let gen = GenerateOptions {
                max_tokens: spec.max_tokens,
                sampling: SamplerConfig {
                    temperature: spec.temperature,
                    top_p: spec.top_p,
                    seed,
                },
                tokenizer: Some(&tok),
            };
            let healed;
            let prompt = if spec.token_healing {
                if !heal.contains_key(prompt) {
                    let h = Healed::new(&tok, prompt, model.cfg().vocab)
                        .map_err(|e| keep_calib::CalibError::Task(e.to_string()))?;
                    heal.insert(prompt.to_string(), h);
                }
                healed = &heal[prompt];
                Prompt::Healed(healed)
            } else {
                Prompt::Text(prompt)
            };
            let mut text = String::new();
            keep_runtime::run::run(&mut model, prompt, &gen, None, |p| {
                if let Piece::Text(s) = p {
                    text.push_str(s);
                    // Nothing after a stop string is checked: stop sampling there.
                    if spec.stop.iter().any(|st| text.contains(st.as_str())) {
                        return ControlFlow::Break(());
                    }
                }
                ControlFlow::Continue(())
            })
            .map_err(|e| keep_calib::CalibError::Task(e.to_string()))?;
            Ok(text)
        },
        &mut |d, t| {
            bar.set_length(t as u64);
            bar.set_position(d as u64);
        },
    )?;
    bar.finish_and_clear();
    Ok(r)
}

fn print_table(r: &Report) {
    let s = &r.spec;
    println!(
        "{} samples per task, temperature {}, top-p {}, {} tokens at most; pass rate [95% interval]",
        s.samples, s.temperature, s.top_p, s.max_tokens
    );
    for (i, m) in r.models.iter().enumerate() {
        println!("  [{i}] {} {}", m.role, m.model);
    }
    print!("{:<24} {:<9}", "task", "check");
    for i in 0..r.models.len() {
        print!(" {:>21}", format!("[{i}]"));
    }
    println!();
    for (ti, t) in s.tasks.iter().enumerate() {
        print!("{:<24} {:<9}", t.name, t.check.name());
        for m in &r.models {
            let x = &m.tasks[ti];
            print!(" {:>21}", cell(x.passed, x.samples, x.ci95));
        }
        println!();
    }
    print!("{:<24} {:<9}", "all", "");
    for m in &r.models {
        print!(" {:>21}", cell(m.passed, m.samples, m.ci95));
    }
    println!();
}

fn cell(passed: usize, n: usize, ci: [f64; 2]) -> String {
    format!("{passed}/{n} [{:.0}–{:.0}%]", ci[0] * 100.0, ci[1] * 100.0)
}
