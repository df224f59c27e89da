//! No file-level import loop inside any crate: within each crate's `src`, the graph of modules
//! (one per file; `foo/mod.rs` is `foo`) with an edge wherever a file names another module
//! through a `crate::…` or `super::…` path has no cycle, so each crate's modules read one way,
//! bottom to top.
//!
//! A path names the deepest module it spells out (`crate::simd::Src` names `simd`); edges
//! between a module and its own parent or children do not count (a module and its submodules
//! are one unit). Comment lines (starting with `//`, doc comments included) and everything
//! from the first `#[cfg(test)] mod name {` of a file on (inline unit tests) are ignored, as
//! are files named `tests.rs` (out-of-line unit tests): tests may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Loops allowed to remain until they are taken apart (none today): crate `src` folder
/// (relative to the workspace root), the modules of the strongly connected component, and why
/// it is still there. A component of that crate made only of those modules passes; any other
/// component (a new loop, or one that grew) fails.
const KNOWN_LOOPS: &[(&str, &[&str], &str)] = &[];

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `a/b/mod.rs` → `a::b`; `lib.rs`, `main.rs` → the crate root (the empty name).
fn module_name(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("file under src");
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts.join("::")
}

/// The file's text without its inline test module (from the first `#[cfg(test)] mod x {` on)
/// and without comment lines.
fn code_of(text: &str) -> String {
    let mut cut = text.len();
    let mut from = 0;
    while let Some(i) = text[from..].find("#[cfg(test)]") {
        let at = from + i;
        let rest = text[at + "#[cfg(test)]".len()..].trim_start();
        let rest = rest.strip_prefix("pub").map_or(rest, str::trim_start);
        if let Some(r) = rest.strip_prefix("mod ") {
            let r = r.trim_start();
            let name_len = r
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(r.len());
            if name_len > 0 && r[name_len..].trim_start().starts_with('{') {
                cut = at;
                break;
            }
        }
        from = at + 1;
    }
    text[..cut]
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_seg(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_'
}

/// Every `kw::a::b::c` path in `code` (segments of lowercase letters, digits and `_`), as its
/// segments. `word_start`: the keyword must not follow an identifier character.
fn paths_after(code: &str, kw: &str, word_start: bool) -> Vec<Vec<String>> {
    let b = code.as_bytes();
    let mut out = vec![];
    let mut from = 0;
    while let Some(i) = code[from..].find(kw) {
        let at = from + i;
        from = at + 1;
        if word_start && at > 0 && (b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_') {
            continue;
        }
        let mut p = at + kw.len();
        let mut segs = vec![];
        loop {
            let s = p;
            while p < b.len() && is_seg(b[p]) {
                p += 1;
            }
            if p == s {
                break;
            }
            segs.push(code[s..p].to_string());
            if code[p..].starts_with("::") && p + 2 < b.len() && is_seg(b[p + 2]) {
                p += 2;
            } else {
                break;
            }
        }
        if !segs.is_empty() {
            out.push(segs);
        }
    }
    out
}

/// The module graph of one crate's `src`.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = vec![];
    rs_files(src, &mut files);
    files.retain(|f| !f.to_string_lossy().ends_with("tests.rs"));
    let mut code: BTreeMap<String, String> = BTreeMap::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("readable source");
        let e = code.entry(module_name(src, f)).or_default();
        e.push_str(&code_of(&text));
        e.push('\n');
    }
    let mut g = BTreeMap::new();
    for (m, c) in &code {
        let base: Vec<String> = if m.is_empty() {
            vec![]
        } else {
            m.split("::").map(String::from).collect()
        };
        let mut refs = paths_after(c, "crate::", false);
        for p in paths_after(c, "super::", true) {
            let mut full = base[..base.len().saturating_sub(1)].to_vec();
            full.extend(p);
            refs.push(full);
        }
        let mut edges = BTreeSet::new();
        for parts in refs {
            for k in (1..=parts.len()).rev() {
                let cand = parts[..k].join("::");
                if code.contains_key(&cand) {
                    let related = cand == *m
                        || m.starts_with(&format!("{cand}::"))
                        || cand.starts_with(&format!("{m}::"));
                    if !related {
                        edges.insert(cand);
                    }
                    break;
                }
            }
        }
        g.insert(m.clone(), edges);
    }
    g
}

/// Strongly connected components with more than one module (Tarjan).
fn loops(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        idx: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.idx.len();
        t.idx.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in &t.g[v] {
            let w = w.as_str();
            if !t.idx.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.idx[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.idx[v] {
            let mut comp = BTreeSet::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        idx: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: vec![],
        on: BTreeSet::new(),
        out: vec![],
    };
    for v in g.keys() {
        if !t.idx.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_crate_has_a_module_import_loop() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut srcs: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .expect("crates/")
        .flatten()
        .map(|e| e.path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    srcs.sort();
    assert!(srcs.len() > 5, "found only {} crates", srcs.len());
    let mut bad = vec![];
    for src in &srcs {
        let rel = format!(
            "crates/{}/src",
            src.parent()
                .and_then(Path::file_name)
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        );
        let g = module_graph(src);
        for comp in loops(&g) {
            let known = KNOWN_LOOPS.iter().any(|(c, mods, _why)| {
                *c == rel && comp.iter().all(|m| mods.contains(&m.as_str()))
            });
            if !known {
                let detail: Vec<String> = comp
                    .iter()
                    .map(|m| {
                        let to: Vec<&str> = g[m]
                            .iter()
                            .filter(|w| comp.contains(*w))
                            .map(String::as_str)
                            .collect();
                        format!("{m} -> {to:?}")
                    })
                    .collect();
                bad.push(format!("{rel}: {comp:?}\n    {}", detail.join("\n    ")));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "module import loops (break each by moving what the lower module needs below it):\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_loop_finder_sees_a_loop() {
    let dir = std::env::temp_dir().join(format!("keep-module-loops-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("b")).unwrap();
    std::fs::write(src.join("lib.rs"), "//! root\npub mod a;\npub mod b;\n").unwrap();
    std::fs::write(
        src.join("a.rs"),
        "//! a\nuse crate::b::inner::X;\nuse crate::c::V;\n",
    )
    .unwrap();
    std::fs::write(src.join("b/mod.rs"), "//! b\npub mod inner;\n").unwrap();
    std::fs::write(
        src.join("b/inner.rs"),
        "//! inner\n// crate::c is a comment\nuse crate::a::Y;\nuse super::Sibling;\n\
         #[cfg(test)]\nmod tests {\n    use crate::c::Z;\n}\n",
    )
    .unwrap();
    std::fs::write(src.join("c.rs"), "//! c\nuse super::a::W;\n").unwrap();
    let g = module_graph(&src);
    let found = loops(&g);
    std::fs::remove_dir_all(&dir).ok();
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(g["b::inner"], set(&["a"]));
    assert_eq!(g["c"], set(&["a"]));
    assert_eq!(found, vec![set(&["a", "b::inner", "c"])]);
}
