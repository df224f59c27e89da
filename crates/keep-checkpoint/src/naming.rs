//! All DeepSeek V4/V4.1 tensor naming, in one place.
//!
//! For every published tensor name: its scope (model, layer N, MTP layer N), its role
//! (embedding, head, norm, hyper-connection, attention projection, compressor, indexer, router
//! weight / bias / bias_vl / tid2eid, routed expert e with w1|w2|w3, shared expert, MTP
//! projection, engram, vision), whether it is a weight, a block scale or something else, and its
//! scale partner. Names have no `model.` prefix (DeepSeek's own tree, not mlx-lm's).

pub(crate) mod deepseek_v3;
pub(crate) mod gpt_oss;
pub(crate) mod qwen3;

/// Where a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// Not inside a layer (embedding, head, final norm).
    Model,
    /// Decoder layer N.
    Layer(usize),
    /// Multi-token-prediction layer N (`mtp.N.*`).
    Mtp(usize),
}

/// Which of an expert's three matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExpertMat {
    /// Gate projection (`w1`).
    W1,
    /// Down projection (`w2`).
    W2,
    /// Up projection (`w3`).
    W3,
}

impl ExpertMat {
    /// All three, in name order.
    pub const ALL: [ExpertMat; 3] = [ExpertMat::W1, ExpertMat::W2, ExpertMat::W3];
    /// `"w1"`, `"w2"` or `"w3"`.
    pub fn name(self) -> &'static str {
        match self {
            ExpertMat::W1 => "w1",
            ExpertMat::W2 => "w2",
            ExpertMat::W3 => "w3",
        }
    }
    fn parse(s: &str) -> Option<ExpertMat> {
        match s {
            "w1" => Some(ExpertMat::W1),
            "w2" => Some(ExpertMat::W2),
            "w3" => Some(ExpertMat::W3),
            _ => None,
        }
    }
}

/// What a tensor is for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Embedding,
    Head,
    /// An RMSNorm weight (which one is in the name).
    Norm,
    /// Hyper-connection mixing parameters (`hc_*_{fn,base,scale}`).
    Hc,
    /// `attn.{wq_a,wq_b,wkv,wo_a,wo_b}`: the projection's short name.
    AttnProj(String),
    /// Attention sinks.
    AttnSink,
    /// `attn.compressor.*`.
    Compressor,
    /// `attn.indexer.*`.
    Indexer,
    RouterWeight,
    RouterBias,
    RouterBiasVl,
    /// Hash routing table of V4-Flash's first layers.
    RouterTid2eid,
    RoutedExpert {
        expert: usize,
        mat: ExpertMat,
    },
    SharedExpert(ExpertMat),
    /// Matrix `mat` of every routed expert of a layer, stacked on a first axis of the layer's
    /// expert count (mlx-lm's `switch_mlp`; expert `e` is the `e`-th slice).
    StackedExperts(ExpertMat),
    /// MTP's `e_proj` / `h_proj` and other MTP-only tensors.
    MtpProj,
    Engram,
    Vision,
    /// `ffn.sidecar.{a,b}`: a pruned MoE block's low-rank sidecar (`keep sidecar`).
    Sidecar,
    Unknown,
}

impl Role {
    /// A short label for reports (`"routed_expert"`, `"attn"`, ...).
    pub fn label(&self) -> &'static str {
        match self {
            Role::Embedding => "embedding",
            Role::Head => "head",
            Role::Norm => "norm",
            Role::Hc => "hc",
            Role::AttnProj(_) => "attn_proj",
            Role::AttnSink => "attn_sink",
            Role::Compressor => "compressor",
            Role::Indexer => "indexer",
            Role::RouterWeight => "router_weight",
            Role::RouterBias => "router_bias",
            Role::RouterBiasVl => "router_bias_vl",
            Role::RouterTid2eid => "router_tid2eid",
            Role::RoutedExpert { .. } => "routed_expert",
            Role::SharedExpert(_) => "shared_expert",
            Role::StackedExperts(_) => "routed_expert",
            Role::MtpProj => "mtp_proj",
            Role::Engram => "engram",
            Role::Vision => "vision",
            Role::Sidecar => "sidecar",
            Role::Unknown => "unknown",
        }
    }
}

