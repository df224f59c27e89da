//! `keep inspect` on a gpt-oss checkpoint (`fixtures/gpt-oss`, written by
//! `tools/oracle/gpt_oss_conformance.py --fixture`): the MXFP4 expert stacks (`*_blocks` U8
//! `[experts, rows, cols/32, 16]` with `*_scales`) are read as MXFP4 routed experts, every
//! layer has its experts, and every tensor has a role (sinks, projection and router biases).

use std::path::PathBuf;

use keep_checkpoint::Checkpoint;
use keep_convert::inspect::inspect;

#[test]
fn gpt_oss_experts_are_mxfp4_stacks_and_every_tensor_has_a_role() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gpt-oss");
    // The model's files only (the fixture's reference outputs are not model tensors).
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let r = inspect(&Checkpoint::open(dir.path()).unwrap());
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert!(r.refused.is_empty(), "{:?}", r.refused);
    assert_eq!(r.experts_per_layer.len(), 3);
    assert!(r.experts_per_layer.values().all(|&n| n == 4));
    // 3 layers × (gate-up 64x64 + down 64x32) × 4 experts, at 4.25 bits a weight.
    let fp4 = &r.by_role_format["routed_expert"]["fp4 (mxfp4)"];
    assert_eq!((fp4.tensors, fp4.weights), (6, 3 * 4 * (64 * 64 + 64 * 32)));
    assert_eq!(fp4.bits_per_weight, 4.25);
    for role in ["attn_sink", "router_bias", "router_weight"] {
        assert!(r.by_role_format.contains_key(role), "{role}");
    }
}
