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
from tests.dist.actor_common import FAMILIES, hf_to_full_mcore, mcore_shards_for_rank, tiny_hf_model


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


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_logits_match_hf(model_type, tie):
    hf = tiny_hf_model(model_type, tie=tie, seed=2)
    arch = ModelArch.from_hf(hf.config)
    init_parallel(seed=0)
    try:
        model = build_gpt_model(arch)
        with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
            build_gpt_model(arch, tp=2)
        shards = mcore_shards_for_rank(hf_to_full_mcore(hf.state_dict(), arch), arch, tp=1, tp_rank=0, pp=1,
                                       pp_rank=0, padded_vocab=padded_vocab_size(arch.vocab_size, 1))
        params = dict(model.named_parameters())
        assert sorted(params) == sorted(shards)
        assert params["embedding.word_embeddings.weight"].shape[0] == padded_vocab_size(arch.vocab_size, 1)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(shards[name])
            ids = torch.randint(0, arch.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
            pos = torch.arange(17).expand(2, 17)
            mask = torch.ones(1, 1, 17, 17, dtype=torch.bool).triu(1)
            got = model(ids, pos, mask)[..., :arch.vocab_size]
            want = hf(ids).logits
    finally:
        destroy_parallel()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