impl Role {
    /// Whether the tensor holds routed-expert bytes (one expert's, or a layer's stacked).
    pub fn is_routed_expert(&self) -> bool {
        matches!(self, Role::RoutedExpert { .. } | Role::StackedExperts(_))
    }
}

/// Whether the tensor is a weight, the block scale of one, or neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// `*.weight`.
    Weight,
    /// `*.scale` (V4) or `*.weight_scale_inv` (V3).
    Scale,
    /// Anything else (`attn_sink`, `hc_*`, `gate.bias`, ...).
    Other,
}

/// A parsed tensor name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorName {
    pub scope: Scope,
    pub role: Role,
    pub part: Part,
}

impl TensorName {
    /// The layer index for decoder layers.
    pub fn layer(&self) -> Option<usize> {
        match self.scope {
            Scope::Layer(l) => Some(l),
            _ => None,
        }
    }
}

/// Parse any tensor name, DeepSeek V4's or (under `model.` / `lm_head.`) a Hugging Face
/// family's: the names only one Hugging Face family has through that family's `parse_name`,
/// the rest through [`qwen3::parse`] (Hugging Face's Qwen3-style names the families share).
/// Never fails: unrecognised names get [`Role::Unknown`].
pub fn parse(name: &str) -> TensorName {
    // A registered format's parts (`.weight_packed`, `.weight_scale`, ...) are the weight's
    // (the main part) and its scale partners (the others), named as `.weight` is.
    if let Some((_, i, base)) = keep_format::registry::find_by_part(name) {
        let mut n = parse(&format!("{base}.weight"));
        n.part = if i == 0 { Part::Weight } else { Part::Scale };
        return n;
    }
    // Hugging Face's `model.`-rooted tree is its family modules' to name; DeepSeek V4's own
    // names never start so. A name is parsed without its config, so by its tree, not by the
    // family registry (which sits above this module).
    if name.starts_with("model.") || name.starts_with("lm_head.") {
        return deepseek_v3::parse_name(name)
            .or_else(|| gpt_oss::parse_name(name))
            .unwrap_or_else(|| qwen3::parse(name));
    }
    let part = if name.ends_with(".weight") {
        Part::Weight
    } else if name.ends_with(".scale")
        || name.ends_with(".weight_scale_inv")
        || name.ends_with(MLX_SCALES)
        || name.ends_with(MLX_BIASES)
    {
        // MLX affine weights' `.scales` and `.biases` are their scale partners.
        Part::Scale
    } else {
        Part::Other
    };
    let (scope, rest) = if let Some((n, rest)) = split_index(name, "layers.") {
        (Scope::Layer(n), rest)
    } else if let Some((n, rest)) = split_index(name, "mtp.") {
        (Scope::Mtp(n), rest)
    } else {
        (Scope::Model, name)
    };
    let role = match scope {
        Scope::Model => model_role(rest),
        Scope::Layer(_) => layer_role(rest),
        Scope::Mtp(_) => match layer_role(rest) {
            Role::Unknown => mtp_role(rest),
            r => r,
        },
    };
    let role = if name.starts_with("vision.") || name.starts_with("aligner.") {
        Role::Vision
    } else {
        role
    };
    TensorName { scope, role, part }
}

fn split_index<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let rest = name.strip_prefix(prefix)?;
    let dot = rest.find('.')?;
    let n = rest[..dot].parse().ok()?;
    Some((n, &rest[dot + 1..]))
}

fn stem(rest: &str) -> &str {
    rest.strip_suffix(".weight_scale_inv")
        .or_else(|| rest.strip_suffix(".weight"))
        .or_else(|| rest.strip_suffix(".scale"))
        .or_else(|| rest.strip_suffix(MLX_SCALES))
        .or_else(|| rest.strip_suffix(MLX_BIASES))
        .unwrap_or(rest)
}

fn model_role(rest: &str) -> Role {
    match stem(rest) {
        "embed" => Role::Embedding,
        "head" => Role::Head,
        "norm" => Role::Norm,
        s if s.starts_with("hc_head") => Role::Hc,
        s if s.starts_with("image_") => Role::Vision,
        _ => Role::Unknown,
    }
}

