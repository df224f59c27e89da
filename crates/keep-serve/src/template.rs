//! Chat templates: the `chat_template` of a model's `tokenizer_config.json` rendered with
//! minijinja in the dialect Hugging Face's `apply_chat_template` uses (blocks trimmed and
//! left-stripped, loop controls, `tojson`, `raise_exception`, `strftime_now`, Python string and
//! dict methods), with `messages`, `add_generation_prompt`, `bos_token` and `eos_token`.
//!
//! [`ChatTemplate::encode`] turns messages into prompt ids so that only the template inserts
//! special tokens: the text of a special token typed inside a message (`<|endoftext|>`) is
//! tokenized as the characters it is made of. It fences each such occurrence in the messages
//! with two private-use characters before rendering, then tokenizes the rendered text piece by
//! piece: the template's own text with the special tokens recognized, the fenced pieces with
//! them encoded as plain text.

use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

use tokenizers::Tokenizer;

use crate::{Result, ServeError};

/// Opens a piece of message text that holds a special token's text (a private-use character,
/// removed from the messages before fencing).
const FENCE_OPEN: char = '\u{E000}';
/// Closes a fenced piece.
const FENCE_CLOSE: char = '\u{E001}';

/// One chat message as the template sees it (content flattened to text).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

/// A token entry of tokenizer_config.json: a string or `{"content": "..."}`.
fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// `strftime_now(fmt)` as transformers defines it for templates: the local time formatted by
/// `fmt`'s strftime directives (`%Y-%m-%d`, `%d %B %Y`, …). A directive chrono does not know is
/// an error of the template, not a panic.
fn strftime_now(fmt: String) -> std::result::Result<String, Error> {
    use std::fmt::Write;
    let items: Vec<chrono::format::Item> = chrono::format::StrftimeItems::new(&fmt).collect();
    if items
        .iter()
        .any(|i| matches!(i, chrono::format::Item::Error))
    {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: unsupported directive in {fmt:?}"),
        ));
    }
    let mut out = String::new();
    write!(
        out,
        "{}",
        chrono::Local::now().format_with_items(items.into_iter())
    )
    .map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format {fmt:?}"),
        )
    })?;
    Ok(out)
}

impl ChatTemplate {
    /// Compile `source` with the special tokens it may name.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ServeError::Template(format!("compiling the chat template: {e:#}")))?;
        Ok(ChatTemplate {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
        })
    }

    /// The template of the model in `dir`: `dir/chat_template.jinja` when present (newer Hugging
    /// Face releases ship the template so; transformers reads the file
    /// over the key), else `chat_template` of `dir/tokenizer_config.json` (a string, or a list
    /// of named templates of which `default` is used); `bos_token` and `eos_token` from
    /// `tokenizer_config.json` either way. `None` when there is no template.
    pub fn from_model_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let read = |p: &Path| {
            keep_checkpoint::small_file::read_text(p, keep_checkpoint::small_file::MAX_SMALL_FILE)
                .map_err(|e| ServeError::Template(format!("{}: {e}", p.display())))
        };
        let p = dir.join("tokenizer_config.json");
        let v: serde_json::Value = if p.is_file() {
            serde_json::from_str(&read(&p)?)
                .map_err(|e| ServeError::Template(format!("{}: {e}", p.display())))?
        } else {
            serde_json::Value::Null
        };
        let file = dir.join("chat_template.jinja");
        let source = if file.is_file() {
            read(&file)?
        } else {
            match v.get("chat_template") {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Array(list)) => {
                    let named = |want: &str| {
                        list.iter().find_map(|t| {
                            (t.get("name")?.as_str()? == want)
                                .then(|| t.get("template")?.as_str().map(String::from))
                                .flatten()
                        })
                    };
                    match named("default") {
                        Some(s) => s,
                        None => return Ok(None),
                    }
                }
                _ => return Ok(None),
            }
        };
        let bos = token_text(v.get("bos_token"));
        let eos = token_text(v.get("eos_token"));
        ChatTemplate::new(&source, &bos, &eos)
            .map_err(|e| match (e, file.is_file()) {
                (ServeError::Template(m), true) => {
                    ServeError::Template(format!("{}: {m}", file.display()))
                }
                (e, _) => e,
            })
            .map(Some)
    }

    /// The prompt text for `messages`, ending with the assistant's turn opened
    /// (`add_generation_prompt`).
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ServeError::Template(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| ServeError::BadRequest(format!("the chat template refused the messages: {e}")))
    }

    /// The prompt ids for `messages`: the rendered template tokenized with its special tokens
    /// recognized, while the text of a special token inside a message's content or role is
    /// tokenized as plain text (only the template inserts special tokens).
    pub fn encode(&self, tok: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>> {
        self.encode_with(tok, &plain_tokenizer(tok), messages)
    }

    /// [`ChatTemplate::encode`] with `plain` = [`plain_tokenizer`]`(tok)` given, so that a
    /// caller that encodes many prompts makes it once.
    pub fn encode_with(
        &self,
        tok: &Tokenizer,
        plain: &Tokenizer,
        messages: &[Message],
    ) -> Result<Vec<u32>> {
        let specials: Vec<String> = tok
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        let fenced: Vec<Message> = messages
            .iter()
            .map(|m| Message {
                role: fence(&m.role, &specials),
                content: fence(&m.content, &specials),
            })
            .collect();
        let text = self.render(&fenced)?;
        let mut ids = vec![];
        let mut inside = false;
        let mut piece = String::new();
        let mut flush = |piece: &mut String, as_text: bool| -> Result<()> {
            if piece.is_empty() {
                return Ok(());
            }
            let t = if as_text { plain } else { tok };
            let enc = t.encode(piece.as_str(), false).map_err(|e| {
                ServeError::BadRequest(format!("cannot tokenize the chat prompt: {e}"))
            })?;
            ids.extend_from_slice(enc.get_ids());
            piece.clear();
            Ok(())
        };
        for c in text.chars() {
            match c {
                FENCE_OPEN => {
                    flush(&mut piece, inside)?;
                    inside = true;
                }
                FENCE_CLOSE if inside => {
                    flush(&mut piece, true)?;
                    inside = false;
                }
                FENCE_CLOSE => {}
                c => piece.push(c),
            }
        }
        flush(&mut piece, inside)?;
        Ok(ids)
    }
}

