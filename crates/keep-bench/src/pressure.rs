//! Memory-pressure counters and the quiet gate every kill-test row carries.
//!
//! A timed window is only evidence if the machine did not page while it ran. The harness
//! reads the kernel's system-wide counters before and after each timed window:
//! - Linux (`/proc/vmstat`): `pgmajfault` (major faults: pages read back in), `pswpin`,
//!   `pswpout` (swap), `pgpgin`, `pgpgout` (KiB moved to/from block devices), and `zswpin`/
//!   `zswpout` where the kernel has zswap (compressed swap; the analogue of macOS's compressor).
//! - macOS (`vm_stat`): `Pageins`, `Pageouts`, `Swapins`, `Swapouts`, `Compressions`,
//!   `Decompressions` (pages).
//!
//! Each platform's counters map onto four gate classes: **outbound** (pages pushed out of
//! memory: Linux `pswpout` + `zswpout`; macOS pageouts + swapouts), **page-ins**
//! (Linux `pgmajfault`; macOS pageins), **swap-ins** (Linux `pswpin`; macOS swapins) and
//! **decompressions** (Linux `zswpin`; macOS decompressions). Linux `pgpgin`/`pgpgout` are
//! recorded but not gated: they count every block read and write of every process (log
//! files, other users' builds), so on a shared machine they are never zero; macOS
//! compressions are recorded, not gated (the outbound half of the gate is pageouts and swapouts).
//!
//! The gate (schema_version 2, [`InboundGate::HARNESS`]): a row is clean only if the outbound
//! delta is zero, page-ins and decompressions each stay under 4,096 and swap-ins are zero. The
//! counters are system-wide, so zero page-ins is not attainable; rows that faulted their working
//! set back in saw thousands to hundreds of thousands. Version 1 rows carry no inbound gate and
//! are clean on zero outbound alone; [`replay`] re-judges a stored row under the rule of its
//! own version and refuses a row that declares a laxer inbound gate than the harness's.
//!
//! Under every version a window whose counters could not be read (no `/proc/vmstat` or
//! `vm_stat`, or a gated counter missing before or after) is not clean: zero deltas of counters
//! that were never read prove nothing ([`counters_complete`]).
//!
//! The records themselves ([`Counters`], [`Classes`], [`InboundGate`], [`Quiet`]) are
//! defined with the rows that carry them, in `keep_artifacts::bench`; this module reads the
//! counters and judges them.

use std::collections::BTreeMap;

pub use keep_artifacts::bench::{Classes, Counters, InboundGate, Quiet};

use crate::{BenchError, Result};

/// The gate version of rows this harness writes.
pub const GATE_VERSION: u32 = 2;

/// Counter names read on Linux.
pub const LINUX_KEYS: [&str; 7] = [
    "pgmajfault",
    "pswpin",
    "pswpout",
    "pgpgin",
    "pgpgout",
    "zswpin",
    "zswpout",
];

/// Counter names read on macOS (as `vm_stat` prints them, lower-cased, no punctuation).
pub const MACOS_KEYS: [&str; 6] = [
    "pageins",
    "pageouts",
    "swapins",
    "swapouts",
    "compressions",
    "decompressions",
];

/// Parse `/proc/vmstat` text (`name value` per line), keeping [`LINUX_KEYS`].
pub fn parse_vmstat(text: &str) -> Counters {
    let mut values = BTreeMap::new();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        if let (Some(k), Some(v)) = (it.next(), it.next()) {
            if LINUX_KEYS.contains(&k) {
                if let Ok(v) = v.parse() {
                    values.insert(k.to_string(), v);
                }
            }
        }
    }
    Counters {
        source: "linux-vmstat".into(),
        values,
    }
}

/// Parse `vm_stat` output (`"Pageins:  123."` lines), keeping [`MACOS_KEYS`].
pub fn parse_vm_stat(text: &str) -> Counters {
    let mut values = BTreeMap::new();
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        let key: String = k
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
            .to_ascii_lowercase();
        if MACOS_KEYS.contains(&key.as_str()) {
            if let Ok(v) = v.trim().trim_end_matches('.').parse() {
                values.insert(key, v);
            }
        }
    }
    Counters {
        source: "macos-vm_stat".into(),
        values,
    }
}

/// Read the counters of this machine (an empty `"none"` reading where there are none).
pub fn read() -> Counters {
    #[cfg(target_os = "linux")]
    {
        if let Ok(t) = std::fs::read_to_string("/proc/vmstat") {
            return parse_vmstat(&t);
        }
    }
    #[cfg(target_os = "macos")]
    {
        if let Ok(o) = std::process::Command::new("vm_stat").output() {
            return parse_vm_stat(&String::from_utf8_lossy(&o.stdout));
        }
    }
    Counters {
        source: "none".into(),
        values: BTreeMap::new(),
    }
}

