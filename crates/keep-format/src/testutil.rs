//! Test-only helpers shared by the unit tests of every format module.
//!
//! What it is: bit-exact float comparison (NaN equals NaN, -0 differs from +0)
//! and a brute-force "is this the nearest code, ties to even" check. What it is
//! not: part of the library (compiled only under `cfg(test)`). Depends on nothing.

/// Equal as the tests mean it: both NaN, or identical bits (so `-0.0 != +0.0`).
pub fn same(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

/// Assert that `code` decodes (via `table`, the format's finite codes) to a value
/// nearest to `x`; where two distinct values are equally near, the code must be
/// even (ties to even); and the sign of the result matches the sign of `x`.
pub fn assert_nearest(x: f32, code: u8, table: &[(u8, f32)]) {
    let r = match table.iter().find(|(c, _)| *c == code) {
        Some(&(_, v)) => v,
        None => panic!("x={x:e}: code {code:#04x} is not a finite code"),
    };
    let d = (x as f64 - r as f64).abs();
    for &(c, v) in table {
        let dv = (x as f64 - v as f64).abs();
        assert!(
            d <= dv,
            "x={x:e}: got code {code:#04x} = {r:e}, but {c:#04x} = {v:e} is nearer"
        );
        if dv == d && v != r {
            assert_eq!(
                code & 1,
                0,
                "x={x:e}: tie between {r:e} and {v:e} must go to the even code"
            );
        }
    }
    assert_eq!(
        r.is_sign_negative(),
        x.is_sign_negative(),
        "x={x:e}: sign lost (code {code:#04x})"
    );
}
