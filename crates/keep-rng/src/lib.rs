//! keep-rng: keep's one random generator, for synthetic checkpoints, synthetic route traces,
//! sampling and test data — so that an output a user can reproduce from a seed stays the same
//! across keep's versions and platforms.
//!
//! What it is: [`Rng`], Xoshiro256++ seeded from a `u64` through SplitMix64 ([`rng`]) — the
//! algorithm and seeding of rand 0.9's `SmallRng` on 64-bit targets, the stream `keep synth`
//! draws — and [`SplitMix64`], its seeding generator, as a stream of its own (sampled text for
//! a seed, `keep residency --make-synthetic` traces, `keep fit`'s synthetic check sets, `keep
//! bench matmul`'s synthetic weights). Both come from `rand_xoshiro`, whose algorithms are fixed by
//! their published definitions (Blackman and Vigna; Steele, Lea and Flood), unlike rand's
//! `SmallRng`/`StdRng`, which may change algorithm between versions. [`Lcg64`] is a third,
//! named stream, for the fixed synthetic prompt of `keep run --prompt-tokens N` (keep-model's
//! `generate::synthetic_prompt`), so runs of synthetic models stay comparable. [`Draw`] adds the few draws keep makes on any of them,
//! each defined here once.
//!
//! What it is not: no distributions beyond those draws (keep-convert draws its normals with
//! rand_distr over [`Rng`]), nothing cryptographic.
//!
//! Depends on: rand_core (the generator traits), rand_xoshiro.

pub use rand_core::{RngCore, SeedableRng};
pub use rand_xoshiro::{SplitMix64, Xoshiro256PlusPlus};

/// keep's generator: Xoshiro256++.
pub type Rng = Xoshiro256PlusPlus;

/// The generator for `seed`: its state is the first four outputs of SplitMix64 started at
/// `seed` (as rand 0.9's `SmallRng::seed_from_u64`).
pub fn rng(seed: u64) -> Rng {
    Xoshiro256PlusPlus::seed_from_u64(seed)
}

/// A SplitMix64 stream whose state starts at `seed` (its first output mixes `seed + φ·2⁶⁴`).
pub fn splitmix(seed: u64) -> SplitMix64 {
    SplitMix64::seed_from_u64(seed)
}

/// Knuth's 64-bit linear congruential generator (MMIX): `s ← s·6364136223846793005 +
/// 1442695040888963407 (mod 2⁶⁴)`, each output the new state. A weak generator, kept as a
/// named stream for the synthetic prompt alone (its stream defines that prompt).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lcg64 {
    state: u64,
}

impl Lcg64 {
    /// The multiplier.
    pub const A: u64 = 6364136223846793005;
    /// The increment.
    pub const C: u64 = 1442695040888963407;
}

impl RngCore for Lcg64 {
    fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_mul(Self::A).wrapping_add(Self::C);
        self.state
    }
    fn fill_bytes(&mut self, dst: &mut [u8]) {
        rand_core::impls::fill_bytes_via_next(self, dst)
    }
}

/// The [`Lcg64`] stream whose state starts at `seed` (its first output is `seed·A + C`).
pub fn lcg(seed: u64) -> Lcg64 {
    Lcg64 { state: seed }
}

/// The draws keep makes, on any generator.
pub trait Draw: RngCore {
    /// Uniform in [0, 1) with 53 random bits: `(x >> 11) · 2⁻⁵³`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` for `n < 2³²` (`n > 0`): the upper 32 bits scaled,
    /// `((x >> 32) · n) >> 32` (Lemire's multiply-shift without rejection; bias < n / 2³²).
    fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }

    /// Uniform in [-1, 1] on a grid of 10⁻⁶ (test data that prints readably).
    fn signed_unit_f32(&mut self) -> f32 {
        (self.next_u64() % 2_000_001) as f32 / 1_000_000.0 - 1.0
    }

    /// A standard normal (Box–Muller on two [`Draw::unit`]s).
    fn gauss(&mut self) -> f64 {
        let u = 1.0 - self.unit();
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    /// `n` random bytes.
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.fill_bytes(&mut b);
        b
    }
}

impl<R: RngCore + ?Sized> Draw for R {}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64 written out from its definition (Steele, Lea, Flood 2014).
    fn splitmix_ref(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Xoshiro256++ written out from its definition (Blackman, Vigna 2019).
    fn xoshiro_ref(s: &mut [u64; 4]) -> u64 {
        let out = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    #[test]
    fn the_streams_are_their_definitions() {
        for seed in [0u64, 1, 7, 0x9E37_79B9_7F4A_7C15, u64::MAX] {
            let mut st = seed;
            let mut sm = splitmix(seed);
            for _ in 0..100 {
                assert_eq!(sm.next_u64(), splitmix_ref(&mut st));
            }
            let mut st = seed;
            let mut s: [u64; 4] = std::array::from_fn(|_| splitmix_ref(&mut st));
            let mut r = rng(seed);
            for _ in 0..100 {
                assert_eq!(r.next_u64(), xoshiro_ref(&mut s));
            }
        }
    }

    #[test]
    fn the_lcg_is_its_definition() {
        let mut r = lcg(0x9E37_79B9_7F4A_7C15);
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..100 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            assert_eq!(r.next_u64(), s);
        }
        // From state 0 the first output is the increment.
        assert_eq!(lcg(0).next_u64(), 1442695040888963407);
    }

    #[test]
    fn known_values() {
        // The first SplitMix64 output from state 0 (published test vector).
        assert_eq!(splitmix(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn draws_stay_in_range() {
        let mut r = rng(3);
        for _ in 0..1000 {
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
            assert!(r.below(7) < 7);
            assert!((-1.0..=1.0).contains(&r.signed_unit_f32()));
            assert!(r.gauss().is_finite());
        }
        assert_eq!(r.bytes(13).len(), 13);
    }
}
