//! The gpt-oss family (`model_type` `gpt_oss`: OpenAI's gpt-oss-20b and gpt-oss-120b): its
//! `config.json`, its role view, its tensor names and the MXFP4 expert stacks.
//!
//! The keys and their defaults are transformers 5.23's `GptOssConfig` (mlx-lm 0.32.2's
//! `gpt_oss.ModelArgs` reads a subset of them with the same defaults); `rope_parameters`
//! (transformers' writing, `rope_theta` inside) is read where the file has no `rope_scaling`.
//! [`GptOssConfig::role_view`] is the same model in keep's role terms (a [`DeepSeekConfig`]
//! whose sizes and router keys are this model's, with the family config itself in
//! [`DeepSeekConfig::gpt_oss`]).
//!
//! Tensors are Hugging Face's names as OpenAI publishes them: `model.embed_tokens.weight`,
//! `lm_head.weight`, `model.norm.weight`; per layer `input_layernorm`, `post_attention_layernorm`,
//! `self_attn.{q,k,v,o}_proj.{weight,bias}`, `self_attn.sinks` `[heads]`, `mlp.router.{weight,
//! bias}`, and the routed experts stacked per layer in MXFP4: `mlp.experts.gate_up_proj_blocks`
//! `U8 [experts, 2·intermediate, hidden/32, 16]` with `gate_up_proj_scales` `U8 [experts,
//! 2·intermediate, hidden/32]` (E8M0 exponents, `2^(s − 127)`) and `gate_up_proj_bias`
//! `[experts, 2·intermediate]` — gate and up rows interleaved, gate first — then `down_proj_*`
//! likewise `[experts, hidden, intermediate/32, 16]`. Two FP4 values a byte, element `2j` in the
//! low nibble: keep's MXFP4 layout, so an expert's matrix is a slice of the stack
//! ([`Mxfp4Stack::expert`]), never converted.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::checkpoint::Checkpoint;
use crate::config::{CodedMatrix, DeepSeekConfig, MAX_EXPERTS};
use crate::naming::ExpertMat;
use crate::{Dtype, TensorRef};

/// The `model_type` of this family.
pub const MODEL_TYPE: &str = "gpt_oss";

/// A sliding-window layer's `layer_types` entry.
pub const SLIDING: &str = "sliding_attention";
/// A full-attention layer's `layer_types` entry.
pub const FULL: &str = "full_attention";

mod d {
    pub(super) fn num_hidden_layers() -> usize {
        36
    }
    pub(super) fn num_local_experts() -> usize {
        128
    }
    pub(super) fn num_experts_per_tok() -> usize {
        4
    }
    pub(super) fn vocab_size() -> usize {
        201088
    }
    pub(super) fn hidden_size() -> usize {
        2880
    }
    pub(super) fn head_dim() -> usize {
        64
    }
    pub(super) fn num_attention_heads() -> usize {
        64
    }
    pub(super) fn num_key_value_heads() -> usize {
        8
    }
    pub(super) fn sliding_window() -> Option<usize> {
        Some(128)
    }
    pub(super) fn max_position_embeddings() -> usize {
        131072
    }
    pub(super) fn rms_norm_eps() -> f64 {
        1e-5
    }
    pub(super) fn rope_theta() -> f64 {
        150000.0
    }
    pub(super) fn swiglu_alpha() -> f64 {
        1.702
    }
    pub(super) fn swiglu_limit() -> f64 {
        7.0
    }
    pub(super) fn t() -> bool {
        true
    }
}

/// `config.json` of a gpt-oss checkpoint (transformers' `GptOssConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GptOssConfig {
    pub model_type: String,
    #[serde(default = "d::num_hidden_layers")]
    pub num_hidden_layers: usize,
    /// Routed experts of every layer (`num_experts` is transformers' alias).
    #[serde(default = "d::num_local_experts", alias = "num_experts")]
    pub num_local_experts: usize,
    #[serde(default = "d::num_experts_per_tok")]
    pub num_experts_per_tok: usize,
    #[serde(default = "d::vocab_size")]
    pub vocab_size: usize,
    #[serde(default = "d::hidden_size")]
    pub hidden_size: usize,
    /// One expert's width (transformers' default is `hidden_size`'s default, 2880).
    #[serde(default = "d::hidden_size")]
    pub intermediate_size: usize,
    #[serde(default = "d::head_dim")]
    pub head_dim: usize,
    #[serde(default = "d::num_attention_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d::num_key_value_heads")]
    pub num_key_value_heads: usize,
    #[serde(default = "d::sliding_window")]
    pub sliding_window: Option<usize>,
    /// `sliding_attention` / `full_attention` per layer (absent: even layers slide, odd layers
    /// attend to everything, as both references and OpenAI's code).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default = "d::max_position_embeddings")]
    pub max_position_embeddings: usize,
    #[serde(default = "d::rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d::rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default = "d::swiglu_alpha")]
    pub swiglu_alpha: f64,
    #[serde(default = "d::swiglu_limit")]
    pub swiglu_limit: f64,
    /// Biases on q/k/v/o (every published model: true).
    #[serde(default = "d::t")]
    pub attention_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// As published: `{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`.
    #[serde(default)]
    pub quantization_config: Option<Value>,
}

