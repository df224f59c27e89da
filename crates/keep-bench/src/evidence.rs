//! Evidence rows: what ran, on what, with which raw timings, and the verdict with its rule.

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
