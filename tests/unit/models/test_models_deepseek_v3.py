"""The deepseek_v3 family (models/deepseek_v3/): config.json parsing and its refusals, the name table against the
tensors transformers saves, and megatron-core's MLA + sigmoid-routed MoE GPTModel (local spec, one process, fp32)
loaded through the table giving HF's logits."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.errors import UserError
from megatron_dapo.models.deepseek_v3 import FAMILY as FAM
from megatron_dapo.models.hf_config import ModelArch
from tests.hf_reference import assert_logits_close, router_topk_margin

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
"""YaRN as DeepSeek-V3 ships it (factor 40, original 4096, mscale = mscale_all_dim = 1), scaled to 128 positions:
original 32 puts most of the 4 rope frequencies of qk_rope_head_dim 8 in the interpolated / ramp range."""

CASES = [
    pytest.param({}, 5, id="q-lora-grouped-dense-first"),
    pytest.param(dict(q_lora_rank=None), 5, id="no-q-lora"),
    pytest.param(dict(rope_parameters=YARN), 5, id="yarn"),
    # V2-Lite-like: no q bottleneck, one group (no group choice), routed_scaling_factor 1, every layer MoE, top-2.
    # Sigmoid scores squeeze the routers' gaps: seed 7 (3 layers) is one whose top-k margins clear 1e-4 (1.1e-3).
    pytest.param(dict(q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=0,
                      num_experts_per_tok=2, num_hidden_layers=3, rope_parameters=YARN), 7,
                 id="v2-lite-like-ungrouped-yarn"),
    # Moonlight-16B-A3B's norms: rms_norm_eps 1e-5, but HF's q_a / kv_a layernorms keep 1e-6; latents of RMS ~0.01
    # (mean square ~1e-4), where 1e-5 instead of 1e-6 moves the normalised latent by ~4.5%.
    pytest.param(dict(rms_norm_eps=1e-5, latent_scale=0.01, n_group=1, topk_group=1), 5, id="moonlight-eps"),
]


def _config(**overrides) -> dict:
    return {**FAM.tiny_config, "model_type": "deepseek_v3", **overrides}


def _hf_model(seed: int, latent_scale: float = 1.0, **overrides):
    """A tiny random DeepseekV3ForCausalLM (fp32, eager) with weights that make each feature show in the logits:
    projections N(0, 1 / fan_in) (tests.hf_reference.sharpen_weights' rule), norms off 1, routers at std 0.3 (top-k
    decided by clear margins) and a non-zero e_score_correction_bias (std 0.1: it changes which experts are chosen);
    the q / kv down projections x `latent_scale` (small latents make the latent norms' eps show)."""
    torch.manual_seed(seed)
    fields = {k: v for k, v in _config(**overrides).items() if k != "model_type"}
    hf = FAM.hf_causal_lm()(FAM.hf_config(**fields, attn_implementation="eager")).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif p.dim() >= 2 and not name.endswith("embed_tokens.weight"):
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
                p.mul_(latent_scale)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return hf


def _hf_tensors(hf) -> dict[str, torch.Tensor]:
    """The tensors a saved checkpoint holds (on-disk expert names) plus the router buffers."""
    from megatron_dapo.models.hf_params import hf_state_dict

    return {**{n: b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")}, **hf_state_dict(hf)}


def test_parse_reads_the_mla_and_routing_fields():
    arch = ModelArch.from_hf(_config())
    o = dict(arch.family_options)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.q_size) == (4, 4, 24, 96)
    assert (o["q_lora_rank"], o["kv_lora_rank"], o["kv_down_rows"], o["kv_up_rows"], o["o_cols"]) == (48, 32, 40,
                                                                                                      112, 48)
    assert arch.moe_layers == (1, 2, 3) and arch.num_experts == 8 and arch.num_experts_per_tok == 4
    assert (o["n_group"], o["topk_group"], o["routed_scaling_factor"], o["shared_expert_size"]) == (4, 2, 2.5, 32)
    assert o["rope_type"] == "rope" and o["q_lora"] and not o["no_q_lora"]
    lite = ModelArch.from_hf(_config(q_lora_rank=None, rope_parameters=YARN))
    assert lite.option("no_q_lora") and lite.option("rope_type") == "yarn" and lite.option("yarn_factor") == 8.0


@pytest.mark.parametrize(("field", "value", "match"), [
    pytest.param("norm_topk_prob", False, "norm_topk_prob false is not supported", id="norm-topk"),
    pytest.param("rope_interleave", False, "rope_interleave false", id="rope-interleave"),
    pytest.param("attention_bias", True, "attention_bias true", id="attention-bias"),
    pytest.param("topk_group", 1, "topk_group 1 with num_experts_per_tok 4", id="group-top2"),
    pytest.param("topk_group", 5, "topk_group 5 exceeds n_group 4", id="group-count"),
    pytest.param("n_routed_experts", 10, "n_routed_experts 10 must be a positive multiple of n_group", id="groups"),
    pytest.param("first_k_dense_replace", 4, "first_k_dense_replace 4 leaves no MoE layer", id="all-dense"),
    pytest.param("n_shared_experts", 0, "n_shared_experts 0", id="no-shared"),
    pytest.param("scoring_func", "softmax", "scoring_func 'softmax'", id="scoring"),
    pytest.param("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_type 'llama3'", id="llama3-rope"),
    pytest.param("hidden_act", "gelu", "hidden_act", id="hidden-act"),
])
def test_unsupported_fields_are_refused_by_name(field, value, match):
    with pytest.raises(UserError, match=match):
        ModelArch.from_hf(_config(**{field: value}))


@pytest.mark.parametrize("overrides", [pytest.param({}, id="q-lora"), pytest.param(dict(q_lora_rank=None),
                                                                                    id="no-q-lora")])
def test_table_lists_exactly_the_saved_tensors(overrides, tmp_path):
    """The table, read for the parsed arch, names every tensor save_pretrained writes, with its shape (the router's
    e_score_correction_bias included)."""
    from safetensors import safe_open

    from megatron_dapo.weights.plan import hf_tensor_specs

    hf = _hf_model(0, **overrides)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    want = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            want |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    got = {spec.name: tuple(spec.shape) for spec in hf_tensor_specs(ModelArch.from_hf(hf.config), torch.float32)}
    assert got == want


SEQ = 128
"""Positions 0..127: with YARN's original 32 the interpolated frequencies turn visibly less than plain RoPE's."""


@pytest.mark.parametrize(("overrides", "seed"), CASES)
def test_logits_match_hf(overrides, seed):
    """megatron-core's MLA GPTModel (local spec, one process, fp32), loaded through the family's table
    (`weights.plan.iter_rank_shards`), gives HF's logits within `assert_logits_close`'s 1e-4 of their scale
    (tests/hf_reference.py argues it from fp32 summation orders; measured <= 3.3e-6 relative here)."""
    hf = _hf_model(seed, **overrides)
    arch = ModelArch.from_hf(hf.config)
    ids = torch.randint(0, arch.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    assert router_topk_margin(hf, ids) > 1e-4  # no top-k decision the two implementations' rounding could flip
    got, want = _megatron_logits(hf, ids), hf(ids).logits.detach()
    print(f"max |logit diff| {(got - want).abs().max().item():.3g} of scale {want.abs().max().item():.3g}")
    assert_logits_close(got, want)


def test_latent_norms_keep_hf_eps_under_another_rms_norm_eps(monkeypatch):
    """The moonlight-eps case's model, built with the latent norms at rms_norm_eps (1e-5) as megatron-core alone
    would: its logits leave HF's tolerance, so test_logits_match_hf[moonlight-eps] checks the eps."""
    hf = _hf_model(5, rms_norm_eps=1e-5, latent_scale=0.01, n_group=1, topk_group=1)
    ids = torch.randint(0, hf.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr("megatron_dapo.models.deepseek_v3.HF_NORM_EPS", 1e-5)  # the latent norms at rms_norm_eps
    with pytest.raises(AssertionError):
        assert_logits_close(_megatron_logits(hf, ids), hf(ids).logits.detach())


def _megatron_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """[b, s, vocab] logits of megatron-core's GPTModel for `hf` (local spec, one process, fp32), its weights loaded
    through the family's table (`weights.plan.iter_rank_shards`)."""
    from megatron_dapo.actor import destroy_parallel, init_parallel
    from megatron_dapo.distributed.parallel import ParallelLayout
    from megatron_dapo.models import build_gpt_model
    from megatron_dapo.weights.plan import iter_rank_shards

    arch = ModelArch.from_hf(hf.config)
    tensors = _hf_tensors(hf)
    init_parallel(seed=0)
    try:
        model = build_gpt_model(arch)
        shards = dict(iter_rank_shards(tensors.__getitem__, arch, ParallelLayout(), pp_rank=0, tp_rank=0))
        state = model.state_dict()
        assert sorted(shards) == sorted(k for k in state if not k.endswith("_extra_state"))
        with torch.no_grad():
            model.load_state_dict({**state, **shards})
            got = model(ids, torch.arange(SEQ).expand(2, SEQ), torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1))
    finally:
        destroy_parallel()
    return got[..., :arch.vocab_size]


@pytest.mark.parametrize(("rope", "fused"), [({}, False), (dict(rope_parameters=YARN), True)], ids=["rope", "yarn"])
def test_gpu_config_fuses_rope_only_for_yarn(monkeypatch, rope, fused):
    """On a CUDA + TE machine megatron-core's fused RoPE is on (models/config.py fusion_settings) except for MLA with
    plain RoPE, which MLATransformerConfig refuses ("apply_rope_fusion for MLA only works with YARN RoPE"): the GPU
    config of a plain-RoPE DeepSeek model (Moonlight, V2-Lite) must build, with the fusion off."""
    from megatron_dapo.models import config as config_module

    monkeypatch.setattr(config_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(config_module, "te_available", lambda: True)
    monkeypatch.setattr(config_module, "apex_wgrad_available", lambda: False)
    tc = config_module.transformer_config_from_arch(ModelArch.from_hf(_config(**rope)))
    assert tc.multi_latent_attention and tc.apply_rope_fusion is fused
    assert tc.rope_type == ("yarn" if fused else "rope")


@pytest.mark.parametrize("use_te", [False, True], ids=["local", "te"])
def test_latent_norm_eps_on_both_layer_implementations(monkeypatch, use_te):
    """Under rms_norm_eps 1e-5 (Moonlight) the latent norms fused into the up projections are built at HF's 1e-6 on
    the local spec and on megatron-core's TE spec (here with tests/te_standins.py's CPU twin of
    TELayerNormColumnParallelLinear, which reads its eps off the config as TE's does); every other norm at 1e-5."""
    from megatron_dapo.actor import destroy_parallel, init_parallel
    from megatron_dapo.models import build_gpt_model
    from tests.te_standins import patch_te_build

    if use_te:
        patch_te_build(monkeypatch)
        monkeypatch.setattr("megatron.core.transformer.moe.moe_utils.te_general_gemm", None, raising=False)
    arch = ModelArch.from_hf(_config(rms_norm_eps=1e-5))
    init_parallel(seed=0)
    try:
        model = build_gpt_model(arch, use_te=use_te)
    finally:
        destroy_parallel()
    eps = {name: getattr(m, "eps", getattr(m, "norm_eps", None)) for name, m in model.named_modules()}
    latent = {n: e for n, e in eps.items() if n.endswith(("linear_q_up_proj", "linear_kv_up_proj"))}
    assert len(latent) == 2 * arch.num_layers and set(latent.values()) == {1e-6}
    dense_norm = eps["decoder.layers.0.mlp.linear_fc1" if use_te else "decoder.layers.0.pre_mlp_layernorm"]
    assert dense_norm == 1e-5


def test_mla_at_tp2_needs_sequence_parallel():
    """MLA at TP > 1 without SP is refused before any model is built (the rope key's gradient would stay partial per
    TP rank: Megatron-LM issue #1699), naming the flag; with SP the layout passes."""
    from megatron_dapo.distributed.parallel import ParallelLayout, validate_layout

    arch = ModelArch.from_hf(_config())
    with pytest.raises(ValueError, match=r"multi-head latent attention at --tensor-model-parallel-size 2 needs "
                                         r"--sequence-parallel.*#1699"):
        validate_layout(arch, ParallelLayout(tp=2, dp=2, ep=2, etp=1))
    validate_layout(arch, ParallelLayout(tp=2, dp=2, ep=2, etp=1, sp=True))
