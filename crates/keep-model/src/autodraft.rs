//! `--draft auto`'s switch: whether drafting pays, decided from a running estimate of the
//! seconds per generated token with and without it, measured on this run as it goes.
//!
//! Drafting wins where a verify forward of K + 1 rows costs little more than one decode step
//! (a resident, memory-bound model) and loses where the drafted rows route to other experts
//! that must be read (offloaded experts: the window's expert union multiplies the reads). No
//! fixed rule knows which case a run is in, so [`AutoDraft`] measures both: it starts drafting
//! for [`MEASURE_FORWARDS`] verify forwards, then decodes [`MEASURE_TOKENS`] tokens without
//! drafts, and settles on the faster per generated token. Verify forwards that kept one token
//! each (no draft accepted) lose without a comparison: a forward of K + 1 rows never costs
//! less than one of a single row. A drafter whose fastest measured verify forward costs at
//! least K + 1 plain steps is stopped at the comparison: no acceptance can make it pay, since
//! a forward yields at most K + 1 tokens (a small model that computes rather than reads, whose
//! rows cost what they multiply; the fastest forward of the measurement is taken, so a first
//! forward that pages in the drafter or catches it up does not decide alone). A settled side
//! is measured as it runs; after [`RECHECK_TOKENS`] tokens the other side is measured again
//! (conditions change: the slot cache warms, acceptance drifts with the text); the plain side,
//! settled because drafting lost, runs twice as long, and twice again for each further loss in
//! a row, and no sooner than when the time the last drafting measurement lost is at most [`EXPLORE_SHARE`] of the
//! decode so far (a recheck of a drafter that lost costs its catch-up and verify forwards, which
//! on a small, fast model outweigh a short generation). After [`GIVE_UP`] comparisons in a row
//! that drafting lost, it is stopped for the rest of the generation (the drafter is then no
//! longer fed, which saves its block's forward on every token).
//!
//! While drafting is switched off the drafter holds back the pairs it is fed (the main
//! model's streams and the next token; of a long pause only the last window's worth, all its
//! window-only block can still see) and runs them through its block in one forward when
//! drafting is switched back on, so that its cache is in step: a plain token costs no drafter
//! forward, and the catch-up is one batched forward of at most a window. The decisions depend on wall-clock time, so
//! with sampling (temperature > 0) the tokens a seed gives may differ from run to run under
//! `--draft auto` (the output distribution does not: the speculative-sampling rule keeps it);
//! greedy output is identical to no drafting whatever the switch does.

/// Verify forwards measured in a drafting phase before comparing.
pub const MEASURE_FORWARDS: u64 = 2;
/// Tokens decoded without drafts in a measuring phase before comparing.
pub const MEASURE_TOKENS: u64 = 4;
/// Tokens a settled side runs before the other is measured again.
pub const RECHECK_TOKENS: u64 = 128;
/// Consecutive comparisons lost by drafting after which it is stopped for good.
pub const GIVE_UP: u32 = 3;
/// A drafter that lost is measured again only when what its last measurement lost is at most
/// this share of the decode time so far.
pub const EXPLORE_SHARE: f64 = 0.01;

/// What the generation loop does after a step ([`AutoDraft::step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    /// Carry on as before.
    Keep,
    /// Stop drafting (for now).
    Off,
    /// Draft again.
    On,
    /// Stop drafting for the rest of the generation (drop the drafter).
    Stop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Measuring one side before a comparison.
    Measure,
    /// Running the side that won the last comparison.
    Settled,
    /// Drafting stopped for good.
    Stopped,
}