fn layer_role(rest: &str) -> Role {
    let s = stem(rest);
    if s.starts_with("engram.") {
        return Role::Engram;
    }
    if (s.ends_with("_norm") || s.ends_with(".q_norm") || s.ends_with(".kv_norm"))
        && !s.contains("compressor")
        && !s.contains("indexer")
    {
        return Role::Norm;
    }
    if s.starts_with("hc_attn_") || s.starts_with("hc_ffn_") {
        return Role::Hc;
    }
    if let Some(a) = s.strip_prefix("attn.") {
        return match a {
            "wq_a" | "wq_b" | "wkv" | "wo_a" | "wo_b" => Role::AttnProj(a.to_string()),
            "attn_sink" => Role::AttnSink,
            a if a.starts_with("compressor.") => Role::Compressor,
            a if a.starts_with("indexer.") => Role::Indexer,
            _ => Role::Unknown,
        };
    }
    if let Some(f) = s.strip_prefix("ffn.") {
        match f {
            "gate" => return Role::RouterWeight,
            "gate.bias" => return Role::RouterBias,
            "gate.bias_vl" => return Role::RouterBiasVl,
            "gate.tid2eid" => return Role::RouterTid2eid,
            "sidecar.a" | "sidecar.b" => return Role::Sidecar,
            _ => {}
        }
        if let Some(e) = f.strip_prefix("experts.") {
            let mut it = e.split('.');
            if let (Some(idx), Some(w), None) = (it.next(), it.next(), it.next()) {
                if let (Ok(expert), Some(mat)) = (idx.parse(), ExpertMat::parse(w)) {
                    return Role::RoutedExpert { expert, mat };
                }
            }
        }
        if let Some(w) = f.strip_prefix("shared_experts.") {
            if let Some(mat) = ExpertMat::parse(w) {
                return Role::SharedExpert(mat);
            }
        }
    }
    Role::Unknown
}

fn mtp_role(rest: &str) -> Role {
    match stem(rest) {
        "e_proj" | "h_proj" | "enorm" | "hnorm" | "norm" | "head" | "embed" => Role::MtpProj,
        // DSpark's (docs/dspark.md): the target-feature projection and the heads.
        "main_proj"
        | "main_norm"
        | "markov_head.embed"
        | "markov_head.head"
        | "confidence_head.proj" => Role::MtpProj,
        s if s.starts_with("hc_head") => Role::Hc,
        _ => Role::Unknown,
    }
}

/// Whether `name` is an Engram table tensor (`layers.N.engram.embed.{weight,scale}`): rows
/// gathered a few per token by hashed n-gram ids, read on demand and never resident. The
/// Engram layer's other tensors (projections, norms) are small residents.
pub fn is_engram_table(name: &str) -> bool {
    name.contains(".engram.embed.")
}

/// The Engram table weight of decoder layer `layer`.
pub fn engram_table(layer: usize, part: &str) -> String {
    format!("layers.{layer}.engram.embed.{part}")
}

/// How an MLX affine weight's scales are named (`<base>.scales`, as mlx-lm writes them).
pub const MLX_SCALES: &str = ".scales";
/// How an MLX affine weight's biases are named (`<base>.biases`).
pub const MLX_BIASES: &str = ".biases";
/// How a stacked MXFP4 weight's packed FP4 tensor is named (`<base>_blocks`, `U8 [.., rows,
/// cols/32, 16]`, as OpenAI publishes its expert stacks; `layout` classifies the pair).
pub const MXFP4_BLOCKS: &str = "_blocks";
/// How a stacked MXFP4 weight's E8M0 scale tensor is named (`<base>_scales`, its blocks'
/// scale partner).
pub const MXFP4_SCALES: &str = "_scales";

/// The possible names of the scale tensor that belongs to weight `name` (V4 `.scale`, then V3
/// `.weight_scale_inv`, then MLX's `.scales`); empty for a name that is not a `.weight`.
pub fn scale_candidates(name: &str) -> Vec<String> {
    if let Some((f, 0, base)) = keep_format::registry::find_by_part(name) {
        return f
            .parts
            .get(1)
            .map(|p| format!("{base}{}", p.suffix))
            .into_iter()
            .collect();
    }
    if let Some(s) = name.strip_suffix(MXFP4_BLOCKS) {
        return vec![format!("{s}{MXFP4_SCALES}")];
    }
    match name.strip_suffix(".weight") {
        Some(s) => vec![
            format!("{s}.scale"),
            format!("{name}_scale_inv"),
            format!("{s}{MLX_SCALES}"),
        ],
        None => vec![],
    }
}

