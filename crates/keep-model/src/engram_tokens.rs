//! The Engram token-id compression map: raw token id → compressed id, built from the
//! checkpoint's `tokenizer.json` as the published DeepSeek-V4.1 code builds it (its
//! `CompressedTokenizer`). Every id of the tokenizer (added tokens included) is decoded on its
//! own; a text that contains U+FFFD (a byte token that is not valid UTF-8 alone) is keyed by its
//! raw token string, any other text by its normalised form (NFKC, NFD, combining marks removed,
//! lowercase, runs of space/tab/CR/LF → one space, a text that is exactly one space kept through
//! the U+E000 sentinel, surrounding whitespace stripped, sentinel → space), or by the decoded
//! text itself when that form is empty. Keys get compressed ids in first-seen order over the
//! vocabulary, so the map's size is the number of distinct keys (`engram_compressed_vocab_size`
//! of the published config). The normaliser is the published one: the `tokenizers` library's
//! normalizer sequence (its Unicode tables are what the published map was built with; the
//! `unicode-normalization` crate's newer tables give another result on 735 code points).

use std::collections::HashMap;
use std::path::Path;

use tokenizers::normalizers::replace::{Replace, ReplacePattern};
use tokenizers::normalizers::strip::{Strip, StripAccents};
use tokenizers::normalizers::unicode::{NFD, NFKC};
use tokenizers::normalizers::utils::{Lowercase, Sequence};
use tokenizers::{NormalizedString, Normalizer, NormalizerWrapper, Tokenizer};

use crate::{ModelError, Result};

/// Protects a lone space from the strip step (the published normaliser's sentinel).
const SENTINEL: &str = "\u{E000}";

/// The published normaliser sequence (built once: its regexes compile).
pub struct TokenNormalizer(Sequence);

impl TokenNormalizer {
    pub fn new() -> Result<TokenNormalizer> {
        let re = |pattern: &str, with: &str| {
            Replace::new(ReplacePattern::Regex(pattern.into()), with)
                .map(NormalizerWrapper::Replace)
                .map_err(|e| ModelError::Config(format!("token normaliser regex {pattern}: {e}")))
        };
        let sentinel_back = Replace::new(SENTINEL, " ")
            .map_err(|e| ModelError::Config(format!("token normaliser: {e}")))?;
        Ok(TokenNormalizer(Sequence::new(vec![
            NormalizerWrapper::NFKC(NFKC),
            NormalizerWrapper::NFD(NFD),
            NormalizerWrapper::StripAccents(StripAccents),
            NormalizerWrapper::Lowercase(Lowercase),
            re("[ \t\r\n]+", " ")?,
            re("^ $", SENTINEL)?,
            NormalizerWrapper::StripNormalizer(Strip::new(true, true)),
            NormalizerWrapper::Replace(sentinel_back),
        ])))
    }

    /// The normalised form of one token's decoded text.
    pub fn normalize(&self, text: &str) -> Result<String> {
        let mut n = NormalizedString::from(text);
        self.0
            .normalize(&mut n)
            .map_err(|e| ModelError::Config(format!("normalising {text:?}: {e}")))?;
        Ok(n.get().to_string())
    }
}

/// [`TokenNormalizer::normalize`] with a normaliser built for the one call.
pub fn normalize_token_text(text: &str) -> Result<String> {
    TokenNormalizer::new()?.normalize(text)
}

/// A tokenizer's compression map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompressedTokens {
    /// `map[raw id]` = compressed id, for every id of the tokenizer (added tokens included).
    pub map: Vec<u32>,
    /// Number of distinct compressed ids (`1 + max(map)`).
    pub size: usize,
}

/// Build the compression map of `tok` (ids `0 .. vocab size with added tokens`).
pub fn compressed_token_map(tok: &Tokenizer) -> Result<CompressedTokens> {
    let n = tok.get_vocab_size(true);
    let normalizer = TokenNormalizer::new()?;
    let mut keys: HashMap<String, u32> = HashMap::new();
    let mut map = Vec::with_capacity(n);
    for id in 0..n {
        let id32 = u32::try_from(id)
            .map_err(|_| ModelError::Config(format!("tokenizer has {n} ids, more than u32")))?;
        let text = tok
            .decode(&[id32], false)
            .map_err(|e| ModelError::Config(format!("tokenizer cannot decode id {id}: {e}")))?;
        let key = if text.contains('\u{FFFD}') {
            tok.id_to_token(id32).unwrap_or_default()
        } else {
            let norm = normalizer.normalize(&text)?;
            if norm.is_empty() {
                text
            } else {
                norm
            }
        };
        let next = keys.len() as u32;
        map.push(*keys.entry(key).or_insert(next));
    }
    Ok(CompressedTokens {
        map,
        size: keys.len(),
    })
}

/// [`compressed_token_map`] of a `tokenizer.json` file.
pub fn compressed_token_map_from_file(path: &Path) -> Result<CompressedTokens> {
    let tok = Tokenizer::from_file(path)
        .map_err(|e| ModelError::Config(format!("tokenizer {}: {e}", path.display())))?;
    compressed_token_map(&tok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normaliser_folds_case_accents_width_and_spaces() {
        let norm = TokenNormalizer::new().unwrap();
        let n = |t: &str| norm.normalize(t).unwrap();
        assert_eq!(n(" Apple"), "apple");
        assert_eq!(n("ÉCOLE\t\n"), "ecole");
        // NFKC folds full-width letters and the "ﬁ" ligature.
        assert_eq!(n("Ｈｅｌｌｏ"), "hello");
        assert_eq!(n("ﬁne"), "fine");
        // A lone space survives the strip (sentinel); a run of spaces collapses to it.
        assert_eq!(n(" "), " ");
        assert_eq!(n("\n\n  "), " ");
        // Only a text that is exactly one space after collapsing is protected.
        assert_eq!(n(" a  b "), "a b");
        // Per-character lowercase: a final capital sigma becomes σ, not ς.
        assert_eq!(n("ΟΔΟΣ"), "οδοσ");
        assert_eq!(n(""), "");
    }
}
