//! Hot-set policies behind one trait: static, LRU, decayed use counts, and Belady's optimum.
//!
//! The model: one hot set of `capacity` experts per layer, replayed slot by slot (token `t`,
//! slot `j` is access `i = t·top_k + j` of the layer's stream). An access to a resident expert
//! is a hit. A miss is read from SSD; the policy then may *admit* the expert (evicting one if
//! full) or *bypass* it (use it once, keep the set). A miss that the fetch threshold drops
//! (`admit == false`) changes no residency.
//!
//! - **static**: a fixed set — the top-`capacity` of the warm-start ordering. Prefilled when
//!   the warm start is `reap`/`frequency`; with `none` each member is loaded on its first use.
//!   Everything else is bypassed.
//! - **lru**: admit every miss, evict the least recently used (prefilled residents count as
//!   used in rank order, the best most recently).
//! - **decay**: every use of an expert (resident or not) adds `2^(t/half_life)` to its score,
//!   so that a score read at time `now` is `2^(now/half_life) · Σ 0.5^((now−t)/half_life)` —
//!   decayed use counts, with all scores scaled alike (the order never changes between uses).
//!   Admit every miss, evict the lowest score; ties go to the least recently used.
//! - **belady**: the offline optimum (the ceiling): on a miss, of the residents and the
//!   incoming expert, the one whose next use is furthest in the future is left out (bypassed
//!   if it is the incoming one). With bypass allowed this is optimal, so no policy above can
//!   miss less (tested against an exhaustive search). Next uses are precomputed per stream in
//!   O(T·k); each access is O(log H).
//!
//! Data structures are flat arrays indexed by expert id (no hashing): LRU a doubly linked
//! list, decay a min-heap and Belady a max-heap with position indices.

use serde::{Deserialize, Serialize};

/// The policies, in report order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    Static,
    Lru,
    Decay,
    Belady,
}

impl PolicyKind {
    /// All policies.
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::Static,
        PolicyKind::Lru,
        PolicyKind::Decay,
        PolicyKind::Belady,
    ];
    /// The CLI/JSON spelling.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Static => "static",
            PolicyKind::Lru => "lru",
            PolicyKind::Decay => "decay",
            PolicyKind::Belady => "belady",
        }
    }
    /// Parse the CLI spelling.
    pub fn parse(s: &str) -> Option<PolicyKind> {
        PolicyKind::ALL
            .iter()
            .copied()
            .find(|p| p.name() == s.trim().to_ascii_lowercase())
    }
    /// Whether the policy can run online (Belady needs the future).
    pub fn realizable(self) -> bool {
        self != PolicyKind::Belady
    }
}

/// One layer's accesses in one session.
#[derive(Debug, Clone, Copy)]
pub struct Stream<'a> {
    /// Expert ids, `[T × top_k]`.
    pub experts: &'a [u16],
    pub top_k: usize,
    pub n_experts: usize,
}

/// How a stream starts.
#[derive(Debug, Clone, Copy)]
pub struct Start<'a> {
    /// Hot-set size (clamped to `n_experts` by the caller).
    pub capacity: usize,
    /// The warm-start ordering, best first (a permutation of `0..n_experts`).
    pub order: &'a [u16],
    /// Whether the top-`capacity` of `order` start resident.
    pub prefill: bool,
}

impl Start<'_> {
    /// The initially resident experts, best first.
    pub fn initial(&self) -> &[u16] {
        if self.prefill {
            &self.order[..self.capacity.min(self.order.len())]
        } else {
            &[]
        }
    }
}

/// A hot-set policy. `reset` starts a stream (a layer in a session); `access` replays access
/// `i` (strictly increasing within a stream) of expert `e` and says whether it hit.
pub trait Policy {
    fn kind(&self) -> PolicyKind;
    fn reset(&mut self, stream: &Stream, start: &Start);
    fn access(&mut self, i: usize, e: u16, admit: bool) -> bool;
}