/// YaRN from `rope_scaling` (type `yarn`), as transformers' `_compute_yarn_parameters` and OpenAI's
/// `RotaryEmbedding` read it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Whether the correction range is rounded out to whole dimensions (floor / ceil).
    pub truncate: bool,
}

impl Yarn {
    /// The attention concentration (transformers' `attention_factor`, OpenAI's
    /// `concentration`): `0.1 · ln(factor) + 1`, 1 when `factor` ≤ 1. It multiplies the cosine
    /// and the sine, so both the query and the key.
    pub fn concentration(&self) -> f64 {
        if self.factor <= 1.0 {
            1.0
        } else {
            0.1 * self.factor.ln() + 1.0
        }
    }
}

impl GptOssConfig {
    /// Parse the (already `text_config`-flattened) JSON object of a `gpt_oss` config and
    /// validate it.
    pub fn from_value(mut v: Value) -> std::result::Result<GptOssConfig, String> {
        if let Some(m) = v.as_object_mut() {
            if m.get("rope_scaling").is_none_or(Value::is_null) {
                if let Some(Value::Object(rp)) = m.get("rope_parameters").cloned() {
                    if let Some(theta) = rp.get("rope_theta") {
                        m.entry("rope_theta").or_insert(theta.clone());
                    }
                    m.insert("rope_scaling".into(), Value::Object(rp));
                }
            }
        }
        let c: GptOssConfig =
            serde_json::from_value(v).map_err(|e| format!("gpt_oss config: {e}"))?;
        c.validate()?;
        Ok(c)
    }

