//! The tests' deterministic generator (xorshift64) of inputs, weight bytes and E8M0 scales.

pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A value in [-1, 1].
    pub(crate) fn f(&mut self) -> f32 {
        (self.next() % 2_000_001) as f32 / 1_000_000.0 - 1.0
    }
    pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// E8M0 scale bytes around 2^-7 .. 2^2.
    pub(crate) fn scales(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| 120 + (self.next() % 10) as u8).collect()
    }
}
