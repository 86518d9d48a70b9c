"""The qwen3_moe family on its own: config.json parsing against HF's own layer choice, parameter counts, the
expert-parallel layout rules, the on-disk names of transformers' fused experts, and logits equal to HF for the
layouts the shared family tests do not build (a mixed dense / MoE model, norm_topk_prob false)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import destroy_parallel, init_parallel
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size, validate_layout
from megatron_dapo.models import ModelArch, build_gpt_model, family, transformer_config_from_arch
from megatron_dapo.models.hf_params import hf_parameters
from megatron_dapo.weights.mapping import canonical_mcore_name, resolve_mcore_name
from megatron_dapo.weights.plan import stage_tensors
from tests.dist.actor_common import draw_routers, hf_to_full_mcore, mcore_shards_for_rank, tiny_hf_model
from tests.hf_reference import assert_logits_close, router_topk_margin, sharpen_weights

FAM = family("qwen3_moe")

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, router_aux_loss_coef=0.001, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False,
    rms_norm_eps=1e-6)
"""Qwen3-30B-A3B's config.json (the model card's shapes)."""


def _config(**fields) -> dict:
    return {**FAM.tiny_config, "model_type": "qwen3_moe", **fields}


@pytest.mark.parametrize("dense, step", [([], 1), ([1], 1), ([], 2), ([0, 3], 2)])
def test_moe_layers_are_the_layers_hf_builds_sparse(dense, step):
    """ModelArch.moe_layers = the layers whose HF decoder layer holds a Qwen3MoeSparseMoeBlock."""
    hf = FAM.hf_causal_lm()(FAM.hf_config(**_config(mlp_only_layers=dense, decoder_sparse_step=step)))
    want = tuple(i for i, layer in enumerate(hf.model.layers) if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock")
    assert want, "this parametrisation builds no MoE layer: it would check nothing"
    arch = ModelArch.from_hf(hf.config)
    assert arch.moe_layers == want
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_qwen3_30b_a3b_sizes():
    """30.5B parameters, 3.3B active (the model card's "30.5B total, 3.3B activated")."""
    arch = ModelArch.from_hf(QWEN3_30B_A3B)
    assert arch.all_layers_moe and arch.moe_layers == tuple(range(48))
    assert 30.4e9 < arch.num_parameters() < 30.6e9
    assert 3.2e9 < arch.num_parameters(active=True) < 3.4e9


@pytest.mark.parametrize("field, value, match", [
    ("shared_expert_intermediate_size", 512, "shared_expert_intermediate_size"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("attention_bias", True, "attention_bias"),
    ("mlp_only_layers", [7], "mlp_only_layers"),
    ("decoder_sparse_step", 0, "decoder_sparse_step"),
    ("norm_topk_prob", "yes", "norm_topk_prob"),
    ("moe_intermediate_size", None, "moe_intermediate_size"),
])
def test_unsupported_config_fields_are_named(field, value, match):
    config = _config(**{field: value})
    if value is None:
        del config[field]
    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf(config)


def test_every_layer_dense_is_refused():
    with pytest.raises(ValueError, match="mlp_only_layers / decoder_sparse_step leave none"):
        ModelArch.from_hf(_config(mlp_only_layers=[0, 1, 2, 3]))


def test_transformers_5_num_local_experts_is_read():
    config = _config()
    config["num_local_experts"] = config.pop("num_experts")
    assert ModelArch.from_hf(config).num_experts == 8


@pytest.mark.parametrize("layout, match", [
    (dict(ep=3, dp=3), "num_experts \\(8\\) is not divisible by --expert-model-parallel-size \\(3\\)"),
    (dict(tp=2, sp=False), "needs --sequence-parallel"),
    (dict(ep=2, etp=1, dp=1), "must divide"),
    (dict(etp=3, dp=3), "moe_intermediate_size \\(32\\) is not divisible by --expert-tensor-parallel-size \\(3\\)"),
])
def test_expert_layout_errors_name_the_flag(layout, match):
    arch = ModelArch.from_hf(_config())
    with pytest.raises(ValueError, match=match):
        validate_layout(arch, ParallelLayout(**layout))


def test_expert_flags_are_refused_for_a_dense_model():
    arch = ModelArch.from_hf({**family("qwen3").tiny_config, "model_type": "qwen3"})
    with pytest.raises(ValueError, match="has no experts"):
        validate_layout(arch, ParallelLayout(ep=2, dp=2))


def test_expert_grid_sizes():
    layout = ParallelLayout(tp=2, sp=True, dp=4, ep=4, etp=1)
    assert (layout.expert_tp, layout.expert_dp) == (1, 2)
    assert ParallelLayout(tp=2, sp=True, dp=2, ep=2).expert_dp == 1  # etp defaults to tp


def test_transformer_config_routing_fields():
    """norm_topk_prob true -> top-k of the logits then softmax (pre_softmax False); false -> softmax first."""
    for norm, pre in ((True, False), (False, True)):
        arch = ModelArch.from_hf(_config(norm_topk_prob=norm, mlp_only_layers=[1]))
        cfg = transformer_config_from_arch(arch, layout=ParallelLayout(ep=1))
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (8, 2, 32)
        assert cfg.moe_router_pre_softmax is pre and cfg.moe_layer_freq == [1, 0, 1, 1]
        assert cfg.ffn_hidden_size == 96 and cfg.moe_aux_loss_coeff == 0.001


def test_stage_tensors_split_experts_over_ep_ranks():
    arch = ModelArch.from_hf(_config(mlp_only_layers=[1]))
    layout = ParallelLayout(ep=2, dp=2)
    for ep_rank in range(2):
        tensors = [t for t in stage_tensors(arch, layout, 0, ep_rank) if t.entry.per_expert]
        assert {t.global_expert for t in tensors} == set(range(4 * ep_rank, 4 * ep_rank + 4))
        assert {t.global_layer for t in tensors} == {0, 2, 3}  # layer 1 is dense
        for t in tensors:
            local = int(t.mcore_name.split("local_experts.")[1].split(".")[0])
            assert local == t.global_expert - 4 * ep_rank
            assert all(f"experts.{t.global_expert}." in name for name in t.hf_names)
    dense = [t.mcore_name for t in stage_tensors(arch, layout, 0) if "linear_fc1" in t.mcore_name
             and "experts" not in t.mcore_name]
    assert dense == ["decoder.layers.1.mlp.linear_fc1.weight"]


def test_grouped_gemm_names_resolve_to_the_local_expert_names():
    arch = ModelArch.from_hf(_config())
    assert canonical_mcore_name("decoder.layers.2.mlp.experts.linear_fc2.weight3", arch) == (
        "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight")
    entry, layer, expert = resolve_mcore_name("decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight", arch)
    assert (layer, expert, entry.kind) == (0, 5, "fc1")


def test_hf_parameters_are_views_under_the_saved_names(tmp_path):
    """The names save_pretrained writes, each a view of the fused parameter (a write lands in the model)."""
    from safetensors import safe_open

    hf = tiny_hf_model("qwen3_moe", seed=1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    with safe_open(next(tmp_path.glob("*.safetensors")), framework="pt") as f:
        saved = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    views = hf_parameters(hf)
    assert sorted(views) == sorted(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(views[name], tensor, rtol=0, atol=0)
    with torch.no_grad():
        views["model.layers.2.mlp.experts.5.up_proj.weight"].fill_(3.0)
    fused = hf.model.layers[2].mlp.experts.gate_up_proj[5]
    assert (fused[32:] == 3.0).all() and not (fused[:32] == 3.0).any()


@pytest.mark.parametrize("overrides", [dict(mlp_only_layers=[1]), dict(norm_topk_prob=False),
                                       dict(decoder_sparse_step=2)],
                         ids=["mixed-dense-moe", "no-topk-renormalisation", "sparse-step-2"])
def test_logits_match_hf(overrides):
    """megatron-core's MoE GPTModel (single process) gives HF's logits: routing, experts, dense layers in between.
    Sharpened weights (`sharpen_weights`) and routers drawn at std 0.3: a routing rule off (top-k, the
    renormalisation, the score function, which layers are MoE) moves the logits by 0.2 to 1.2 of their scale."""
    hf = draw_routers(sharpen_weights(tiny_hf_model("qwen3_moe", seed=4, **overrides)), 0.3)
    arch = ModelArch.from_hf(hf.config)
    ids = torch.randint(0, arch.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    assert router_topk_margin(hf, ids) > 1e-4  # no top-k decision the two implementations' rounding could flip
    init_parallel(seed=0)
    try:
        model = build_gpt_model(arch)
        shards = mcore_shards_for_rank(hf_to_full_mcore(hf.state_dict(), arch), arch, tp=1, tp_rank=0, pp=1,
                                       pp_rank=0, padded_vocab=padded_vocab_size(arch.vocab_size, 1))
        params = dict(model.named_parameters())
        assert sorted(params) == sorted(shards)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(shards[name])
            got = model(ids, torch.arange(19).expand(2, 19), torch.ones(1, 1, 19, 19, dtype=torch.bool).triu(1))
            want = hf(ids).logits
    finally:
        destroy_parallel()
    assert_logits_close(got[..., :arch.vocab_size], want)
