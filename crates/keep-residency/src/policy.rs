//! Hot-set policies behind one trait: static, LRU, decayed use counts, and Belady's optimum.
//! The same implementations run the simulator and keep-runtime's slot cache (Belady, which
//! needs the future, is simulator-only), so `keep residency` predicts what `keep run
//! --memory-budget` does.
//!
//! The model: one hot set of `capacity` experts per layer, replayed slot by slot (token `t`,
//! slot `j` is access `i = t·top_k + j` of the layer's stream; a token's experts are taken in
//! ascending id, the order in which the runtime serves them). An access to a resident expert
//! is a hit. A miss is read from SSD; the policy then *admits* the expert, evicting one if
//! full, or *bypasses* it (use it once, keep the set). A token's experts are chosen together
//! (the router runs before the experts), so all of them are in use while the token lasts and
//! none is evicted for another: a miss when every resident is in use is bypassed.
//! A miss that the fetch threshold drops (`admit == false`) changes no residency.
//!
//! - **static**: a fixed ranking — the warm-start ordering when the hot set starts filled with
//!   its top, else the order of first use in the stream (earliest best). Every miss is
//!   admitted; the lowest-ranked resident goes first, so the top of the ranking stays resident
//!   and the rest cycle through the remaining places (as in the runtime, where an expert can
//!   only be used from a slot).
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
//! list, static, decay and Belady heaps with position indices. The residents in use by the
//! current token are keyed out of the victim's way while the token lasts.
//!
//! Online use ([`SlotPolicy`]): a cache that keeps its own residents (keep-runtime's slots)
//! reports every use with [`SlotPolicy::touch`] and asks [`SlotPolicy::victim`] among the
//! residents it may give up; both share the scoring of `access`, and a test replays a route
//! file the runtime recorded to get the runtime's hit count exactly.

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

/// A hot-set policy. `reset` starts a stream (a layer in a session); `begin_token` announces
/// the experts of the token whose first access is `i` (they are in use together: none of them
/// is evicted while the token lasts); `access` replays access `i` (strictly increasing within
/// a stream) of expert `e` and says whether it hit.
pub trait Policy {
    fn kind(&self) -> PolicyKind;
    fn reset(&mut self, stream: &Stream, start: &Start);
    fn begin_token(&mut self, _i: usize, _experts: &[u16]) {}
    fn access(&mut self, i: usize, e: u16, admit: bool) -> bool;
}