/// The counters each source must have for its gate classes to mean anything (`zswpin` and
/// `zswpout` exist only with zswap, so they are optional).
pub fn required_keys(source: &str) -> &'static [&'static str] {
    match source {
        "linux-vmstat" => &["pgmajfault", "pswpin", "pswpout"],
        "macos-vm_stat" => &[
            "pageins",
            "pageouts",
            "swapins",
            "swapouts",
            "decompressions",
        ],
        _ => &[],
    }
}

/// Whether two readings can be judged: a known source, the same on both sides, and every
/// required counter present in both.
pub fn counters_complete(before: &Counters, after: &Counters) -> bool {
    let req = required_keys(&before.source);
    !req.is_empty()
        && before.source == after.source
        && req
            .iter()
            .all(|k| before.values.contains_key(*k) && after.values.contains_key(*k))
}

/// `after − before` per counter (saturating; a counter missing from either side is left out).
pub fn deltas(before: &Counters, after: &Counters) -> BTreeMap<String, u64> {
    before
        .values
        .iter()
        .filter_map(|(k, b)| {
            after
                .values
                .get(k)
                .map(|a| (k.clone(), a.saturating_sub(*b)))
        })
        .collect()
}

/// Map deltas onto the gate classes by the counters' source.
pub fn classes(source: &str, d: &BTreeMap<String, u64>) -> Classes {
    let g = |k: &str| d.get(k).copied().unwrap_or(0);
    match source {
        "macos-vm_stat" => Classes {
            outbound: g("pageouts") + g("swapouts"),
            pageins: g("pageins"),
            swapins: g("swapins"),
            decompressions: g("decompressions"),
        },
        _ => Classes {
            outbound: g("pswpout") + g("zswpout"),
            pageins: g("pgmajfault"),
            swapins: g("pswpin"),
            decompressions: g("zswpin"),
        },
    }
}

/// The rule text of a gate version.
pub fn rule(version: u32) -> String {
    match version {
        1 => "clean iff the counters were read and outbound deltas are zero (v1)".into(),
        _ => format!(
            "clean iff the counters were read, outbound deltas are zero, page-ins < {}, decompressions < {} and swap-ins <= {} (v2)",
            InboundGate::HARNESS.pageins_below,
            InboundGate::HARNESS.decompressions_below,
            InboundGate::HARNESS.swapins_at_most
        ),
    }
}

/// Judge a window under the harness's (version 2) gate.
pub fn judge(before: Counters, after: Counters) -> Quiet {
    let d = deltas(&before, &after);
    let c = classes(&before.source, &d);
    let gate = InboundGate::HARNESS;
    let outbound_clean = c.outbound == 0;
    let inbound_clean = gate.admits(&c);
    let counters_read = counters_complete(&before, &after);
    Quiet {
        gate_version: GATE_VERSION,
        before,
        after,
        deltas: d,
        classes: c,
        inbound_gate: Some(gate),
        outbound_clean,
        inbound_clean,
        counters_read,
        clean: counters_read && outbound_clean && inbound_clean,
        rule: rule(GATE_VERSION),
    }
}

/// Re-judge a stored quiet record under its own version's rule: version 1 on outbound alone;
/// version 2 with its declared inbound gate, which may not be laxer than the harness's.
/// Returns whether the record is clean; refuses records that cannot be judged.
pub fn replay(q: &Quiet) -> Result<bool> {
    let d = deltas(&q.before, &q.after);
    let c = classes(&q.before.source, &d);
    let read = counters_complete(&q.before, &q.after);
    Ok(read && replay_classes(q, &c)?)
}

fn replay_classes(q: &Quiet, c: &Classes) -> Result<bool> {
    match q.gate_version {
        1 => Ok(c.outbound == 0),
        2 => {
            let g = q.inbound_gate.ok_or_else(|| {
                BenchError::Invalid("a schema_version 2 quiet record has no inbound_gate".into())
            })?;
            if g.laxer_than(&InboundGate::HARNESS) {
                return Err(BenchError::Invalid(format!(
                    "the row declares an inbound gate {g:?} laxer than the harness's {:?}",
                    InboundGate::HARNESS
                )));
            }
            Ok(c.outbound == 0 && g.admits(c))
        }
        v => Err(BenchError::Invalid(format!(
            "quiet gate version {v} is unknown (this harness knows 1 and 2)"
        ))),
    }
}

/// The gate of a cold-read benchmark (repack and prune against plain copies), which evicts its
/// source before every timed step: page-ins are the measured reads themselves, so they are not
/// gated; the window is clean only if the counters were read, nothing was pushed out of memory,
/// nothing was swapped in, and decompressions stayed under the harness's limit. Recomputed
/// from the stored counters, so a summary can replay it.
pub fn cold_read_clean(q: &Quiet) -> bool {
    let c = classes(&q.before.source, &deltas(&q.before, &q.after));
    counters_complete(&q.before, &q.after)
        && c.outbound == 0
        && c.swapins == 0
        && c.decompressions < InboundGate::HARNESS.decompressions_below
}

/// The rule text of [`cold_read_clean`].
pub const COLD_READ_RULE: &str = "clean iff the counters were read, outbound deltas are zero, swap-ins are zero and decompressions < 4096; page-ins are the cold reads being measured and are not gated";

