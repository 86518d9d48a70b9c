"""The model families on megatron-core: config mapping, layer-spec choice, and logits equal to HF transformers
(every registered family, tied and untied)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_dapo.actor import destroy_parallel, init_parallel
from megatron_dapo.distributed.parallel import padded_vocab_size
from megatron_dapo.models import (
    ModelArch,
    build_gpt_model,
    get_layer_spec,
    te_available,
    transformer_config_from_arch,
)
from tests.dist.actor_common import FAMILIES, draw_routers, hf_to_full_mcore, mcore_shards_for_rank, tiny_hf_model
from tests.hf_reference import assert_logits_close, router_topk_margin, sharpen_weights


def test_transformer_config_maps_every_qwen2_field():
    arch = ModelArch(model_type="qwen2",
                     vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=8,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=5e5)
    cfg = transformer_config_from_arch(arch, tp=2, pp=2, calculate_per_token_loss=True)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 64, 96)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (8, 2, 16)
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-5
    assert cfg.gated_linear_unit and cfg.activation_func is F.silu
    assert cfg.add_qkv_bias and not cfg.add_bias_linear
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 2)
    assert cfg.calculate_per_token_loss and cfg.hidden_dropout == 0 and cfg.attention_dropout == 0


def test_transformer_config_rejects_bad_layout_and_fields():
    arch = ModelArch(model_type="qwen2",
                     vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size"):
        transformer_config_from_arch(arch, pp=2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        transformer_config_from_arch(arch, tp=4)
    with pytest.raises(TypeError, match="not TransformerConfig fields"):
        transformer_config_from_arch(arch, not_a_field=1)


def test_layer_spec_choice():
    spec = get_layer_spec(use_te=False)
    names = str(spec)
    assert "TENorm" not in names and "TELayerNormColumnParallelLinear" not in names
    if not te_available():
        assert "ColumnParallelLinear" in str(get_layer_spec(None))  # CPU / no TE: the local spec
        with pytest.raises(ImportError, match="transformer_engine"):
            get_layer_spec(use_te=True)


def test_build_gpt_model_needs_parallel_state():
    arch = ModelArch.from_hf(tiny_hf_model().config)
    with pytest.raises(RuntimeError, match="init_parallel"):
        build_gpt_model(arch)


SEQ = 128
"""Tokens per sequence in the logits test. Positions reach 127: llama3's scaled rope frequencies (megatron-core's
wavelengths above 8192 / 4 = 2048 tokens) then turn q and k visibly less than plain RoPE's. In the tiny llama
(head_dim 16, theta 1e4) the two lowest of 8 frequency pairs (wavelengths 6283 and 19869) turn 0.79 x and 0.875 x
less: 0.1 and 0.035 rad at position 127, which `sharpen_weights`' q/k (entries ~3) turn into score changes of ~0.5
(at 17 tokens, HF's init weights: logits 1.5e-5 apart, under the old atol of 2e-5)."""


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_logits_match_hf(model_type, tie):
    """megatron-core's GPTModel of each family gives HF's logits on sharpened weights (`sharpen_weights`: each family
    feature, llama3 rope scaling, Qwen3's q/k norms, head_dim != hidden / heads, Qwen2's q/k/v biases, MoE routing,
    moves them by 0.2 to 1.6 of their scale), over 128 positions (`SEQ`)."""
    hf = sharpen_weights(tiny_hf_model(model_type, tie=tie, seed=2))
    arch = ModelArch.from_hf(hf.config)
    ids = torch.randint(0, arch.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    if arch.is_moe:  # wide routers; a top-k decision within ~1e-6 could go either way under either's rounding
        draw_routers(hf, 0.3)
        assert router_topk_margin(hf, ids) > 1e-4
    init_parallel(seed=0)
    try:
        model = build_gpt_model(arch)
        with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
            build_gpt_model(arch, tp=2)
        shards = mcore_shards_for_rank(hf_to_full_mcore(hf.state_dict(), arch), arch, tp=1, tp_rank=0, pp=1,
                                       pp_rank=0, padded_vocab=padded_vocab_size(arch.vocab_size, 1))
        params = {**dict(model.named_parameters()),  # and DeepSeek-V3's router bias, a buffer
                  **{n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}}
        assert sorted(params) == sorted(shards)
        assert params["embedding.word_embeddings.weight"].shape[0] == padded_vocab_size(arch.vocab_size, 1)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(shards[name])
            pos = torch.arange(SEQ).expand(2, SEQ)
            mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
            got = model(ids, pos, mask)[..., :arch.vocab_size]
            want = hf(ids).logits
    finally:
        destroy_parallel()
    assert_logits_close(got, want)
