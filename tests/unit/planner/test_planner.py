"""The memory planner against Korthikanti et al. 2022's activation formulas, against the bytes the real
megatron-core model saves for backward (CPU, local spec), and the launchers' --dry-run plans."""

from __future__ import annotations

import io
import json
import math
import sys
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from megatron_dapo.arguments import build_parser
from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import family, model_types
from megatron_dapo.planner import activations, colocated, report, stages
from megatron_dapo.startup import dry_run, plan_from_flags
from tests.unit.launch.test_examples import REPO, launcher_args

# ---- Korthikanti et al. 2022, Sec. 4 (fp16 activations, 1-byte dropout masks), written out ------------


def paper_layer_bytes(s, b, h, a, t=1, sp=False, selective=False):
    """Eq. (1)-(4): 34sbh + 5as^2b; TP: sbh(10 + 24/t + 5as/(ht)); TP + SP: (34sbh + 5as^2b)/t;
    selective recompute drops the 5as^2b term."""
    attn_sq = 0 if selective else 5 * a * s * s * b
    if t == 1:
        return 34 * s * b * h + attn_sq
    if sp:
        return (34 * s * b * h + attn_sq) / t
    return s * b * h * 10 + (24 * s * b * h + attn_sq) / t


def gpt_spec(h: int, a: int) -> activations.ActivationSpec:
    """The paper's GPT layer: MHA, 4h GeLU MLP, LayerNorm (input only + next GEMM input), dropout, no RoPE."""
    return activations.ActivationSpec(hidden=h, ffn=4 * h, heads=a, q=h, kv=h, head_dim=h // a, gated=False,
                                  attention="unfused", norm_tensors=2, norm_stats_bytes=0, dropout=True,
                                  rope="none", bytes_per_element=2)


@pytest.mark.parametrize("s,b,h,a,t,sp", [
    pytest.param(2048, 1, 12288, 96, 1, False, id="gpt3-175b-tp1"),
    pytest.param(2048, 1, 12288, 96, 8, False, id="gpt3-175b-tp8"),
    pytest.param(2048, 1, 12288, 96, 8, True, id="gpt3-175b-tp8-sp"),
    pytest.param(4096, 3, 5120, 40, 4, True, id="tp4-sp-b3"),
])
def test_layer_activations_match_korthikanti(s, b, h, a, t, sp):
    layout = ParallelLayout(tp=t, sp=sp)
    spec = gpt_spec(h, a)
    got = activations.layer_activation_bytes(spec, layout, tokens=s * b, seq_len=s)
    assert got == pytest.approx(paper_layer_bytes(s, b, h, a, t, sp), rel=1e-12)
    sel = ParallelLayout(tp=t, sp=sp, recompute_granularity="selective")
    got_sel = activations.layer_activation_bytes(spec, sel, tokens=s * b, seq_len=s, selective=True)
    # the paper's selective recompute keeps everything but the attention core: 34sbh (/t with SP)
    assert got_sel == pytest.approx(paper_layer_bytes(s, b, h, a, t, sp, selective=True), rel=1e-12)
    # full recompute keeps only each layer's input, 2sbh (/t with SP) (Sec. 4.3 / Table 2)
    assert activations.recompute_input_bytes(spec, layout, tokens=s * b) == pytest.approx(
        2 * s * b * h / (t if sp else 1))


def test_flash_attention_has_no_quadratic_term():
    """TE's fused attention keeps O(s) per row: doubling the row length at a fixed token budget leaves the
    layer's bytes unchanged, except the RoPE tables (4 s d), while the local spec's grow by a s^2 b."""
    arch = ModelArch.from_hf(REPO / "examples/models/qwen2.5-32B")
    layout = ParallelLayout(tp=8, pp=2, sp=True)
    te = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=2)
    local = activations.ActivationSpec.for_arch(arch, transformer_impl="local", bytes_per_element=2)
    short, long = 4096, 16384
    rope = 4 * (long - short) * arch.head_dim * 2
    d_te = (activations.layer_activation_bytes(te, layout, tokens=16384, seq_len=long)
            - activations.layer_activation_bytes(te, layout, tokens=16384, seq_len=short))
    assert d_te == pytest.approx(rope)
    d_local = (activations.layer_activation_bytes(local, layout, tokens=16384, seq_len=long)
               - activations.layer_activation_bytes(local, layout, tokens=16384, seq_len=short))
    # softmax output [b, a/t, s, s] in bf16: tokens x a/t x (s_long - s_short) x 2 B
    assert d_local == pytest.approx(16384 * (arch.num_heads / 8) * (long - short) * 2 + rope)


# ---- against the tensors megatron-core actually saves (CPU, local spec, fp32) ----------------------------

TINY = ModelArch(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16)
RECOMPUTE = {
    "none": {},
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}


def saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd still holds at the end of one forward, parameters excluded. A tensor
    saved by a branch whose graph dies during the forward (the MoE load-balancing loss's int64 top-k indices
    feed only integer counts) is freed before backward and its memory may be reused by a later saved tensor:
    only the tensors still alive count, each storage once."""
    saved: list[weakref.ref] = []

    def pack(t):
        saved.append(weakref.ref(t))
        return t

    b, s = tokens.shape
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(diagonal=1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, torch.arange(s).expand(b, s), mask)
    alive = {st.data_ptr(): st.nbytes() for t in (r() for r in saved) if t is not None
             for st in (t.untyped_storage(),)}
    del out
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in alive.items() if ptr not in params)


@pytest.fixture(scope="module")
def world():
    from megatron_dapo.actor import destroy_parallel, init_parallel

    init_parallel(seed=0)
    yield
    destroy_parallel()


def _family_tiny(model_type: str, **fields) -> ModelArch:
    return ModelArch.from_hf({**family(model_type).tiny_config, **fields, "model_type": model_type})


# Every registered family on its tiny config (qwen3_moe's: all-MoE, 8 experts, top-2, expert width 32), except that
# TINY's family is measured on TINY (2 layers), the model this test was written for.
FAMILY_ARCHS: dict[str, Callable[[], ModelArch]] = {model_type: partial(_family_tiny, model_type)
                                                    for model_type in model_types()}
FAMILY_ARCHS[TINY.model_type] = lambda: TINY
# Variants on top. Qwen3's tiny config: 2 query groups of 2 heads (the query reshape copies q before its norm); the
# variants without GQA and with one group keep q a view of the fused qkv output. The MoE's mixed layout: layer 1
# dense, 96 wide.
# DeepSeek-V3's MLA without q_lora_rank (DeepSeek-V2-Lite, Moonlight: one q projection, no q latent).
ARCHS = {
    **FAMILY_ARCHS,
    "qwen3-mha": lambda: _family_tiny("qwen3", num_key_value_heads=4, head_dim=16),
    "qwen3-one-group": lambda: _family_tiny("qwen3", num_key_value_heads=1),
    "qwen3_moe-mixed": lambda: _family_tiny("qwen3_moe", mlp_only_layers=[1]),
    "deepseek_v3-no-q-lora": lambda: _family_tiny("deepseek_v3", q_lora_rank=None),
}
UNREGISTERED = "the deepseek_v3 family is not registered yet (docs/MODELS.md)"
NEEDS_DEEPSEEK_V3 = [pytest.mark.skipif("deepseek_v3" not in model_types(), reason=UNREGISTERED),
                     pytest.mark.designed_skip(UNREGISTERED)]
SAVED_TENSOR_CASES = [pytest.param(a, r, id=f"{a}-{r}") for a in FAMILY_ARCHS for r in RECOMPUTE] + [
    pytest.param(a, "none", id=f"{a}-none") for a in ("qwen3-mha", "qwen3-one-group", "qwen3_moe-mixed")] + [
    pytest.param("qwen3_moe-mixed", "full-block", id="qwen3_moe-mixed-full-block")] + [
    pytest.param("deepseek_v3-no-q-lora", r, id=f"deepseek_v3-no-q-lora-{r}", marks=NEEDS_DEEPSEEK_V3)
    for r in RECOMPUTE]


@pytest.mark.parametrize("arch_name,name", SAVED_TENSOR_CASES)
def test_planner_matches_saved_tensors(world, arch_name, name):
    """Exact to the byte except selective recompute, whose checkpoints also save an int32 scalar per layer
    (8 B for the 2-layer qwen2 model); Qwen3's per-head q/k norms included. The MoE models (EP1, alltoall
    dispatcher, SequentialMLP, load-balancing loss on) route data-dependent token counts to each expert: the
    plan counts their sum, T x k copies."""
    from megatron_dapo.models.gpt import build_gpt_model

    arch = ARCHS[arch_name]()
    layout = ParallelLayout(**RECOMPUTE[name])
    model = build_gpt_model(arch, layout=layout, use_te=False)
    b, s = 3, 40
    measured = saved_activation_bytes(model, torch.randint(0, arch.vocab_size, (b, s)))
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="local", bytes_per_element=4)
    assert spec.qk_norm == arch.qk_layernorm
    inputs = stages.PlanInputs(tokens_per_micro_batch=b * s, max_seq_len=s, params_dtype="float32")
    (plan,) = stages.plan_stages(arch, layout, inputs, spec)
    predicted = plan.lines["  activations per micro-batch"]
    assert abs(predicted - measured) <= (4 * arch.num_layers if name == "selective" else 0), (predicted, measured)
    if name == "full-uniform":  # and the recompute saves what the paper says: one input of s b h per layer (fp32)
        layer = activations.layer_activation_bytes(spec, layout, tokens=b * s, seq_len=s,
                                               moe_factor=1.0 if arch.is_moe else None)
        assert predicted < 0.15 * layer * arch.num_layers


def _ep2_saved_bytes_worker() -> None:
    """torchrun rank (EP 2 x DP 2, gloo): the tiny all-MoE qwen3_moe's saved bytes on this rank against the plan at
    the routed-token factor measured here (this rank's token copies over T x k, averaged over the layers)."""
    import torch.distributed as dist

    from megatron_dapo.actor import destroy_parallel, init_parallel
    from megatron_dapo.models.gpt import build_gpt_model

    init_parallel(ep=2, seed=0)
    arch = ARCHS["qwen3_moe"]()
    model = build_gpt_model(arch, layout=ParallelLayout(), use_te=False)
    routed: list[int] = []
    for module in model.modules():
        if type(module).__name__ == "SequentialMLP":  # its input: the token copies this rank's experts take
            module.register_forward_pre_hook(lambda _, args: routed.append(args[0].shape[0]))
    b, s = 3, 40
    torch.manual_seed(10 + dist.get_rank())
    measured = saved_activation_bytes(model, torch.randint(0, arch.vocab_size, (b, s)))
    factor = sum(routed) / len(routed) / (b * s * arch.num_experts_per_tok)
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="local", bytes_per_element=4)
    inputs = stages.PlanInputs(tokens_per_micro_batch=b * s, max_seq_len=s, params_dtype="float32",
                                moe_capacity_factor=factor)  # at EP > 1 the plan's factor
    (plan,) = stages.plan_stages(arch, ParallelLayout(dp=2, ep=2), inputs, spec)
    predicted = plan.lines["  activations per micro-batch"]
    out = Path(sys.argv[1]) / f"rank{dist.get_rank()}.json"  # a file per rank: printed lines of 2 ranks interleave
    out.write_text(json.dumps({"routed": routed, "factor": factor, "measured": measured, "predicted": predicted}))
    destroy_parallel()