#[cfg(test)]
mod tests {
    use super::*;

    fn linux(pgmaj: u64, pswpin: u64, pswpout: u64) -> Counters {
        parse_vmstat(&format!(
            "nr_free_pages 12\npgpgin 100\npgpgout 5000\npswpin {pswpin}\npswpout {pswpout}\npgmajfault {pgmaj}\n"
        ))
    }

    #[test]
    fn parses_both_platforms() {
        let c = linux(7, 1, 2);
        assert_eq!(c.values["pgmajfault"], 7);
        assert_eq!(c.values["pgpgout"], 5000);
        assert!(!c.values.contains_key("nr_free_pages"));
        let m = parse_vm_stat(
            "Mach Virtual Memory Statistics: (page size of 16384 bytes)\nPages free:     1000.\n\
             Pageins:                                 245255.\nPageouts:    3.\nSwapins:  0.\n\
             Swapouts: 0.\n\"Compressions\":  10.\nDecompressions:   4095.\n",
        );
        assert_eq!(m.values["pageins"], 245255);
        assert_eq!(m.values["decompressions"], 4095);
        assert_eq!(m.values["pageouts"], 3);
        assert!(!m.values.contains_key("pagesfree"));
    }

    #[test]
    fn gate_v2_is_two_sided() {
        // Outbound zero but the working set faulted back in: dirty under v2, clean under v1.
        let q = judge(linux(0, 0, 0), linux(245_255, 0, 0));
        assert!(q.outbound_clean && !q.inbound_clean && !q.clean);
        let mut v1 = q.clone();
        v1.gate_version = 1;
        v1.inbound_gate = None;
        assert!(replay(&v1).unwrap());
        assert!(!replay(&q).unwrap());
        // Just under the limits: clean. Pgpgout (ordinary writes) is not gated.
        let q = judge(linux(0, 0, 0), linux(4095, 0, 0));
        assert!(q.clean && replay(&q).unwrap());
        // Any swap-in or swap-out: dirty.
        assert!(!judge(linux(0, 0, 0), linux(0, 1, 0)).clean);
        assert!(!judge(linux(0, 0, 0), linux(0, 0, 1)).clean);
    }

    #[test]
    fn cold_read_gate_ignores_page_ins_only() {
        let q = judge(linux(0, 0, 0), linux(900_000, 0, 0));
        assert!(!q.clean && cold_read_clean(&q));
        assert!(!cold_read_clean(&judge(linux(0, 0, 0), linux(0, 0, 1))));
        assert!(!cold_read_clean(&judge(linux(0, 0, 0), linux(0, 1, 0))));
        let none = Counters {
            source: "none".into(),
            values: BTreeMap::new(),
        };
        assert!(!cold_read_clean(&judge(none.clone(), none)));
    }

    #[test]
    fn unreadable_counters_are_never_clean() {
        let none = Counters {
            source: "none".into(),
            values: BTreeMap::new(),
        };
        let q = judge(none.clone(), none);
        assert!(q.outbound_clean && q.inbound_clean && !q.counters_read && !q.clean);
        assert!(!replay(&q).unwrap());
        // A gated counter missing on one side: not clean either, under both versions.
        let mut after = linux(0, 0, 0);
        after.values.remove("pswpout");
        let mut q = judge(linux(0, 0, 0), after);
        assert!(!q.clean && !replay(&q).unwrap());
        q.gate_version = 1;
        q.inbound_gate = None;
        assert!(!replay(&q).unwrap());
        // zswap counters are optional.
        assert!(judge(linux(0, 0, 0), linux(0, 0, 0)).clean);
    }

    #[test]
    fn laxer_gate_is_refused_and_unknown_versions_too() {
        let mut q = judge(linux(0, 0, 0), linux(10, 0, 0));
        q.inbound_gate = Some(InboundGate {
            pageins_below: 1 << 20,
            ..InboundGate::HARNESS
        });
        assert!(replay(&q).is_err());
        q.inbound_gate = Some(InboundGate {
            pageins_below: 100,
            ..InboundGate::HARNESS
        });
        assert!(replay(&q).unwrap());
        q.inbound_gate = None;
        assert!(replay(&q).is_err());
        q.gate_version = 3;
        assert!(replay(&q).is_err());
    }

    #[test]
    fn macos_classes() {
        let mut b = Counters {
            source: "macos-vm_stat".into(),
            values: BTreeMap::new(),
        };
        for k in MACOS_KEYS {
            b.values.insert(k.into(), 100);
        }
        let mut a = b.clone();
        *a.values.get_mut("decompressions").unwrap() += 5000;
        let q = judge(b.clone(), a);
        assert_eq!(q.classes.decompressions, 5000);
        assert!(!q.clean);
        let mut a = b.clone();
        *a.values.get_mut("compressions").unwrap() += 1;
        assert!(judge(b.clone(), a).clean);
        let mut a = b.clone();
        *a.values.get_mut("swapouts").unwrap() += 1;
        assert!(!judge(b, a).outbound_clean);
    }
}
