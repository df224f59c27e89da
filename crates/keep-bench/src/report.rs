//! Tables rendered from evidence: the measured numbers of a Markdown document (`docs/results.md`)
//! come from the JSON evidence files it cites, never from typing.
//!
//! A rendered table is an HTML comment holding its template, followed at once by the table:
//!
//! ```text
//! <!-- table
//! @k = dev/evidence/killtest-quick-quiet-memory-bandwidth.json
//! | test | GB/s |
//! |---|---|
//! | read bandwidth | {k/gbps|.1f} |
//! {for r in k/rows if /verdict == "PASS"}| {r/test} | {= r/gbps / k/gbps |.2f}× |
//! -->
//! | test | GB/s |
//! |---|---|
//! | read bandwidth | 21.2 |
//! ```
//!
//! - `@NAME = PATH` binds a file (relative to the repository root) to a name; `.jsonl` files
//!   read as an array of their lines.
//! - `{NAME/POINTER|FORMAT}` is a value: `POINTER` is an RFC 6901 JSON pointer into the file
//!   (or into a row bound by `for`); a missing value is an error, not a blank, unless the
//!   pointer ends in `?` (`{NAME/POINTER?|FORMAT}`), which renders a missing value as `—`.
//! - `{= EXPR |FORMAT}` computes with `+ - * /`, parentheses, numbers, values and
//!   `sum(NAME/POINTER)` (the sum of an array of numbers).
//! - A template line that starts with `{for ROW in NAME/POINTER}` repeats the rest of the line
//!   for every element of that array (or every value of that object, its key as `{ROW@key}`;
//!   a pointer segment `@i` stands for the element's position, to read parallel arrays),
//!   optionally only those where `if /POINTER == "text"` (or `!=`, or a number) holds
//!   (several conditions joined by ` and `).
//! - Formats: none (the JSON value as written; `null` as `—`), `.Nf` fixed, `,.Nf` with
//!   thousands separators, `.Ne` scientific (`1.14e-4`), `.N%` percent, `.Ns` N significant
//!   digits, `gib.N` / `mib.N` / `gb.N` bytes in GiB / MiB / GB, `esc` text with newlines as
//!   `\n` and `|` escaped (for a table cell).
//!
//! [`check`] compares every rendered table with what its evidence renders; [`render`] rewrites
//! them. What it is not: a place for numbers — nothing here holds a measurement.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What went wrong rendering a document's tables.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{doc}:{line}: {msg}")]
    Template {
        doc: String,
        line: usize,
        msg: String,
    },
}

/// One rendered table that differs from its evidence.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// 1-based line of the table's first row in the document.
    pub line: usize,
    /// The table as the document holds it.
    pub document: Vec<String>,
    /// The table as its evidence renders it.
    pub rendered: Vec<String>,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "table at line {} differs from its evidence:", self.line)?;
        let n = self.document.len().max(self.rendered.len());
        for i in 0..n {
            let d = self.document.get(i).map(String::as_str);
            let r = self.rendered.get(i).map(String::as_str);
            if d != r {
                writeln!(f, "  document: {}", d.unwrap_or("(no line)"))?;
                writeln!(f, "  evidence: {}", r.unwrap_or("(no line)"))?;
            }
        }
        Ok(())
    }
}

/// A parsed document: its lines, and where each rendered table's template and table lie.
struct Block {
    /// Index of the `<!-- table` line.
    open: usize,
    /// Index of the `-->` line.
    close: usize,
    /// Index range of the table lines after `close`.
    table: std::ops::Range<usize>,
}

fn blocks(doc: &str, lines: &[&str]) -> Result<Vec<Block>, ReportError> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim_end() == "<!-- table" {
            let open = i;
            let close = (open + 1..lines.len())
                .find(|&j| lines[j].trim_end() == "-->")
                .ok_or_else(|| ReportError::Template {
                    doc: doc.to_string(),
                    line: open + 1,
                    msg: "a `<!-- table` template is never closed by `-->`".into(),
                })?;
            let mut end = close + 1;
            while end < lines.len() && lines[end].starts_with('|') {
                end += 1;
            }
            out.push(Block {
                open,
                close,
                table: close + 1..end,
            });
            i = end;
        } else {
            i += 1;
        }
    }
    Ok(out)
}