    /// Every number within bounds far above any published model and far below what would make
    /// an allocation run away; the layer types, the RoPE scaling and the expert format keep
    /// computes.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.model_type != MODEL_TYPE {
            return Err(format!(
                "model_type `{}` is not `{MODEL_TYPE}`",
                self.model_type
            ));
        }
        for (key, v, lo, hi) in [
            ("vocab_size", self.vocab_size, 1, 1 << 24),
            ("hidden_size", self.hidden_size, 1, 1 << 16),
            ("intermediate_size", self.intermediate_size, 1, 1 << 18),
            ("num_hidden_layers", self.num_hidden_layers, 1, 1 << 10),
            ("num_attention_heads", self.num_attention_heads, 1, 1 << 10),
            (
                "num_key_value_heads",
                self.num_key_value_heads,
                1,
                self.num_attention_heads,
            ),
            ("head_dim", self.head_dim, 2, 1 << 12),
            ("num_local_experts", self.num_local_experts, 1, MAX_EXPERTS),
            (
                "num_experts_per_tok",
                self.num_experts_per_tok,
                1,
                self.num_local_experts,
            ),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                1,
                1 << 24,
            ),
        ] {
            if v < lo || v > hi {
                return Err(format!("{key} = {v} must be in {lo}..={hi}"));
            }
        }
        for (key, v) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
            ("swiglu_alpha", self.swiglu_alpha),
            ("swiglu_limit", self.swiglu_limit),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{key} = {v} must be a finite number > 0"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "num_key_value_heads = {} does not divide num_attention_heads = {}",
                self.num_key_value_heads, self.num_attention_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim = {} must be even (RoPE rotates the two halves of a head)",
                self.head_dim
            ));
        }
        for (key, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
        ] {
            if !v.is_multiple_of(32) {
                return Err(format!(
                    "{key} = {v} must be a multiple of 32 (the MXFP4 experts hold one scale \
                     per 32 inputs)"
                ));
            }
        }
        let types = self.layer_types();
        if types.len() != self.num_hidden_layers {
            return Err(format!(
                "layer_types has {} entries for num_hidden_layers = {}",
                types.len(),
                self.num_hidden_layers
            ));
        }
        if let Some(t) = types.iter().find(|t| *t != SLIDING && *t != FULL) {
            return Err(format!(
                "layer_types entry `{t}`: keep runs `{SLIDING}` and `{FULL}` layers"
            ));
        }
        if types.iter().any(|t| t == SLIDING) && !matches!(self.sliding_window, Some(w) if w >= 1) {
            return Err(format!(
                "sliding_window = {:?}: sliding_attention layers need a window of at least 1",
                self.sliding_window
            ));
        }
        if let Some(q) = &self.quantization_config {
            let m = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
            if m != "mxfp4" {
                return Err(format!(
                    "quantization_config.quant_method = `{m}`: keep runs gpt-oss's experts as \
                     published (`mxfp4`)"
                ));
            }
        }
        self.yarn()?;
        Ok(())
    }

    /// Each layer's type: `layer_types`, or the default alternation (even layers slide).
    pub fn layer_types(&self) -> Vec<String> {
        match &self.layer_types {
            Some(t) => t.clone(),
            None => (0..self.num_hidden_layers)
                .map(|l| if l % 2 == 0 { SLIDING } else { FULL }.to_string())
                .collect(),
        }
    }

    /// The attention window of `layer` (`None`: every earlier position). A query at position
    /// `p` of a sliding layer sees positions `p − window + 1 ..= p`.
    pub fn window(&self, layer: usize) -> Option<usize> {
        let sliding = match &self.layer_types {
            Some(t) => t.get(layer).is_some_and(|t| t == SLIDING),
            None => layer.is_multiple_of(2),
        };
        if sliding {
            self.sliding_window
        } else {
            None
        }
    }

    /// The YaRN scaling of `rope_scaling` (`None`: plain RoPE, no `rope_scaling` or type
    /// `default`); any other type, and keys that would change the attention factor, are
    /// refused.
    ///
    /// `truncate`: transformers rounds the correction range out to whole dimensions unless
    /// `truncate` is false, and mlx-lm 0.32.2's `YarnRoPE` always rounds (it never reads the key).
    /// OpenAI's own code (`gpt_oss/torch/model.py`, `RotaryEmbedding`) never rounds, and the
    /// published configs say `"truncate": false`: keep rounds only when the file says
    /// `"truncate": true`, so a published config gives the publisher's frequencies, which
    /// transformers matches and mlx-lm does not.
    pub fn yarn(&self) -> std::result::Result<Option<Yarn>, String> {
        let Some(rs) = self.rope_scaling.as_ref().filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let m = rs
            .as_object()
            .ok_or_else(|| format!("rope_scaling = {rs} is not an object"))?;
        let ty = m
            .get("rope_type")
            .or_else(|| m.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        match ty {
            "default" => return Ok(None),
            "yarn" => {}
            t => {
                return Err(format!(
                    "rope_scaling type `{t}`: keep runs gpt-oss with YaRN or plain RoPE"
                ))
            }
        }
        for k in ["attention_factor", "mscale", "mscale_all_dim"] {
            if m.get(k).is_some_and(|v| !v.is_null()) {
                return Err(format!(
                    "rope_scaling.{k}: keep runs gpt-oss's YaRN with the concentration \
                     0.1·ln(factor) + 1 only (OpenAI's code has no {k})"
                ));
            }
        }
        let num = |k: &str, d: Option<f64>| -> std::result::Result<f64, String> {
            match m.get(k).filter(|v| !v.is_null()) {
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| format!("rope_scaling.{k} = {v} is not a finite number")),
                None => d.ok_or_else(|| format!("rope_scaling (yarn) has no `{k}`")),
            }
        };
        let truncate = match m.get("truncate") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(format!("rope_scaling.truncate = {v} is not a boolean")),
        };
        let y = Yarn {
            factor: num("factor", None)?,
            original_max_position_embeddings: num("original_max_position_embeddings", None)?,
            beta_fast: num("beta_fast", Some(32.0))?,
            beta_slow: num("beta_slow", Some(1.0))?,
            truncate,
        };
        if !(y.factor > 0.0
            && y.original_max_position_embeddings >= 1.0
            && y.beta_fast > 0.0
            && y.beta_slow > 0.0)
        {
            return Err(format!(
                "rope_scaling: factor = {}, original_max_position_embeddings = {}, beta_fast = \
                 {} and beta_slow = {} must be > 0",
                y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow
            ));
        }
        Ok(Some(y))
    }

    /// The config key that holds the routed-expert count (what `keep prune` rewrites).
    pub const EXPERTS_KEY: &'static str = "num_local_experts";

    /// The model in keep's role terms (see the module doc); `raw` is the file as read.
    pub fn role_view(&self, raw: Value) -> DeepSeekConfig {
        let mut c: DeepSeekConfig =
            serde_json::from_value(Value::Object(Default::default())).expect("all keys default");
        c.model_type = MODEL_TYPE.into();
        c.vocab_size = self.vocab_size;
        c.hidden_size = self.hidden_size;
        c.num_hidden_layers = self.num_hidden_layers;
        c.num_attention_heads = self.num_attention_heads;
        c.head_dim = self.head_dim;
        c.moe_intermediate_size = self.intermediate_size;
        c.n_routed_experts = self.num_local_experts;
        c.n_shared_experts = 0;
        c.num_experts_per_tok = self.num_experts_per_tok;
        // Softmax over the chosen k logits = the softmax over all, renormalised over the k.
        c.scoring_func = "softmax".into();
        c.norm_topk_prob = true;
        c.routed_scaling_factor = 1.0;
        c.swiglu_limit = self.swiglu_limit;
        c.rms_norm_eps = self.rms_norm_eps;
        c.rope_theta = self.rope_theta;
        c.rope_scaling = self.rope_scaling.clone();
        c.max_position_embeddings = self.max_position_embeddings;
        c.sliding_window = self.sliding_window.unwrap_or(1);
        c.quantization_config = None;
        c.gpt_oss = Some(self.clone());
        c.raw = raw;
        c
    }
}