/// The MLX affine biases of weight `name` (`<base>.biases`), if `name` is a `.weight`.
pub fn biases_name(name: &str) -> Option<String> {
    name.strip_suffix(".weight")
        .map(|s| format!("{s}{MLX_BIASES}"))
}

/// The weight a scale tensor (or MLX biases tensor) belongs to.
pub fn weight_of_scale(name: &str) -> Option<String> {
    if let Some((f, 1.., base)) = keep_format::registry::find_by_part(name) {
        return Some(format!("{base}{}", f.parts[0].suffix));
    }
    if let Some(s) = name.strip_suffix(".weight_scale_inv") {
        return Some(format!("{s}.weight"));
    }
    if let Some(s) = name.strip_suffix(MXFP4_SCALES) {
        return Some(format!("{s}{MXFP4_BLOCKS}"));
    }
    name.strip_suffix(".scale")
        .or_else(|| name.strip_suffix(MLX_SCALES))
        .or_else(|| name.strip_suffix(MLX_BIASES))
        .map(|s| format!("{s}.weight"))
}

/// `layers.{layer}.ffn.experts.{expert}.{w}.{part}` (`part` is `"weight"` or `"scale"`).
pub fn expert_tensor(layer: usize, expert: usize, mat: ExpertMat, part: &str) -> String {
    format!(
        "{}{}.{part}",
        expert_prefix(Scope::Layer(layer), expert),
        mat.name()
    )
}

/// The prefix of routed expert `expert`'s tensors in `scope` (`layers.3.ffn.experts.7.`,
/// `mtp.0.ffn.experts.7.`).
pub fn expert_prefix(scope: Scope, expert: usize) -> String {
    format!("{}ffn.experts.{expert}.", scope_prefix(scope))
}