/// A new policy of `kind` (`half_life` in tokens, for decay).
pub fn make(kind: PolicyKind, half_life: f64) -> Box<dyn Policy> {
    match kind {
        PolicyKind::Static => Box::new(StaticSet::default()),
        PolicyKind::Lru => Box::new(Lru::default()),
        PolicyKind::Decay => Box::new(Decay::new(half_life)),
        PolicyKind::Belady => Box::new(Belady::default()),
    }
}

/// The fixed hot set.
#[derive(Debug, Default, Clone)]
pub struct StaticSet {
    member: Vec<bool>,
    resident: Vec<bool>,
}

impl Policy for StaticSet {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Static
    }
    fn reset(&mut self, s: &Stream, st: &Start) {
        self.member.clear();
        self.member.resize(s.n_experts, false);
        self.resident.clear();
        self.resident.resize(s.n_experts, false);
        for &e in &st.order[..st.capacity.min(st.order.len())] {
            self.member[e as usize] = true;
        }
        for &e in st.initial() {
            self.resident[e as usize] = true;
        }
    }
    #[inline]
    fn access(&mut self, _i: usize, e: u16, admit: bool) -> bool {
        let e = e as usize;
        if self.resident[e] {
            return true;
        }
        if admit && self.member[e] {
            self.resident[e] = true;
        }
        false
    }
}

const NIL: u32 = u32::MAX;

/// Least recently used, as a doubly linked list over expert ids (head = most recent).
#[derive(Debug, Default, Clone)]
pub struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    resident: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
    cap: usize,
}

impl Lru {
    #[inline]
    fn unlink(&mut self, e: u32) {
        let (p, n) = (self.prev[e as usize], self.next[e as usize]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
    }
    #[inline]
    fn push_front(&mut self, e: u32) {
        self.prev[e as usize] = NIL;
        self.next[e as usize] = self.head;
        if self.head != NIL {
            self.prev[self.head as usize] = e;
        } else {
            self.tail = e;
        }
        self.head = e;
    }
    #[inline]
    fn push_back(&mut self, e: u32) {
        self.next[e as usize] = NIL;
        self.prev[e as usize] = self.tail;
        if self.tail != NIL {
            self.next[self.tail as usize] = e;
        } else {
            self.head = e;
        }
        self.tail = e;
    }
}

impl Policy for Lru {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }
    fn reset(&mut self, s: &Stream, st: &Start) {
        let n = s.n_experts;
        self.prev.clear();
        self.prev.resize(n, NIL);
        self.next.clear();
        self.next.resize(n, NIL);
        self.resident.clear();
        self.resident.resize(n, false);
        self.head = NIL;
        self.tail = NIL;
        self.len = 0;
        self.cap = st.capacity;
        for &e in st.initial() {
            // Best first = most recent first.
            self.push_back(e as u32);
            self.resident[e as usize] = true;
            self.len += 1;
        }
    }
    #[inline]
    fn access(&mut self, _i: usize, e: u16, admit: bool) -> bool {
        let e = e as u32;
        if self.resident[e as usize] {
            if self.head != e {
                self.unlink(e);
                self.push_front(e);
            }
            return true;
        }
        if !admit || self.cap == 0 {
            return false;
        }
        if self.len == self.cap {
            let victim = self.tail;
            self.unlink(victim);
            self.resident[victim as usize] = false;
        } else {
            self.len += 1;
        }
        self.push_front(e);
        self.resident[e as usize] = true;
        false
    }
}

/// The order of a [`KeyHeap`]: `above(a, b)` when key `a` belongs nearer the root.
trait HeapOrder {
    type K: Copy + std::fmt::Debug + Default;
    fn above(a: &Self::K, b: &Self::K) -> bool;
}

/// A binary heap of `(key, expert)` with the keys stored inline (children compare within one
/// array) and a position index per expert.
#[derive(Debug, Clone)]
struct KeyHeap<O: HeapOrder> {
    heap: Vec<(O::K, u32)>,
    pos: Vec<u32>,
}

impl<O: HeapOrder> Default for KeyHeap<O> {
    fn default() -> Self {
        KeyHeap {
            heap: vec![],
            pos: vec![],
        }
    }
}