/// `model.layers.{layer}.` .
pub fn layer_prefix(layer: usize) -> String {
    format!("model.layers.{layer}.")
}

/// The embedding's weight base name (without `.weight`).
pub const EMBED: &str = "model.embed_tokens";
/// The head (untied in every published model).
pub const HEAD: &str = "lm_head";
/// The final norm's weight.
pub const NORM: &str = "model.norm.weight";

pub use crate::naming::gpt_oss::{parse_name, BLOCKS, SCALES};

/// A layer's two expert stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stack {
    /// `mlp.experts.gate_up_proj_*`: `[2·intermediate, hidden]` an expert, gate and up rows
    /// interleaved (row `2i` gate `i`, row `2i + 1` up `i`).
    GateUp,
    /// `mlp.experts.down_proj_*`: `[hidden, intermediate]` an expert.
    Down,
}

impl Stack {
    /// The stack's name stem under `mlp.experts.`.
    pub fn stem(self) -> &'static str {
        match self {
            Stack::GateUp => "gate_up_proj",
            Stack::Down => "down_proj",
        }
    }

    /// One expert's `[rows, cols]`.
    pub fn shape(self, c: &GptOssConfig) -> (usize, usize) {
        match self {
            Stack::GateUp => (2 * c.intermediate_size, c.hidden_size),
            Stack::Down => (c.hidden_size, c.intermediate_size),
        }
    }

    /// `model.layers.{layer}.mlp.experts.{stem}{suffix}` (`suffix`: `_blocks`, `_scales`,
    /// `_bias`).
    pub fn name(self, layer: usize, suffix: &str) -> String {
        format!("{}mlp.experts.{}{suffix}", layer_prefix(layer), self.stem())
    }

    /// The stack holding expert matrix `mat` (`W1` the gate-up stack, `W2` the down stack;
    /// gpt-oss has no `W3`).
    pub fn of(mat: ExpertMat) -> Option<Stack> {
        match mat {
            ExpertMat::W1 => Some(Stack::GateUp),
            ExpertMat::W2 => Some(Stack::Down),
            ExpertMat::W3 => None,
        }
    }

    /// The base name (`.weight`, `.scale`, `.resid.*` follow) of expert `expert`'s matrix of
    /// this stack once `keep quant` has coded it on its own:
    /// `model.layers.{layer}.mlp.experts.{expert}.{stem}`. The model reads an expert from these
    /// tensors where they exist, and from its slice of the stack otherwise.
    pub fn coded_base(self, layer: usize, expert: usize) -> String {
        format!(
            "{}mlp.experts.{expert}.{}",
            layer_prefix(layer),
            self.stem()
        )
    }
}