/// `tok` with its special tokens' text encoded as plain text.
pub fn plain_tokenizer(tok: &Tokenizer) -> Tokenizer {
    let mut plain = tok.clone();
    plain.set_encode_special_tokens(true);
    plain
}

/// `text` without the fence characters, each occurrence of a special token's text fenced.
fn fence(text: &str, specials: &[String]) -> String {
    let text: String = text
        .chars()
        .filter(|&c| c != FENCE_OPEN && c != FENCE_CLOSE)
        .collect();
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    'scan: while !rest.is_empty() {
        // The earliest occurrence of any special token's text, the longest at that place.
        let mut best: Option<(usize, usize)> = None;
        for s in specials {
            if let Some(i) = rest.find(s.as_str()) {
                let better = match best {
                    None => true,
                    Some((bi, bl)) => i < bi || (i == bi && s.len() > bl),
                };
                if better {
                    best = Some((i, s.len()));
                }
            }
        }
        let Some((i, len)) = best else {
            out.push_str(rest);
            break 'scan;
        };
        out.push_str(&rest[..i]);
        out.push(FENCE_OPEN);
        out.push_str(&rest[i..i + len]);
        out.push(FENCE_CLOSE);
        rest = &rest[i + len..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: &[(&str, &str)]) -> Vec<Message> {
        v.iter()
            .map(|(r, c)| Message {
                role: r.to_string(),
                content: c.to_string(),
            })
            .collect()
    }

    /// A Hugging Face style template (ChatML with a system-message check, loop controls,
    /// Python methods and raise_exception), as such templates are written.
    const CHATML: &str = "{%- if messages[0]['role'] == 'system' -%}\n    {%- set system = messages[0]['content'] -%}\n{%- endif -%}\n{%- for message in messages -%}\n    {%- if message.role not in ['system', 'user', 'assistant'] -%}\n        {{ raise_exception('Unknown role: ' + message.role) }}\n    {%- endif -%}\n    {%- if loop.first and message.role == 'assistant' %}{% continue %}{% endif -%}\n    {{ '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>' + '\\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{ '<|im_start|>assistant\\n' }}\n{%- endif -%}";

    #[test]
    fn renders_a_hugging_face_style_template() {
        let t = ChatTemplate::new(CHATML, "<s>", "</s>").unwrap();
        let out = t
            .render(&msgs(&[("system", "Be brief."), ("user", "  Hi  ")]))
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let e = t.render(&msgs(&[("robot", "x")])).unwrap_err();
        assert!(e.to_string().contains("Unknown role: robot"), "{e}");
    }

    #[test]
    fn tojson_and_special_tokens_are_there() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let out = t.render(&msgs(&[("user", "a\"b")])).unwrap();
        // Keys in the order the message gives them, as Python's json.dumps writes a dict.
        assert_eq!(out, r#"<s>[{"role":"user","content":"a\"b"}]</s>"#);
    }

    #[test]
    fn the_bundled_model_has_a_template_of_its_own() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny");
        let t = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
        let out = t.render(&msgs(&[("user", "sort a list")])).unwrap();
        // What transformers 5.23's apply_chat_template(add_generation_prompt=True) renders.
        assert_eq!(out, "# user:\nsort a list\n# assistant:\n");
    }

    /// The special-token ids of `tok`.
    fn special_ids(tok: &Tokenizer) -> Vec<u32> {
        tok.get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect()
    }

    #[test]
    fn special_token_text_in_a_message_is_tokenized_as_text() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny");
        let tok = keep_model::generate::load_tokenizer(&dir).unwrap();
        let specials = special_ids(&tok);
        assert!(!specials.is_empty());
        let typed = "stop here <|endoftext|> and <|endoftext|><|endoftext|>go on";
        // The bundled template: nothing of it is special, so no special id at all.
        let t = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
        let ids = t.encode(&tok, &msgs(&[("user", typed)])).unwrap();
        assert!(
            ids.iter().all(|i| !specials.contains(i)),
            "a special id from the message text: {ids:?}"
        );
        // The text round-trips: the message's characters are all there.
        let back = tok.decode(&ids, false).unwrap();
        assert!(back.contains(typed), "{back:?}");
        // Without special tokens in the text, the ids are those of the rendered text.
        let plain = msgs(&[("user", "sort a list")]);
        let want = tok
            .encode(t.render(&plain).unwrap(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(t.encode(&tok, &plain).unwrap(), want);
        // A template that writes special tokens itself keeps them, and only them.
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
            "<|endoftext|>",
            "<|endoftext|>",
        )
        .unwrap();
        let ids = t
            .encode(
                &tok,
                &msgs(&[("user", typed), ("assistant", "\u{E001}<|endoftext|>")]),
            )
            .unwrap();
        let at: Vec<usize> = (0..ids.len())
            .filter(|&i| specials.contains(&ids[i]))
            .collect();
        assert_eq!(at.len(), 3, "{ids:?}");
        assert_eq!((at[0], at[2]), (0, ids.len() - 1), "{ids:?}");
        assert_eq!(tok.decode(&ids[1..at[1]], false).unwrap(), typed);
        assert_eq!(
            tok.decode(&ids[at[1] + 1..at[2]], false).unwrap(),
            "<|endoftext|>"
        );
    }

    #[test]
    fn the_template_file_beside_the_checkpoint_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // No template at all: none.
        assert!(ChatTemplate::from_model_dir(d).unwrap().is_none());
        std::fs::write(
            d.join("tokenizer_config.json"),
            r#"{"bos_token":"<b>","eos_token":{"content":"<e>"}}"#,
        )
        .unwrap();
        assert!(ChatTemplate::from_model_dir(d).unwrap().is_none());
        // tokenizer_config.json carries none; chat_template.jinja has one, with the file's
        // special tokens.
        std::fs::write(
            d.join("chat_template.jinja"),
            "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\n{% if add_generation_prompt %}<|assistant|>{% endif %}{{ eos_token }}",
        )
        .unwrap();
        let t = ChatTemplate::from_model_dir(d).unwrap().unwrap();
        assert_eq!(
            t.render(&msgs(&[("user", "hi")])).unwrap(),
            // trim_blocks drops the newline after `endfor`.
            "<b><|user|>hi<|assistant|><e>"
        );
        // The file is read over the key, as transformers does.
        std::fs::write(
            d.join("tokenizer_config.json"),
            r#"{"chat_template":"key","bos_token":"<b>"}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_model_dir(d).unwrap().unwrap();
        assert!(t
            .render(&msgs(&[("user", "hi")]))
            .unwrap()
            .starts_with("<b><|user|>"));
        // A broken file is refused, naming it.
        std::fs::write(d.join("chat_template.jinja"), "{% for %}").unwrap();
        let e = ChatTemplate::from_model_dir(d).err().unwrap();
        assert!(e.to_string().contains("chat_template.jinja"), "{e}");
    }

    #[test]
    fn strftime_now_writes_the_date() {
        // Published templates write "Current date: {{ strftime_now('%Y-%m-%d') }}".
        let t = ChatTemplate::new(
            "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %B %Y') }}",
            "",
            "",
        )
        .unwrap();
        let out = t.render(&[]).unwrap();
        let (iso, long) = out.split_once('|').unwrap();
        let b = iso.as_bytes();
        assert!(
            b.len() == 10
                && b[4] == b'-'
                && b[7] == b'-'
                && iso.replace('-', "").bytes().all(|c| c.is_ascii_digit()),
            "{out:?}"
        );
        let year = &iso[..4];
        assert!(long.ends_with(year) && long.len() > 12, "{out:?}");
        // A directive chrono does not know is the template's error.
        let t = ChatTemplate::new("{{ strftime_now('%Q') }}", "", "").unwrap();
        assert!(t
            .render(&[])
            .unwrap_err()
            .to_string()
            .contains("strftime_now"));
    }

    #[test]
    fn a_broken_template_is_refused_when_loaded() {
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }
}
