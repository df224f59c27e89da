//! Print every code of the 8- and 4-bit element formats as decoded by keep's fast path, one
//! JSON object per line with the exact f32 bits, for the conformance suite to compare against
//! ml_dtypes (`cargo run -p keep-format --example dump_codes`).

fn main() {
    for (f, code, v) in keep_format::dump_all_codes() {
        println!(
            "{{\"format\":\"{}\",\"code\":{},\"bits\":{}}}",
            f.name(),
            code,
            v.to_bits()
        );
    }
}