/// A policy run beside a cache that keeps its own residents (keep-runtime's slots, one
/// [`Stream`] per layer for the whole run, `top_k` = the experts of one pass). After `reset`
/// (with `prefill` when the cache starts filled with the top of `order`), the cache reports
/// every use with `touch` (access indices strictly increasing; a pass is one "token") and asks
/// `victim` which of `candidates` — residents not in use by the current pass — gives up its
/// place. Scoring is shared with [`Policy::access`], so a cache driven this way holds what the
/// simulator's hot set holds.
pub trait SlotPolicy: Policy + Send {
    fn touch(&mut self, i: usize, e: u16);
    /// The index in `candidates` of the expert to give up (`None` when empty).
    fn victim(&self, candidates: &[u16]) -> Option<usize>;
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

/// A new online policy of `kind` (`None` for Belady, which needs the future).
pub fn make_online(kind: PolicyKind, half_life: f64) -> Option<Box<dyn SlotPolicy>> {
    match kind {
        PolicyKind::Static => Some(Box::new(StaticSet::default())),
        PolicyKind::Lru => Some(Box::new(Lru::default())),
        PolicyKind::Decay => Some(Box::new(Decay::new(half_life))),
        PolicyKind::Belady => None,
    }
}

/// The index of the smallest key among `candidates` (ties: the earlier candidate).
fn min_by_key<K: PartialOrd>(candidates: &[u16], key: impl Fn(usize) -> K) -> Option<usize> {
    let mut best: Option<(K, usize)> = None;
    for (ci, &e) in candidates.iter().enumerate() {
        let k = key(e as usize);
        if best.as_ref().is_none_or(|(bk, _)| k < *bk) {
            best = Some((k, ci));
        }
    }
    best.map(|b| b.1)
}

/// Max-heap on rank position (worst ranked at the root); in-use residents key as `-1`.
#[derive(Debug, Clone)]
struct WorstRank;
impl HeapOrder for WorstRank {
    type K = i64;
    #[inline]
    fn above(a: &i64, b: &i64) -> bool {
        a > b
    }
}

/// The in-use key of [`WorstRank`].
const IN_USE_RANK: i64 = -1;

/// The fixed ranking (see the module doc).
#[derive(Debug, Default, Clone)]
pub struct StaticSet {
    /// Rank position of each expert (lower is better); `u32::MAX` until ranked.
    rank: Vec<u32>,
    /// Experts ranked by first use so far (when there is no warm-start ordering).
    arrivals: u32,
    heap: KeyHeap<WorstRank>,
    cap: usize,
    /// Residents in use by the current token.
    pinned: Vec<u32>,
}

impl StaticSet {
    #[inline]
    fn note(&mut self, e: usize) {
        if self.rank[e] == u32::MAX {
            self.rank[e] = self.arrivals;
            self.arrivals += 1;
        }
    }
    #[inline]
    fn pin(&mut self, e: u32) {
        if self.heap.key(e) != IN_USE_RANK {
            self.heap.rekey(e, IN_USE_RANK, true);
            self.pinned.push(e);
        }
    }
}

impl Policy for StaticSet {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Static
    }
    fn reset(&mut self, s: &Stream, st: &Start) {
        self.rank.clear();
        self.rank.resize(s.n_experts, u32::MAX);
        self.arrivals = 0;
        if st.prefill {
            for (r, &e) in st.order.iter().enumerate() {
                self.rank[e as usize] = r as u32;
            }
        }
        self.heap.reset(s.n_experts);
        self.cap = st.capacity;
        self.pinned.clear();
        for &e in st.initial() {
            self.heap.push(e as u32, self.rank[e as usize] as i64);
        }
    }
    fn begin_token(&mut self, _i: usize, experts: &[u16]) {
        for p in std::mem::take(&mut self.pinned) {
            self.heap.rekey(p, self.rank[p as usize] as i64, false);
        }
        for &e in experts {
            if self.heap.contains(e as u32) {
                self.pin(e as u32);
            }
        }
    }
    #[inline]
    fn access(&mut self, _i: usize, e: u16, admit: bool) -> bool {
        let eu = e as u32;
        self.note(e as usize);
        if self.heap.contains(eu) {
            self.pin(eu);
            return true;
        }
        if !admit || self.cap == 0 {
            return false;
        }
        if self.heap.len() < self.cap {
            self.heap.push(eu, IN_USE_RANK);
        } else if self.heap.top_key() != IN_USE_RANK {
            self.heap.replace_top(eu, IN_USE_RANK);
        } else {
            return false;
        }
        self.pinned.push(eu);
        false
    }
}

impl SlotPolicy for StaticSet {
    fn touch(&mut self, _i: usize, e: u16) {
        if (e as usize) < self.rank.len() {
            self.note(e as usize);
        }
    }
    fn victim(&self, candidates: &[u16]) -> Option<usize> {
        // The worst rank: the smallest negated position.
        min_by_key(candidates, |e| {
            std::cmp::Reverse(self.rank.get(e).copied().unwrap_or(u32::MAX))
        })
    }
}

const NIL: u32 = u32::MAX;