impl<O: HeapOrder> KeyHeap<O> {
    fn reset(&mut self, n: usize) {
        self.heap.clear();
        self.pos.clear();
        self.pos.resize(n, NIL);
    }
    #[inline]
    fn contains(&self, e: u32) -> bool {
        self.pos[e as usize] != NIL
    }
    #[inline]
    fn len(&self) -> usize {
        self.heap.len()
    }
    #[inline]
    fn top_key(&self) -> O::K {
        self.heap[0].0
    }
    #[inline]
    fn up(&mut self, mut i: usize) {
        let item = self.heap[i];
        while i > 0 {
            let p = (i - 1) / 2;
            if O::above(&item.0, &self.heap[p].0) {
                self.heap[i] = self.heap[p];
                self.pos[self.heap[i].1 as usize] = i as u32;
                i = p;
            } else {
                break;
            }
        }
        self.heap[i] = item;
        self.pos[item.1 as usize] = i as u32;
    }
    #[inline]
    fn down(&mut self, mut i: usize) {
        let n = self.heap.len();
        let item = self.heap[i];
        loop {
            let l = 2 * i + 1;
            if l >= n {
                break;
            }
            let r = l + 1;
            let c = if r < n && O::above(&self.heap[r].0, &self.heap[l].0) {
                r
            } else {
                l
            };
            if O::above(&self.heap[c].0, &item.0) {
                self.heap[i] = self.heap[c];
                self.pos[self.heap[i].1 as usize] = i as u32;
                i = c;
            } else {
                break;
            }
        }
        self.heap[i] = item;
        self.pos[item.1 as usize] = i as u32;
    }
    #[inline]
    fn push(&mut self, e: u32, k: O::K) {
        self.heap.push((k, e));
        let i = self.heap.len() - 1;
        self.up(i);
    }
    /// Replace the root with `e` (key `k`) and restore the order; returns the old root.
    #[inline]
    fn replace_top(&mut self, e: u32, k: O::K) -> u32 {
        let old = self.heap[0].1;
        self.pos[old as usize] = NIL;
        self.heap[0] = (k, e);
        self.down(0);
        old
    }
    /// Set the key of resident `e`; `grows_away` says it can only move away from the root.
    #[inline]
    fn rekey(&mut self, e: u32, k: O::K, grows_away: bool) {
        let i = self.pos[e as usize] as usize;
        self.heap[i].0 = k;
        if grows_away {
            self.down(i)
        } else {
            self.up(i)
        }
    }
}

/// Scores past this exponent are rescaled (f64 holds up to 2^1023).
const DECAY_RESCALE_EXP: f64 = 512.0;

/// Min-heap on (score, last-use tick).
#[derive(Debug, Clone)]
struct LowestScore;
impl HeapOrder for LowestScore {
    type K = (f64, u64);
    #[inline]
    fn above(a: &(f64, u64), b: &(f64, u64)) -> bool {
        a.0 < b.0 || (a.0 == b.0 && a.1 < b.1)
    }
}

/// Decayed use counts with a half-life in tokens.
#[derive(Debug, Clone)]
pub struct Decay {
    half_life: f64,
    /// Scaled decayed count of every expert (resident or not).
    score: Vec<f64>,
    heap: KeyHeap<LowestScore>,
    cap: usize,
    top_k: usize,
    /// First access index of the next token, and the current token's increment.
    tok_end: usize,
    inc: f64,
    /// Exponent subtracted from every score so far (rescaling).
    base: f64,
    /// Ticks of real accesses start here (prefill ranks use `1..=n`).
    tick0: u64,
}

impl Decay {
    /// A decay policy with `half_life` tokens (infinite: plain use counts; non-positive or
    /// NaN: 1).
    pub fn new(half_life: f64) -> Decay {
        Decay {
            half_life: if half_life > 0.0 { half_life } else { 1.0 },
            score: vec![],
            heap: KeyHeap::default(),
            cap: 0,
            top_k: 1,
            tok_end: 0,
            inc: 1.0,
            base: 0.0,
            tick0: 0,
        }
    }
    #[inline]
    fn increment(&mut self, i: usize) -> f64 {
        if i >= self.tok_end {
            let t = i / self.top_k;
            self.tok_end = (t + 1) * self.top_k;
            let mut x = t as f64 / self.half_life - self.base;
            if x > DECAY_RESCALE_EXP {
                // Scale every score alike: the order is unchanged.
                let f = (-x).exp2();
                for s in &mut self.score {
                    *s *= f;
                }
                for h in &mut self.heap.heap {
                    h.0 .0 *= f;
                }
                self.base += x;
                x = 0.0;
            }
            self.inc = x.exp2();
        }
        self.inc
    }
}