/// The running estimate and the switch (see the module doc).
#[derive(Debug, Clone)]
pub struct AutoDraft {
    drafting: bool,
    phase: Phase,
    /// Seconds, tokens and steps of the current phase.
    secs: f64,
    tokens: u64,
    steps: u64,
    /// Seconds per generated token last measured with and without drafting.
    pub draft_spt: Option<f64>,
    pub plain_spt: Option<f64>,
    losses: u32,
    /// Drafts per verify forward (K): a forward yields at most K + 1 tokens.
    k: u64,
    /// The fastest verify forward of the current drafting measurement, and of the last one.
    fastest: f64,
    probe_fastest: f64,
    /// Seconds of every step counted so far, and the seconds the last drafting measurement
    /// lost against plain decoding (its time less its tokens at the plain rate).
    total_secs: f64,
    probe_secs: f64,
    probe_tokens: u64,
    probe_lost: f64,
    /// Times drafting was switched off, and back on.
    pub offs: u64,
    pub ons: u64,
    /// Tokens decoded while drafting was switched off.
    pub plain_tokens: u64,
}

impl AutoDraft {
    /// Start drafting `k` tokens per verify forward, measuring.
    pub fn new(k: usize) -> AutoDraft {
        AutoDraft {
            drafting: true,
            phase: Phase::Measure,
            secs: 0.0,
            tokens: 0,
            steps: 0,
            draft_spt: None,
            plain_spt: None,
            losses: 0,
            k: k as u64,
            fastest: f64::INFINITY,
            probe_fastest: f64::INFINITY,
            total_secs: 0.0,
            probe_secs: 0.0,
            probe_tokens: 0,
            probe_lost: 0.0,
            offs: 0,
            ons: 0,
            plain_tokens: 0,
        }
    }

    /// Tokens the settled side runs before the other is measured again: [`RECHECK_TOKENS`]
    /// while drafting; while decoding plainly, twice that, doubled again for each further
    /// comparison drafting has lost in a row (a drafter that keeps losing is rechecked less often: each recheck costs its
    /// verify forwards and the drafter's catch-up).
    pub fn recheck_tokens(&self) -> u64 {
        if self.drafting {
            RECHECK_TOKENS
        } else {
            RECHECK_TOKENS << self.losses.min(16)
        }
    }

    /// Whether the next step drafts.
    pub fn drafting(&self) -> bool {
        self.drafting && self.phase != Phase::Stopped
    }

    /// Whether drafting was stopped for good.
    pub fn stopped(&self) -> bool {
        self.phase == Phase::Stopped
    }