/// Render every table of the document at `doc_path`, reading evidence relative to `root`;
/// returns the document with its tables replaced and the tables that differed.
pub fn render(doc_path: &Path, root: &Path) -> Result<(String, Vec<Mismatch>), ReportError> {
    let text = std::fs::read_to_string(doc_path).map_err(|err| ReportError::Io {
        path: doc_path.to_path_buf(),
        err,
    })?;
    render_text(&doc_path.display().to_string(), &text, root)
}

/// [`render`] on a document's text (`doc` names it in errors).
pub fn render_text(
    doc: &str,
    text: &str,
    root: &Path,
) -> Result<(String, Vec<Mismatch>), ReportError> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out: Vec<String> = Vec::with_capacity(lines.len());
    let mut mismatches = Vec::new();
    let mut next = 0;
    for b in blocks(doc, &lines)? {
        out.extend(lines[next..=b.close].iter().map(|s| s.to_string()));
        let rendered = render_block(doc, &lines, &b, root)?;
        let document: Vec<String> = lines[b.table.clone()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        if document != rendered {
            mismatches.push(Mismatch {
                line: b.table.start + 1,
                document,
                rendered: rendered.clone(),
            });
        }
        out.extend(rendered);
        next = b.table.end;
    }
    out.extend(lines[next..].iter().map(|s| s.to_string()));
    let mut s = out.join("\n");
    if text.ends_with('\n') {
        s.push('\n');
    }
    Ok((s, mismatches))
}

/// The evidence files a document's tables cite (paths as written, relative to the root).
pub fn cited_files(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let Ok(bs) = blocks("", &lines) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for b in bs {
        for l in &lines[b.open + 1..b.close] {
            if let Some((_, path)) = binding(l) {
                out.push(path.to_string());
            }
        }
    }
    out
}

fn binding(line: &str) -> Option<(&str, &str)> {
    let rest = line.trim().strip_prefix('@')?;
    let (name, path) = rest.split_once('=')?;
    Some((name.trim(), path.trim()))
}

fn render_block(
    doc: &str,
    lines: &[&str],
    b: &Block,
    root: &Path,
) -> Result<Vec<String>, ReportError> {
    let err = |line: usize, msg: String| ReportError::Template {
        doc: doc.to_string(),
        line: line + 1,
        msg,
    };
    let mut files: BTreeMap<String, Value> = BTreeMap::new();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate().take(b.close).skip(b.open + 1) {
        if let Some((name, path)) = binding(line) {
            let v = load(&root.join(path)).map_err(|m| err(i, m))?;
            files.insert(name.to_string(), v);
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        let scope = Scope {
            files: &files,
            row: None,
            index: None,
        };
        if let Some(rest) = line.strip_prefix("{for ") {
            let (head, row_tpl) = rest
                .split_once('}')
                .ok_or_else(|| err(i, "`{for` without its closing `}`".into()))?;
            let (var, source, filter) = parse_for(head).map_err(|m| err(i, m))?;
            let items = scope.lookup(source).map_err(|m| err(i, m))?;
            let entries: Vec<(Option<String>, &Value)> = match items {
                Value::Array(a) => a.iter().map(|v| (None, v)).collect(),
                Value::Object(o) => o.iter().map(|(k, v)| (Some(k.clone()), v)).collect(),
                other => return Err(err(i, format!("`{source}` is not an array: {other}"))),
            };
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if let Some(f) = &filter {
                    if !f.holds(item).map_err(|m| err(i, m))? {
                        continue;
                    }
                }
                let row_scope = Scope {
                    files: &files,
                    row: Some((var, item, key.as_deref())),
                    index: Some(i),
                };
                out.push(fill(row_tpl, &row_scope).map_err(|m| err(i, m))?);
            }
        } else {
            out.push(fill(line, &scope).map_err(|m| err(i, m))?);
        }
    }
    Ok(out)
}