impl Policy for Decay {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Decay
    }
    fn reset(&mut self, s: &Stream, st: &Start) {
        let n = s.n_experts;
        self.score.clear();
        self.score.resize(n, 0.0);
        self.heap.reset(n);
        self.cap = st.capacity;
        self.top_k = s.top_k.max(1);
        self.tok_end = 0;
        self.base = 0.0;
        self.tick0 = n as u64 + 1;
        let init = st.initial();
        for (r, &e) in init.iter().enumerate() {
            self.heap.push(e as u32, (0.0, (init.len() - r) as u64));
        }
    }
    #[inline]
    fn access(&mut self, i: usize, e: u16, admit: bool) -> bool {
        let inc = self.increment(i);
        let eu = e as usize;
        self.score[eu] += inc;
        let key = (self.score[eu], self.tick0 + i as u64);
        if self.heap.contains(e as u32) {
            // Its score and tick only grew.
            self.heap.rekey(e as u32, key, true);
            return true;
        }
        if !admit || self.cap == 0 {
            return false;
        }
        if self.heap.len() < self.cap {
            self.heap.push(e as u32, key);
        } else {
            self.heap.replace_top(e as u32, key);
        }
        false
    }
}

/// "Never used again".
const NEVER: u32 = u32::MAX;

/// Max-heap on next use.
#[derive(Debug, Clone)]
struct FurthestNextUse;
impl HeapOrder for FurthestNextUse {
    type K = u32;
    #[inline]
    fn above(a: &u32, b: &u32) -> bool {
        a > b
    }
}

/// Belady's optimum with bypass (see the module doc).
#[derive(Debug, Default, Clone)]
pub struct Belady {
    /// Next access index of the same expert after access `i` (or [`NEVER`]).
    next: Vec<u32>,
    /// First access of each expert (scratch of the precompute).
    first: Vec<u32>,
    heap: KeyHeap<FurthestNextUse>,
    cap: usize,
}

/// Next-use indices of a stream: `next[i]` is the next access of `experts[i]` after `i`;
/// `first[e]` the first access of `e`; [`NEVER`] when there is none.
pub fn next_uses(experts: &[u16], n_experts: usize, next: &mut Vec<u32>, first: &mut Vec<u32>) {
    first.clear();
    first.resize(n_experts, NEVER);
    next.clear();
    next.resize(experts.len(), NEVER);
    for i in (0..experts.len()).rev() {
        let e = experts[i] as usize;
        next[i] = first[e];
        first[e] = i as u32;
    }
}

impl Policy for Belady {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Belady
    }
    fn reset(&mut self, s: &Stream, st: &Start) {
        next_uses(s.experts, s.n_experts, &mut self.next, &mut self.first);
        self.heap.reset(s.n_experts);
        self.cap = st.capacity;
        for &e in st.initial() {
            self.heap.push(e as u32, self.first[e as usize]);
        }
    }
    #[inline]
    fn access(&mut self, i: usize, e: u16, admit: bool) -> bool {
        let nu = self.next[i];
        let eu = e as u32;
        if self.heap.contains(eu) {
            // Its key grew from `i` to `nu`: it can only move toward the root.
            self.heap.rekey(eu, nu, false);
            return true;
        }
        if !admit || self.cap == 0 {
            return false;
        }
        if self.heap.len() < self.cap {
            self.heap.push(eu, nu);
        } else if self.heap.top_key() > nu {
            self.heap.replace_top(eu, nu);
        }
        false
    }
}

#[cfg(test)]
pub(crate) mod reference {
    //! Brute-force policies written from the definitions (linear scans, full histories), to
    //! test the fast ones against.

