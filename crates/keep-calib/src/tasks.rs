//! The task check of `keep eval --tasks`: does a model still do the job, judged by what it
//! writes. A spec (`keep-tasks` JSON) lists prompts, how many completions to sample for each and
//! how, and the check each completion must pass — the prompt plus the completion **parses** as
//! Python (tree-sitter's Python grammar, in-process), **compiles** (the user's `python3`,
//! `compile()` only), or **runs** and prints the expected output (the user's `python3` in a
//! fresh temporary directory, isolated mode, an empty environment, CPU, memory, file-size and
//! process limits, killed at its time limit). Pass rates come with Wilson 95% intervals.
//!
//! What it is not: no model code — the caller hands [`run`] a function that samples one
//! completion for a prompt and a seed, so the teacher and every student see the same seeds; no
//! printing.
//!
//! Parsing uses `tree-sitter` with `tree-sitter-python`, the grammar GitHub and editors parse
//! Python with: a maintained C parser with Rust bindings, fast enough to check thousands of
//! samples, and error-recovering, so "parses" means a tree with no ERROR or MISSING node.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{CalibError, Result};

/// The `format` of a spec file.
pub const FORMAT: &str = "keep-tasks";
/// The `format` of a report.
pub const REPORT_FORMAT: &str = "keep-tasks-report";
/// The z of a two-sided 95% interval.
const Z95: f64 = 1.959_963_984_540_054;
/// Most samples a task may ask for (each is a generation).
const MAX_SAMPLES: usize = 10_000;
/// Time limit of one `compiles` / `runs` check unless the task sets its own, seconds.
pub const DEFAULT_TIMEOUT_SECS: f64 = 5.0;
/// Memory a `runs` check's process may map (bytes).
const RUN_ADDRESS_SPACE: u64 = 1 << 30;
/// Largest file a `runs` check's process may write (bytes).
const RUN_FILE_SIZE: u64 = 16 << 20;
/// Output kept from a `runs` check's stdout and stderr (bytes each).
const RUN_OUTPUT_CAP: usize = 64 << 10;

/// A task spec: prompts, sampling and the check.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    pub format: String,
    pub version: u32,
    /// Completions sampled per task.
    pub samples: usize,
    /// Most tokens per completion.
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    /// Sample `i` of task `t` uses seed `seed + t * samples + i`, for every model alike.
    pub seed: u64,
    /// A completion is cut before the first of these strings (e.g. a blank line and a new
    /// top-level statement), so a check sees one unit of code.
    #[serde(default)]
    pub stop: Vec<String>,
    /// Back the prompt's last token off and make the first sampled token begin with its text
    /// (token healing; keep-model's `Healed`), so a prompt that ends in a newline before an
    /// indented body is continued as the model saw such text in training (default true).
    #[serde(default = "yes")]
    pub token_healing: bool,
    pub tasks: Vec<Task>,
}

fn yes() -> bool {
    true
}

/// One prompt and its check.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Task {
    pub name: String,
    pub prompt: String,
    pub check: Check,
    /// Time limit of a `compiles` / `runs` check, seconds (default 5).
    #[serde(default)]
    pub timeout_secs: Option<f64>,
}

/// What a completion must do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum Check {
    /// Prompt + completion parses as Python (in-process).
    Parses,
    /// Prompt + completion compiles (`compile(src, "<sample>", "exec")` in `python3`).
    Compiles,
    /// Prompt + completion + `append` runs in `python3` and prints exactly `expect_stdout`
    /// (trailing whitespace of both ignored), exiting 0.
    Runs {
        #[serde(default)]
        append: String,
        expect_stdout: String,
    },
}

impl Check {
    /// The check's name in reports.
    pub fn name(&self) -> &'static str {
        match self {
            Check::Parses => "parses",
            Check::Compiles => "compiles",
            Check::Runs { .. } => "runs",
        }
    }

    fn needs_python(&self) -> bool {
        !matches!(self, Check::Parses)
    }
}

fn invalid(path: &Path, msg: impl std::fmt::Display) -> CalibError {
    CalibError::invalid(path, msg.to_string())
}

impl Spec {
    /// Read and check a spec file.
    pub fn read(path: &Path) -> Result<Spec> {
        let text = std::fs::read_to_string(path).map_err(|e| CalibError::io(path, e))?;
        let spec: Spec = serde_json::from_str(&text)
            .map_err(|e| invalid(path, format!("not a {FORMAT} spec: {e}")))?;
        spec.check().map_err(|m| invalid(path, m))?;
        Ok(spec)
    }