/// Least recently used, as a doubly linked list over expert ids (head = most recent).
#[derive(Debug, Default, Clone)]
pub struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    resident: Vec<bool>,
    /// Last-use tick of each expert: prefilled ranks `1..=n` (best highest), then
    /// `tick0 + i`.
    last: Vec<u64>,
    tick0: u64,
    head: u32,
    tail: u32,
    len: usize,
    cap: usize,
    /// Whether each expert is in use by the current token, and which are.
    in_use: Vec<bool>,
    pinned: Vec<u32>,
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
    /// The least recent resident not in use by the current token.
    #[inline]
    fn victim_slot(&self) -> u32 {
        let mut v = self.tail;
        while v != NIL && self.in_use[v as usize] {
            v = self.prev[v as usize];
        }
        v
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
        self.last.clear();
        self.last.resize(n, 0);
        self.tick0 = n as u64 + 1;
        self.head = NIL;
        self.tail = NIL;
        self.len = 0;
        self.cap = st.capacity;
        self.in_use.clear();
        self.in_use.resize(n, false);
        self.pinned.clear();
        let init = st.initial();
        for (r, &e) in init.iter().enumerate() {
            // Best first = most recent first.
            self.push_back(e as u32);
            self.resident[e as usize] = true;
            self.last[e as usize] = (init.len() - r) as u64;
            self.len += 1;
        }
    }
    fn begin_token(&mut self, _i: usize, experts: &[u16]) {
        for p in std::mem::take(&mut self.pinned) {
            self.in_use[p as usize] = false;
        }
        for &e in experts {
            let eu = e as usize;
            if self.resident[eu] && !self.in_use[eu] {
                self.in_use[eu] = true;
                self.pinned.push(e as u32);
            }
        }
    }
    #[inline]
    fn access(&mut self, i: usize, e: u16, admit: bool) -> bool {
        let e = e as u32;
        if self.resident[e as usize] {
            self.last[e as usize] = self.tick0 + i as u64;
            if self.head != e {
                self.unlink(e);
                self.push_front(e);
            }
            return true;
        }
        if !admit || self.cap == 0 {
            self.last[e as usize] = self.tick0 + i as u64;
            return false;
        }
        if self.len == self.cap {
            let victim = self.victim_slot();
            if victim == NIL {
                // Every resident is in use by this token: bypass.
                self.last[e as usize] = self.tick0 + i as u64;
                return false;
            }
            self.unlink(victim);
            self.resident[victim as usize] = false;
        } else {
            self.len += 1;
        }
        self.last[e as usize] = self.tick0 + i as u64;
        self.push_front(e);
        self.resident[e as usize] = true;
        self.in_use[e as usize] = true;
        self.pinned.push(e);
        false
    }
}