    use super::*;

    /// Replay `experts` with `admit[i]`; the hit/miss of every access.
    #[allow(clippy::too_many_arguments)]
    pub fn replay(
        kind: PolicyKind,
        experts: &[u16],
        admit: &[bool],
        top_k: usize,
        n: usize,
        cap: usize,
        order: &[u16],
        prefill: bool,
        half_life: f64,
    ) -> Vec<bool> {
        let init: Vec<u16> = if prefill {
            order[..cap.min(n)].to_vec()
        } else {
            vec![]
        };
        let mut res: Vec<u16> = init.clone();
        let mut hits = vec![];
        // For LRU/decay: last-use tick (prefill: rank ticks, best highest).
        let mut last = vec![0u64; n];
        for (r, &e) in init.iter().enumerate() {
            last[e as usize] = (init.len() - r) as u64;
        }
        let mut uses: Vec<Vec<usize>> = vec![vec![]; n];
        for (i, &e) in experts.iter().enumerate() {
            let t = i / top_k;
            uses[e as usize].push(t);
            last[e as usize] = n as u64 + 1 + i as u64;
            let hit = res.contains(&e);
            hits.push(hit);
            if hit || !admit[i] || cap == 0 {
                continue;
            }
            match kind {
                PolicyKind::Static => {
                    if order[..cap.min(n)].contains(&e) {
                        res.push(e);
                    }
                }
                PolicyKind::Lru => {
                    if res.len() == cap {
                        let v = *res.iter().min_by_key(|&&x| last[x as usize]).unwrap();
                        res.retain(|&x| x != v);
                    }
                    res.push(e);
                }
                PolicyKind::Decay => {
                    if res.len() == cap {
                        let score = |x: u16| -> f64 {
                            let mut s = 0.0;
                            for &u in &uses[x as usize] {
                                s += (u as f64 / half_life).exp2();
                            }
                            s
                        };
                        let v = *res
                            .iter()
                            .min_by(|&&a, &&b| {
                                (score(a), last[a as usize])
                                    .partial_cmp(&(score(b), last[b as usize]))
                                    .unwrap()
                            })
                            .unwrap();
                        res.retain(|&x| x != v);
                    }
                    res.push(e);
                }
                PolicyKind::Belady => {
                    let nu = |x: u16| -> usize {
                        (i + 1..experts.len())
                            .find(|&j| experts[j] == x)
                            .unwrap_or(usize::MAX)
                    };
                    if res.len() < cap {
                        res.push(e);
                    } else {
                        let v = *res.iter().max_by_key(|&&x| nu(x)).unwrap();
                        if nu(v) > nu(e) {
                            res.retain(|&x| x != v);
                            res.push(e);
                        }
                    }
                }
            }
        }
        hits
    }

    /// The fewest misses any policy (admit or bypass each miss, evict anything) can have:
    /// exhaustive search over resident sets (n ≤ 16).
    pub fn optimal_misses(experts: &[u16], n: usize, cap: usize, initial: &[u16]) -> usize {
        use std::collections::HashMap;
        let mut init = 0u32;
        for &e in initial {
            init |= 1 << e;
        }
        let mut states: HashMap<u32, usize> = HashMap::from([(init, 0)]);
        for &e in experts {
            let bit = 1u32 << e;
            let mut nextst: HashMap<u32, usize> = HashMap::new();
            let mut put = |s: u32, m: usize| {
                let v = nextst.entry(s).or_insert(usize::MAX);
                *v = (*v).min(m);
            };
            for (&s, &m) in &states {
                if s & bit != 0 {
                    put(s, m);
                    continue;
                }
                put(s, m + 1); // bypass
                if cap == 0 {
                    continue;
                }
                if (s.count_ones() as usize) < cap {
                    put(s | bit, m + 1);
                } else {
                    for v in 0..n {
                        if s & (1 << v) != 0 {
                            put((s & !(1 << v)) | bit, m + 1);
                        }
                    }
                }
            }
            states = nextst;
        }
        let _ = n;
        states.values().copied().min().unwrap_or(0)
    }
}
