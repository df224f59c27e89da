//! `keep chat-template`: the prompt `keep serve` builds for a chat, printed.

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use keep_serve::api::ChatMessage;
use keep_serve::template::{ChatTemplate, Message};

/// Print the prompt `keep serve` renders for a chat.
///
/// The model's chat template (`chat_template.jinja` beside the checkpoint, else `chat_template`
/// of `tokenizer_config.json`) applied to the messages with the assistant's turn opened, as
/// transformers' `apply_chat_template(add_generation_prompt=True)` renders it and as
/// `/v1/chat/completions` sends it to the model.
///
/// MESSAGES is a JSON file (`-` for standard input) holding an array of `{"role", "content"}`
/// objects, or a `/v1/chat/completions` request body (an object with `messages`). The text is
/// printed exactly, without a newline of its own; `--ids` prints the prompt's token ids instead
/// (the template's special tokens as special ids, a special token's text typed inside a
/// message as plain text), `--json` both.
///
/// Example: echo '[{"role":"user","content":"sort a list"}]' | keep chat-template models/keep-tiny --messages -
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct ChatTemplateArgs {
    /// The model directory (its tokenizer_config.json / chat_template.jinja).
    model: PathBuf,
    /// The messages: a JSON file, or - for standard input.
    #[arg(long)]
    messages: String,
    /// Print the prompt's token ids (one JSON array) instead of its text.
    #[arg(long)]
    ids: bool,
    /// Print `{"prompt": TEXT, "ids": [...]}` (ids when the model has a tokenizer.json).
    #[arg(long)]
    json: bool,
}

/// At most this many bytes of messages are read (what `keep serve` accepts in one body by
/// default is smaller).
const MAX_MESSAGES_BYTES: u64 = 64 << 20;

pub fn run(a: ChatTemplateArgs) -> anyhow::Result<()> {
    let mut text = String::new();
    if a.messages == "-" {
        std::io::stdin()
            .take(MAX_MESSAGES_BYTES)
            .read_to_string(&mut text)
            .context("reading the messages from standard input")?;
    } else {
        std::fs::File::open(&a.messages)
            .and_then(|f| f.take(MAX_MESSAGES_BYTES).read_to_string(&mut text))
            .with_context(|| format!("reading the messages from {}", a.messages))?;
    }
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", a.messages))?;
    let list = match v.get("messages") {
        Some(m) => m.clone(),
        None => v,
    };
    let messages: Vec<ChatMessage> = serde_json::from_value(list).with_context(|| {
        format!(
            "{}: expected an array of {{\"role\", \"content\"}} objects or an object with \"messages\"",
            a.messages
        )
    })?;
    if messages.is_empty() {
        bail!("{}: no messages", a.messages);
    }
    let messages: Vec<Message> = messages.iter().map(|m| m.template_message()).collect();
    let Some(template) = ChatTemplate::from_model_dir(&a.model)? else {
        bail!(
            "{} has no chat template (neither chat_template.jinja nor `chat_template` in tokenizer_config.json)",
            a.model.display()
        );
    };
    let prompt = template.render(&messages)?;
    let ids = if a.ids || (a.json && a.model.join("tokenizer.json").is_file()) {
        let tok = keep_model::generate::load_tokenizer(&a.model)?;
        Some(template.encode(&tok, &messages)?)
    } else {
        None
    };
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::json!({"prompt": prompt, "ids": ids}))?;
    } else if let Some(ids) = ids {
        writeln!(out, "{}", serde_json::to_string(&ids)?)?;
    } else {
        out.write_all(prompt.as_bytes())?;
    }
    Ok(())
}
