//! The OpenAI wire format keep serves: request bodies (fields keep acts on; unknown fields are
//! ignored, wrong types refused), the error body (`{"error": {"message", "type", "param",
//! "code"}}`), and the pieces of responses shared by completions and chat completions.

use serde::Deserialize;
use serde_json::{json, Value};

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn list(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `prompt`: text, a list of one text, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// What completions and chat completions share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    /// Top alternatives per token (0..=5), as OpenAI's legacy completions take it.
    #[serde(default)]
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub common: Common,
}

/// A message's content: text, or a list of parts of which the text ones are joined.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

impl ChatMessage {
    /// The message as the chat template sees it: text content as is, a list of parts joined
    /// from its `text` parts (other parts carry nothing a text model reads), no content empty.
    pub fn template_message(&self) -> crate::template::Message {
        crate::template::Message {
            role: self.role.clone(),
            content: match &self.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(p)) => p
                    .iter()
                    .filter(|p| p.kind == "text")
                    .filter_map(|p| p.text.clone())
                    .collect::<Vec<_>>()
                    .join(""),
            },
        }
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    #[serde(flatten)]
    pub common: Common,
}

/// `POST /tokenize`.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    pub prompt: String,
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

/// An OpenAI error body.
pub fn error_body(message: &str, kind: &str, param: Option<&str>) -> Value {
    json!({
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": Value::Null,
        }
    })
}

/// `usage`.
pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// Seconds since the Unix epoch (`created`).
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_ignored_and_wrong_types_refused() {
        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt":"hi","max_tokens":3,"frobnicate":{"x":1}}"#).unwrap();
        assert_eq!(r.common.max_tokens, Some(3));
        assert!(
            serde_json::from_str::<CompletionRequest>(r#"{"prompt":"hi","max_tokens":"3"}"#)
                .is_err()
        );
        assert!(serde_json::from_str::<CompletionRequest>(r#"{"max_tokens":3}"#).is_err());
        assert!(serde_json::from_str::<ChatRequest>(r#"{"messages":"hi"}"#).is_err());
        let c: ChatRequest = serde_json::from_str(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"stop":["x","y"]}"#,
        )
        .unwrap();
        assert_eq!(c.common.stop.unwrap().list(), vec!["x", "y"]);
    }
}