fn load(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if path.extension().is_some_and(|e| e == "jsonl") {
        let rows: Result<Vec<Value>, _> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(serde_json::from_str)
            .collect();
        rows.map(Value::Array)
            .map_err(|e| format!("{}: {e}", path.display()))
    } else {
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// The conditions of a `for … if` line, all of which must hold.
struct Filter(Vec<Condition>);

struct Condition {
    pointer: String,
    negate: bool,
    want: Value,
}

impl Filter {
    fn holds(&self, item: &Value) -> Result<bool, String> {
        Ok(self.0.iter().all(|c| {
            let v = item.pointer(&c.pointer).unwrap_or(&Value::Null);
            let eq = match (&c.want, v) {
                (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
                (a, b) => a == b,
            };
            eq != c.negate
        }))
    }
}

fn parse_for(head: &str) -> Result<(&str, &str, Option<Filter>), String> {
    let (cond_part, filter) = match head.split_once(" if ") {
        Some((h, cond)) => (h, Some(cond.trim())),
        None => (head, None),
    };
    let mut words = cond_part.split_whitespace();
    let (Some(var), Some("in"), Some(source), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Err(format!(
            "`{{for {head}}}`: expected `{{for ROW in NAME/POINTER}}`"
        ));
    };
    let filter = match filter {
        None => None,
        Some(all) => {
            let mut conds = Vec::new();
            for c in all.split(" and ") {
                let (lhs, negate, rhs) = if let Some((l, r)) = c.split_once("!=") {
                    (l, true, r)
                } else if let Some((l, r)) = c.split_once("==") {
                    (l, false, r)
                } else {
                    return Err(format!("filter `{c}`: expected `/POINTER == VALUE`"));
                };
                let want: Value = serde_json::from_str(rhs.trim())
                    .map_err(|e| format!("filter `{c}`: the value is not JSON ({e})"))?;
                conds.push(Condition {
                    pointer: lhs.trim().to_string(),
                    negate,
                    want,
                });
            }
            Some(Filter(conds))
        }
    };
    Ok((var, source, filter))
}

struct Scope<'a> {
    files: &'a BTreeMap<String, Value>,
    /// The row variable of a `for` line: its name, its value, and its key in an object.
    row: Option<(&'a str, &'a Value, Option<&'a str>)>,
    /// The row's position in what the `for` line walks (`@i` in a pointer).
    index: Option<usize>,
}

impl Scope<'_> {
    fn lookup(&self, r: &str) -> Result<&Value, String> {
        let r = r.trim();
        let (name, pointer) = match r.find('/') {
            Some(i) => (&r[..i], &r[i..]),
            None => (r, ""),
        };
        let root = match self.row {
            Some((var, v, _)) if var == name => v,
            _ => self
                .files
                .get(name)
                .ok_or_else(|| format!("`{name}` names no file bound with `@{name} = …`"))?,
        };
        let pointer = match self.index {
            Some(i) if pointer.contains("/@i") => {
                let mut p = pointer.replace("/@i/", &format!("/{i}/"));
                if p.ends_with("/@i") {
                    p.truncate(p.len() - 3);
                    p += &format!("/{i}");
                }
                std::borrow::Cow::Owned(p)
            }
            _ => std::borrow::Cow::Borrowed(pointer),
        };
        root.pointer(&pointer)
            .ok_or_else(|| format!("`{r}`: no such value in the evidence"))
    }

    fn key(&self, r: &str) -> Option<&str> {
        let (name, what) = r.trim().split_once('@')?;
        match self.row {
            Some((var, _, key)) if var == name && what == "key" => key,
            _ => None,
        }
    }
}

/// Replace every `{…}` of a template line with its value.
fn fill(tpl: &str, scope: &Scope) -> Result<String, String> {
    let mut out = String::with_capacity(tpl.len());
    let mut rest = tpl;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("`{{` without `}}` in `{tpl}`"))?;
        out.push_str(&cell(&after[..end], scope)?);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn cell(spec: &str, scope: &Scope) -> Result<String, String> {
    let (expr, fmt) = match spec.rsplit_once('|') {
        Some((e, f)) => (e, f.trim()),
        None => (spec, ""),
    };
    if let Some(k) = scope.key(expr) {
        return Ok(k.to_string());
    }
    let v = if let Some(e) = expr.trim_start().strip_prefix('=') {
        Value::from(eval(e, scope)?)
    } else if let Some(optional) = expr.trim_end().strip_suffix('?') {
        match scope.lookup(optional) {
            Ok(v) => v.clone(),
            Err(_) => return Ok("—".to_string()),
        }
    } else {
        scope.lookup(expr)?.clone()
    };
    format(&v, fmt).map_err(|m| format!("`{{{spec}}}`: {m}"))
}

/// Format one value.
pub fn format(v: &Value, fmt: &str) -> Result<String, String> {
    if fmt == "esc" {
        let s = match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        return Ok(s
            .replace('\\', "\\\\")
            .replace('\n', "\\n")
            .replace('|', "\\|"));
    }
    if fmt.is_empty() {
        return Ok(match v {
            Value::Null => "—".to_string(),
            Value::String(s) => s.clone(),
            other => other.to_string(),
        });
    }
    let x = match v {
        Value::Number(n) => n.as_f64().ok_or("not a finite number")?,
        other => {
            return Err(format!(
                "format `{fmt}` needs a number, the value is {other}"
            ))
        }
    };
    let digits = |s: &str| -> Result<usize, String> {
        s.parse::<usize>()
            .map_err(|_| format!("unknown format `{fmt}`"))
    };
    if let Some(unit) = ["gib.", "mib.", "gb."]
        .iter()
        .find(|u| fmt.starts_with(**u))
    {
        let d = digits(&fmt[unit.len()..])?;
        let div = match *unit {
            "gib." => (1u64 << 30) as f64,
            "mib." => (1u64 << 20) as f64,
            _ => 1e9,
        };
        return Ok(format!("{:.*}", d, x / div));
    }
    let (sep, body) = match fmt.strip_prefix(',') {
        Some(b) => (true, b),
        None => (false, fmt),
    };
    if sep && body.is_empty() {
        return Ok(thousands(&format!("{:.0}", x)));
    }
    let body = body
        .strip_prefix('.')
        .ok_or_else(|| format!("unknown format `{fmt}`"))?;
    let (n, kind) = body.split_at(body.len().saturating_sub(1));
    let d = digits(n)?;
    let s = match kind {
        "f" => format!("{:.*}", d, x),
        "%" => format!("{:.*}%", d, x * 100.0),
        "e" => format!("{:.*e}", d, x),
        "s" => significant(x, d),
        _ => return Err(format!("unknown format `{fmt}`")),
    };
    Ok(if sep { thousands(&s) } else { s })
}

/// `x` with `d` significant digits, in fixed notation.
fn significant(x: f64, d: usize) -> String {
    if x == 0.0 || d == 0 {
        return format!("{:.*}", d.saturating_sub(1), 0.0);
    }
    let mag = x.abs().log10().floor() as i32;
    let decimals = (d as i32 - 1 - mag).max(0) as usize;
    // Rounding can carry into a new digit (9.96 → 10.0): recompute from the rounded value.
    let rounded: f64 = format!("{:.*}", decimals, x).parse().unwrap_or(x);
    let mag2 = if rounded == 0.0 {
        mag
    } else {
        rounded.abs().log10().floor() as i32
    };
    let places = d as i32 - 1 - mag2;
    if places >= 0 {
        format!("{:.*}", places as usize, x)
    } else {
        let unit = 10f64.powi(-places);
        format!("{:.0}", (x / unit).round() * unit)
    }
}

fn thousands(s: &str) -> String {
    let (sign, rest) = match s.strip_prefix('-') {
        Some(r) => ("-", r),
        None => ("", s),
    };
    let (int, frac) = match rest.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (rest, None),
    };
    let mut grouped = String::new();
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(c);
    }
    match frac {
        Some(f) => format!("{sign}{grouped}.{f}"),
        None => format!("{sign}{grouped}"),
    }
}

