//! The tests' generator of inputs, weight bytes and E8M0 scales: keep-rng's, with the draws
//! these tests use.

use keep_rng::{Draw, RngCore};

pub(crate) struct Rng(keep_rng::Rng);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(keep_rng::rng(seed))
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// A value in [-1, 1].
    pub(crate) fn f(&mut self) -> f32 {
        self.0.signed_unit_f32()
    }
    pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
        self.0.bytes(n)
    }
    /// E8M0 scale bytes around 2^-7 .. 2^2.
    pub(crate) fn scales(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| 120 + (self.next() % 10) as u8).collect()
    }
}