impl SlotPolicy for Lru {
    fn touch(&mut self, i: usize, e: u16) {
        if let Some(t) = self.last.get_mut(e as usize) {
            *t = self.tick0 + i as u64;
        }
    }
    fn victim(&self, candidates: &[u16]) -> Option<usize> {
        min_by_key(candidates, |e| self.last.get(e).copied().unwrap_or(0))
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
    /// The key of resident `e`.
    #[inline]
    fn key(&self, e: u32) -> O::K {
        self.heap[self.pos[e as usize] as usize].0
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

/// Min-heap on (score, last-use tick); in-use residents key as an infinite score.
#[derive(Debug, Clone)]
struct LowestScore;
impl HeapOrder for LowestScore {
    type K = (f64, u64);
    #[inline]
    fn above(a: &(f64, u64), b: &(f64, u64)) -> bool {
        a.0 < b.0 || (a.0 == b.0 && a.1 < b.1)
    }
}

/// Default half-life of [`Decay`], in tokens. Decoding, one token is one forward pass of each
/// layer, so this is also keep-runtime's `--policy decay` default: `keep residency` predicts
/// the `keep run --memory-budget` that runs with the defaults.
pub const DEFAULT_HALF_LIFE: f64 = 32.0;

/// Decayed use counts with a half-life in tokens.
#[derive(Debug, Clone)]
pub struct Decay {
    half_life: f64,
    /// Scaled decayed count of every expert (resident or not).
    score: Vec<f64>,
    /// Last-use tick of every expert (prefilled ranks `1..=n`, best highest, then
    /// `tick0 + i`).
    tick: Vec<u64>,
    heap: KeyHeap<LowestScore>,
    cap: usize,
    top_k: usize,
    /// Residents in use by the current token.
    pinned: Vec<u32>,
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
            tick: vec![],
            heap: KeyHeap::default(),
            cap: 0,
            top_k: 1,
            pinned: vec![],
            tok_end: 0,
            inc: 1.0,
            base: 0.0,
            tick0: 0,
        }
    }
    /// The increment of access `i`.
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
    /// Count a use of `e` at access `i`.
    #[inline]
    fn note(&mut self, i: usize, e: usize) {
        let inc = self.increment(i);
        self.score[e] += inc;
        self.tick[e] = self.tick0 + i as u64;
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
        self.tick.clear();
        self.tick.resize(n, 0);
        self.heap.reset(n);
        self.cap = st.capacity;
        self.top_k = s.top_k.max(1);
        self.pinned.clear();
        self.tok_end = 0;
        self.base = 0.0;
        self.tick0 = n as u64 + 1;
        let init = st.initial();
        for (r, &e) in init.iter().enumerate() {
            self.tick[e as usize] = (init.len() - r) as u64;
            self.heap.push(e as u32, (0.0, self.tick[e as usize]));
        }
    }
    fn begin_token(&mut self, _i: usize, experts: &[u16]) {
        for p in std::mem::take(&mut self.pinned) {
            let k = (self.score[p as usize], self.tick[p as usize]);
            self.heap.rekey(p, k, false);
        }
        for &e in experts {
            let eu = e as u32;
            if self.heap.contains(eu) && self.heap.key(eu).0 != f64::INFINITY {
                self.heap
                    .rekey(eu, (f64::INFINITY, self.tick[e as usize]), true);
                self.pinned.push(eu);
            }
        }
    }
    #[inline]
    fn access(&mut self, i: usize, e: u16, admit: bool) -> bool {
        self.note(i, e as usize);
        let eu = e as u32;
        let in_use = (f64::INFINITY, self.tick[e as usize]);
        if self.heap.contains(eu) {
            // In use since the token began; its tick only grew.
            self.heap.rekey(eu, in_use, true);
            return true;
        }
        if !admit || self.cap == 0 {
            return false;
        }
        if self.heap.len() < self.cap {
            self.heap.push(eu, in_use);
        } else if self.heap.top_key().0 != f64::INFINITY {
            self.heap.replace_top(eu, in_use);
        } else {
            return false;
        }
        self.pinned.push(eu);
        false
    }
}

impl SlotPolicy for Decay {
    fn touch(&mut self, i: usize, e: u16) {
        if (e as usize) < self.score.len() {
            self.note(i, e as usize);
        }
    }
    fn victim(&self, candidates: &[u16]) -> Option<usize> {
        min_by_key(candidates, |e| {
            (
                self.score.get(e).copied().unwrap_or(0.0),
                self.tick.get(e).copied().unwrap_or(0),
            )
        })
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
        // Static's ranking: the order's positions when prefilled, else first use.
        let mut rank: Vec<usize> = vec![usize::MAX; n];
        if prefill {
            for (r, &e) in order.iter().enumerate() {
                rank[e as usize] = r;
            }
        }
        let mut arrivals = 0;
        for (i, &e) in experts.iter().enumerate() {
            let t = i / top_k;
            uses[e as usize].push(t);
            last[e as usize] = n as u64 + 1 + i as u64;
            if rank[e as usize] == usize::MAX {
                rank[e as usize] = arrivals;
                arrivals += 1;
            }
            let hit = res.contains(&e);
            hits.push(hit);
            if hit || !admit[i] || cap == 0 {
                continue;
            }
            // Residents the current token does not use may leave.
            let token = &experts[t * top_k..((t + 1) * top_k).min(experts.len())];
            let free: Vec<u16> = res.iter().copied().filter(|x| !token.contains(x)).collect();
            match kind {
                PolicyKind::Static => {
                    if res.len() == cap {
                        let Some(&v) = free.iter().max_by_key(|&&x| rank[x as usize]) else {
                            continue;
                        };
                        res.retain(|&x| x != v);
                    }
                    res.push(e);
                }
                PolicyKind::Lru => {
                    if res.len() == cap {
                        let Some(&v) = free.iter().min_by_key(|&&x| last[x as usize]) else {
                            continue;
                        };
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
                        let Some(&v) = free.iter().min_by(|&&a, &&b| {
                            (score(a), last[a as usize])
                                .partial_cmp(&(score(b), last[b as usize]))
                                .unwrap()
                        }) else {
                            continue;
                        };
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
