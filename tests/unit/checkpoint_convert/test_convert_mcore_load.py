"""megatron-core's own GPTModel loads `checkpoint_convert hf-to-mcore` output with logits equal to HF's, for every
registered family.

Nothing of megatron_dapo sits in the loading path: the TransformerConfig is written out here from the
config.json fields (and the HF model's tensor names for the optional q/k/v bias and q/k norm), the layer
spec is megatron-core's `get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=...)`, the model is
`GPTModel` (llama3 rope scaling through its `rope_scaling` / `rope_scaling_factor` arguments) and the weights
come from `dist_checkpointing.load({"model": model.sharded_state_dict()}, dir)`: what Megatron-LM does with the
converter's output. The checkpoint is written for TP2 x PP2 (an MoE one checked for EP2 too) and loaded at TP1 x
EP1 (torch_dist is layout-independent; tests/dist/weights_dist_ckpt.py loads an MoE one into this model at EP2).
Qwen3-MoE gets megatron-core's MoE fields and its per-layer block spec (`get_gpt_decoder_block_spec`), every layer
MoE and with a dense layer 1 (per-layer checkpoint keys), under the local spec (converter output written with
`--transformer-impl local`) and under the TE spec (the default output; TE's modules replaced by the CPU twins of
tests/te_standins.py). Process groups are megatron-core's own (one gloo rank).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from checkpoint_convert.cli import main as convert_main
from megatron_dapo.models.hf_params import hf_state_dict
from megatron_dapo.models.registry import families
from tests.dist.actor_common import FAMILIES
from tests.ports import free_port
from tests.te_standins import patch_te_build
from tests.unit.checkpoint_convert.test_convert import load_common, make_tiny_hf


@pytest.fixture(scope="module")
def mcore_world():
    """torch.distributed (gloo, 1 rank) and megatron-core parallel_state at TP1 x PP1, torn down after."""
    from megatron.core import parallel_state, tensor_parallel

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    # dropout is 0: the attention's RNG fork needs a tracker to exist, megatron-core's CUDA-free inference one will do
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


def moe_config(config: dict) -> dict:
    """megatron-core's MoE fields of a Qwen3-MoE config.json, written out: layer i is MoE unless in
    mlp_only_layers or off the decoder_sparse_step grid (HF's rule); routing = softmax, top-k, renormalised
    (pre_softmax False) when norm_topk_prob; the allgather dispatcher (no CUDA stream on the CPU)."""
    experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 5 writes the second
    if not experts:
        return {}
    n, step, dense = config["num_hidden_layers"], config.get("decoder_sparse_step", 1), config.get("mlp_only_layers")
    freq = [int(i not in (dense or []) and (i + 1) % step == 0) for i in range(n)]
    return dict(num_moe_experts=experts, moe_router_topk=config["num_experts_per_tok"],
                moe_ffn_hidden_size=config["moe_intermediate_size"], moe_layer_freq=1 if all(freq) else freq,
                moe_router_pre_softmax=not config["norm_topk_prob"], moe_router_score_function="softmax",
                moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather")


def mla_config(config: dict) -> dict:
    """megatron-core's multi-head latent attention and DeepSeek-V3 MoE fields of a DeepSeek-V3 config.json, written
    out (MLATransformerConfig): the latent ranks and head dims, plain RoPE (megatron-core's MLA default is YaRN);
    the first `first_k_dense_replace` layers dense; sigmoid scores with the correction bias (`expert_bias`, not
    updated), group-limited top-k where groups are dropped, renormalised and scaled by routed_scaling_factor; the
    shared experts; the allgather dispatcher."""
    if "kv_lora_rank" not in config:
        return {}
    n, first, groups, keep = (config[k] for k in ("num_hidden_layers", "first_k_dense_replace", "n_group",
                                                   "topk_group"))
    return dict(multi_latent_attention=True, q_lora_rank=config["q_lora_rank"], kv_lora_rank=config["kv_lora_rank"],
                qk_head_dim=config["qk_nope_head_dim"], qk_pos_emb_head_dim=config["qk_rope_head_dim"],
                v_head_dim=config["v_head_dim"], rope_type="rope", rotary_base=rope_kwargs(config)["rotary_base"],
                mscale_all_dim=0.0, qk_layernorm=True,
                num_moe_experts=config["n_routed_experts"], moe_router_topk=config["num_experts_per_tok"],
                moe_ffn_hidden_size=config["moe_intermediate_size"], moe_layer_freq=[int(i >= first) for i in range(n)],
                moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                moe_router_num_groups=groups if keep < groups else None,
                moe_router_group_topk=keep if keep < groups else None,
                moe_router_topk_scaling_factor=config["routed_scaling_factor"],
                moe_shared_expert_intermediate_size=config["n_shared_experts"] * config["moe_intermediate_size"],
                moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather")


def transformer_config(config: dict, hf_names: set[str], **parallel):
    """megatron-core TransformerConfig of an HF decoder (dense, Qwen3-MoE, or DeepSeek-V3's MLATransformerConfig),
    written out field by field; `parallel`: its parallel sizes (e.g. expert_model_parallel_size)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    heads = config["num_attention_heads"]
    mla = mla_config(config)
    qk_norm = "model.layers.0.self_attn.q_norm.weight" in hf_names
    fields = mla if mla else dict(qk_layernorm=qk_norm, **moe_config(config))
    return (MLATransformerConfig if mla else TransformerConfig)(
        **fields, **parallel,
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"], num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or config["hidden_size"] // heads,
        normalization="RMSNorm", layernorm_epsilon=config["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias="model.layers.0.self_attn.q_proj.bias" in hf_names,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, use_cpu_initialization=True,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )


def rope_kwargs(config: dict) -> dict:
    """GPTModel rope arguments from config.json: base, and Llama 3's scaling factor when rope_type is llama3."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope.get("rope_theta"))
    kwargs = dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=theta)
    if rope.get("rope_type", rope.get("type")) == "llama3":
        kwargs |= dict(rope_scaling=True, rope_scaling_factor=rope["factor"])
    return kwargs


MLA_FAMILIES = tuple(f for f in FAMILIES if "kv_lora_rank" in families()[f].tiny_config)
"""Families with multi-head latent attention: megatron-core's own local MLA layer names its latent norms otherwise
than its TE layer (`q_layernorm` vs `linear_q_up_proj.layer_norm_weight`) and keys every pre-MLP norm apart; the
converter writes the TE layer's keys (megatron_dapo's local MLA layer takes those too, but for an MoE layer's
pre-MLP norm under --transformer-impl local: models/mla_local.py), so their case is megatron-core's TE spec."""
CASES = ([(f, tied, {}, "transformer_engine" if f in MLA_FAMILIES else "local")
          for f in FAMILIES for tied in (False, True)]
         + [("qwen3_moe", False, {"mlp_only_layers": [1]}, "local")]
         + [("qwen3_moe", False, overrides, "transformer_engine") for overrides in ({}, {"mlp_only_layers": [1]})])
"""Every family tied and untied; Qwen3-MoE also with a dense layer among MoE ones (per-layer checkpoint keys); each
into megatron-core's local spec, and Qwen3-MoE into its TE spec too (an MoE layer's pre-MLP norm is the one key
that differs: hf-to-mcore writes TE's by default, the local spec's under --transformer-impl local); an MLA family
into the TE spec only (MLA_FAMILIES)."""


@pytest.mark.parametrize(("model_type", "tied", "overrides", "impl"), CASES,
                         ids=[f"{f}-{'tied' if t else 'untied'}{'-mixed' if o else ''}{'-te' if i != 'local' else ''}"
                              for f, t, o, i in CASES])
def test_megatron_core_gpt_model_loads_converter_output(tmp_path: Path, mcore_world, monkeypatch, model_type: str,
                                                        tied: bool, overrides: dict, impl: str) -> None:
    """The TE spec is megatron-core's own (`get_gpt_decoder_block_spec(use_transformer_engine=True)`, TEGroupedMLP
    experts) with CPU twins of TE's modules (tests/te_standins.py); converter output with its default keys."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs

    hf = make_tiny_hf(tmp_path / "hf", tied=tied, model_type=model_type, overrides=overrides)
    moe = "num_experts_per_tok" in families()[model_type].tiny_config
    experts = ["--ep", "2"] if moe else []
    keys = ["--transformer-impl", "local"] if impl == "local" and moe else []
    assert convert_main(["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"),
                         "--tp", "2", "--pp", "2", *experts, *keys]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    names = set(hf_state_dict(hf))
    te = impl == "transformer_engine"
    if te:  # what a TE build runs: TE modules (here their CPU twins), grouped-GEMM experts
        patch_te_build(monkeypatch)
    tconfig = transformer_config(config, names, **({"moe_grouped_gemm": True} if te else {}))
    if tconfig.num_moe_experts:  # per-layer MoE or dense specs (megatron-core's own choice from moe_layer_freq)
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(tconfig, use_transformer_engine=te,
                                                          normalization="RMSNorm")
        # megatron-core 0.16.1's router reads this module global, bound only when TransformerEngine imports
        monkeypatch.setattr("megatron.core.transformer.moe.moe_utils.te_general_gemm", None, raising=False)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=tconfig.qk_layernorm)
    # megatron-core's rotary embedding allocates on torch.cuda.current_device() (MLA's at build, GPTModel's in the
    # forward): point it at the CPU (the one CUDA call on this path; megatron_dapo's CPU shims are not used here)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    padded_vocab = load_common(tmp_path / "mc" / "release")["args"].padded_vocab_size  # Megatron-LM reads it so
    model = GPTModel(tconfig, spec, vocab_size=padded_vocab,
                     max_sequence_length=config["max_position_embeddings"],
                     share_embeddings_and_output_weights=config["tie_word_embeddings"], **rope_kwargs(config))
    # common.pt holds Megatron-LM's args (an argparse.Namespace): megatron.core allow-lists it for torch.load when
    # imported (megatron/core/safe_globals.py), but inside this pytest process it was found missing from the list
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(tmp_path / "mc" / "release"))
    model.load_state_dict(state["model"])  # Megatron-LM's layout: the model under "model", its args beside
    model.eval()
    ids = torch.randint(0, config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 1, 13, 13, dtype=torch.bool).triu(1)
    with torch.no_grad():
        got = model(ids, torch.arange(13).expand(2, 13), mask)[..., :config["vocab_size"]]
        want = hf(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