    /// Refuse a spec that could not be run as written.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.format != FORMAT || self.version != 1 {
            return Err(format!(
                "format {:?} version {} (expected {FORMAT:?} version 1)",
                self.format, self.version
            ));
        }
        if self.samples == 0 || self.samples > MAX_SAMPLES {
            return Err(format!(
                "samples must be 1..={MAX_SAMPLES}, not {}",
                self.samples
            ));
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature must be ≥ 0, not {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], not {}", self.top_p));
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return Err("an empty stop string would cut every completion".into());
        }
        if self.tasks.is_empty() {
            return Err("no tasks".into());
        }
        let mut names = HashSet::new();
        for t in &self.tasks {
            if !names.insert(t.name.as_str()) {
                return Err(format!("task {:?} is named twice", t.name));
            }
            if let Some(s) = t.timeout_secs {
                if !(s.is_finite() && s > 0.0 && s <= 600.0) {
                    return Err(format!(
                        "task {:?}: timeout_secs must be in (0, 600]",
                        t.name
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether some task needs the user's `python3`.
    pub fn needs_python(&self) -> bool {
        self.tasks.iter().any(|t| t.check.needs_python())
    }

    /// Sample `i` of task `t`: its seed.
    pub fn seed_of(&self, t: usize, i: usize) -> u64 {
        self.seed
            .wrapping_add((t as u64).wrapping_mul(self.samples as u64))
            .wrapping_add(i as u64)
    }

    /// `completion` cut before the first stop string, where a stop string may begin in the
    /// prompt's tail: after a prompt that ends with a newline, a completion that opens the next
    /// top-level `def` straight away matches `"\ndef "` and is cut to nothing.
    pub fn cut<'a>(&self, prompt: &str, completion: &'a str) -> &'a str {
        let end = self
            .stop
            .iter()
            .filter_map(|s| {
                // The prompt's last bytes a match could start in (on a character boundary).
                let mut from = prompt.len().saturating_sub(s.len().saturating_sub(1));
                while !prompt.is_char_boundary(from) {
                    from += 1;
                }
                let tail = &prompt[from..];
                let joined = format!("{tail}{completion}");
                joined
                    .match_indices(s.as_str())
                    .map(|(j, _)| j)
                    .find(|j| j + s.len() > tail.len())
                    .map(|j| j.saturating_sub(tail.len()))
            })
            .min()
            .unwrap_or(completion.len());
        &completion[..end]
    }
}

/// Whether `src` parses as Python: tree-sitter's tree has no ERROR or MISSING node.
pub fn parses(src: &str) -> Result<bool> {
    let mut p = tree_sitter::Parser::new();
    p.set_language(&tree_sitter_python::LANGUAGE.into())
        .map_err(|e| CalibError::Task(format!("the Python grammar does not load: {e}")))?;
    Ok(p.parse(src, None)
        .is_some_and(|t| !t.root_node().has_error()))
}

/// The interpreter the `compiles` / `runs` checks use: the user's `python3`, resolved once
/// (through the user's PATH, pyenv shims and all) to the real executable, which the checks then
/// run with an empty environment.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Python {
    pub executable: std::path::PathBuf,
    pub version: String,
}

/// Find the user's `python3`, or say what the spec needs it for.
pub fn find_python() -> Result<Python> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys; print(sys.executable); print(sys.version.split()[0])",
        ])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            CalibError::Task(format!(
                "this spec's compiles/runs checks need python3 on PATH, which could not be run \
                 ({e}); install Python 3 or use only `parses` checks"
            ))
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    match (out.status.success(), lines.next(), lines.next()) {
        (true, Some(exe), Some(v)) if !exe.is_empty() => Ok(Python {
            executable: exe.into(),
            version: format!("Python {v}"),
        }),
        _ => Err(CalibError::Task(format!(
            "python3 did not run ({}: {}): the compiles/runs checks need a working python3",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
    }
}

/// What one check of one sample found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    pub pass: bool,
    /// Why it failed (a syntax error, the exit status, the output that differed, a timeout).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

impl Outcome {
    fn pass() -> Outcome {
        Outcome {
            pass: true,
            why: None,
        }
    }

    fn fail(why: impl Into<String>) -> Outcome {
        Outcome {
            pass: false,
            why: Some(why.into()),
        }
    }
}

/// Check one program (`python`: the interpreter for `compiles` / `runs`).
pub fn check(
    check: &Check,
    src: &str,
    timeout: Duration,
    python: Option<&Python>,
) -> Result<Outcome> {
    let need = || {
        python.ok_or_else(|| {
            CalibError::Task("a compiles/runs check needs python3 (see find_python)".into())
        })
    };
    match check {
        Check::Parses => Ok(if parses(src)? {
            Outcome::pass()
        } else {
            Outcome::fail("does not parse")
        }),
        Check::Compiles => {
            let code = "import sys\nsrc = sys.stdin.read()\ncompile(src, '<sample>', 'exec')\n";
            let r = python_run(need()?, &["-I", "-S", "-c", code], src, timeout)?;
            Ok(match r {
                Ran::Exited { ok: true, .. } => Outcome::pass(),
                Ran::Exited { stderr, .. } => Outcome::fail(last_line(&stderr)),
                Ran::TimedOut => Outcome::fail("timed out"),
            })
        }
        Check::Runs {
            append,
            expect_stdout,
        } => {
            let program = format!("{src}\n{append}");
            let dir = tempfile_dir()?;
            let file = dir.path().join("sample.py");
            std::fs::write(&file, program)
                .map_err(|e| CalibError::Task(format!("{}: {e}", file.display())))?;
            let r = python_in(
                need()?,
                &["-I", "-S", "sample.py"],
                "",
                timeout,
                Some(dir.path()),
            )?;
            Ok(match r {
                Ran::Exited {
                    ok: true, stdout, ..
                } if stdout.trim_end() == expect_stdout.trim_end() => Outcome::pass(),
                Ran::Exited {
                    ok: true, stdout, ..
                } => Outcome::fail(format!(
                    "printed {:?}, expected {:?}",
                    clip(stdout.trim_end(), 200),
                    clip(expect_stdout.trim_end(), 200)
                )),
                Ran::Exited { stderr, .. } => Outcome::fail(last_line(&stderr)),
                Ran::TimedOut => Outcome::fail("timed out"),
            })
        }
    }
}

fn clip(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

fn last_line(stderr: &str) -> String {
    clip(
        stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("failed"),
        300,
    )
}

/// A temporary directory (removed on drop).
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempfile_dir() -> Result<TempDir> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "keep-task-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir(&d).map_err(|e| CalibError::Task(format!("{}: {e}", d.display())))?;
    Ok(TempDir(d))
}

enum Ran {
    Exited {
        ok: bool,
        stdout: String,
        stderr: String,
    },
    TimedOut,
}

fn python_run(py: &Python, args: &[&str], stdin: &str, timeout: Duration) -> Result<Ran> {
    let dir = tempfile_dir()?;
    python_in(py, args, stdin, timeout, Some(dir.path()))
}

/// Run `PYTHON ARGS` in `cwd` with an empty environment and resource limits, `stdin` on its
/// standard input, killed after `timeout`.
fn python_in(
    py: &Python,
    args: &[&str],
    stdin: &str,
    timeout: Duration,
    cwd: Option<&Path>,
) -> Result<Ran> {
    let mut cmd = Command::new(&py.executable);
    cmd.args(args)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    limit(&mut cmd, timeout);
    let mut child = cmd.spawn().map_err(|e| {
        CalibError::Task(format!(
            "python3 could not be started ({e}); the compiles/runs checks need it on PATH"
        ))
    })?;
    // Feed stdin and drain the pipes on threads, so a chatty program cannot block on a full pipe.
    let mut input = child.stdin.take();
    let stdin = stdin.as_bytes().to_vec();
    let feeder = std::thread::spawn(move || {
        if let Some(i) = input.as_mut() {
            let _ = i.write_all(&stdin);
        }
    });
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(r) = r {
                let _ = r.take(RUN_OUTPUT_CAP as u64).read_to_end(&mut buf);
            }
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if start.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(CalibError::Task(format!("waiting for python3: {e}"))),
        }
    };
    let _ = feeder.join();
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    Ok(match status {
        Some(s) => Ran::Exited {
            ok: s.success(),
            stdout,
            stderr,
        },
        None => Ran::TimedOut,
    })
}