@pytest.mark.slow
def test_planner_matches_saved_tensors_at_ep2(tmp_path):
    """EP 2 over gloo (alltoall dispatcher across 2 ranks): each rank's saved bytes equal the plan's at the number of
    token copies its experts received (uneven: ~0.98 and ~1.02 of T x k); the dispatcher's all-to-all adds no
    saved tensor beyond the EP1 count."""
    from tests.torchrun import run_torchrun

    run_torchrun(__file__, str(tmp_path), nproc=2, timeout=300)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for row in rows:
        assert row["measured"] == row["predicted"], row
        assert len(row["routed"]) == 4 and row["factor"] != 1.0, row  # 4 MoE layers, uneven routing
    assert sum(row["factor"] for row in rows) == pytest.approx(2.0)  # the EP group's copies: 2 ranks x T x k


def test_qk_norm_term_by_hand():
    """The q/k-norm bytes written out for the tiny Qwen3 (4 heads, 2 groups of head_dim 24, fp32): torch's norms
    keep normalised q (96) and k (48), q's reshape copy (96) and 6 fp32 rstds; the k norm's input, a view,
    keeps the fused qkv output (192) which local GQA attention would otherwise drop. TE: contiguous q and k
    inputs and the rstds. At TP2 one group per rank: no q copy."""
    arch = _family_tiny("qwen3")
    local = activations.ActivationSpec.for_arch(arch, transformer_impl="local", bytes_per_element=4)
    te = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=4)
    assert activations.qk_norm_bytes(local, 1) == (96 + 48 + 96) * 4 + 4 * 6
    assert activations.qk_norm_bytes(local, 2) == (96 + 48) * 4 + 4 * 6
    assert activations.qk_norm_bytes(te, 1) == (96 + 48) * 4 + 4 * 6
    off = replace(local, qk_norm=False)
    layout = ParallelLayout()
    diff = (activations.layer_activation_bytes(local, layout, tokens=10, seq_len=10)
            - activations.layer_activation_bytes(off, layout, tokens=10, seq_len=10))
    assert diff == 10 * ((96 + 48 + 96 + 192) * 4 + 4 * 6)


def test_mla_terms_by_hand():
    """Multi-head latent attention's bytes written out. The tiny DeepSeek-V3 on the local spec (fp32; 4 heads of
    16 nope + 8 rope q / k dims and 12 v dims, q latent 48, kv latent 32): q latent, its norm's normalised input and
    output (3 x 48) and rstd; kv down output (32 + 8, kept by the norm's view), normalised and output (2 x 32) and
    rstd; query and key (2 x 96), value (48); scores 4 heads x s. DeepSeek-V3 under TE (bf16, 128 heads of 192 / 128,
    q 1536, kv 512 + 64): each latent's input and norm output, the rstds; query, key, value and the log-sum-exp."""
    tiny = activations.ActivationSpec(hidden=64, ffn=96, heads=4, q=96, kv=96, head_dim=24, attention="unfused",
                                      norm_tensors=3, bytes_per_element=4, causal_mask=True, qk_norm=True, q_lora=48,
                                      kv_lora=32, rope_dim=8, v_dim=12, experts=8, topk=4, moe_ffn=32, shared_ffn=32,
                                      router_scores="sigmoid", aux_loss=False)
    latents, attn, scores = activations.mla_bytes(tiny, seq_len=40, selective=False)
    assert (latents, attn, scores) == ((3 * 48 + 40 + 2 * 32) * 4 + 2 * 4, (2 * 96 + 48) * 4, 4 * 40 * 4)
    assert activations.mla_bytes(tiny, seq_len=40, selective=True) == (latents, attn, 0.0)
    no_q_lora = replace(tiny, q_lora=0)
    assert activations.mla_bytes(no_q_lora, seq_len=40, selective=False)[0] == (40 + 2 * 32) * 4 + 4
    # a dense layer of 120 tokens: 2 norms (3 x 64 + rstd), latents, attention, its output (48), SwiGLU 5 x 96; rope
    # tables 4 x s x 8; an MoE layer's MLP is its shared experts' (5 x 32) beside moe_layer_bytes
    layout = ParallelLayout()
    dense = 120 * (2 * (3 * 64 * 4 + 4) + latents + attn + scores + 48 * 4 + 5 * 96 * 4) + 4 * 40 * 8 * 4
    assert activations.layer_activation_bytes(tiny, layout, tokens=120, seq_len=40) == dense
    moe = activations.layer_activation_bytes(tiny, layout, tokens=120, seq_len=40, moe_factor=1.0)
    router = 120 * (16 * 4 + 4 * 8 + 5 * 4 + 8 + 8 * 4)  # no aux loss: nothing per layer
    assert moe == dense - 120 * 5 * (96 - 32) * 4 + router + 120 * 4 * (64 + 6 * 32 + 1) * 4
    v3 = activations.ActivationSpec(hidden=7168, ffn=18432, heads=128, q=24576, kv=24576, head_dim=192,
                                    attention="flash", norm_tensors=2, bytes_per_element=2, qk_norm=True, q_lora=1536,
                                    kv_lora=512, rope_dim=64, v_dim=128)
    assert activations.mla_bytes(v3, seq_len=4096, selective=False) == (
        2 * 1536 * 2 + 4 + 2 * 512 * 2 + 4, (2 * 24576 + 16384) * 2 + 4 * 128, 0.0)
    with pytest.raises(ValueError, match="latent RMSNorms"):
        replace(v3, qk_norm=False)


MLA_CONFIGS = {m: json.loads((REPO / "examples/models" / m / "config.json").read_text())
               for m in ("deepseek-v3-671B", "moonlight-16B-A3B")}
"""The shipped config.json of the two (the releases' fields; DeepSeek-V3's num_nextn_predict_layers 1 is the MTP
layer, which neither HF's model nor ours builds)."""


