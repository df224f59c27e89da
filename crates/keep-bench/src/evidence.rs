//! Evidence rows: what ran, on what, with which raw timings, and the verdict with its rule —
//! and the gates every timed verdict passes through: a row whose memory-pressure gate failed,
//! whose pressure counters could not be read, or that ran on a busy machine (1-minute load
//! average above the core count, or a load average that could not be read) cannot say PASS
//! ([`gated_verdict`]). The rows' types, their reader and their one writer are
//! `keep_artifacts::bench`'s.

use serde::Serialize;

/// The machine a benchmark ran on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub os: &'static str,
    pub arch: &'static str,
    pub cpus: usize,
    pub cpu_model: Option<String>,
    pub mem_total_kib: Option<u64>,
}

/// Describe this machine (best effort; missing facts are `None`).
pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_total_kib = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok());
    Machine {
        os: std::env::consts::OS,
        arch: std::env::consts::ARCH,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu_model,
        mem_total_kib,
    }
}

/// The command line that produced a row.
pub fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

/// The 1-minute load average (`getloadavg`, Linux and macOS), if readable.
pub fn load_average() -> Option<f64> {
    let mut l = [0f64; 3];
    // SAFETY: `l` holds the 3 doubles asked for.
    let n = unsafe { libc::getloadavg(l.as_mut_ptr(), 3) };
    (n >= 1 && l[0].is_finite()).then_some(l[0])
}

/// The cores a load average is compared with.
pub fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1, |n| n.get()) as f64
}

/// The verdict a row may show, from the verdict its numbers alone give, whether its quiet gate
/// passed (`false` also when its counters could not be read), and the load average it ran under
/// (`None`: not read) on `cores` cores; with the note that says what the gates changed.
/// Only PASS is gated: a PASS becomes `UNQUIET` (quiet gate failed or counters unreadable) or
/// `BUSY` (load above the core count, or unknown); other verdicts stay, with a note when the
/// machine was busy.
pub fn gated_verdict(
    numbers: &str,
    quiet: bool,
    load: Option<f64>,
    cores: f64,
) -> (String, Option<String>) {
    let busy = load.is_none_or(|l| l > cores || l.is_nan());
    let load_text = match load {
        Some(l) => format!("load average {l:.2} on {cores} cores"),
        None => format!("load average not read, {cores} cores"),
    };
    if numbers != "PASS" {
        let note = (busy && load.is_some())
            .then(|| format!("measured while the machine was busy ({load_text})"));
        return (numbers.into(), note);
    }
    let (why, what) = if !quiet {
        (
            "UNQUIET",
            "quiet gate failed or its counters could not be read",
        )
    } else if busy {
        ("BUSY", "machine was busy or its load could not be read")
    } else {
        return (numbers.into(), None);
    };
    (
        why.into(),
        Some(format!(
            "the numbers alone say PASS, but the {what} ({load_text}): rerun on a quiet machine"
        )),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_quiet_idle_row_passes() {
        assert_eq!(
            gated_verdict("PASS", true, Some(1.5), 2.0),
            ("PASS".into(), None)
        );
        assert_eq!(gated_verdict("PASS", true, Some(2.5), 2.0).0, "BUSY");
        assert_eq!(gated_verdict("PASS", true, None, 2.0).0, "BUSY");
        assert_eq!(gated_verdict("PASS", true, Some(f64::NAN), 2.0).0, "BUSY");
        assert_eq!(gated_verdict("PASS", false, Some(0.5), 2.0).0, "UNQUIET");
        let (v, note) = gated_verdict("KILL", true, Some(9.0), 2.0);
        assert_eq!(v, "KILL");
        assert!(note.unwrap().contains("busy"));
        assert_eq!(
            gated_verdict("TUNE", false, None, 2.0),
            ("TUNE".into(), None)
        );
        assert!(load_average().is_some_and(|l| l >= 0.0));
    }
}