#[cfg(unix)]
fn limit(cmd: &mut Command, timeout: Duration) {
    use std::os::unix::process::CommandExt;
    let cpu = timeout.as_secs().saturating_add(1);
    // SAFETY: the closure runs in the child between fork and exec and calls only setrlimit and
    // setsid, which are async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let set = |res, v: u64| {
                let l = libc::rlimit {
                    rlim_cur: v as libc::rlim_t,
                    rlim_max: v as libc::rlim_t,
                };
                libc::setrlimit(res, &l);
            };
            set(libc::RLIMIT_CPU, cpu);
            set(libc::RLIMIT_AS, RUN_ADDRESS_SPACE);
            set(libc::RLIMIT_FSIZE, RUN_FILE_SIZE);
            set(libc::RLIMIT_NOFILE, 64);
            set(libc::RLIMIT_CORE, 0);
            libc::setsid();
            Ok(())
        });
    }
}

#[cfg(not(unix))]
fn limit(_cmd: &mut Command, _timeout: Duration) {}

/// The Wilson score interval of `k` passes in `n` trials at 95%.
pub fn wilson(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (k, n) = (k as f64, n as f64);
    let p = k / n;
    let z2 = Z95 * Z95;
    let denom = 1.0 + z2 / n;
    let centre = (p + z2 / (2.0 * n)) / denom;
    let half = Z95 * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt() / denom;
    // The bounds at k = 0 and k = n are 0 and 1 exactly; rounding would leave 1e-17.
    let lo = if k == 0.0 {
        0.0
    } else {
        (centre - half).max(0.0)
    };
    let hi = if k == n {
        1.0
    } else {
        (centre + half).min(1.0)
    };
    (lo, hi)
}

