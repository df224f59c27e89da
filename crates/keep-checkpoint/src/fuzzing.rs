//! Entry points shared by the `cargo fuzz` targets (in `fuzz/`) and the test that replays their
//! committed corpus: each feeds arbitrary bytes to a parser and must return, never panic.

use std::path::Path;

/// Run the parser named `target` (`"header"`, `"index"` or `"config"`) on `data`.
pub fn run(target: &str, data: &[u8]) {
    let p = Path::new("fuzz-input");
    match target {
        "header" => {
            if data.len() >= 8 {
                let n = u64::from_le_bytes(data[..8].try_into().expect("8 bytes")) as usize;
                let rest = &data[8..];
                let n = n.min(rest.len());
                let (json, body) = rest.split_at(n);
                let _ = crate::safetensors::parse_header(p, json, 8 + n as u64, body.len() as u64);
            } else {
                let _ = crate::safetensors::parse_header(p, data, 8, 0);
            }
        }
        "index" => {
            if let Ok(s) = std::str::from_utf8(data) {
                let _ = crate::index::Index::parse(p, s);
            }
        }
        "config" => {
            if let Ok(s) = std::str::from_utf8(data) {
                let _ = crate::config::DeepSeekConfig::from_json(p, s);
            }
        }
        _ => {}
    }
}