/// Evaluate `+ - * /` over numbers and values (the usual precedence, parentheses).
fn eval(src: &str, scope: &Scope) -> Result<f64, String> {
    let toks = tokens(src)?;
    let mut p = Parser {
        toks: &toks,
        i: 0,
        scope,
    };
    let v = p.sum()?;
    if p.i != toks.len() {
        return Err(format!("`{src}`: unexpected `{:?}`", toks[p.i]));
    }
    Ok(v)
}

#[derive(Debug)]
enum Tok {
    Num(f64),
    Ref(String),
    Op(char),
}

fn tokens(src: &str) -> Result<Vec<Tok>, String> {
    let mut out = Vec::new();
    let cs: Vec<char> = src.chars().collect();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c.is_whitespace() {
            i += 1;
        } else if "+-*()".contains(c) || (c == '/' && is_op_slash(&cs, i)) {
            out.push(Tok::Op(c));
            i += 1;
        } else {
            let start = i;
            while i < cs.len() && !cs[i].is_whitespace() && !"()*+".contains(cs[i]) {
                i += 1;
            }
            let w: String = cs[start..i].iter().collect();
            match w.parse::<f64>() {
                Ok(x) => out.push(Tok::Num(x)),
                Err(_) => out.push(Tok::Ref(w)),
            }
        }
    }
    Ok(out)
}