    /// One step took `secs` and generated `tokens`; `drafted` says whether it was a verify
    /// forward (a step of the other kind than the current side is not counted).
    pub fn step(&mut self, drafted: bool, secs: f64, tokens: u64) -> Switch {
        if self.phase == Phase::Stopped {
            if !drafted {
                self.plain_tokens += tokens;
            }
            return Switch::Keep;
        }
        if !drafted {
            self.plain_tokens += tokens;
        }
        self.total_secs += secs;
        if drafted != self.drafting {
            return Switch::Keep;
        }
        self.secs += secs;
        self.tokens += tokens;
        self.steps += 1;
        if drafted {
            self.fastest = self.fastest.min(secs);
        }
        let spt = self.secs / self.tokens.max(1) as f64;
        let done = match self.phase {
            Phase::Measure if self.drafting => self.steps >= MEASURE_FORWARDS,
            Phase::Measure => self.tokens >= MEASURE_TOKENS,
            Phase::Settled if self.drafting => self.tokens >= self.recheck_tokens(),
            Phase::Settled => {
                self.tokens >= self.recheck_tokens()
                    && self.probe_lost <= EXPLORE_SHARE * self.total_secs
            }
            Phase::Stopped => false,
        };
        if !done {
            return Switch::Keep;
        }
        if self.drafting {
            self.draft_spt = Some(spt);
            (self.probe_secs, self.probe_tokens) = (self.secs, self.tokens);
            self.probe_fastest = self.fastest;
        } else {
            self.plain_spt = Some(spt);
        }
        let was = self.drafting;
        let none_accepted = self.drafting && self.tokens <= self.steps;
        match (self.phase, self.draft_spt, self.plain_spt) {
            // No draft accepted: drafting lost, whatever plain decoding costs.
            _ if none_accepted => {
                self.losses += 1;
                self.drafting = false;
                self.phase = Phase::Settled;
            }
            // Both sides measured, and even a forward whose every draft is accepted would lose:
            // drafting cannot pay on this run.
            (Phase::Measure, Some(_), Some(p)) if self.probe_fastest >= (self.k + 1) as f64 * p => {
                self.losses = GIVE_UP;
                self.drafting = false;
            }
            // Both sides measured after a measuring phase: settle on the faster.
            (Phase::Measure, Some(d), Some(p)) => {
                if d < p {
                    self.losses = 0;
                    self.drafting = true;
                } else {
                    self.losses += 1;
                    self.drafting = false;
                }
                self.phase = Phase::Settled;
            }
            // One side measured, or a settled side ran its course: measure the other.
            _ => {
                self.drafting = !self.drafting;
                self.phase = Phase::Measure;
            }
        }
        if !self.drafting && self.phase == Phase::Settled {
            // Settled on plain decoding: what the drafting measurement lost against it (all of
            // its time when plain decoding was not measured yet).
            let plain = self.plain_spt.unwrap_or(0.0) * self.probe_tokens as f64;
            self.probe_lost = (self.probe_secs - plain).max(0.0);
        }
        self.secs = 0.0;
        self.tokens = 0;
        self.steps = 0;
        self.fastest = f64::INFINITY;
        if self.losses >= GIVE_UP {
            self.phase = Phase::Stopped;
            if was {
                self.offs += 1;
            }
            return Switch::Stop;
        }
        match (was, self.drafting) {
            (true, false) => {
                self.offs += 1;
                Switch::Off
            }
            (false, true) => {
                self.ons += 1;
                Switch::On
            }
            _ => Switch::Keep,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `n` steps where a verify forward takes `draft` seconds for `per_forward` tokens and a
    /// plain step `plain` seconds for one token; the fraction of tokens drafted.
    fn run(a: &mut AutoDraft, n: usize, draft: f64, per_forward: u64, plain: f64) -> f64 {
        let (mut drafted, mut all) = (0u64, 0u64);
        for _ in 0..n {
            if a.drafting() {
                a.step(true, draft, per_forward);
                drafted += per_forward;
                all += per_forward;
            } else {
                a.step(false, plain, 1);
                all += 1;
            }
        }
        drafted as f64 / all as f64
    }

    #[test]
    fn drafting_that_pays_stays_on_and_is_rechecked() {
        let mut a = AutoDraft::new(2);
        // 2 tokens per 1.2 plain steps: drafting is 1.67x faster.
        let f = run(&mut a, 2000, 1.2, 2, 1.0);
        assert!(!a.stopped());
        assert!(f > 0.9, "drafted fraction {f}");
        // It measured plain decoding more than once (rechecks), and switched back each time.
        assert!(a.offs >= 2 && a.ons >= 2, "offs {} ons {}", a.offs, a.ons);
        assert!(a.offs - a.ons <= 1, "offs {} ons {}", a.offs, a.ons);
    }

    #[test]
    fn drafting_that_loses_is_switched_off_then_stopped() {
        let mut a = AutoDraft::new(2);
        // One token a verify forward that costs three plain steps: no draft accepted.
        run(&mut a, 2000, 3.0, 1, 1.0);
        assert!(a.stopped());
        assert!(!a.drafting());
        assert_eq!(a.offs, u64::from(GIVE_UP));
        assert_eq!(a.ons, u64::from(GIVE_UP) - 1);
        // Drafting that accepts some drafts is compared with plain decoding, and still loses.
        let mut b = AutoDraft::new(2);
        let mut n = 0;
        while !b.stopped() && n < 2000 {
            if b.drafting() {
                // Two forwards of three, one draft accepted: 4 tokens in 3 forwards.
                b.step(true, 3.0, if n % 3 == 0 { 2 } else { 1 });
            } else {
                b.step(false, 1.0, 1);
            }
            n += 1;
        }
        assert!(b.stopped());
        assert!(b.draft_spt.unwrap() > b.plain_spt.unwrap());
    }

    #[test]
    fn a_forward_dearer_than_k_plus_one_plain_steps_stops_at_the_first_comparison() {
        // K = 2 and every draft accepted (3 tokens a forward), but a forward costs 3.2 plain
        // steps: no acceptance can make drafting pay, so it is stopped at once, after the
        // measuring forwards, with no recheck.
        let mut a = AutoDraft::new(2);
        let mut forwards = 0;
        for _ in 0..5_000 {
            if a.drafting() {
                a.step(true, 3.2, 3);
                forwards += 1;
            } else {
                a.step(false, 1.0, 1);
            }
        }
        assert!(a.stopped());
        assert_eq!(forwards, MEASURE_FORWARDS);
        assert_eq!((a.offs, a.ons), (1, 0));
        // The fastest forward decides: a first forward slowed by the drafter's catch-up (or its
        // pages read in) does not stop a drafter whose next forward costs 2 plain steps.
        let mut b = AutoDraft::new(2);
        b.step(true, 9.0, 3);
        b.step(true, 2.0, 3);
        for _ in 0..MEASURE_TOKENS {
            b.step(false, 1.0, 1);
        }
        assert!(b.plain_spt.is_some());
        assert!(!b.stopped(), "stopped by a slow first forward");
    }

    #[test]
    fn a_drafter_that_keeps_losing_is_rechecked_less_often() {
        let mut a = AutoDraft::new(2);
        // Drafting accepts some drafts but loses: 4 tokens in 3 forwards of 1.6 plain steps
        // (what a measurement loses is far below EXPLORE_SHARE of the time: the token counts
        // alone decide when to recheck).
        let mut rechecks = vec![];
        let (mut n, mut plain_run) = (0u64, 0u64);
        while !a.stopped() && n < 10_000 {
            if a.drafting() {
                if plain_run > 0 {
                    rechecks.push(plain_run);
                    plain_run = 0;
                }
                a.step(true, 1.6, if n % 3 == 0 { 2 } else { 1 });
            } else {
                a.step(false, 1.0, 1);
                plain_run += 1;
            }
            n += 1;
        }
        // The plain runs between measurements of drafting: the measuring tokens and the first
        // settled run (twice the recheck), then one twice as long after the second loss; the
        // third stops.
        assert_eq!(
            rechecks,
            [MEASURE_TOKENS + 2 * RECHECK_TOKENS, 4 * RECHECK_TOKENS],
            "plain runs between rechecks"
        );
        assert!(a.stopped());
    }

    #[test]
    fn a_costly_recheck_waits_until_it_is_a_small_share_of_the_decode() {
        // A verify forward (with the drafter's catch-up) costs 50 plain steps and keeps one
        // token: the two measuring forwards lose 100 s, so drafting is measured again only
        // once the decode has run 100 / EXPLORE_SHARE = 10,000 s, not after RECHECK_TOKENS.
        let mut a = AutoDraft::new(2);
        let (mut n, mut plain_run) = (0u64, 0u64);
        let mut first = None;
        while n < 20_000 && first.is_none() {
            if a.drafting() {
                if plain_run > 0 {
                    first = Some(plain_run);
                }
                a.step(true, 50.0, 1);
            } else {
                a.step(false, 1.0, 1);
                plain_run += 1;
            }
            n += 1;
        }
        let first = first.expect("drafting was measured again");
        assert!(
            (9_900..=9_901).contains(&first),
            "plain tokens before the recheck: {first}"
        );
        assert!(!a.stopped());
    }

    #[test]
    fn steps_of_the_other_side_are_not_counted() {
        let mut a = AutoDraft::new(2);
        for _ in 0..100 {
            assert_eq!(a.step(false, 9.0, 1), Switch::Keep);
        }
        assert!(a.drafting());
        assert_eq!(a.plain_spt, None);
        assert_eq!(a.plain_tokens, 100);
    }
}