impl GptOssConfig {
    /// The expert matrices `keep quant` codes, one of each stack, each replacing its stack
    /// (`_blocks` and `_scales`) once every expert of the layer is coded.
    pub fn coded_matrices(&self, layer: usize, expert: usize) -> Vec<CodedMatrix> {
        [ExpertMat::W1, ExpertMat::W2]
            .into_iter()
            .filter_map(|mat| {
                let s = Stack::of(mat)?;
                let (rows, cols) = s.shape(self);
                Some(CodedMatrix {
                    mat,
                    rows,
                    cols,
                    base: s.coded_base(layer, expert),
                    replaces: vec![s.name(layer, BLOCKS), s.name(layer, SCALES)],
                })
            })
            .collect()
    }
}

/// One layer's MXFP4 expert stack, checked: `experts` matrices of `[rows, cols]`.
#[derive(Debug, Clone, Copy)]
pub struct Mxfp4Stack<'a> {
    pub blocks: TensorRef<'a>,
    pub scales: TensorRef<'a>,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Mxfp4Stack<'a> {
    /// Resolve and check stack `s` of `layer`: `_blocks` `U8 [experts, rows, cols/32, 16]` and
    /// `_scales` `U8 [experts, rows, cols/32]` (`I8` and `F8_E8M0` hold the same bytes and are
    /// read alike). The error names the tensor and what was expected.
    pub fn open(
        ck: &'a Checkpoint,
        c: &GptOssConfig,
        layer: usize,
        s: Stack,
    ) -> std::result::Result<Self, String> {
        let (rows, cols) = s.shape(c);
        let e = c.num_local_experts;
        let get = |suffix: &str, dtypes: &[Dtype], shape: &[u64]| {
            let name = s.name(layer, suffix);
            let t = ck.get(&name).ok_or_else(|| {
                format!(
                    "tensor `{name}` is missing (gpt-oss's experts are read as published: \
                     MXFP4 `_blocks` and `_scales`)"
                )
            })?;
            if !dtypes.contains(&t.dtype) || t.shape != shape {
                return Err(format!(
                    "tensor `{name}` is {} {:?}, expected {} {shape:?}",
                    t.dtype, t.shape, dtypes[0]
                ));
            }
            Ok(t)
        };
        let (e64, r64, g64) = (e as u64, rows as u64, (cols / 32) as u64);
        let blocks = get("_blocks", &[Dtype::U8, Dtype::I8], &[e64, r64, g64, 16])?;
        let scales = get("_scales", &[Dtype::U8, Dtype::F8_E8M0], &[e64, r64, g64])?;
        Ok(Mxfp4Stack {
            blocks,
            scales,
            experts: e,
            rows,
            cols,
        })
    }

    /// Expert `e`'s packed FP4 bytes (`rows · cols/2`) and E8M0 scales (`rows · cols/32`).
    pub fn expert(&self, e: usize) -> Option<(&'a [u8], &'a [u8])> {
        if e >= self.experts {
            return None;
        }
        let (p, s) = (self.rows * self.cols / 2, self.rows * self.cols / 32);
        Some((
            self.blocks.bytes.get(e * p..(e + 1) * p)?,
            self.scales.bytes.get(e * s..(e + 1) * s)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{"model_type":"gpt_oss","vocab_size":67,"hidden_size":64,
        "intermediate_size":32,"num_hidden_layers":3,"num_attention_heads":4,
        "num_key_value_heads":2,"head_dim":8,"num_local_experts":4,"num_experts_per_tok":2,
        "sliding_window":5,"layer_types":["sliding_attention","full_attention","sliding_attention"],
        "rope_scaling":{"rope_type":"yarn","factor":8.0,"original_max_position_embeddings":64,
        "beta_fast":32.0,"beta_slow":1.0,"truncate":false},
        "quantization_config":{"quant_method":"mxfp4"}}"#;

    #[test]
    fn reads_a_config_and_its_role_view() {
        let v: Value = serde_json::from_str(TINY).unwrap();
        let c = GptOssConfig::from_value(v.clone()).unwrap();
        let y = c.yarn().unwrap().unwrap();
        assert_eq!((y.factor, y.truncate, y.beta_fast), (8.0, false, 32.0));
        assert_eq!(
            (c.window(0), c.window(1), c.window(2)),
            (Some(5), None, Some(5))
        );
        assert_eq!(c.swiglu_limit, 7.0);
        let r = c.role_view(v);
        assert_eq!(
            (r.n_routed_experts, r.head_dim, r.num_experts_per_tok),
            (4, 8, 2)
        );
        assert!(r.validate().is_ok());
        // transformers' rope_parameters (rope_theta inside) read alike.
        let text = TINY
            .replace("\"rope_scaling\"", "\"rope_parameters\"")
            .replace(
                "\"rope_type\":\"yarn\"",
                "\"rope_type\":\"yarn\",\"rope_theta\":5000.0",
            );
        let c = DeepSeekConfig::from_json(std::path::Path::new("config.json"), &text).unwrap();
        let g = c.gpt_oss.unwrap();
        assert_eq!(
            (g.rope_theta, g.yarn().unwrap().unwrap().factor),
            (5000.0, 8.0)
        );
    }

    #[test]
    fn names_parse_to_roles() {
        use crate::naming::{parse, ExpertMat, Part, Role, Scope};
        for (name, role, part) in [
            (
                "model.layers.3.self_attn.sinks",
                Role::AttnSink,
                Part::Other,
            ),
            (
                "model.layers.3.self_attn.o_proj.bias",
                Role::AttnProj("o_proj".into()),
                Part::Other,
            ),
            (
                "model.layers.3.mlp.router.weight",
                Role::RouterWeight,
                Part::Weight,
            ),
            (
                "model.layers.3.mlp.router.bias",
                Role::RouterBias,
                Part::Other,
            ),
            (
                "model.layers.3.mlp.experts.gate_up_proj_blocks",
                Role::StackedExperts(ExpertMat::W1),
                Part::Weight,
            ),
            (
                "model.layers.3.mlp.experts.down_proj_scales",
                Role::StackedExperts(ExpertMat::W2),
                Part::Scale,
            ),
            (
                "model.layers.3.mlp.experts.down_proj_bias",
                Role::StackedExperts(ExpertMat::W2),
                Part::Other,
            ),
        ] {
            let n = parse(name);
            assert_eq!(
                (n.scope, n.role, n.part),
                (Scope::Layer(3), role, part),
                "{name}"
            );
        }
        // Hugging Face's other names are the Qwen3 naming's, unchanged.
        assert_eq!(
            parse("model.layers.3.self_attn.q_proj.weight").role,
            Role::AttnProj("q_proj".into())
        );
        let b = "model.layers.0.mlp.experts.down_proj_blocks";
        let s = crate::naming::scale_candidates(b);
        assert_eq!(s, vec!["model.layers.0.mlp.experts.down_proj_scales"]);
        assert_eq!(crate::naming::weight_of_scale(&s[0]).as_deref(), Some(b));
    }

    #[test]
    fn refusals_name_their_keys() {
        for (from, to, key) in [
            ("\"hidden_size\":64", "\"hidden_size\":65", "hidden_size"),
            ("\"head_dim\":8", "\"head_dim\":7", "head_dim"),
            (
                "\"num_key_value_heads\":2",
                "\"num_key_value_heads\":3",
                "num_key_value_heads",
            ),
            (
                "\"full_attention\",",
                "\"chunked_attention\",",
                "layer_types",
            ),
            (
                "\"rope_type\":\"yarn\"",
                "\"rope_type\":\"longrope\"",
                "rope_scaling",
            ),
            ("\"truncate\":false", "\"truncate\":1", "truncate"),
            (
                "\"truncate\":false",
                "\"truncate\":false,\"mscale\":0.7",
                "mscale",
            ),
            ("\"mxfp4\"", "\"fp8\"", "quant_method"),
            (
                "\"num_experts_per_tok\":2",
                "\"num_experts_per_tok\":5",
                "num_experts_per_tok",
            ),
        ] {
            let text = TINY.replace(from, to);
            assert_ne!(text, TINY, "{from}");
            let e = GptOssConfig::from_value(serde_json::from_str(&text).unwrap()).unwrap_err();
            assert!(e.contains(key), "{key}: {e}");
        }
        let e = GptOssConfig::from_value(
            serde_json::from_str(
                &TINY.replace("\"sliding_window\":5,", "\"sliding_window\":null,"),
            )
            .unwrap(),
        )
        .unwrap_err();
        assert!(e.contains("sliding_window"), "{e}");
    }
}