/// Prefix of a scope's tensors (`"layers.3."`, `"mtp.0."`, `""`).
pub fn scope_prefix(scope: Scope) -> String {
    match scope {
        Scope::Model => String::new(),
        Scope::Layer(n) => format!("layers.{n}."),
        Scope::Mtp(n) => format!("mtp.{n}."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn role(n: &str) -> Role {
        parse(n).role
    }

    #[test]
    fn published_names() {
        assert_eq!(role("embed.weight"), Role::Embedding);
        assert_eq!(role("head.weight"), Role::Head);
        assert_eq!(role("norm.weight"), Role::Norm);
        assert_eq!(role("layers.3.attn_norm.weight"), Role::Norm);
        assert_eq!(role("layers.3.attn.q_norm.weight"), Role::Norm);
        assert_eq!(role("layers.3.hc_attn_fn"), Role::Hc);
        assert_eq!(role("layers.3.hc_ffn_scale"), Role::Hc);
        assert_eq!(
            role("layers.3.attn.wo_a.scale"),
            Role::AttnProj("wo_a".into())
        );
        assert_eq!(role("layers.3.attn.attn_sink"), Role::AttnSink);
        assert_eq!(
            role("layers.3.attn.compressor.norm.weight"),
            Role::Compressor
        );
        assert_eq!(role("layers.3.attn.indexer.k_norm.weight"), Role::Indexer);
        assert_eq!(role("layers.3.attn.indexer.wq_b.scale"), Role::Indexer);
        assert_eq!(role("layers.3.ffn.gate.weight"), Role::RouterWeight);
        assert_eq!(role("layers.3.ffn.gate.bias"), Role::RouterBias);
        assert_eq!(role("layers.3.ffn.gate.bias_vl"), Role::RouterBiasVl);
        assert_eq!(role("layers.0.ffn.gate.tid2eid"), Role::RouterTid2eid);
        assert_eq!(
            role("layers.7.ffn.experts.381.w2.scale"),
            Role::RoutedExpert {
                expert: 381,
                mat: ExpertMat::W2
            }
        );
        assert_eq!(
            role("layers.7.ffn.shared_experts.w3.weight"),
            Role::SharedExpert(ExpertMat::W3)
        );
        assert_eq!(role("layers.1.engram.table.weight"), Role::Engram);
        assert_eq!(role("mtp.0.e_proj.scale"), Role::MtpProj);
        for name in [
            "mtp.0.main_proj.weight",
            "mtp.0.main_proj.scale",
            "mtp.2.markov_head.embed.weight",
            "mtp.2.markov_head.head.weight",
            "mtp.2.confidence_head.proj.weight",
        ] {
            assert_eq!(role(name), Role::MtpProj, "{name}");
        }
        assert_eq!(role("mtp.0.main_norm.weight"), Role::Norm);
        assert_eq!(parse("mtp.0.ffn.experts.2.w1.weight").scope, Scope::Mtp(0));
        assert_eq!(role("vision.blocks.0.attn.qkv.weight"), Role::Vision);
        assert_eq!(role("layers.x.attn.wq_a.weight"), Role::Unknown);
        assert_eq!(role("layers.3.ffn.sidecar.a.weight"), Role::Sidecar);
        assert_eq!(role("layers.3.ffn.sidecar.c.weight"), Role::Unknown);
        assert_eq!(role("layers.3.ffn.experts.1.w4.weight"), Role::Unknown);
    }

    #[test]
    fn deepseek_v3_names() {
        let p = |n: &str| {
            let t = parse(n);
            (t.scope, t.role, t.part)
        };
        let l = Scope::Layer(4);
        for (n, role, part) in [
            (
                "model.layers.4.self_attn.q_a_proj.weight",
                Role::AttnProj("q_a_proj".into()),
                Part::Weight,
            ),
            (
                "model.layers.4.self_attn.kv_a_proj_with_mqa.weight_scale_inv",
                Role::AttnProj("kv_a_proj_with_mqa".into()),
                Part::Scale,
            ),
            (
                "model.layers.4.self_attn.kv_b_proj.weight",
                Role::AttnProj("kv_b_proj".into()),
                Part::Weight,
            ),
            (
                "model.layers.4.self_attn.q_b_proj.weight",
                Role::AttnProj("q_b_proj".into()),
                Part::Weight,
            ),
            (
                "model.layers.4.self_attn.kv_a_layernorm.weight",
                Role::Norm,
                Part::Weight,
            ),
            (
                "model.layers.4.self_attn.q_a_layernorm.weight",
                Role::Norm,
                Part::Weight,
            ),
            (
                "model.layers.4.mlp.gate.e_score_correction_bias",
                Role::RouterBias,
                Part::Other,
            ),
            (
                "model.layers.4.mlp.shared_experts.down_proj.weight_scale_inv",
                Role::SharedExpert(ExpertMat::W2),
                Part::Scale,
            ),
            (
                "model.layers.4.mlp.experts.7.up_proj.weight",
                Role::RoutedExpert {
                    expert: 7,
                    mat: ExpertMat::W3,
                },
                Part::Weight,
            ),
            (
                "model.layers.4.mlp.gate.weight",
                Role::RouterWeight,
                Part::Weight,
            ),
        ] {
            assert_eq!(p(n), (l, role, part), "{n}");
        }
        for n in [
            "model.layers.4.self_attn.kv_c_proj.weight",
            "model.layers.4.mlp.shared_experts.w1.weight",
            "model.layers.4.mlp.gate.e_score_correction",
        ] {
            assert_eq!(parse(n).role, Role::Unknown, "{n}");
        }
    }

    #[test]
    fn parts_and_partners() {
        assert_eq!(parse("layers.0.attn.wkv.weight").part, Part::Weight);
        assert_eq!(parse("layers.0.attn.wkv.scale").part, Part::Scale);
        assert_eq!(parse("layers.0.attn.attn_sink").part, Part::Other);
        assert_eq!(
            weight_of_scale("layers.0.attn.wkv.scale").as_deref(),
            Some("layers.0.attn.wkv.weight")
        );
        assert_eq!(
            weight_of_scale("model.x.weight_scale_inv").as_deref(),
            Some("model.x.weight")
        );
        assert_eq!(
            scale_candidates("a.weight"),
            vec![
                "a.scale".to_string(),
                "a.weight_scale_inv".to_string(),
                "a.scales".to_string()
            ]
        );
        assert_eq!(weight_of_scale("a.b.biases").as_deref(), Some("a.b.weight"));
        assert_eq!(weight_of_scale("a.b.scales").as_deref(), Some("a.b.weight"));
        assert_eq!(biases_name("a.b.weight").as_deref(), Some("a.b.biases"));
        assert_eq!(parse("layers.1.ffn.experts.2.w1.biases").part, Part::Scale);
        assert_eq!(
            expert_tensor(2, 5, ExpertMat::W3, "scale"),
            "layers.2.ffn.experts.5.w3.scale"
        );
    }
}