/// A `/` is division when surrounded by spaces (inside a value it separates pointer parts).
fn is_op_slash(cs: &[char], i: usize) -> bool {
    let before = i == 0 || cs[i - 1].is_whitespace();
    let after = i + 1 >= cs.len() || cs[i + 1].is_whitespace();
    before && after
}

struct Parser<'a> {
    toks: &'a [Tok],
    i: usize,
    scope: &'a Scope<'a>,
}

impl Parser<'_> {
    fn sum(&mut self) -> Result<f64, String> {
        let mut v = self.product()?;
        while let Some(Tok::Op(c @ ('+' | '-'))) = self.toks.get(self.i) {
            self.i += 1;
            let r = self.product()?;
            v = if *c == '+' { v + r } else { v - r };
        }
        Ok(v)
    }

    fn product(&mut self) -> Result<f64, String> {
        let mut v = self.atom()?;
        while let Some(Tok::Op(c @ ('*' | '/'))) = self.toks.get(self.i) {
            self.i += 1;
            let r = self.atom()?;
            v = if *c == '*' { v * r } else { v / r };
        }
        Ok(v)
    }

    fn atom(&mut self) -> Result<f64, String> {
        let t = self.toks.get(self.i).ok_or("expression ends early")?;
        self.i += 1;
        match t {
            Tok::Num(x) => Ok(*x),
            Tok::Op('-') => Ok(-self.atom()?),
            Tok::Op('(') => {
                let v = self.sum()?;
                match self.toks.get(self.i) {
                    Some(Tok::Op(')')) => {
                        self.i += 1;
                        Ok(v)
                    }
                    _ => Err("`(` without `)`".into()),
                }
            }
            Tok::Ref(f) if f == "sum" => {
                let (Some(Tok::Op('(')), Some(Tok::Ref(r)), Some(Tok::Op(')'))) = (
                    self.toks.get(self.i),
                    self.toks.get(self.i + 1),
                    self.toks.get(self.i + 2),
                ) else {
                    return Err("expected `sum(NAME/POINTER)`".into());
                };
                self.i += 3;
                let a = self.scope.lookup(r)?;
                let a = a
                    .as_array()
                    .ok_or_else(|| format!("`{r}` is not an array"))?;
                a.iter()
                    .map(|v| {
                        v.as_f64()
                            .ok_or_else(|| format!("`{r}` holds a non-number"))
                    })
                    .sum()
            }
            Tok::Ref(r) => self
                .scope
                .lookup(r)?
                .as_f64()
                .ok_or_else(|| format!("`{r}` is not a number")),
            Tok::Op(c) => Err(format!("unexpected `{c}`")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("e.json"),
            r#"{"gbps": 21.234, "rows": [{"name": "a", "x": 0.5, "v": "PASS"},
               {"name": "b", "x": 1234567.0, "v": "KILL"}], "obj": {"k1": 1, "k2": 2}, "par": [1, 2, 3]}"#,
        )
        .unwrap();
        std::fs::write(d.path().join("l.jsonl"), "{\"a\": 1}\n{\"a\": 2}\n").unwrap();
        d
    }

    const TPL: &str = "intro\n<!-- table\n@e = e.json\n@l = l.jsonl\n| t | v |\n|---|---|\n| bw | {e/gbps|.1f} GB/s |\n{for r in e/rows if /v == \"KILL\" and /x != 0.5}| {r/name} | {r/x|,.0f} |\n{for r in e/rows}| {r/name} | {= r/x / e/gbps * 2 |.3s} |\n{for o in e/obj}| {o@key} | {o|.1%} | {o/none?} |\n| l | {l/1/a} |\n{for n in e/rows}| {e/rows/@i/name} | {= sum(e/par) |.0f} |\n-->\n";

    #[test]
    fn renders_values_rows_expressions_and_keys() {
        let d = setup();
        let (text, mismatches) = render_text("doc", TPL, d.path()).unwrap();
        assert_eq!(
            mismatches.len(),
            1,
            "an empty table differs from its render"
        );
        let table: Vec<&str> = text.lines().skip_while(|l| *l != "-->").skip(1).collect();
        assert_eq!(
            table,
            [
                "| t | v |",
                "|---|---|",
                "| bw | 21.2 GB/s |",
                "| b | 1,234,567 |",
                "| a | 0.0471 |",
                "| b | 116000 |",
                "| k1 | 100.0% | — |",
                "| k2 | 200.0% | — |",
                "| l | 2 |",
                "| a | 6 |",
                "| b | 6 |",
            ]
        );
        let (again, m2) = render_text("doc", &text, d.path()).unwrap();
        assert!(m2.is_empty());
        assert_eq!(again, text);
    }

    #[test]
    fn an_edited_number_is_a_mismatch() {
        let d = setup();
        let (text, _) = render_text("doc", TPL, d.path()).unwrap();
        let edited = text.replace("| bw | 21.2 GB/s |", "| bw | 21.3 GB/s |");
        let (_, m) = render_text("doc", &edited, d.path()).unwrap();
        assert_eq!(m.len(), 1);
        assert!(m[0].to_string().contains("21.3"), "{}", m[0]);
    }

    #[test]
    fn a_missing_value_is_an_error_not_a_blank() {
        let d = setup();
        let tpl = "<!-- table\n@e = e.json\n| {e/nope} |\n-->\n";
        let e = render_text("doc", tpl, d.path()).unwrap_err().to_string();
        assert!(e.contains("e/nope") && e.contains("doc:3"), "{e}");
        let tpl = "<!-- table\n@e = missing.json\n| x |\n-->\n";
        assert!(render_text("doc", tpl, d.path()).is_err());
    }

    #[test]
    fn formats() {
        let f = |x: f64, s: &str| format(&Value::from(x), s).unwrap();
        assert_eq!(f(1.14e-4, ".2e"), "1.14e-4");
        assert_eq!(f(0.99462, ".2%"), "99.46%");
        assert_eq!(f(203912.0, ","), "203,912");
        assert_eq!(f(9.96, ".2s"), "10");
        assert_eq!(f(0.061234, ".3s"), "0.0612");
        assert_eq!(f(2.0 * 1073741824.0, "gib.2"), "2.00");
        assert!(format(&Value::from("x"), ".2f").is_err());
        assert_eq!(format(&Value::from("a\nb|c"), "esc").unwrap(), "a\\nb\\|c");
    }

    #[test]
    fn cited_files_lists_bindings() {
        assert_eq!(cited_files(TPL), ["e.json", "l.jsonl"]);
    }
}