/// One task's result for one model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskResult {
    pub name: String,
    pub check: String,
    pub samples: usize,
    pub passed: usize,
    pub rate: f64,
    pub ci95: [f64; 2],
    /// Every sample's completion (cut at the stop strings) and outcome, in seed order.
    pub outcomes: Vec<SampleOutcome>,
}

/// One sample: its seed, completion and outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SampleOutcome {
    pub seed: u64,
    pub completion: String,
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// One model's results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelResult {
    /// `teacher` or `student`.
    pub role: String,
    pub model: String,
    pub tasks: Vec<TaskResult>,
    pub passed: usize,
    pub samples: usize,
    pub rate: f64,
    pub ci95: [f64; 2],
    pub seconds: f64,
}

/// A report: the spec and every model's results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub format: String,
    pub version: u32,
    pub spec: Spec,
    /// The interpreter, when a check needed one.
    pub python: Option<Python>,
    pub models: Vec<ModelResult>,
}

/// Sample every task's completions with `sample(prompt, seed)` and check them.
pub fn run(
    spec: &Spec,
    python: Option<&Python>,
    role: &str,
    model: &str,
    sample: &mut dyn FnMut(&str, u64) -> Result<String>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ModelResult> {
    let start = Instant::now();
    let total = spec.tasks.len() * spec.samples;
    let mut tasks = Vec::with_capacity(spec.tasks.len());
    for (ti, t) in spec.tasks.iter().enumerate() {
        let timeout = Duration::from_secs_f64(t.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS));
        let mut outcomes = Vec::with_capacity(spec.samples);
        for i in 0..spec.samples {
            let seed = spec.seed_of(ti, i);
            let full = sample(&t.prompt, seed)?;
            let completion = spec.cut(&t.prompt, &full).to_string();
            let program = format!("{}{}", t.prompt, completion);
            // A model that writes nothing has not done the task, even where the prompt alone
            // would pass (a docstring-only body parses).
            let outcome = if completion.trim().is_empty() {
                Outcome::fail("the completion is empty")
            } else {
                check(&t.check, &program, timeout, python)?
            };
            outcomes.push(SampleOutcome {
                seed,
                completion,
                outcome,
            });
            progress(ti * spec.samples + i + 1, total);
        }
        let passed = outcomes.iter().filter(|o| o.outcome.pass).count();
        let (lo, hi) = wilson(passed, spec.samples);
        tasks.push(TaskResult {
            name: t.name.clone(),
            check: t.check.name().to_string(),
            samples: spec.samples,
            passed,
            rate: passed as f64 / spec.samples as f64,
            ci95: [lo, hi],
            outcomes,
        });
    }
    let passed: usize = tasks.iter().map(|t| t.passed).sum();
    let (lo, hi) = wilson(passed, total);
    Ok(ModelResult {
        role: role.to_string(),
        model: model.to_string(),
        tasks,
        passed,
        samples: total,
        rate: passed as f64 / total as f64,
        ci95: [lo, hi],
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Plot every model's pass rate per task with its 95% interval (`.png` or `.svg`).
pub fn plot(report: &Report, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let size = (960, 560);
    let r = match ext.as_str() {
        "svg" => draw_plot(&SVGBackend::new(path, size).into_drawing_area(), report),
        "png" => draw_plot(&BitMapBackend::new(path, size).into_drawing_area(), report),
        _ => Err(format!(
            "unknown image type `.{ext}`; name the file *.png or *.svg"
        )),
    };
    r.map_err(|msg| CalibError::Plot {
        path: path.to_path_buf(),
        msg,
    })
}

fn draw_plot<DB: plotters::prelude::DrawingBackend>(
    root: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    report: &Report,
) -> std::result::Result<(), String> {
    use plotters::prelude::*;
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let names: Vec<String> = report.spec.tasks.iter().map(|t| t.name.clone()).collect();
    let n = names.len().max(1) as f64;
    let mut chart = ChartBuilder::on(root)
        .caption(
            "pass rate per task (95% Wilson interval)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(50)
        .build_cartesian_2d(-0.5f64..n - 0.5, 0f64..1.0)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_labels(names.len().max(1))
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-9 && i >= 0.0 {
                names.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("pass rate")
        .draw()
        .map_err(e)?;
    let m = report.models.len().max(1) as f64;
    for (mi, model) in report.models.iter().enumerate() {
        let colour = Palette99::pick(mi).to_rgba();
        let off = (mi as f64 - (m - 1.0) / 2.0) * (0.6 / m);
        let label = format!("{} {}", model.role, model.model);
        chart
            .draw_series(
                model
                    .tasks
                    .iter()
                    .enumerate()
                    .map(|(ti, t)| Circle::new((ti as f64 + off, t.rate), 4, colour.filled())),
            )
            .map_err(e)?
            .label(label)
            .legend(move |(x, y)| Circle::new((x, y), 4, colour.filled()));
        chart
            .draw_series(model.tasks.iter().enumerate().map(|(ti, t)| {
                PathElement::new(
                    vec![(ti as f64 + off, t.ci95[0]), (ti as f64 + off, t.ci95[1])],
                    colour.stroke_width(2),
                )
            }))
            .map_err(e)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(tasks: Vec<Task>) -> Spec {
        Spec {
            format: FORMAT.into(),
            version: 1,
            samples: 3,
            max_tokens: 8,
            temperature: 0.8,
            top_p: 0.95,
            seed: 10,
            stop: vec!["\n\n\n".into()],
            token_healing: true,
            tasks,
        }
    }

    fn task(name: &str, check: Check) -> Task {
        Task {
            name: name.into(),
            prompt: "def f(x):\n".into(),
            check,
            timeout_secs: None,
        }
    }

    #[test]
    fn parses_tells_python_from_not_python() {
        assert!(parses("def f(x):\n    return x + 1\n").unwrap());
        assert!(parses("import os\nclass A(B):\n    pass\n").unwrap());
        assert!(!parses("def f(x):\n    return (x +\n").unwrap());
        assert!(!parses("def f(x)\n    return x\n").unwrap());
        assert!(!parses("class:\n").unwrap());
    }

    #[test]
    fn wilson_interval() {
        let (lo, hi) = wilson(0, 24);
        assert_eq!(lo, 0.0);
        assert!((hi - 0.1380).abs() < 1e-3, "{hi}");
        let (lo, hi) = wilson(21, 24);
        assert!(
            (lo - 0.6898).abs() < 1e-3 && (hi - 0.9566).abs() < 1e-3,
            "{lo} {hi}"
        );
        assert_eq!(wilson(0, 0), (0.0, 1.0));
    }

    #[test]
    fn a_bad_spec_is_refused_with_the_reason() {
        let mut s = spec(vec![task("a", Check::Parses), task("a", Check::Parses)]);
        assert!(s.check().unwrap_err().contains("named twice"));
        s.tasks.pop();
        assert!(s.check().is_ok());
        s.top_p = 0.0;
        assert!(s.check().unwrap_err().contains("top_p"));
        s.top_p = 1.0;
        s.samples = 0;
        assert!(s.check().unwrap_err().contains("samples"));
        s.samples = 1;
        s.stop.push(String::new());
        assert!(s.check().unwrap_err().contains("stop"));
    }

    #[test]
    fn seeds_are_distinct_and_shared_by_every_model() {
        let s = spec(vec![task("a", Check::Parses), task("b", Check::Parses)]);
        let seeds: HashSet<u64> = (0..2)
            .flat_map(|t| (0..3).map(move |i| (t, i)))
            .map(|(t, i)| s.seed_of(t, i))
            .collect();
        assert_eq!(seeds.len(), 6);
    }

    #[test]
    fn run_samples_cuts_and_checks() {
        let s = spec(vec![task("a", Check::Parses)]);
        let mut n = 0;
        let r = run(
            &s,
            None,
            "teacher",
            "m",
            &mut |p, seed| {
                assert_eq!(p, "def f(x):\n");
                n += 1;
                Ok(if seed % 2 == 0 {
                    "    return x\n\n\n\nthis is not python".into()
                } else {
                    "    return (x\n".into()
                })
            },
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(n, 3);
        // Seeds 10, 11, 12: two even ones pass once cut at the stop string.
        assert_eq!(r.passed, 2);
        assert_eq!(r.tasks[0].outcomes[0].completion, "    return x");
    }

    #[test]
    fn a_stop_string_that_starts_in_the_prompt_cuts_the_completion() {
        // The prompt ends with a newline; a completion that opens the next top-level statement
        // straight away matches "\ndef " across the boundary and is cut to nothing.
        let mut s = spec(vec![]);
        s.stop = vec!["\ndef ".into(), "\n\n\n".into()];
        let prompt = "def f(x):\n    \"\"\"Doc.\"\"\"\n";
        assert_eq!(s.cut(prompt, "def g(y):\n    return y\n"), "");
        assert_eq!(s.cut(prompt, "\n\nx = 1\n"), "");
        assert_eq!(s.cut(prompt, "    return x\ndef g():\n"), "    return x");
        // A stop string wholly inside the prompt does not cut.
        assert_eq!(s.cut("a\ndef b", "    c\n"), "    c\n");
        // A prompt tail that is not on a character boundary of the stop's length.
        assert_eq!(s.cut("aécd\n", "def x"), "");
        assert_eq!(s.cut("", "x\ndef y"), "x");
    }

    #[test]
    fn every_committed_spec_is_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tasks");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "json") {
                let s = Spec::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                assert!(s.token_healing, "{}", p.display());
                n += 1;
            }
        }
        assert!(n >= 3, "{n} specs in {}", dir.display());
    }

    #[test]
    fn an_empty_completion_fails_every_check() {
        // A docstring-only body parses: the prompt alone must not pass for the model.
        let mut s = spec(vec![task("a", Check::Parses)]);
        s.tasks[0].prompt = "def f(x):\n    \"\"\"Doc.\"\"\"\n".into();
        s.stop = vec!["\ndef ".into()];
        let r = run(
            &s,
            None,
            "teacher",
            "m",
            &mut |_, seed| {
                Ok(match seed % 3 {
                    0 => "  \n".into(),
                    1 => "def g():\n    pass\n".into(),
                    _ => "    return x\n".into(),
                })
            },
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(r.passed, 1, "{:?}", r.tasks[0].outcomes);
        assert_eq!(
            r.tasks[0].outcomes[0].outcome.why.as_deref(),
            Some("the completion is empty")
        );
    }

    #[test]
    fn python_checks_compile_and_run_when_python3_is_there() {
        let Ok(py) = find_python() else {
            // The refusal itself is tested through the binary (keep-cli's tasks test).
            return;
        };
        let py = Some(&py);
        let t = Duration::from_secs(5);
        assert!(check(&Check::Compiles, "x = 1\n", t, py).unwrap().pass);
        // Parses, but does not compile.
        let bad = "def f():\n    pass\nreturn 1\n";
        assert!(parses(bad).unwrap());
        assert!(!check(&Check::Compiles, bad, t, py).unwrap().pass);
        let runs = |expect: &str| Check::Runs {
            append: "print(f(2))".into(),
            expect_stdout: expect.into(),
        };
        let src = "def f(x):\n    return x * 21\n";
        assert!(check(&runs("42"), src, t, py).unwrap().pass);
        let o = check(&runs("43"), src, t, py).unwrap();
        assert!(!o.pass && o.why.unwrap().contains("42"));
        let o = check(
            &runs("0"),
            "import time\ndef f(x):\n    time.sleep(30)\n",
            Duration::from_millis(300),
            py,
        )
        .unwrap();
        assert_eq!(o.why.as_deref(), Some("timed out"));
    }
}
