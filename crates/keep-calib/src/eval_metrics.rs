//! Scoring a student against a teacher's stored top-K log-probs (`keep eval`).
//!
//! Per position t the teacher left its K most likely tokens with their log-probs `lp_i` and the
//! log-prob of the true next token. With `p_i = exp(lp_i)` and the tail mass
//! `p_tail = 1 − Σ p_i`, and the student's softmax `q` over the full vocabulary
//! (`q_i` at the teacher's ids, `q_tail = 1 − Σ q_i`):
//!
//! `KL(teacher ‖ student) = Σ_i p_i (lp_i − log q_i) + p_tail (log p_tail − log q_tail)`
//!
//! The tail is one bucket (the teacher's mass outside its top-K, against the student's mass
//! outside the same K ids): by the log-sum inequality this is a lower bound of the full KL and
//! exact when the tail is empty, and it never ignores the tail mass silently. Also: the change
//! in NLL of the true next token (student − teacher) and whether the student's argmax is the
//! teacher's top-1. Accumulated in f64.

use serde::Serialize;

/// Tail masses below this are treated as empty (f32 log-probs summed over K entries round).
pub const TAIL_EPS: f64 = 1e-7;

/// Sums over scored positions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EvalSums {
    /// Positions scored for KL and top-1.
    pub positions: u64,
    /// Σ KL(teacher ‖ student).
    pub kl: f64,
    /// Positions with a true next token (all but the last of each record).
    pub next_positions: u64,
    /// Σ (student NLL − teacher NLL) of the true next token.
    pub dnll: f64,
    /// Σ student NLL of the true next token.
    pub nll: f64,
    /// Positions where the student's argmax equals the teacher's top-1.
    pub top1: u64,
}

impl EvalSums {
    /// Add another set of sums.
    pub fn add(&mut self, o: &EvalSums) {
        self.positions += o.positions;
        self.kl += o.kl;
        self.next_positions += o.next_positions;
        self.dnll += o.dnll;
        self.nll += o.nll;
        self.top1 += o.top1;
    }
    /// Mean KL per position.
    pub fn mean_kl(&self) -> f64 {
        self.kl / self.positions.max(1) as f64
    }
    /// Mean NLL change per next-token position.
    pub fn mean_dnll(&self) -> f64 {
        self.dnll / self.next_positions.max(1) as f64
    }
    /// Mean student NLL per next-token position.
    pub fn mean_nll(&self) -> f64 {
        self.nll / self.next_positions.max(1) as f64
    }
    /// Top-1 agreement rate.
    pub fn top1_rate(&self) -> f64 {
        self.top1 as f64 / self.positions.max(1) as f64
    }
}

/// Log-softmax of one row, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let s: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
    let lse = m + s.ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// Score one record: `logits` `[T, vocab]` of the student, the teacher's `topk_ids` /
/// `topk_logprobs` `[T, k]` (descending), `next_logprob` `[T-1]`, and the record's `tokens`
/// (the true next token of position t is `tokens[t+1]`).
pub fn score(
    logits: &[f32],
    vocab: usize,
    tokens: &[u32],
    topk_ids: &[i32],
    topk_logprobs: &[f32],
    next_logprob: &[f32],
    k: usize,
) -> EvalSums {
    let t_len = tokens.len();
    let mut s = EvalSums::default();
    for t in 0..t_len {
        let row = &logits[t * vocab..(t + 1) * vocab];
        let lq = log_softmax(row);
        let ids = &topk_ids[t * k..(t + 1) * k];
        let lps = &topk_logprobs[t * k..(t + 1) * k];
        let mut kl = 0.0;
        let (mut p_in, mut q_in) = (0.0f64, 0.0f64);
        for (&id, &lp) in ids.iter().zip(lps) {
            let (lp, id) = (lp as f64, id as usize);
            let p = lp.exp();
            let lqi = lq.get(id).copied().unwrap_or(f64::NEG_INFINITY);
            kl += p * (lp - lqi);
            p_in += p;
            q_in += lqi.exp();
        }
        let p_tail = 1.0 - p_in;
        if p_tail > TAIL_EPS {
            let q_tail = (1.0 - q_in).max(f64::MIN_POSITIVE);
            kl += p_tail * (p_tail.ln() - q_tail.ln());
        }
        s.kl += kl;
        s.positions += 1;
        let arg = row
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |a, (i, &v)| {
                if v > a.1 {
                    (i, v)
                } else {
                    a
                }
            });
        if ids.first().is_some_and(|&i| i as usize == arg.0) {
            s.top1 += 1;
        }
        if t + 1 < t_len {
            let next = tokens[t + 1] as usize;
            let nll = -lq.get(next).copied().unwrap_or(f64::NEG_INFINITY);
            s.nll += nll;
            s.dnll += nll + next_logprob[t] as f64;
            s.next_positions += 1;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn teacher_of(logits: &[f32], vocab: usize, k: usize) -> (Vec<i32>, Vec<f32>) {
        let mut ids = vec![];
        let mut lps = vec![];
        for row in logits.chunks(vocab) {
            let l = log_softmax(row);
            let mut o: Vec<usize> = (0..vocab).collect();
            o.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
            for &i in &o[..k] {
                ids.push(i as i32);
                lps.push(l[i] as f32);
            }
        }
        (ids, lps)
    }

    fn full_kl(a: &[f32], b: &[f32]) -> f64 {
        let (la, lb) = (log_softmax(a), log_softmax(b));
        la.iter().zip(&lb).map(|(p, q)| p.exp() * (p - q)).sum()
    }

    #[test]
    fn identical_student_scores_zero() {
        let vocab = 50;
        let logits: Vec<f32> = (0..3 * vocab)
            .map(|i| ((i * 37) % 23) as f32 * 0.3)
            .collect();
        let (ids, lps) = teacher_of(&logits, vocab, 8);
        let tokens = [1u32, 5, 9];
        let next: Vec<f32> = (0..2)
            .map(|t| {
                log_softmax(&logits[t * vocab..(t + 1) * vocab])[tokens[t + 1] as usize] as f32
            })
            .collect();
        let s = score(&logits, vocab, &tokens, &ids, &lps, &next, 8);
        assert!(s.mean_kl().abs() < 1e-6, "{}", s.mean_kl());
        assert!(s.mean_dnll().abs() < 1e-6);
        assert_eq!(s.top1, 3);
    }

    #[test]
    fn full_vocabulary_topk_is_the_exact_kl_and_the_tail_bound_holds() {
        let vocab = 20;
        let a: Vec<f32> = (0..vocab).map(|i| (i as f32 * 0.7).sin() * 3.0).collect();
        let b: Vec<f32> = (0..vocab).map(|i| (i as f32 * 0.5).cos() * 2.0).collect();
        let exact = full_kl(&a, &b);
        let (ids, lps) = teacher_of(&a, vocab, vocab);
        let s = score(&b, vocab, &[0], &ids, &lps, &[], vocab);
        assert!((s.kl - exact).abs() < 1e-5, "{} vs {exact}", s.kl);
        for k in [1, 4, 10] {
            let (ids, lps) = teacher_of(&a, vocab, k);
            let s = score(&b, vocab, &[0], &ids, &lps, &[], k);
            assert!(
                s.kl <= exact + 1e-9 && s.kl >= 0.0,
                "k={k}: {} > {exact}",
                s.kl
            );
        }
    }
}