@pytest.mark.parametrize("model", [pytest.param(m, marks=NEEDS_DEEPSEEK_V3) for m in MLA_CONFIGS])
def test_mla_parameters_add_up_to_the_hf_count(model):
    """DeepSeek-V3 (671B, 37B active per the paper, the MTP layer aside) and Moonlight-16B-A3B (q_lora_rank null, 2
    shared experts): the count read off the table equals HF's model built on the meta device (expert bias buffers left
    out), and at TP8 every rank holds the norms, the routers and the q / kv down projections whole (TE's duplicated
    TELinear); an SGLang rank's KV cache holds the latent."""
    arch = ModelArch.from_hf(REPO / "examples/models" / model)
    with torch.device("meta"):
        hf = arch.family.hf_causal_lm()(arch.family.hf_config(**MLA_CONFIGS[model]))
    assert hf.num_parameters() == arch.num_parameters()
    total, active = {"deepseek-v3-671B": ((670e9, 672e9), (37e9, 38e9)),
                     "moonlight-16B-A3B": ((15.9e9, 16e9), (2.9e9, 3e9))}[model]
    assert total[0] < arch.num_parameters() < total[1] and active[0] < arch.num_parameters(active=True) < active[1]
    pp2 = ParallelLayout(pp=2, layers_in_first_stage=arch.num_layers // 2)  # 61 and 27 layers: uneven
    assert sum(stages.stage_parameters(arch, pp2, i) for i in range(2)) == arch.num_parameters()
    o, h = dict(arch.family_options), arch.hidden_size
    down = h * (o["q_lora_rank"] + o["kv_lora_rank"] + o["qk_rope_head_dim"])
    per_layer = 2 * h + o["q_lora_rank"] + o["kv_lora_rank"] + down
    replicated = per_layer * arch.num_layers + len(arch.moe_layers) * arch.num_experts * h + h
    tp8 = sum(stages.stage_parameters(arch, replace(pp2, tp=8), i) for i in range(2))
    pad = -(-arch.vocab_size // 1024) * 1024 - arch.vocab_size
    assert tp8 * 8 - 7 * replicated == arch.num_parameters() + 2 * pad * h
    # SGLang caches one latent of kv_lora + rope per token and layer on every TP rank, not K and V per head
    assert colocated.kv_bytes_per_token(arch, 8) == arch.num_layers * (512 + 64) * 2


@pytest.mark.parametrize("model", ["qwen3-8B", "qwen3-32B", "llama3.1-8B"])
def test_stage_parameters_add_up_to_the_hf_count_per_family(model):
    """No q/k/v bias, Qwen3's q/k norm weights (2 x head_dim per layer, replicated over TP) counted; the count of
    HF's own model built from the config.json (on the meta device) and the model cards' sizes (Qwen3-8B 8.2B,
    Qwen3-32B 32.8B, Llama-3.1-8B 8.03B)."""
    import json

    arch = ModelArch.from_hf(REPO / "examples/models" / model)
    fields = json.loads((REPO / "examples/models" / model / "config.json").read_text())
    with torch.device("meta"):
        hf = arch.family.hf_causal_lm()(arch.family.hf_config(**fields))
    assert hf.num_parameters() == arch.num_parameters()
    assert sum(stages.stage_parameters(arch, ParallelLayout(pp=2), i) for i in range(2)) == arch.num_parameters()
    low, high = {"qwen3-8B": (8.1e9, 8.3e9), "qwen3-32B": (32.7e9, 32.9e9), "llama3.1-8B": (8.0e9, 8.1e9)}[model]
    assert low < arch.num_parameters() < high
    tp8 = sum(stages.stage_parameters(arch, ParallelLayout(tp=8, pp=2), i) for i in range(2))
    replicated = (2 * arch.hidden_size + (2 * arch.head_dim if arch.qk_layernorm else 0)) * arch.num_layers \
        + arch.hidden_size
    pad = -(-arch.vocab_size // 1024) * 1024 - arch.vocab_size  # vocab padded to a multiple of 128 x TP8
    assert tp8 * 8 - 7 * replicated == arch.num_parameters() + 2 * pad * arch.hidden_size


def test_stage_parameters_add_up_to_the_hf_count():
    arch = ModelArch.from_hf(REPO / "examples/models/qwen2.5-32B")
    assert sum(stages.stage_parameters(arch, ParallelLayout(pp=2), i) for i in range(2)) == arch.num_parameters()
    assert 32.7e9 < arch.num_parameters() < 32.8e9  # "32.5B" (31.0B non-embedding) per the model card
    # TP splits everything but the 2h norm weights per layer and the final norm
    tp8 = sum(stages.stage_parameters(arch, ParallelLayout(tp=8, pp=2), i) for i in range(2))
    replicated = 2 * arch.hidden_size * arch.num_layers + arch.hidden_size
    assert tp8 * 8 - 7 * replicated == arch.num_parameters() + 2 * 512 * arch.hidden_size  # vocab pad 152576


def test_static_memory_closed_form():
    """bf16 weights 2 B, fp32 grads 4 B, Adam 12 B / DP per parameter (16.5 B/param at DP 8: Megatron's
    distributed-optimizer table)."""
    arch = ModelArch.from_hf(REPO / "examples/models/qwen2.5-7B")
    layout = ParallelLayout(tp=4, dp=8)
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=2)
    (plan,) = stages.plan_stages(arch, layout, stages.PlanInputs(tokens_per_micro_batch=8192,
                                                                   max_seq_len=8192), spec)
    n = stages.stage_parameters(arch, layout, 0)
    static = sum(v for k, v in plan.lines.items() if k.startswith(("weights", "grads", "optimizer")))
    assert static == pytest.approx(n * (2 + 4 + 12 / 8))


# ---- --dry-run -------------------------------------------------------------------------------------------

LAUNCHERS = [
    pytest.param("examples/run_qwen2.5_7b_single_node.sh", {}, "qwen2.5-7B", id="7b-single-node"),
    pytest.param("examples/run_qwen2.5_32b_multinode.sh",
                 {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000"},
                 "qwen2.5-32B", id="32b-multinode"),
    pytest.param("examples/run_qwen3_8b_single_node.sh", {}, "qwen3-8B", id="qwen3-8b-single-node"),
    pytest.param("examples/run_qwen3_8b_distill.sh", {"TEACHER_URLS": "http://t0:30000 http://t1:30000"}, "qwen3-8B",
                 id="qwen3-8b-distill"),
    pytest.param("examples/run_llama3.1_8b_single_node.sh", {}, "llama3.1-8B", id="llama3.1-8b-single-node"),
    pytest.param("examples/run_qwen3_32b_multinode.sh",
                 {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000"},
                 "qwen3-32B", id="qwen3-32b-multinode"),
    pytest.param("examples/run_qwen3_30b_a3b_multinode.sh",
                 {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000"},
                 "qwen3-30B-A3B", id="qwen3-30b-a3b-multinode"),
    pytest.param("examples/run_moonlight_16b_a3b_multinode.sh",
                 {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000"},
                 "moonlight-16B-A3B", id="moonlight-16b-a3b-multinode", marks=NEEDS_DEEPSEEK_V3),
    pytest.param("examples/run_deepseek_v3_671b_multinode.sh",
                 {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000"},
                 "deepseek-v3-671B", id="deepseek-v3-671b-multinode", marks=NEEDS_DEEPSEEK_V3),
]


def _dry_run(train_args: list[str]) -> tuple[int, list[str]]:
    out = io.StringIO()
    rc = dry_run(build_parser().parse_args(train_args + ["--dry-run"]), out=out)
    return rc, out.getvalue().splitlines()


def _launcher_train_args(tmp_path, script, env, model) -> list[str]:
    torchrun_args, train_args = launcher_args(tmp_path, script, env)
    nodes = int(torchrun_args[torchrun_args.index("--nnodes") + 1]) if "--nnodes" in torchrun_args else 1
    world = nodes * int(torchrun_args[torchrun_args.index("--nproc_per_node") + 1])
    train_args[train_args.index("--hf-checkpoint") + 1] = str(REPO / "examples/models" / model)
    return train_args + ["--world-size", str(world)]


@pytest.mark.parametrize("script,env,model", LAUNCHERS)
def test_launcher_dry_run_fits_an_80gb_gpu_with_headroom(tmp_path, script, env, model):
    rc, lines = _dry_run(_launcher_train_args(tmp_path, script, env, model))
    assert rc == 0, "\n".join(lines)
    peak, of = lines[-1].removeprefix("plan: peak ").split(" GiB per GPU of ")
    assert lines[-1].startswith("plan: peak ") and of == "80 GiB"
    assert float(peak) <= (1 - stages.HEADROOM) * 80, "\n".join(lines)
    assert any(line.startswith("SGLang (not colocated)") for line in lines)


def test_dry_run_over_budget_exits_1_and_names_the_flag(tmp_path):
    script, env, model = LAUNCHERS[1].values
    args = _launcher_train_args(tmp_path, script, env, model)
    for flag, n in (("--sequence-parallel", 0), ("--recompute-granularity", 1), ("--recompute-method", 1),
                    ("--recompute-num-layers", 1)):
        i = args.index(flag)
        del args[i:i + 1 + n]
    rc, lines = _dry_run(args)
    assert rc == 1
    assert lines[-1].startswith("plan: peak ") and float(lines[-1].split()[2]) > 80
    assert any("--sequence-parallel" in line for line in lines)
    assert any("--recompute-granularity full" in line and "(fits)" in line for line in lines)


PLAN_7B = ["--hf-checkpoint", str(REPO / "examples/models/qwen2.5-7B"), "--prompt-data", "x", "--num-steps", "1",
           "--tensor-model-parallel-size", "4"]


@pytest.mark.parametrize("flags, message", [
    pytest.param(["--gpu-memory-gib", "0"], "--gpu-memory-gib must be a finite number of GiB > 0, got 0.0", id="0"),
    pytest.param(["--gpu-memory-gib", "-80"], "--gpu-memory-gib must be a finite number of GiB > 0, got -80.0",
                 id="negative"),
    pytest.param(["--gpu-memory-gib", "nan"], "--gpu-memory-gib must be a finite number of GiB > 0, got nan", id="nan"),
    pytest.param(["--gpu-memory-gib", "inf"], "--gpu-memory-gib must be a finite number of GiB > 0, got inf", id="inf"),
    pytest.param(["--gpu-memory-gib", "0", "--colocate", "--rollout-engine", "sglang"],
                 "--gpu-memory-gib must be a finite number of GiB > 0, got 0.0", id="0-colocated"),
    pytest.param(["--world-size", "0"], "--world-size must be >= 1 (the actor GPUs to plan for), got 0", id="world-0"),
    pytest.param(["--world-size", "-8"], "--world-size must be >= 1 (the actor GPUs to plan for), got -8",
                 id="world-negative"),
])
def test_dry_run_refuses_a_gpu_size_or_world_it_cannot_plan_for(capsys, flags, message):
    """One line on stderr naming the flag, exit 2, no plan. They were: a ZeroDivisionError (0 with --colocate), a
    plan over budget (0, negative, nan: every comparison with nan is false), "headroom 100%" (inf), and a world size
    of 0 named as the layout's "data-parallel size"."""
    args = PLAN_7B + (["--world-size", "8"] if "--world-size" not in flags else []) + flags
    rc, lines = _dry_run(args)
    err = capsys.readouterr().err.splitlines()
    assert (rc, lines, [line for line in err if "error" in line]) == (2, [], [f"plan: error: {message}"])


def test_python_m_planner_prints_the_dry_run_plan():
    """`python -m megatron_dapo.planner <train flags>` is the trainer's --dry-run (it was a module that did nothing)."""
    out = io.StringIO()
    want = dry_run(build_parser().parse_args(PLAN_7B + ["--world-size", "8"]), out=out)
    import subprocess

    from tests.torchrun import subprocess_env

    proc = subprocess.run([sys.executable, "-m", "megatron_dapo.planner", *PLAN_7B, "--world-size", "8"], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (want, out.getvalue()) and "plan: peak" in proc.stdout


def test_dry_run_says_when_no_single_change_fits(tmp_path):
    """At 40 GiB the 32B launcher (every memory flag already on) has nothing left to switch: the plan says so."""
    script, env, model = LAUNCHERS[1].values
    rc, lines = _dry_run(_launcher_train_args(tmp_path, script, env, model) + ["--gpu-memory-gib", "40"])
    assert rc == 1 and float(lines[-1].split()[2]) > 40
    i = next(i for i, line in enumerate(lines) if "single changes that lower the peak" in line)
    assert "(fits)" not in "\n".join(lines[i:])
    assert "no single flag change fits" in lines[-2] and "--tensor-model-parallel-size" in lines[-2]


def test_dry_run_rejects_a_bad_layout(tmp_path, capsys):
    script, env, model = LAUNCHERS[1].values
    args = _launcher_train_args(tmp_path, script, env, model)
    args[args.index("--world-size") + 1] = "24"  # not a multiple of TP8 x PP2
    rc, lines = _dry_run(args)
    err = capsys.readouterr().err.splitlines()  # the error on stderr, no plan on stdout
    assert rc == 2 and lines == [] and "--tensor-model-parallel-size" in err[-1] and err[-1].startswith("plan: error: ")


def test_planned_bytes_per_component_are_itemised():
    """Each printed row is one component and the total is their sum (details excluded)."""
    arch = ModelArch.from_hf(REPO / "examples/models/qwen2.5-32B")
    layout = ParallelLayout(tp=8, pp=2, dp=4, sp=True)
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=2)
    plans = stages.plan_stages(arch, layout, stages.PlanInputs(tokens_per_micro_batch=24576,
                                                                 max_seq_len=22528), spec)
    assert [p.in_flight for p in plans] == [2, 1]
    first, last = plans
    assert first.lines["activations in flight (1F1B)"] == 2 * first.lines["  activations per micro-batch"]
    assert first.lines["logits + grad (last stage)"] == 0 < last.lines["logits + grad (last stage)"]
    assert Counter(k.startswith("  ") for k in first.lines)[True] == 1


def test_interleaved_activations_match_korthikanti_factor():
    """--num-layers-per-virtual-pipeline-stage: stage 0 holds L (1 + (p - 1) / (p v)) layers of activations
    (Korthikanti et al. 2022, section 4.2.3) against L for plain 1F1B."""
    arch = ModelArch.from_hf(REPO / "examples/models/qwen2.5-7B")  # 28 layers
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=2)
    inputs = stages.PlanInputs(tokens_per_micro_batch=4096, max_seq_len=4096)
    p, v = 2, 7  # 2 layers per virtual stage
    layer = activations.layer_activation_bytes(spec, ParallelLayout(tp=4, pp=p), tokens=4096, seq_len=4096)
    plain = stages.plan_stages(arch, ParallelLayout(tp=4, pp=p), inputs, spec)
    vpp = stages.plan_stages(arch, ParallelLayout(tp=4, pp=p, layers_per_virtual_stage=2), inputs, spec)

    def layer_part(plan, stage):
        extra = activations.micro_batch_extra_bytes(spec, ParallelLayout(tp=4, pp=p), tokens=4096, seq_len=4096,
                                                first=stage == 0, last=stage == p - 1, recompute=False)
        return plan[stage].lines["activations in flight (1F1B)"] - plan[stage].in_flight * extra

    L = arch.num_layers
    assert layer_part(plain, 0) == pytest.approx(L * layer)
    assert layer_part(vpp, 0) == pytest.approx(L * (1 + (p - 1) / (p * v)) * layer)
    # last stage: (v - 1) p + 1 chunks of L / (p v) layers, against L / p for plain 1F1B
    assert layer_part(vpp, 1) == pytest.approx(((v - 1) * p + 1) * L / (p * v) * layer)
    assert layer_part(plain, 1) == pytest.approx(L / p * layer)
    # weights, grads and optimizer are unchanged: the stage holds the same parameters
    for a, b in zip(plain, vpp, strict=True):
        assert {k: x for k, x in a.lines.items() if "activation" not in k} == \
            {k: x for k, x in b.lines.items() if "activation" not in k}


def test_uneven_pipeline_plans_each_stages_own_layers():
    """--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: Qwen2.5-32B's 64 layers at PP3 as
    20/24/20. Each stage's parameters and activations are its own layer count's (a middle stage's 24 layers = 1.5 x a
    PP4 middle stage's 16), the stages together hold the model once, and the printed plan names each stage's count."""
    arch = ModelArch.from_hf(REPO / "examples/models/qwen2.5-32B")
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=2)
    uneven = ParallelLayout(tp=8, pp=3, dp=2, sp=True, layers_in_first_stage=20, layers_in_last_stage=20)
    even = ParallelLayout(tp=8, pp=4, dp=2, sp=True)
    assert sum(stages.stage_parameters(arch, replace(uneven, tp=1, sp=False), i) for i in range(3)) == \
        arch.num_parameters()
    params = {(lay.pp, i): stages.stage_parameters(arch, lay, i) for lay in (uneven, even) for i in range(lay.pp)}
    layer = params[4, 1] / 16  # one layer's parameters on a TP rank
    assert params[3, 1] == 24 * layer
    assert params[3, 0] - 20 * layer == params[4, 0] - 16 * layer  # + the embedding
    assert params[3, 2] - 20 * layer == params[4, 3] - 16 * layer  # + the final norm and the output layer
    inputs = stages.PlanInputs(tokens_per_micro_batch=8192, max_seq_len=8192)
    per_layer = activations.layer_activation_bytes(spec, uneven, tokens=8192, seq_len=8192)
    plans = stages.plan_stages(arch, uneven, inputs, spec)
    for plan, layers in zip(plans, (20, 24, 20), strict=True):
        extra = activations.micro_batch_extra_bytes(spec, uneven, tokens=8192, seq_len=8192, first=plan.stage == 0,
                                                    last=plan.stage == 2, recompute=False)
        assert plan.lines["  activations per micro-batch"] == pytest.approx(layers * per_layer + extra)
    lines = report.format_plan(arch, uneven, inputs, spec)
    assert "20/24/20 layers on stages 0..2 (--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)" \
        in lines[1]
    assert lines[4].split() == ["decoder", "layers", "(uneven", "pipeline)", "20", "24", "20"]
    assert not any("decoder layers" in line for line in report.format_plan(arch, even, inputs, spec))


# ---- --colocate ------------------------------------------------------------------------------------------

COLOCATED = ("examples/run_qwen2.5_32b_colocated.sh",
             {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "LAUNCH_ENGINES": "0",
              "SGLANG_URLS": " ".join(f"http://n{i // 2}:{30000 + i % 2}" for i in range(32))}, "qwen2.5-32B")


def test_colocated_launcher_fits_80gb_in_both_phases(tmp_path):
    """16 x 8 GPUs, each an actor rank and an SGLang shard: training (actor + released SGLang) and generation
    (actor leftovers + SGLang weights, KV cache, runtime) both under 90% of 80 GB; the launcher's
    --mem-fraction-static is the one the planner computes."""
    args = _launcher_train_args(tmp_path, *COLOCATED)
    assert args[args.index("--world-size") + 1] == "128"
    rc, lines = _dry_run(args)
    assert rc == 0, "\n".join(lines)
    phases = dict(p.split(" ")[:2] for p in lines[-3].removeprefix("phases: ").removesuffix(" GiB").split(" GiB, "))
    assert set(phases) == {"training", "generation"}, lines[-3]
    assert all(float(v) <= (1 - stages.HEADROOM) * 80 for v in phases.values()), "\n".join(lines)
    assert any(line.startswith("SGLang (colocated, released)") for line in lines)
    given = args[args.index("--mem-fraction-static") + 1]
    i = args.index("--mem-fraction-static")
    rc, computed = _dry_run(args[:i] + args[i + 2:])
    share = next(line for line in computed if line.startswith("SGLang share:"))
    assert share.startswith(f"SGLang share: --mem-fraction-static {given} (computed"), share
    assert next(line for line in lines if line.startswith("SGLang share:")).endswith("per engine of 4 GPUs)")


def test_colocated_share_by_hand():
    """The SGLang share written out: weights = the TP4 shard's parameters x 2 B, KV = frac x 80 GiB - weights,
    tokens = KV / (2 x 64 layers x 2 kv heads x 128 x 2 B); frac = floor((72 - actor leftovers - 4) / 80)."""
    arch = ModelArch.from_hf(REPO / "examples/models/qwen2.5-32B")
    layout = ParallelLayout(tp=8, pp=2, dp=8, sp=True, recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=1)
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=2)
    inputs = stages.PlanInputs(tokens_per_micro_batch=24576, max_seq_len=22528, colocate=True,
                                rollout_gpus_per_engine=4, sglang_gib=colocated.SGLANG_RELEASED_GIB)
    plans = stages.plan_stages(arch, layout, inputs, spec)
    share = colocated.sglang_share(arch, plans, inputs)
    h, f, v = arch.hidden_size, arch.intermediate_size, 152064
    per_layer = (h * (5120 + 2048) + (5120 + 2048) + 5120 * h + 3 * h * f) // 4 + 2 * h
    weights = 2 * (64 * per_layer + 2 * v * h // 4 + h)
    assert share.weights == weights
    actor = 2 * stages.stage_parameters(arch, layout, 0) + 2 * stages.GIB  # bf16 weights + context
    frac = int((0.9 * 80 * stages.GIB - actor - 4 * stages.GIB) / (80 * stages.GIB) * 100) / 100
    assert share.mem_fraction_static == frac and share.computed
    assert share.kv_tokens == int((frac * 80 * stages.GIB - weights) // (2 * 64 * 2 * 128 * 2))


def test_colocated_fraction_too_small_names_the_flag():
    arch = ModelArch.from_hf(REPO / "examples/models/qwen2.5-32B")
    layout = ParallelLayout(tp=8, pp=2, dp=8, sp=True)
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=2)
    inputs = stages.PlanInputs(tokens_per_micro_batch=24576, max_seq_len=22528, colocate=True,
                                rollout_gpus_per_engine=4, mem_fraction_static=0.2)
    with pytest.raises(ValueError, match="--mem-fraction-static 0.20 .given.*--rollout-num-gpus-per-engine"):
        colocated.sglang_share(arch, stages.plan_stages(arch, layout, inputs, spec), inputs)
    with pytest.raises(ValueError, match="--mem-fraction-static must be in"):
        stages.PlanInputs(tokens_per_micro_batch=1, max_seq_len=1, mem_fraction_static=1.0)


def test_host_copy_line_is_what_the_engine_keeps(tmp_path):
    """The plan's rank-0 host line equals the bytes SGLangEngine holds after a push of the whole HF model (fp32
    tiny model, tied and untied), and HF's own parameter count; at 32B it is one bf16 version, 61 GiB."""
    from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
    from tests.dist.actor_common import tiny_hf_model
    from tests.sglang import full_push
    from tests.sglang.fake_server import serve

    for tied in (False, True):
        hf = tiny_hf_model(seed=1, tie=tied)
        arch = ModelArch.from_hf(hf.config)
        assert report.host_copy_bytes(arch, 4) == hf.num_parameters() * 4
        server, _ = serve(tp_size=1)
        engine = SGLangEngine(server_urls=[f"http://127.0.0.1:{server.server_address[1]}"],
                              client=ClientConfig(bucket_bytes=4096))
        try:
            named = [(n, t) for n, t in hf.state_dict().items() if not (tied and n == "lm_head.weight")]
            full_push(engine, "tensor").update(iter(named), version=1)
            assert sum(b.nbytes for b in full_push(engine).kept) == report.host_copy_bytes(arch, 4), tied
        finally:
            engine.shutdown()
            server.shutdown()
            server.server_close()
    rc, lines = _dry_run(_launcher_train_args(tmp_path, *LAUNCHERS[1].values))
    host = next(line for line in lines if line.startswith("rank 0 host memory"))
    assert "weight-sync host copy 61.03 GiB" in host and "--weight-sync-mode distributed" in host, host


def _colocated_32b_stage1_params() -> int:
    """Parameters on one GPU of stage 1 of the 32B colocated launcher (TP 8, PP 2), written out: 32 layers' TP8
    shard (q/k/v with bias, o, SwiGLU; the two norms whole) + the final norm + the padded head's shard."""
    h, q, kv, f = 5120, 5120, 1024, 27648
    per_layer = (h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * f) // 8 + 2 * h
    return 32 * per_layer + h + -(-152064 // 1024) * 1024 * h // 8


def test_colocated_startup_rows_by_hand(tmp_path):
    """The start-up rows of the 32B colocated launcher, written out: stage 1 holds P = 32 layers' TP8 shard + the
    final norm + the padded head's shard; build = 2 x bf16 weights (DDP's transient copy) + fp32 grads, resume =
    weights + grads + optimizer (12 B/P / DP 8) + load buffers (weights + optimizer), each next to the released
    engine (2 GiB) and the context (2 GiB). The old order adds SGLang's static pool (0.77 x 80 GiB) and runtime
    (4 GiB) in place of the released 2 GiB."""
    rc, lines = _dry_run(_launcher_train_args(tmp_path, *COLOCATED))
    assert rc == 0, "\n".join(lines)
    P, gib = _colocated_32b_stage1_params(), stages.GIB
    build = 2 * (2 * P) + 4 * P + 4 * gib
    resume = 2 * P + 4 * P + 12 * P / 8 + (2 * P + 12 * P / 8) + 4 * gib
    old = resume + 0.77 * 80 * gib + 4 * gib - 2 * gib
    table = lines.index(next(line for line in lines if line.startswith("phase: start-up, stage 1")))
    total = lines[table + 8].split()
    assert total[0] == "total" and [float(x) for x in total[1:]] == [round(build / gib, 2), round(resume / gib, 2)]
    worst = next(line for line in lines if line.startswith("start-up: worst"))
    assert worst == f"start-up: worst {resume / gib:.2f} GiB per GPU; the old order (actor built next to resident " \
                    f"engines) held {old / gib:.2f} GiB"
    assert old / gib > 80 > 72 > resume / gib  # the old order overflowed the GPU; the new one fits with headroom


def test_colocated_save_row_by_hand(tmp_path):
    """The save rows of the 32B colocated launcher, written out: a save runs in the training phase after the update
    (trainer/loop.py), so stage 1 holds P = 32 layers' TP8 shard + the final norm + the padded head's shard as bf16
    weights, fp32 grads and the optimizer shard (12 B/P / DP 8), next to the released engine (2 GiB) and the context
    (2 GiB). The old save, in the generation phase, onloaded grads and optimizer next to SGLang's static pool
    (0.77 x 80 GiB), its runtime (4 GiB), the actor's weights and context: over the 80 GB GPU."""
    rc, lines = _dry_run(_launcher_train_args(tmp_path, *COLOCATED))
    assert rc == 0, "\n".join(lines)
    P, gib = _colocated_32b_stage1_params(), stages.GIB
    save = 2 * gib + 2 * P + 4 * P + 12 * P / 8 + 2 * gib
    old = 0.77 * 80 * gib + 4 * gib + 2 * P + 2 * gib + 4 * P + 12 * P / 8
    table = lines.index(next(line for line in lines if line.startswith("phase: save, stage 1")))
    rows = {line[:48].strip(): float(line[48:]) for line in lines[table + 1:table + 7]}
    assert rows == {"SGLang (colocated, released)": 2.0, "weights (bfloat16)": round(2 * P / gib, 2),
                    "grads (fp32 DDP buffer)": round(4 * P / gib, 2),
                    "optimizer (main params + Adam, read by the save)": round(12 * P / 8 / gib, 2),
                    "CUDA context, NCCL, workspaces (assumed)": 2.0, "total": round(save / gib, 2)}
    summary = next(line for line in lines if line.startswith("save:"))
    assert summary == f"save: {save / gib:.2f} GiB per GPU; saved in the generation phase (grads and optimizer " \
                      f"onloaded next to the resident engines) it held {old / gib:.2f} GiB"
    assert old / gib > 80 > 72 > save / gib  # the old save overflowed the GPU; this one fits with headroom


# ---- mixture of experts ----------------------------------------------------------------------------------

A3B = REPO / "examples/models/qwen3-30B-A3B"
A3B_LAUNCHER = next(p.values for p in LAUNCHERS if p.id == "qwen3-30b-a3b-multinode")


def test_moe_static_memory_closed_form():
    """Qwen3-30B-A3B at the launcher's layout (TP1, EP8, ETP1, 32 GPUs): each GPU holds 16 of 128 experts of
    3 x 2048 x 768 in every one of the 48 layers, their fp32 grads, and Adam state sharded over the 4 expert-DP
    replicas; the dense part (attention, norms, routers, embedding, head: HF's count minus the experts) has its
    Adam state sharded over all 32 DP ranks. Summed over EP x ETP ranks the experts are HF's 29.0B."""
    arch = ModelArch.from_hf(A3B)
    expert = 3 * 2048 * 768
    assert 30.4e9 < arch.num_parameters() < 30.6e9 and 48 * 128 * expert == 28_991_029_248
    dense = arch.num_parameters() - 48 * 128 * expert  # 151936 = 1187 x 128: no vocab padding at TP1
    layout = ParallelLayout(tp=1, dp=32, ep=8, etp=1)
    assert layout.expert_dp == 4
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=2)
    (plan,) = stages.plan_stages(arch, layout, stages.PlanInputs(tokens_per_micro_batch=24576,
                                                                   max_seq_len=22528), spec)
    local = 48 * 16 * expert
    assert stages.stage_expert_parameters(arch, layout, 0) == local
    assert stages.stage_parameters(arch, layout, 0) == dense + local
    lines = plan.lines
    assert lines["expert weights (16 of 128 per layer, /1 ETP)"] == 2 * local
    assert lines["expert grads (fp32 DDP buffer)"] == 4 * local
    assert lines["expert optimizer (/4 expert-DP)"] == 12 * local / 4
    assert (lines["weights (bfloat16)"], lines["grads (fp32 DDP buffer)"]) == (2 * dense, 4 * dense)
    assert lines["optimizer (fp32 Adam + main params, /32)"] == 12 * dense / 32
    for ep, etp, tp in ((1, 1, 1), (8, 1, 1), (4, 2, 2), (2, 4, 4)):
        lay = ParallelLayout(tp=tp, dp=8 // tp, ep=ep, etp=etp, sp=tp > 1)
        assert stages.stage_expert_parameters(arch, lay, 0) * ep * etp == 48 * 128 * expert
    two = ParallelLayout(pp=2, dp=4, ep=4)
    assert sum(stages.stage_parameters(arch, ParallelLayout(pp=2), i) for i in range(2)) == arch.num_parameters()
    assert [stages.stage_expert_parameters(arch, two, i) for i in range(2)] == [24 * 32 * expert] * 2


def test_moe_layer_bytes_by_hand():
    """The MoE block's saved bytes written out at Qwen3-30B-A3B (bf16, 24576 tokens): per local token the router's
    2 x int64 + fp32 top-8 (8 x 20 B), fp32 aux-loss scores, bool map and bf16 probs over 128 experts
    (128 x 7 B); per routed copy its hidden state (2048), fc1 out + act (6 x 768 / ETP) and prob, in bf16; copies
    = local tokens x 8 x ETP x factor (2 dropless at EP > 1, the capacity factor when set, 1 at EP1)."""
    arch = ModelArch.from_hf(A3B)
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=2)
    assert (spec.experts, spec.topk, spec.moe_ffn) == (128, 8, 768)

    def by_hand(local, etp, factor):
        return local * (8 * 20 + 128 * 7) + 8 * 128 + 4 + local * 8 * etp * factor * (2048 + 6 * 768 // etp + 1) * 2

    inputs = stages.PlanInputs(tokens_per_micro_batch=24576, max_seq_len=22528)
    for layout, local, etp in ((ParallelLayout(dp=8, ep=8), 24576, 1),
                               (ParallelLayout(tp=2, sp=True, dp=4, ep=8, etp=1), 12288, 1),
                               (ParallelLayout(tp=2, sp=True, dp=4, ep=4, etp=2), 12288, 2),
                               (ParallelLayout(dp=8), 24576, 1)):
        factor = stages.moe_factor(layout, inputs)
        assert factor == (1.0 if layout.ep == 1 else 2.0) and stages.MOE_DROPLESS_IMBALANCE == 2.0
        got = activations.moe_layer_bytes(spec, layout, tokens=24576, factor=factor)
        assert got == pytest.approx(by_hand(local, etp, factor), rel=1e-12), layout
    capped = stages.PlanInputs(tokens_per_micro_batch=24576, max_seq_len=22528, moe_capacity_factor=1.25)
    assert stages.moe_factor(ParallelLayout(dp=8, ep=8), capped) == 1.25
    assert stages.moe_factor(ParallelLayout(dp=8), replace(capped, moe_capacity_factor=0.5)) == 0.5
    # the a2a: 24576 x 8 copies of 2048 bf16 per direction, 7/8 of them to the other ranks
    assert (activations.moe_alltoall_bytes(spec, ParallelLayout(dp=8, ep=8), tokens=24576)
            == 24576 * 8 * 2048 * 2 * 7 / 8)
    assert activations.moe_alltoall_bytes(spec, ParallelLayout(dp=8), tokens=24576) == 0


def test_moe_launcher_dry_run_prints_the_moe_terms(tmp_path):
    """The 30B-A3B launcher's plan names the expert grid, the routed-token factor it assumes and why, and what the
    all-to-all moves; a capacity factor replaces the assumed imbalance and lowers the peak; at 48 GiB the plan is
    over and suggests more expert parallelism or a capacity factor."""
    args = _launcher_train_args(tmp_path, *A3B_LAUNCHER)
    rc, lines = _dry_run(args)
    assert rc == 0, "\n".join(lines)
    assert "experts ETP1 x EP8 x EDP4 x PP1" in lines[0]
    copies = next(line for line in lines if line.startswith("MoE routed token copies"))
    assert "393,216 = 24,576 local tokens x top-8 x ETP1 x 2 (dropless: assumed imbalance" in copies, copies
    assert any(line.startswith("MoE all-to-all per layer and micro-batch: 672 MiB") for line in lines)
    peak = float(lines[-1].split()[2])
    rc, capped = _dry_run(args + ["--moe-expert-capacity-factor", "1.25"])
    assert rc == 0 and "x 1.25 (--moe-expert-capacity-factor 1.25: a hard cap)" in "\n".join(capped)
    assert float(capped[-1].split()[2]) < peak
    rc, over = _dry_run(args + ["--gpu-memory-gib", "48"])
    assert rc == 1
    text = "\n".join(over)
    assert "--expert-model-parallel-size 16: peak" in text and "--moe-expert-capacity-factor 1.0: peak" in text


def test_moe_dry_run_default_world_holds_one_expert_grid(tmp_path, monkeypatch):
    """Without --world-size or $WORLD_SIZE the plan takes the fewest GPUs that hold a model replica and an expert
    grid: lcm(TP x CP, EP x ETP) x PP (8 at TP1, EP8; TP x PP x CP alone, 1, would fail the EP x ETP rule). One
    node does not fit 30B-A3B: with one expert replica its Adam state is not sharded (16 experts x 48 layers x
    3 x 2048 x 768 x 12 B = 40.5 GiB)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = _launcher_train_args(tmp_path, *A3B_LAUNCHER)
    i = args.index("--world-size")
    rc, lines = _dry_run(args[:i] + args[i + 2:])
    assert rc == 1 and lines[0].startswith("layout: TP1 x PP1 x CP1 x DP8 = 8 GPUs; experts ETP1 x EP8 x EDP1")
    row = next(line for line in lines if line.startswith("expert optimizer (/1 expert-DP)"))
    assert float(row.split()[-1]) == round(48 * 16 * 3 * 2048 * 768 * 12 / stages.GIB, 2) == 40.5


def _fenced_block_starting(doc: Path, first: str) -> list[str]:
    """The lines of the ``` block of `doc` whose first line starts with `first`."""
    lines = doc.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(first) and i > 0 and lines[i - 1] == "```":
            return lines[i:lines.index("```", i)]
    raise AssertionError(f"{doc} has no ``` block starting with {first!r}")


def test_a3b_plan_is_the_one_the_docs_quote(tmp_path):
    """The numbers the docs quote for the 30B-A3B recipe are the planner's, at the precision they are quoted:
    docs/PARALLELISM.md's plan block is the launcher's --dry-run line for line (peak 58.13 GiB, 2 decimals as printed);
    docs/LAUNCH.md's '58 GiB of 80' and the launchers' '~58 GiB of 80' are that peak rounded to whole GiB; the variants
    docs/PARALLELISM.md names (a capacity factor, TP2 + SP, 2 / 8 / 1 actor nodes) peak at the values it prints, and
    the recipe's comment quotes the node counts to one decimal."""
    args = _launcher_train_args(tmp_path, *A3B_LAUNCHER)
    rc, lines = _dry_run(args)
    assert rc == 0, "\n".join(lines)
    assert lines == _fenced_block_starting(REPO / "docs/PARALLELISM.md", "layout: TP1 x PP1 x CP1 x DP32")
    peak = float(lines[-1].split()[2])
    assert f"TP1 x EP8, `--dry-run` {round(peak)} GiB of 80)" in " ".join((REPO / "docs/LAUNCH.md").read_text().split())
    for path in ("examples/recipes/qwen3-30b-a3b.sh", "examples/run_qwen3_30b_a3b_multinode.sh"):
        assert f"~{round(peak)} GiB of 80" in (REPO / path).read_text(), path
    world = args.index("--world-size") + 1
    variants = {  # the change, and the phrase the docs print its peak in ({} = the peak, 2 decimals)
        "capacity": (["--moe-expert-capacity-factor", "1.0"], "`--moe-expert-capacity-factor 1.0` the peak is {} GiB"),
        "tp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                   "with TP2 + SP (the experts' share unchanged) {} GiB"),
        "2-nodes": (16, "2 nodes (EDP 2) plan {} GiB"),
        "8-nodes": (64, "8 nodes {} GiB"),
        "1-node": (8, "per GPU) {} GiB, over"),
    }
    doc = " ".join((REPO / "docs/PARALLELISM.md").read_text().split())  # the phrases wherever the lines wrap
    recipe = (REPO / "examples/recipes/qwen3-30b-a3b.sh").read_text()
    for name, (change, phrase) in variants.items():
        if isinstance(change, int):
            changed = args[:world] + [str(change)] + args[world + 1:]
        else:
            changed = args + change
        rc, out = _dry_run(changed)
        assert rc == (1 if name == "1-node" else 0), "\n".join(out)
        value = float(out[-1].split()[2])
        assert phrase.format(f"{value:.2f}") in doc, (name, value)
        if isinstance(change, int):
            assert f"{value:.1f} GiB" in recipe, (name, value)


NO_RECOMPUTE = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers")
MLA_RECIPE_PLANS = [  # (the recipe, its launcher's LAUNCHERS id, [(--world-size or None, flags, phrase)])
    pytest.param("moonlight-16b-a3b", "moonlight-16b-a3b-multinode", [
        (None, [], "Memory (--dry-run --world-size 16): {:.2f} GiB of 80 (41.6% headroom)"),
        (None, NO_RECOMPUTE, "without it the plan is {:.2f} GiB"),
        (None, ["--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor 1.0: {:.2f} GiB"),
        (8, [], "one actor node (expert-DP 1, 20.11 GiB of expert Adam state) plans {:.2f} GiB (27.7% headroom)"),
        (32, [], "4 actor nodes plan {:.2f} GiB"),
        (4, ["--expert-model-parallel-size", "4"], "4 GPUs at EP4 plan {:.2f} GiB (over by 10.21)"),
        (8, ["--expert-model-parallel-size", "2"], "one node at EP2 {:.2f} GiB"),
    ], id="moonlight-16b-a3b", marks=NEEDS_DEEPSEEK_V3),
    pytest.param("deepseek-v3-671b", "deepseek-v3-671b-multinode", [
        (None, [], "Memory (--dry-run --world-size 192): peak {:.2f} GiB of 80 (12.1% headroom)"),
        (None, NO_RECOMPUTE, "without it the plan is {:.2f} GiB"),
        (None, ["--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor 1.0: {:.2f} GiB"),
        (160, ["--pipeline-model-parallel-size", "20", "--decoder-first-pipeline-num-layers", "5",
               "--decoder-last-pipeline-num-layers", "2", "--expert-model-parallel-size", "8"],
         "20 nodes (160 GPUs) plan {:.2f} GiB at best (TP8 x PP20 x DP1, EP8: over by 1.99"),
        (160, ["--pipeline-model-parallel-size", "10", "--decoder-first-pipeline-num-layers", "8",
               "--decoder-last-pipeline-num-layers", "5", "--context-parallel-size", "2"],
         "TP8 x PP10 x CP2, EP16, {:.2f} GiB: accepted at 80 but 1.0% headroom"),
        (128, ["--pipeline-model-parallel-size", "16", "--decoder-first-pipeline-num-layers", "2",
               "--decoder-last-pipeline-num-layers", "3", "--expert-model-parallel-size", "8"],
         "{:.2f} GiB planned at TP8 x PP16, EP8"),
        (256, ["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "17",
               "--decoder-last-pipeline-num-layers", "14", "--expert-model-parallel-size", "64"],
         "EP64: {:.2f} GiB (28.0% headroom)"),
    ], id="deepseek-v3-671b", marks=NEEDS_DEEPSEEK_V3),
]


@pytest.mark.parametrize("recipe,launcher,plans", MLA_RECIPE_PLANS)
def test_mla_recipe_headers_quote_the_planner(tmp_path, recipe, launcher, plans):
    """The memory numbers in the header of examples/recipes/<recipe>.sh are what --dry-run prints for the launcher's
    flags (and for the variants it names: another node count, layout or flag; NO_RECOMPUTE drops the recompute
    flags), at the precision quoted; the variants over 80 GiB exit 1."""
    args = _launcher_train_args(tmp_path, *next(p.values for p in LAUNCHERS if p.id == launcher))
    header = " ".join(line.removeprefix("#").strip() for line in
                      (REPO / f"examples/recipes/{recipe}.sh").read_text().splitlines() if line.startswith("#"))
    for world, flags, phrase in plans:
        changed = list(args)
        if world is not None:
            changed[changed.index("--world-size") + 1] = str(world)
        if flags is NO_RECOMPUTE:
            for flag in flags:
                i = changed.index(flag)
                del changed[i:i + 2]
        else:
            changed += flags
        rc, lines = _dry_run(changed)
        peak = float(lines[-1].split()[2])
        assert rc == (0 if peak <= 80 else 1), "\n".join(lines)
        assert phrase.format(peak) in header, (phrase, peak)

if __name__ == "__main__":  # the worker of test_planner_matches_saved_tensors_at_ep2 (under torchrun)
    _ep2_saved_bytes_worker()



def test_fully_async_host_line_counts_what_rank_0_holds(tmp_path):
    """--max-staleness K: the plan's rank-0 line is the formula written out (groups in flight at keep rate 0.5 plus
    the lead's batches ahead and the one being built, all at L_max), and its bytes per token are what a Sample's
    lists take in CPython (ids above the cached small ints, float log-probs, mixed versions)."""
    from megatron_dapo.rollout.streaming import lead
    from megatron_dapo.rollout.types import Sample

    n = 1000
    ids, logprobs, versions = [], [], []
    for i in range(n):  # as the embedded engine builds them, a token at a time (lists over-allocate by <= 1/8)
        ids.append(1000 + i)
        logprobs.append(-1.0 - i / n)
        versions.append(3 if i < n // 2 else 4)
    sample = Sample(request_id="r", index=0, prompt_ids=[1], response_ids=ids, logprobs=logprobs,
                    finish_reason="stop", weight_version=3, token_versions=versions)
    lists = (sample.response_ids, sample.logprobs, sample.token_versions)
    held = sum(sys.getsizeof(x) for x in lists) - 3 * sys.getsizeof([])
    held += sum(sys.getsizeof(t) for t in sample.response_ids) + sum(sys.getsizeof(x) for x in sample.logprobs)
    # 28 + 24 B objects and three 8 B slots = 76 B; the versions are small ints (CPython's cached objects)
    assert 76 <= held / n <= report.PY_TOKEN_BYTES

    k, b, g, length = 2, 512, 16, 20480
    groups = math.ceil(k * b / 0.5) + (lead(k) + 1) * b  # the rollout's own lead: the planner must follow it
    line = report.stream_state_line(max_staleness=k, batch_groups=b, n_samples=g, max_response_length=length)
    tokens = groups * g * length
    assert f"at most {groups:,} groups" in line and f"{tokens:,} tokens" in line
    assert f"{tokens * report.PY_TOKEN_BYTES / 2**30:.1f} GiB as lists" in line
    assert f"{tokens * 16 / 2**30:.1f} GiB in a checkpoint" in line
    args = _launcher_train_args(tmp_path, *LAUNCHERS[1].values)
    rc, lines = _dry_run(args + ["--max-staleness", "2"])
    host = [line for line in lines if line.startswith("rank 0 host memory: fully async")]
    # the 32B launcher's --sglang-max-concurrency 2048: 1.25 x 2048 / 16 = 160 groups in flight, not 2048
    capped = math.ceil(1.25 * 2048 / g)
    assert host == [report.stream_state_line(max_staleness=k, batch_groups=b, n_samples=g, max_response_length=length,
                                             max_in_flight=capped)], lines
    assert f"at most {capped + (lead(k) + 1) * b:,} groups ({capped:,} of them in flight" in host[0]
    rc, lines = _dry_run(args + ["--max-staleness", "2", "--max-in-flight-groups", "4096"])  # above the target
    (uncapped,) = [line for line in lines if line.startswith("rank 0 host memory: fully async")]
    assert "in flight" not in uncapped and "GiB as lists" in uncapped


def test_tool_use_adds_the_sandbox_line_with_its_worst_cases(tmp_path):
    """--tool-template: the 32B launcher's plan gains the sandbox's host line, its numbers written out: B x G x
    (turns - 1) calls at the measured CPU of a trivial call, every process of every worker at --tool-memory-mib plus
    its tmpfs, every turn resending --max-response-length ids as JSON."""
    b, g, turns, workers, mib, length = 512, 16, 9, 16, 1024, 20480
    args = _launcher_train_args(tmp_path, *LAUNCHERS[1].values)
    rc, lines = _dry_run(args + ["--tool-template", "qwen", "--max-turns", str(turns), "--tool-workers",
                                 str(workers), "--tool-memory-mib", str(mib)])
    (line,) = [x for x in lines if x.startswith("rank 0 host: tool sandbox")]
    calls = b * g * (turns - 1)
    assert f"at most {calls:,} calls ({calls * 0.0335 / 60:.1f} core-minutes" in line
    assert f"at most {workers * (mib * 18 + 16) / 1024:.1f} GiB of address space" in line
    assert f"{b * g * turns * length * 7.3 / 1e9:.1f} GB of turn requests" in line
    _, plain = _dry_run(args)
    assert not [x for x in plain if "tool sandbox" in x]


def test_a_reference_model_adds_its_weights_and_nothing_else(tmp_path):
    """--ref-load: the 32B launcher's plan gains one row per stage, the frozen reference's bf16 weights on the actor's
    layout (TP8 x PP2: 32.8e9 params x 2 B / 16 = 3.8 GiB), and every other row is unchanged (no grads, no optimizer,
    no activations at the training peak)."""
    script, env, model = LAUNCHERS[1].values
    args = _launcher_train_args(tmp_path, script, env, model)
    plain = plan_from_flags(build_parser().parse_args(args), ModelArch.from_hf(REPO / "examples/models" / model))
    with_ref = plan_from_flags(build_parser().parse_args(args + ["--ref-load", "initial", "--kl-coef", "0.001"]),
                               ModelArch.from_hf(REPO / "examples/models" / model))
    a, b = (stages.plan_stages(p.arch, p.layout, p.inputs, p.spec) for p in (plain, with_ref))
    row = "reference model weights (frozen, bfloat16)"
    for stage, (x, y) in enumerate(zip(a, b, strict=True)):
        assert {k: v for k, v in y.lines.items() if k != row} == x.lines
        assert y.lines[row] == stages.stage_parameters(plain.arch, plain.layout, stage) * 2
        assert y.lines[row] == stages.static_bytes(x, "weights")
        assert 3.7 < y.lines[row] / 2**30 < 4.0, y.lines[row] / 2**30
    rc, lines = _dry_run(args + ["--ref-load", "initial"])
    assert rc == 0 and any(line.startswith(row) for line in lines), "\n".join(lines)


def test_colocated_frozen_models_count_in_training_start_up_and_save_not_in_generation(tmp_path):
    """--colocate --ref-load on the 32B colocated launcher: the reference's 3.8 GiB per GPU joins the training table,
    the start-up moments and the save (resident in the training phase), and the generation phase is unchanged (the
    offloader moves it to host with the actor's state, trainer/colocate.py ActorOffloader.frozen)."""
    args = _launcher_train_args(tmp_path, *COLOCATED)
    plain, with_ref = _dry_run(args), _dry_run(args + ["--ref-load", "initial", "--kl-coef", "0.001"])
    assert plain[0] == with_ref[0] == 0

    def totals(lines: list[str]) -> list[list[float]]:
        return [[float(x) for x in line.split()[1:]] for line in lines if line.startswith("total ")]

    ref_gib = next(float(line.split()[-1]) for line in with_ref[1] if line.startswith("reference model weights"))
    assert 3.7 < ref_gib < 4.0
    (train0, train1), (gen,), startup, (save,) = totals(plain[1])
    (rtrain0, rtrain1), (rgen,), rstartup, (rsave,) = totals(with_ref[1])
    near = lambda x: pytest.approx(x + ref_gib, abs=0.011)  # noqa: E731 (each printed value rounds to 0.01 GiB)
    assert [rtrain0, rtrain1] == [near(train0), near(train1)]
    assert rgen == gen  # offloaded while generating
    assert rstartup == [near(x) for x in startup] and rsave == near(save)


def test_a_served_teacher_is_a_line_of_requests_and_bytes_not_memory(tmp_path):
    """--teacher-url: the dry run adds one line whose numbers follow the formula written out (B x G requests, at the
    maximum lengths: ids up, log-prob entries down, fp32 broadcast per replica) and no GPU memory: the teacher's GPUs
    are its own. The JSON sizes per token are measured here on Qwen-sized ids."""
    import json
    import random

    rng = random.Random(0)
    ids = [rng.randrange(151_665) for _ in range(4000)]
    assert len(json.dumps(ids)) / len(ids) == pytest.approx(report.ID_JSON_BYTES, rel=0.05)
    entries = [[-rng.expovariate(1.0), i, None] for i in ids]
    assert len(json.dumps(entries)) / len(entries) == pytest.approx(report.LOGPROB_JSON_BYTES, rel=0.05)

    args = _launcher_train_args(tmp_path, *LAUNCHERS[1].values)  # Qwen2.5-32B's multi-node launcher
    dp = plan_from_flags(build_parser().parse_args(args), ModelArch.from_hf(REPO / "examples/models/qwen2.5-32B")
                         ).layout.dp
    rc, plain = _dry_run(args)
    rc_t, lines = _dry_run(args + ["--teacher-url", "http://t:30000", "--distill-coef", "1",
                                   "--teacher-max-concurrency", "32"])
    assert rc == rc_t == 0
    (line,) = [x for x in lines if x.startswith("served teacher")]
    b, g, p, r = 512, 16, 2048, 20480
    tokens = b * g * (p + r)
    assert f"{b * g:,} scoring requests ({b * g // dp:,} from each of {dp} data-parallel replicas, <= 32 in" in line
    assert f"{tokens / 1e6:,.1f} M tokens prefilled" in line
    assert f"{tokens * 7.3 / 1e9:.2f} GB of JSON up and {b * g * r * 36.4 / 1e9:.2f} GB down" in line
    assert f"broadcasts {b * g // dp * r * 4 / 2**20:,.0f} MiB" in line
    assert [x for x in lines if x != line] == plain  # every memory row as without the teacher
