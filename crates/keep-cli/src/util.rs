//! Small helpers shared by the verbs: byte sizes, progress bars, output checks.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};

/// Parse a byte size: `123`, `64KiB`, `2GiB`, `1.5GB`, `8G` (binary units for K/M/G/T with or
/// without `iB`; `KB`/`MB`/`GB`/`TB` are decimal).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 2GiB or 512MB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        u => return Err(format!("unknown size unit `{u}` in `{s}`")),
    };
    Ok((n * mult).round() as u64)
}

/// Most shards a `--shard I/N` may split work into (more than any model has layers or a pack
/// has groups worth running apart).
pub const MAX_SHARDS: usize = 65_536;

/// Parse `--shard I/N`: 0 ≤ I < N ≤ [`MAX_SHARDS`].
pub fn parse_shard(s: &str) -> Result<(usize, usize), String> {
    let (i, n) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}` is not I/N (e.g. 0/4)"))?;
    let (i, n): (usize, usize) = (
        i.trim()
            .parse()
            .map_err(|_| format!("`{i}` is not a shard index (a whole number ≥ 0)"))?,
        n.trim()
            .parse()
            .map_err(|_| format!("`{n}` is not a shard count (a whole number ≥ 1)"))?,
    );
    if n == 0 || i >= n || n > MAX_SHARDS {
        return Err(format!(
            "{i}/{n} is out of range: need 0 ≤ I < N ≤ {MAX_SHARDS}"
        ));
    }
    Ok((i, n))
}

/// Parse a gate threshold τ: a number from 0 to 1 (gate weights are probabilities).
pub fn parse_tau(s: &str) -> Result<f64, String> {
    let t: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))?;
    if !(0.0..=1.0).contains(&t) {
        return Err(format!(
            "τ {s} is out of range: a gate threshold is from 0 to 1"
        ));
    }
    Ok(t)
}

/// Refuse a single-file output before any work is done: an existing file without `--force`,
/// anything that is not a regular file, a path that is or lies inside one of `inputs`, or a
/// path inside keep's cache.
pub fn check_out_file(out: &Path, force: bool, inputs: &[&Path]) -> anyhow::Result<()> {
    keep_checkpoint::atomic::check_file_target(out, force)?;
    keep_checkpoint::atomic::check_disjoint(out, inputs)?;
    check_out_of_cache(out)
}

/// Refuse an output inside keep's cache (the bundled model and pack live there and are
/// trusted by their own SHA256SUMS).
pub fn check_out_of_cache(out: &Path) -> anyhow::Result<()> {
    if let Ok(cache) = crate::bundled::cache_root() {
        keep_checkpoint::atomic::check_outside(out, &[&cache], "keep's cache")?;
    }
    Ok(())
}

/// Human-readable bytes.
/// The line saying which source shards an output took whole (nothing when none).
pub fn print_reused(r: &keep_checkpoint::writer::ReuseStats) {
    if r.linked_shards > 0 {
        println!(
            "{} source shards of {} hard-linked unchanged (they share their bytes with the source)",
            r.linked_shards,
            human(r.linked_bytes)
        );
    }
    if r.copied_shards > 0 {
        println!(
            "{} source shards of {} copied unchanged (the file system refused a hard link)",
            r.copied_shards,
            human(r.copied_bytes)
        );
    }
}

pub fn human(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[i])
    }
}

/// A byte progress bar with throughput and ETA (hidden when stderr is not a terminal).
pub fn byte_bar(total: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// A progress bar counting items (tensors, records) with rate and ETA.
pub fn count_bar(total: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {per_sec} ETA {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("8G").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("512").unwrap(), 512);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
    }

    #[test]
    fn shards_and_taus_are_bounded() {
        assert_eq!(parse_shard("1/4").unwrap(), (1, 4));
        for bad in ["4/4", "0/0", "0/4294967296", "-1/2", "1", "a/b"] {
            assert!(parse_shard(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_tau("0.25").unwrap(), 0.25);
        for bad in ["nan", "-1", "2", "inf", "x"] {
            assert!(parse_tau(bad).is_err(), "{bad}");
        }
    }
}

/// `--threads N`, shared by the verbs that run a model: the compute threads of every parallel
/// kernel (the process's one worker pool). Default: `RAYON_NUM_THREADS`, else one per core.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ThreadsArg {
    /// Compute threads (default: RAYON_NUM_THREADS, else one per core). Expert reads under
    /// --memory-budget have their own I/O threads besides these.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub threads: Option<u64>,
}

impl ThreadsArg {
    /// Size the worker pool, before the verb runs anything.
    pub fn apply(&self) -> anyhow::Result<()> {
        if let Some(n) = self.threads {
            keep_runtime::set_threads(n as usize).map_err(|e| anyhow::anyhow!("--threads: {e}"))?;
        }
        Ok(())
    }
}

/// A refusal of keep-runtime's `Session::open` on the model at `dir`, in the words of what
/// failed: opening the checkpoint, reading its model, or a flag.
pub fn open_error(e: keep_runtime::RuntimeError, dir: &Path) -> anyhow::Error {
    use keep_runtime::RuntimeError;
    match e {
        e @ RuntimeError::Checkpoint(_) => {
            anyhow::Error::from(e).context(format!("opening {}", dir.display()))
        }
        e @ RuntimeError::Invalid(_) => e.into(),
        e => anyhow::Error::from(e).context(format!("loading the model from {}", dir.display())),
    }
}
