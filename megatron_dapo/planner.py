"""Per-GPU memory plan of a layout, from the architecture alone (no model, no GPU): `--dry-run`.

Static memory (per pipeline stage, this TP rank's shards): weights in --params-dtype, the mcore DDP grad
buffer in fp32 (grad_reduce_in_fp32), and Adam state (fp32 main params + two moments; sharded over DP x CP
with --use-distributed-optimizer).

Activations: the tensors autograd saves for backward, per transformer layer and micro-batch of T padded
tokens in rows of length s (b s = T). Following Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Sec. 4): a GPT layer with dropout saves 34 s b h + 5 a s^2 b
bytes in fp16; norm inputs/outputs and dropout masks (10 s b h) are replicated over TP ranks unless
sequence parallelism shards them, the rest is split over TP. `ActivationSpec` generalises the paper's
count to what this project runs (tests/test_planner.py checks both against the paper's formulas and
against the bytes the real megatron-core model saves on CPU):
  - SwiGLU MLP (fc1 output 2f, then silu(x1), x2 + 0 and their product: 3f more; 1f when fused);
  - GQA: flash/fused attention (TransformerEngine) keeps q and k after RoPE, the fused qkv output (v is
    a view of it) and the output, no s^2 term; megatron-core's local attention keeps q and k, v
    expanded to all heads, and the [b, a, s, s] softmax (the 5 a s^2 b term, 2 a s^2 b without dropout);
  - torch RMSNorm (local spec) keeps input, normalised input and output (3h) + fp32 rstd; TE's fused
    norm-linear keeps input and output (2h);
  - unfused RoPE keeps cos/sin per q and k (4 s d per layer), the local spec an [s, s] bool mask;
  - per-head q/k RMSNorm before RoPE (qk_layernorm families: Qwen3): the fp32 rstd of every head and
    token; torch's norm keeps its normalised input (q + kv) and its input, a view of the fused qkv output
    for k (which keeps that output alive) and for q unless megatron-core's [ng, np/ng hn] -> [np, hn]
    reshape copies it (more than one query group on the rank, more than one head per group); TE's norm
    keeps its input made contiguous (q + kv). RoPE saves none of the norm's output (it multiplies by the
    constant cos / sin). Measured on CPU for torch (tests/test_planner.py); the TE count is read off TE's
    RMSNorm op (ops/basic/rmsnorm.py saves input_.contiguous() and the fp32 rstdevs), not measured.
Packing (--pack-sequences): a micro-batch is one [1, T] row of T real tokens, so every row-length term
(local attention scores, the explicit mask, the RoPE table) uses s = T; on TE (flash) only the RoPE
table does. Logits on the last stage: [T, V/tp] and their gradient, or with --fused-linear-logprob one
[chunk, V/tp] block plus the fp32 d weight accumulator of the chunked head.
Pipeline (1F1B): stage i of p holds min(p - i, M) micro-batches in flight, so stage 0 holds p.
Interleaved 1F1B (--num-layers-per-virtual-pipeline-stage, v chunks of L / (p v) layers per stage):
megatron-core's schedule runs 2 (p - i - 1) + (v - 1) p warm-up chunk-forwards on stage i, so it holds
that + 1 chunk-micro-batches (capped by M v); on stage 0 that is L (1 + (p - 1) / (p v)) layers' worth,
Korthikanti et al. 2022 section 4.2.3's interleaved factor. Embedding / head extras stay per micro-batch.
Full recompute keeps each recompute unit's input (s b h, /t with SP) and rebuilds one unit (n layers of one
micro-batch) during its backward; selective recompute drops the core-attention internals.

Mixture of experts (Qwen3-MoE): expert weights, fp32 grads and Adam state are this rank's E / EP experts of each
MoE layer of its stage, each 1 / ETP of 3 h I (stage_expert_parameters); the distributed optimizer shards them over
expert-DP (TP x CP x DP / (ETP x EP)), not DP. The router (E x h) counts with the dense part. An MoE layer saves
the router's tensors per local token and, per routed token copy, its hidden state and the expert's fc1 / SwiGLU /
prob products (moe_layer_bytes, measured on CPU at EP1); copies per rank = local tokens x k x ETP x a factor: 1 at
EP1, the capacity factor, or MOE_DROPLESS_IMBALANCE (2, assumed and printed) for the busiest EP rank when dropless.
One layer's dispatcher buffers (moe_dispatch_buffer_bytes) sit next to the recompute working set. Qwen3-30B-A3B at
TP1 x EP8 x 32 GPUs, 24576-token micro-batches, full recompute: 58.1 GiB per 80 GB GPU (experts 30.4 GiB of it).

Colocated (--colocate): every GPU holds an actor rank and a shard of an SGLang engine of
--rollout-num-gpus-per-engine GPUs, in two phases per step (megatron_dapo/trainer/colocate.py):
  - training: the actor's plan above, plus what SGLang keeps after /release_memory_occupation of its
    weights, KV cache and CUDA graphs (its CUDA context and allocator slack: SGLANG_RELEASED_GIB, assumed);
  - generation: the actor's leftovers after it offloaded grads and optimizer state (its bf16 weights, the
    source of the next weight push, and its CUDA context), SGLang's static pool (weights + KV cache =
    --mem-fraction-static x GPU memory) and its runtime outside that pool (SGLANG_RUNTIME_GIB, assumed).
  - start-up (startup_lines): the engines come up and release everything before the actor is built
    (colocate.py), so the worst start-up moment is the actor's build (bf16 weights plus a transient second
    copy while DDP fills its param buffer, the fp32 grad buffer) or its resume (Adam state and the load's
    buffers) next to the released engines. The old order built the actor next to resident engines: SGLang's
    static pool and runtime on top: at the 32B colocated launcher 82.9 GiB per 80 GB GPU while building,
    88.6 GiB while resuming, against 19.3 / 25.0 GiB now.
  - save (save_lines): a checkpoint is written in the training phase after the step's update, before the push
    (trainer/loop.py Trainer.save): weights, grads and the optimizer shard next to the released engine, the
    activations freed; the tensors are staged to host memory (megatron-core's D2H preload), no GPU buffers. The
    old save ran in the generation phase and onloaded grads and optimizer state next to SGLang's static pool and
    runtime: at the 32B colocated launcher 81.9 GiB per 80 GB GPU, against 18.3 GiB now.
SGLang 0.5.23 sizes its KV pool as (free memory at start) x mem_fraction_static - its weights
(mem_cache/kv_cache_configurator._profile_available_bytes); free <= GPU memory, so frac x GPU memory bounds it.
The computed --mem-fraction-static is the largest (in 0.01 steps) that keeps the generation phase under
(1 - HEADROOM) x --gpu-memory-gib.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass, replace
from typing import TextIO

from megatron_dapo.distributed.parallel import ParallelLayout, layer_range, padded_vocab_size, validate_layout
from megatron_dapo.models.hf_config import ModelArch

GIB = 1 << 30
FRAMEWORK_OVERHEAD_GIB = 2.0
"""Assumed, not modelled: CUDA context (~0.5 GiB), NCCL buffers, cuBLAS/TE workspaces, allocator slack."""
HEADROOM = 0.10
"""Launchers keep the planned peak under (1 - HEADROOM) x --gpu-memory-gib."""
SGLANG_RUNTIME_GIB = 4.0
"""Assumed, not modelled: a colocated SGLang process's memory outside its static pool while generating
(CUDA context, CUDA graphs, decode activations, sampling buffers)."""
MOE_DROPLESS_IMBALANCE = 2.0
"""Assumed: without --moe-expert-capacity-factor (dropless) the busiest EP rank receives this many times the
mean number of routed tokens in a micro-batch (load-balancing loss on; the per-step router statistics, tokens
per expert max / mean, show the real value). At EP1 a rank holds every expert and receives exactly T x k."""
SGLANG_RELEASED_GIB = 2.0
"""Assumed: what a colocated SGLang process keeps after releasing weights, KV cache and CUDA graphs (CUDA
context ~0.5 GiB, NCCL buffers, allocator slack); slime reports 3-5 GB for Megatron's side in the other phase."""


@dataclass(frozen=True, kw_only=True)
class ActivationSpec:
    """What one decoder layer saves for backward, in elements per token unless stated."""

    hidden: int
    ffn: int
    heads: int
    q: int
    """heads x head_dim."""
    kv: int
    """query groups x head_dim (= q without GQA)."""
    head_dim: int
    gated: bool = True
    """SwiGLU (the registered families) vs a plain two-matrix MLP (GPT: ffn = 4h, GeLU input and output saved)."""
    swiglu_fused: bool = False
    """bias_swiglu fusion keeps only fc1's output (f instead of 3f for the activation)."""
    attention: str = "flash"
    """'flash' (TE fused attention) or 'unfused' (megatron-core local DotProductAttention)."""
    norm_tensors: int = 2
    """h-sized tensors saved per norm: 2 (TE norm-linear, the paper's LN input + next GEMM input), 3 (torch)."""
    norm_stats_bytes: int = 4
    """Bytes per token per norm of saved statistics (fp32 rstd); 0 in the paper's count."""
    dropout: bool = False
    """Attention-prob and hidden dropout (GPT); the registered families have none (p = 0 saves nothing)."""
    rope: str = "unfused"
    """'unfused' (cos/sin saved per layer), 'fused' or 'none' (GPT: learned positions)."""
    bytes_per_element: int = 2
    causal_mask: bool = False
    """An explicit [1, 1, s, s] bool mask is passed (local spec): s^2 bytes per micro-batch, shared."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (HF q_norm / k_norm, megatron-core qk_layernorm: Qwen3)."""
    experts: int = 0
    """Routed experts of an MoE layer (0: dense MLPs only); see moe_layer_bytes."""
    topk: int = 0
    """Experts each token is routed to."""
    moe_ffn: int = 0
    """SwiGLU inner size of one expert (moe_intermediate_size)."""

    @property
    def kv_heads(self) -> int:
        return self.kv // self.head_dim

    @classmethod
    def for_arch(cls, arch: ModelArch, *, transformer_impl: str, bytes_per_element: int,
                 swiglu_fused: bool = False) -> ActivationSpec:
        """The spec of `arch`: sizes from the arch, the model's terms (gated MLP, dropout, rope, q/k norm) from its
        family (`arch.family.activation_terms`), attention and norm tensors from the layer implementation."""
        te = transformer_impl == "transformer_engine"
        return cls(hidden=arch.hidden_size, ffn=arch.intermediate_size, heads=arch.num_heads, q=arch.q_size,
                   kv=arch.kv_size, head_dim=arch.head_dim, swiglu_fused=swiglu_fused,
                   attention="flash" if te else "unfused", norm_tensors=2 if te else 3,
                   bytes_per_element=bytes_per_element, causal_mask=not te, experts=arch.num_experts,
                   topk=arch.num_experts_per_tok, moe_ffn=arch.moe_intermediate_size,
                   **arch.family.activation_terms(arch))


def layer_activation_bytes(spec: ActivationSpec, layout: ParallelLayout, *, tokens: int, seq_len: int,
                           selective: bool = False, moe_factor: float | None = None) -> float:
    """Bytes one layer saves for one micro-batch of `tokens` padded tokens in rows of `seq_len` (no full
    recompute). TP shards all but the norm tensors, norm statistics and dropout masks, which SP shards
    too; CP splits every token-proportional term. moe_factor: an MoE layer, whose MLP part is
    moe_layer_bytes(..., factor=moe_factor) instead of the dense MLP's."""
    e, t = spec.bytes_per_element, layout.tp
    tok = tokens / layout.cp
    rep = 2 * (spec.norm_tensors * spec.hidden * e + spec.norm_stats_bytes)  # two norms
    if spec.dropout:
        rep += 2 * spec.hidden  # attention-output and MLP-output dropout masks, 1 byte
    roped = spec.rope != "none"  # RoPE writes new q and k; without it q, k, v stay views of the qkv output
    gqa = spec.q != spec.kv
    if spec.attention == "flash" or selective:
        # the attention core's inputs: q, k (new tensors after RoPE) and v, a view that keeps the whole
        # fused qkv GEMM output alive; TE adds the softmax log-sum-exp (fp32, per head)
        attn = ((spec.q + spec.kv if roped else 0) + spec.q + 2 * spec.kv) * e
        if spec.attention == "flash" and not selective:
            attn += 4 * spec.heads
        scores = 0.0
    else:
        # local DotProductAttention: q, and k, v expanded to every head under GQA (repeat_interleave);
        # any of them left a view keeps the fused qkv output
        q_new, k_new, v_new = roped, roped or gqa, gqa
        attn = ((spec.q if q_new else 0) + (spec.q if gqa else spec.kv if k_new else 0)
                + (spec.q if v_new else 0)) * e
        if not (q_new and k_new and v_new) or spec.qk_norm:  # the k norm's input is a view of it
            attn += (spec.q + 2 * spec.kv) * e
        # softmax output [b, a, s, s]; with dropout also its mask (1 B) and output: 5 a s^2 b in fp16
        per_score = e + (1 + e if spec.dropout else 0)
        scores = spec.heads * seq_len * per_score  # per token: a s entries of its row
    if spec.qk_norm:
        attn += qk_norm_bytes(spec, layout.tp)
    attn += spec.q * e  # attention output = linear_proj input
    if moe_factor is not None:
        mlp = 0.0
    elif spec.gated:
        mlp = (2 * spec.ffn + (spec.ffn if spec.swiglu_fused else 3 * spec.ffn)) * e
    else:
        mlp = 2 * spec.ffn * e  # activation input and output (fc2 input)
    sharded = attn + scores + mlp
    per_token = (rep / t if layout.sp else rep) + sharded / t
    rope = 4 * (seq_len / layout.cp) * spec.head_dim * e if spec.rope == "unfused" else 0.0
    moe = 0.0 if moe_factor is None else moe_layer_bytes(spec, layout, tokens=tokens, factor=moe_factor)
    return tok * per_token + rope + moe


def moe_local_tokens(layout: ParallelLayout, tokens: int) -> float:
    """Tokens of a micro-batch that reach one rank's MoE layer: /cp, and /tp (sequence parallelism, which an
    MoE model needs at TP > 1)."""
    return tokens / (layout.cp * layout.tp)


def moe_routed_tokens(spec: ActivationSpec, layout: ParallelLayout, *, tokens: int, factor: float) -> float:
    """Token copies one rank's experts process per MoE layer and micro-batch: local tokens x top-k x ETP (the
    expert-TP group all-gathers its ranks' tokens) x factor. On average every rank of the EP group receives
    what it sends (EP ranks x local tokens x k / EP); `factor` is the busiest rank's share of the mean
    (moe_factor). Qwen3-30B-A3B at 24576 tokens, TP1: 196,608 copies x factor."""
    return moe_local_tokens(layout, tokens) * spec.topk * layout.expert_tp * factor


def moe_layer_bytes(spec: ActivationSpec, layout: ParallelLayout, *, tokens: int, factor: float) -> float:
    """Bytes an MoE block (router, dispatcher, experts) saves for backward per micro-batch, replacing the dense
    MLP's term; the pre-MLP norm is in layer_activation_bytes (its output is the router's saved input).
    Measured exactly on CPU at EP1 (megatron-core's alltoall dispatcher, SequentialMLP; tests/test_planner.py):
      - router, per local token: int64 top-k indices and sort permutation (16 k B; the load-balancing loss's
        own top-k indices die with its integer branch before backward), the fp32 top-k probs (4 k), the fp32
        softmax scores of the aux loss (4 E), the [E, T] routing map (bool, E) and probs (E x bytes); per layer
        the int64 tokens-per-expert and the loss;
      - experts, per routed token copy (moe_routed_tokens): its permuted hidden state (fc1's input, h), fc1's
        output (2 I), silu(x1), x2, their product and its product with the routing prob (fc2's input): 6 I
        (3 I with the fused weighted SwiGLU), each / ETP, and the permuted prob.
    Qwen3-30B-A3B (E 128, k 8, h 2048, I 768, bf16) per local token: router 1,056 B; experts 8 x (2048 + 6 x
    768 + 1) x 2 = 106.5 KB, x factor; a dense 6144-wide MLP would keep 61.4 KB."""
    e, k, E = spec.bytes_per_element, spec.topk, spec.experts
    local = moe_local_tokens(layout, tokens)
    router = local * (2 * 8 * k + 4 * k + 4 * E + E + E * e) + 8 * E + 4
    act = spec.moe_ffn if spec.swiglu_fused else 4 * spec.moe_ffn  # after fc1 (2 I)
    per_copy = (spec.hidden + (2 * spec.moe_ffn + act) / layout.expert_tp + 1) * e
    return router + moe_routed_tokens(spec, layout, tokens=tokens, factor=factor) * per_copy


def moe_dispatch_buffer_bytes(spec: ActivationSpec, layout: ParallelLayout, *, tokens: int, factor: float) -> float:
    """Transient bytes of one MoE layer's token exchange (assumed, not measured): the dispatch's send buffer (local
    tokens x k permuted copies of h) and receive buffer (the routed copies), and the combine's two in the
    other direction, all live around the all-to-alls of one layer (forward, or its gradient in backward).
    Qwen3-30B-A3B, 24576 tokens, TP1: 2 x (196,608 + 196,608 x factor) x 2048 x 2 B = 3.0 GiB at factor 1."""
    sent = moe_local_tokens(layout, tokens) * spec.topk
    received = moe_routed_tokens(spec, layout, tokens=tokens, factor=factor)
    return 2 * (sent + received) * spec.hidden * spec.bytes_per_element


def moe_alltoall_bytes(spec: ActivationSpec, layout: ParallelLayout, *, tokens: int) -> float:
    """Bytes one rank sends to other EP ranks per MoE layer, micro-batch and direction (dispatch, then combine;
    the backward pass repeats both): its local tokens x k hidden states, of which (EP - 1) / EP leave the rank
    on average. Qwen3-30B-A3B, 24576 tokens, TP1, EP8: 196,608 x 2048 x 2 B x 7/8 = 672 MiB."""
    sent = moe_local_tokens(layout, tokens) * spec.topk * spec.hidden * spec.bytes_per_element
    return sent * (layout.ep - 1) / layout.ep


def qk_norm_bytes(spec: ActivationSpec, tp: int) -> float:
    """Bytes per token (all heads: the caller divides by TP) the per-head q/k RMSNorms save beyond the fused
    qkv output: fp32 rstd per head, then torch's normalised q and k plus q's input when the query reshape
    copies it, or TE's contiguous input (see the module doc). Qwen3-32B (64 heads / 8 groups x 128, TE, bf16):
    (8192 + 1024) x 2 + 4 x 72 = 18.7 KB per token, 5.3% of the layer's 353 KB (before TP / SP)."""
    e = spec.bytes_per_element
    stats = 4 * (spec.heads + spec.kv_heads)
    if spec.norm_tensors == 2:  # TE: input (contiguous copy) and rstd
        return (spec.q + spec.kv) * e + stats
    groups = max(1, spec.kv_heads // tp)  # query groups on this rank
    q_copied = groups > 1 and spec.heads > spec.kv_heads
    return (spec.q + spec.kv + (spec.q if q_copied else 0)) * e + stats


def recompute_input_bytes(spec: ActivationSpec, layout: ParallelLayout, *, tokens: int) -> float:
    """Bytes a full-recompute unit keeps: its input hidden states [s, b, h] (/t with SP, /cp)."""
    shard = layout.tp if layout.sp else 1
    return tokens / layout.cp * spec.hidden * spec.bytes_per_element / shard


def micro_batch_extra_bytes(spec: ActivationSpec, layout: ParallelLayout, *, tokens: int, seq_len: int,
                            first: bool, last: bool, recompute: bool) -> float:
    """Per micro-batch, outside the layers: token ids (first stage, int64; plus the vocab-parallel
    embedding's out-of-shard mask at TP > 1), the final norm (last stage),
    the explicit causal mask (local spec), the RoPE table kept by recompute checkpoints."""
    tok, s = tokens / layout.cp, seq_len / layout.cp
    out = 0.0
    if first:
        out += 8 * tok + (tok if layout.tp > 1 else 0)  # int64 ids; at TP > 1 also the out-of-shard bool mask
    if last:
        norm = spec.norm_tensors * spec.hidden * spec.bytes_per_element + spec.norm_stats_bytes
        out += tok * (norm / layout.tp if layout.sp else norm)
    if spec.causal_mask:
        out += s * s
    if recompute:
        out += s * spec.head_dim * 4  # rotary_pos_emb [s, 1, 1, d] fp32, a checkpoint input
    return out


def logits_bytes(arch: ModelArch, layout: ParallelLayout, *, tokens: int, bytes_per_element: int,
                 fused_logprob: bool, fused_linear: bool = False) -> float:
    """Last stage, one micro-batch: vocab-parallel logits [b, s, V/tp] saved by the loss and their grad;
    the unfused log-prob adds an fp32 copy, log-softmax and fp32 grad (12 B per entry).

    fused_linear (--fused-linear-logprob): no [tokens, V/tp] tensor; the chunked head holds one
    [chunk, V/tp] block in the compute dtype plus its fp32 statistics/gradient temporaries (chunk x V/tp =
    ops.fused_linear.DEFAULT_CHUNK_LOGITS, 16 M entries), and in backward an fp32 [V/tp, h] accumulator of
    d weight (bf16 weights only). Under SP it saves the TP-gathered hidden states [tokens, h], where the
    output layer saves its 1/tp shard and gathers again in backward: (1 - 1/tp) tokens h more.
    32B launcher (TP8 + SP, 24576 tokens, fused kernel): 1.75 GiB -> 0.66 GiB.
    """
    vocab_local = padded_vocab_size(arch.vocab_size, layout.tp) // layout.tp
    if fused_linear:
        from megatron_dapo.ops.fused_linear import default_chunk_tokens

        chunk = min(default_chunk_tokens(vocab_local), tokens)
        accumulator = vocab_local * arch.hidden_size * 4 if bytes_per_element < 4 else 0
        gathered = tokens / layout.cp * arch.hidden_size * bytes_per_element * (1 - 1 / layout.tp) if layout.sp else 0
        return chunk * vocab_local * (bytes_per_element + 4) + accumulator + gathered
    entries = tokens / layout.cp * vocab_local
    return entries * (2 * bytes_per_element if fused_logprob else bytes_per_element + 12)


def stage_layers(arch: ModelArch, layout: ParallelLayout, stage: int) -> list[list[int]]:
    """Global layer indices of each model chunk pipeline `stage` holds (one chunk without VPP; `layer_range`)."""
    return [list(layer_range(arch.num_layers, layout, stage, c)) for c in range(layout.virtual_stages(arch.num_layers))]


def stage_expert_parameters(arch: ModelArch, layout: ParallelLayout, stage: int) -> int:
    """Expert parameters this rank holds on pipeline `stage`: E / EP experts of every MoE layer, each split over
    ETP (the router is not an expert parameter). Qwen3-30B-A3B at EP8, ETP1: 48 x 16 x 3 x 2048 x 768 = 3.62B."""
    if not arch.is_moe:
        return 0
    n_moe = sum(arch.is_moe_layer(i) for chunk in stage_layers(arch, layout, stage) for i in chunk)
    per_expert = 3 * arch.hidden_size * arch.moe_intermediate_size // layout.expert_tp
    return n_moe * arch.num_experts // layout.ep * per_expert


def stage_parameters(arch: ModelArch, layout: ParallelLayout, stage: int) -> int:
    """Parameters this rank holds on pipeline `stage`: norms and the router replicated over TP, the rest of the
    dense part split over TP, plus stage_expert_parameters."""
    h, t = arch.hidden_size, layout.tp
    qkv = arch.q_size + 2 * arch.kv_size
    bias = qkv if arch.qkv_bias else 0
    qk_norms = 2 * arch.head_dim if arch.qk_layernorm else 0  # per-head weights, replicated over TP
    attn = (h * qkv + bias + arch.q_size * h) // t + 2 * h + qk_norms
    layers = [i for chunk in stage_layers(arch, layout, stage) for i in chunk]
    n_moe = sum(arch.is_moe_layer(i) for i in layers)
    dense_mlp = 3 * h * arch.intermediate_size // t
    n = len(layers) * attn + (len(layers) - n_moe) * dense_mlp + n_moe * arch.num_experts * h
    n += stage_expert_parameters(arch, layout, stage)
    vocab = padded_vocab_size(arch.vocab_size, t) * h // t
    if stage == 0:
        n += vocab
    if stage == layout.pp - 1:
        n += h  # final norm
        if not arch.tie_word_embeddings or layout.pp > 1:
            n += vocab  # output layer (a tied copy when the embedding lives on another stage)
    return n


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything the plan depends on besides the architecture and layout."""

    tokens_per_micro_batch: int
    """--max-tokens-per-micro-batch (padded tokens of the largest micro-batch)."""
    max_seq_len: int
    """Longest row: --max-prompt-length + --max-response-length (capped by the budget)."""
    params_dtype: str = "bfloat16"
    use_distributed_optimizer: bool = True
    fused_logprob: bool = True
    packed: bool = False
    """--pack-sequences: tokens_per_micro_batch real tokens in one row (s = T for row-length terms)."""
    fused_linear_logprob: bool = False
    """--fused-linear-logprob: no [tokens, V/tp] logits on the last stage (see logits_bytes)."""
    num_micro_batches: int | None = None
    """Micro-batches per step per DP rank; None = at least pp (1F1B's steady state)."""
    gpu_memory_gib: float = 80.0
    sglang_gib: float = 0.0
    """What SGLang holds during the training phase: 0 on separate GPUs, SGLANG_RELEASED_GIB colocated."""
    colocate: bool = False
    """--colocate: the actor and an SGLang engine shard share every GPU (two phases; see the module doc)."""
    rollout_gpus_per_engine: int = 1
    """--rollout-num-gpus-per-engine: GPUs (= SGLang TP ranks) of one engine."""
    mem_fraction_static: float | None = None
    """--mem-fraction-static given by the user (validated), or None (computed from the plan)."""
    moe_capacity_factor: float | None = None
    """--moe-expert-capacity-factor: a hard cap on each expert's tokens (None: dropless)."""
    moe_imbalance: float = MOE_DROPLESS_IMBALANCE
    """Dropless MoE at EP > 1: the busiest EP rank's routed tokens over the mean (assumed)."""

    @property
    def moe_factor(self) -> float:
        """The routed-token factor of moe_routed_tokens at EP > 1: the capacity factor, else the assumed imbalance."""
        return self.moe_capacity_factor if self.moe_capacity_factor is not None else self.moe_imbalance

    def __post_init__(self) -> None:
        check_gpu_memory(self.gpu_memory_gib)
        if self.rollout_gpus_per_engine < 1:
            raise ValueError(f"--rollout-num-gpus-per-engine must be >= 1, got {self.rollout_gpus_per_engine}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")


def check_gpu_memory(gib: float) -> None:
    """Raise ValueError naming --gpu-memory-gib unless it is a finite number of GiB > 0: the plan's verdict and
    headroom divide by it, and a colocated run sizes SGLang's share (--mem-fraction-static) from it."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib <= 0:
        raise ValueError(f"--gpu-memory-gib must be a finite number of GiB > 0, got {gib!r}")


@dataclass(frozen=True)
class StagePlan:
    stage: int
    in_flight: int
    """Micro-batches whose activations this stage holds at its peak (1F1B)."""
    lines: dict[str, float]
    """Component -> bytes; keys starting with two spaces are details of the next line, not summed."""

    @property
    def total(self) -> float:
        return sum(v for k, v in self.lines.items() if not k.startswith("  "))


def moe_factor(layout: ParallelLayout, inputs: PlanInputs) -> float:
    """The routed-token factor the plan uses (moe_routed_tokens): 1 at EP1 (the rank holds every expert and gets
    exactly T x k copies; a capacity factor below 1 caps that), else the capacity factor or the assumed
    dropless imbalance (PlanInputs.moe_factor)."""
    if layout.ep == 1:
        return min(1.0, inputs.moe_capacity_factor or 1.0)
    return inputs.moe_factor


def _stage_activations(arch: ModelArch, layout: ParallelLayout, stage: int, *, dense: float, moe: float,
                       kept: float) -> tuple[float, float]:
    """(bytes of one model chunk's layers per micro-batch, recompute working set) of pipeline `stage`, given one
    dense and one MoE layer's bytes and a full-recompute unit's kept input. Chunks of a mixed model differ: the
    stage's mean chunk (VPP) and its largest recompute unit."""
    def of(layers: list[int]) -> float:
        n_moe = sum(arch.is_moe_layer(i) for i in layers)
        return (len(layers) - n_moe) * dense + n_moe * moe if n_moe else len(layers) * dense

    def mean(values: list[float]) -> float:
        return values[0] if len(set(values)) == 1 else sum(values) / len(values)

    chunks = stage_layers(arch, layout, stage)
    n = len(chunks[0])
    if layout.recompute_granularity != "full":
        return mean([of(c) for c in chunks]), 0.0
    unit = layout.layers_recomputed_per_unit
    if layout.recompute_method == "uniform":
        units = [c[i:i + unit] for c in chunks for i in range(0, n, unit)]
        return (n // unit) * kept, max(of(u) for u in units)
    recomputed = min(unit, n)  # block: the first n layers of each chunk are recomputed, the others keep everything
    rest = mean([of(c[recomputed:]) for c in chunks])
    working = max(of([i]) for c in chunks for i in c[:recomputed]) if recomputed else 0.0
    return recomputed * kept + rest, working


def plan_stages(arch: ModelArch, layout: ParallelLayout, inputs: PlanInputs, spec: ActivationSpec
                ) -> list[StagePlan]:
    """Bytes per component on each pipeline stage (this rank's share)."""
    validate_layout(arch, layout)
    pbytes = 2 if inputs.params_dtype == "bfloat16" else 4
    opt_per_param = 12 if pbytes == 2 else 8  # fp32 main params (bf16 only) + Adam exp_avg, exp_avg_sq
    opt_shards = layout.dp * layout.cp if inputs.use_distributed_optimizer else 1
    # expert parameters are replicated over the expert-DP group only, and the distributed optimizer shards them there
    expert_shards = layout.expert_dp if inputs.use_distributed_optimizer else 1
    tokens = inputs.tokens_per_micro_batch
    s = tokens if inputs.packed else min(inputs.max_seq_len, tokens)
    vpp = layout.virtual_stages(arch.num_layers)
    full = layout.recompute_granularity == "full"
    selective = layout.recompute_granularity == "selective"
    layer = layer_activation_bytes(spec, layout, tokens=tokens, seq_len=s, selective=selective)
    factor = moe_factor(layout, inputs) if arch.is_moe else None
    moe_layer = layer if factor is None else layer_activation_bytes(spec, layout, tokens=tokens, seq_len=s,
                                                                   selective=selective, moe_factor=factor)
    kept = recompute_input_bytes(spec, layout, tokens=tokens)
    plans = []
    for stage in range(layout.pp):
        first, last = stage == 0, stage == layout.pp - 1
        per_mb_layers, working = _stage_activations(arch, layout, stage, dense=layer, moe=moe_layer, kept=kept)
        experts = stage_expert_parameters(arch, layout, stage)
        params = stage_parameters(arch, layout, stage) - experts
        in_flight = layout.pp - stage
        # chunk-micro-batches in flight (interleaved: see the module doc); = in_flight without VPP
        chunks = in_flight if vpp == 1 else 2 * (layout.pp - stage - 1) + (vpp - 1) * layout.pp + 1
        if inputs.num_micro_batches is not None:
            in_flight = min(in_flight, inputs.num_micro_batches)
            chunks = min(chunks, inputs.num_micro_batches * vpp)
        extra = micro_batch_extra_bytes(spec, layout, tokens=tokens, seq_len=s, first=first, last=last,
                                        recompute=full)
        per_mb = vpp * per_mb_layers + extra
        p2p = 0.0 if layout.pp == 1 else 2 * recompute_input_bytes(spec, layout, tokens=tokens)
        lines = {
            f"weights ({inputs.params_dtype})": params * pbytes,
            "grads (fp32 DDP buffer)": params * 4.0,
            f"optimizer (fp32 Adam{' + main params' if pbytes == 2 else ''}, /{opt_shards})":
                params * opt_per_param / opt_shards,
        }
        if arch.is_moe:
            lines |= {
                f"expert weights ({arch.num_experts // layout.ep} of {arch.num_experts} per layer, "
                f"/{layout.expert_tp} ETP)": experts * pbytes,
                "expert grads (fp32 DDP buffer)": experts * 4.0,
                f"expert optimizer (/{expert_shards} expert-DP)": experts * opt_per_param / expert_shards,
            }
        lines |= {
            "  activations per micro-batch": per_mb,
            "activations in flight (1F1B)": chunks * per_mb_layers + in_flight * extra,
            "recompute working set": working,
        }
        if arch.is_moe:
            lines["MoE dispatcher buffers (one layer, transient)"] = moe_dispatch_buffer_bytes(
                spec, layout, tokens=tokens, factor=factor)
        lines |= {
            "logits + grad (last stage)": logits_bytes(
                arch, layout, tokens=tokens, bytes_per_element=spec.bytes_per_element,
                fused_logprob=inputs.fused_logprob, fused_linear=inputs.fused_linear_logprob) if last else 0.0,
            "pipeline p2p buffers": p2p,
            "SGLang (colocated, released)" if inputs.colocate else "SGLang (not colocated)": inputs.sglang_gib * GIB,
            "CUDA context, NCCL, workspaces (assumed)": FRAMEWORK_OVERHEAD_GIB * GIB,
        }
        plans.append(StagePlan(stage, in_flight, lines))
    return plans


def static_bytes(plan: StagePlan, kind: str) -> float:
    """A stage's 'weights', 'grads' or 'optimizer' bytes, dense and expert lines together."""
    return sum(v for k, v in plan.lines.items() if k.startswith((kind, "expert " + kind)))


def peak_gib(plans: list[StagePlan]) -> float:
    return max(p.total for p in plans) / GIB


# ---- colocated: the SGLang share and the generation phase -----------------------------------------------
def sglang_weight_bytes(arch: ModelArch, gpus_per_engine: int, bytes_per_element: int = 2) -> float:
    """Bytes of one SGLang TP rank's weights (bf16): the TP shard of every layer plus the vocab-padded
    embedding and head (32B at TP8: 8.2 GB)."""
    return stage_parameters(arch, ParallelLayout(tp=gpus_per_engine), 0) * bytes_per_element


def host_copy_bytes(arch: ModelArch, bytes_per_element: int = 2) -> int:
    """Bytes of rank 0's weight-sync host copy: one whole HF version, every tensor once (a tied lm_head is the
    embedding). SGLangEngine keeps exactly this after each tensor / distributed push and drops the previous
    version as the new one arrives, so it is also the peak (Qwen2.5-32B bf16: 65.5 GB = 61.0 GiB)."""
    return arch.num_parameters() * bytes_per_element


def host_copy_line(arch: ModelArch, *, mode: str, colocate: bool, bytes_per_element: int = 2) -> str:
    """The plan's rank-0 host-memory line for the weight-sync host copy (what re-syncs a lost server)."""
    if colocate:
        return "rank 0 host memory: no weight-sync host copy (--colocate: each rank hands its own GPU's buckets)"
    if mode == "disk":
        return "rank 0 host memory: no weight-sync host copy (--weight-sync-mode disk: the version is on disk)"
    return (f"rank 0 host memory: weight-sync host copy {host_copy_bytes(arch, bytes_per_element) / GIB:.2f} GiB "
            f"(one version, --weight-sync-mode {mode}; the previous one is dropped as the new one arrives)")


def kv_bytes_per_token(arch: ModelArch, gpus_per_engine: int, bytes_per_element: int = 2) -> float:
    """KV-cache bytes one token takes on one SGLang TP rank: K and V of every layer for its kv heads (SGLang
    replicates kv heads when TP > kv heads). 32B (8 kv heads x 128) at TP8: 2 x 64 x 1 x 128 x 2 = 32 KiB."""
    heads = max(1, arch.num_kv_heads // gpus_per_engine)
    return 2 * arch.num_layers * heads * arch.head_dim * bytes_per_element


@dataclass(frozen=True)
class SGLangShare:
    """What a colocated SGLang engine takes of each GPU, by phase, and the --mem-fraction-static behind it."""

    mem_fraction_static: float
    computed: bool
    """True when derived from the plan, False when given with --mem-fraction-static (validated)."""
    weights: float
    """Bytes of this GPU's weight shard."""
    kv_cache: float
    """Bytes of this GPU's KV pool: frac x GPU memory - weights."""
    kv_tokens: int
    """Tokens the engine's KV pool holds (every rank holds its heads' share of each token)."""
    actor_generation: dict[str, float]
    """The actor's resident bytes while generating, on its fullest pipeline stage (actor_generation_lines)."""

    @property
    def static(self) -> float:
        return self.weights + self.kv_cache


def actor_generation_lines(plan: StagePlan) -> dict[str, float]:
    """The actor's resident bytes during generation: its weights (the source of the next weight push) and
    CUDA context; grads and optimizer state are offloaded to host and activations freed."""
    weights = static_bytes(plan, "weights")
    return {"actor weights (resident)": weights,
            "actor CUDA context, NCCL (assumed)": FRAMEWORK_OVERHEAD_GIB * GIB}


def sglang_share(arch: ModelArch, plans: list[StagePlan], inputs: PlanInputs, bytes_per_element: int = 2
                 ) -> SGLangShare:
    """The SGLang share of each GPU for --colocate: --mem-fraction-static computed as the largest multiple of
    0.01 that keeps (actor leftovers + frac x GPU + SGLANG_RUNTIME_GIB) under (1 - HEADROOM) x GPU memory, or
    the given one. Raises ValueError (naming the flag) when the pool cannot hold the weights and one
    --max-prompt-length + --max-response-length sequence."""
    gpu = inputs.gpu_memory_gib * GIB
    actor = max((actor_generation_lines(p) for p in plans), key=lambda d: sum(d.values()))
    weights = sglang_weight_bytes(arch, inputs.rollout_gpus_per_engine, bytes_per_element)
    computed = inputs.mem_fraction_static is None
    if computed:
        room = (1 - HEADROOM) * gpu - sum(actor.values()) - SGLANG_RUNTIME_GIB * GIB
        frac = int(room / gpu * 100) / 100
    else:
        frac = inputs.mem_fraction_static
    kv = frac * gpu - weights
    per_token = kv_bytes_per_token(arch, inputs.rollout_gpus_per_engine, bytes_per_element)
    tokens = int(kv // per_token) if kv > 0 else 0
    if tokens < inputs.max_seq_len:
        need = (weights + inputs.max_seq_len * per_token) / gpu
        what = "computed" if computed else "given"
        raise ValueError(
            f"--mem-fraction-static {frac:.2f} ({what}) leaves SGLang {max(kv, 0) / GIB:.2f} GiB of KV cache per GPU "
            f"({tokens} tokens) next to {weights / GIB:.2f} GiB of weights at --rollout-num-gpus-per-engine "
            f"{inputs.rollout_gpus_per_engine}: one {inputs.max_seq_len}-token sequence needs a fraction >= "
            f"{need:.3f}; raise --rollout-num-gpus-per-engine or --gpu-memory-gib, or shrink the actor")
    return SGLangShare(mem_fraction_static=frac, computed=computed, weights=weights, kv_cache=kv,
                       kv_tokens=tokens, actor_generation=actor)


def generation_lines(share: SGLangShare) -> dict[str, float]:
    """Component -> bytes of one GPU while generating (colocated)."""
    return {**share.actor_generation,
            "SGLang weights (TP shard)": share.weights,
            f"SGLang KV cache ({share.kv_tokens:,} tokens)": share.kv_cache,
            "SGLang runtime: CUDA graphs, activations (assumed)": SGLANG_RUNTIME_GIB * GIB}


def startup_lines(plan: StagePlan, inputs: PlanInputs, use_distributed_optimizer: bool | None = None
                  ) -> dict[str, tuple[float, float]]:
    """Component -> (bytes at the actor's build, bytes at a resume) on one GPU during a colocated start-up, the
    engines released first (SGLANG_RELEASED_GIB each).

    Build: megatron-core DDP allocates its bf16 param buffer and fp32 grad buffer, then copies every parameter
    in and frees the original, so it briefly holds 2 x weights + grads; the optimizer's fp32 main-param shards
    (4 B/param / DP shards, bf16 only) come after that copy is freed: the larger of the two moments. Resume: weights,
    grads, the whole optimizer shard (main params + Adam moments) and the load's buffers (assumed: the tensors
    read from the checkpoint before they are copied in, one copy of the weights and optimizer shard)."""
    weights, grads, optimizer = (static_bytes(plan, kind) for kind in ("weights", "grads", "optimizer"))
    main = optimizer / 3 if weights * 2 == grads else 0.0  # bf16: 4 of the 12 B/param are main params
    copy, build_opt = (weights, 0.0) if weights >= main else (0.0, main)
    return {"SGLang (colocated, released)": (inputs.sglang_gib * GIB,) * 2,
            f"weights ({inputs.params_dtype})": (weights, weights),
            "DDP param buffer's transient copy of the weights": (copy, 0.0),
            "grads (fp32 DDP buffer)": (grads, grads),
            "optimizer (main params; + Adam on resume)": (build_opt, optimizer),
            "checkpoint load buffers (assumed)": (0.0, weights + optimizer),
            "CUDA context, NCCL, workspaces (assumed)": (FRAMEWORK_OVERHEAD_GIB * GIB,) * 2}


def startup_peaks(arch: ModelArch, plans: list[StagePlan], inputs: PlanInputs, bytes_per_element: int = 2
                  ) -> tuple[float, float]:
    """(new order, old order) bytes of the fullest GPU at its worst start-up moment: the engines released before
    the actor allocates, against the actor built and loaded next to engines holding their static pool
    (--mem-fraction-static x GPU memory) and runtime (SGLANG_RUNTIME_GIB) in place of the released share."""
    share = sglang_share(arch, plans, inputs, bytes_per_element)
    new = max(sum(col) for p in plans for col in zip(*startup_lines(p, inputs).values(), strict=True))
    resident = share.static + SGLANG_RUNTIME_GIB * GIB - inputs.sglang_gib * GIB
    return new, new + resident


def save_lines(plan: StagePlan, inputs: PlanInputs) -> dict[str, float]:
    """Component -> bytes on one GPU while a colocated run writes a checkpoint: in the training phase, after the
    step's update (the activations freed) and before the push, next to the released engine. The save reads the
    weights and the optimizer shard (fp32 main params + Adam moments: megatron-core's dp_reshardable state reads
    only the grad buffers' sizes); the grads stay allocated, as the training phase left them."""
    return {"SGLang (colocated, released)": inputs.sglang_gib * GIB,
            f"weights ({inputs.params_dtype})": static_bytes(plan, "weights"),
            "grads (fp32 DDP buffer)": static_bytes(plan, "grads"),
            "optimizer (main params + Adam, read by the save)": static_bytes(plan, "optimizer"),
            "CUDA context, NCCL, workspaces (assumed)": FRAMEWORK_OVERHEAD_GIB * GIB}


def save_peaks(arch: ModelArch, plans: list[StagePlan], inputs: PlanInputs, bytes_per_element: int = 2
               ) -> tuple[float, float]:
    """(now, old) bytes of the fullest GPU while a colocated run saves: in the training phase (save_lines), against
    the old save in the generation phase, which onloaded grads and optimizer state next to everything the
    generation phase holds (generation_lines)."""
    share = sglang_share(arch, plans, inputs, bytes_per_element)
    engine = sum(generation_lines(share).values()) - sum(share.actor_generation.values())
    new = max(sum(save_lines(p, inputs).values()) for p in plans)
    old = max(engine + sum(actor_generation_lines(p).values()) + static_bytes(p, "grads")
              + static_bytes(p, "optimizer") for p in plans)
    return new, old


# ---- --dry-run ---------------------------------------------------------------------------------------
def plan_world_size(world_size: int | None, *, tp: int, pp: int, cp: int, ep: int, etp: int | None) -> int:
    """--world-size, else $WORLD_SIZE, else the fewest ranks that hold one model replica and one expert grid
    (a multiple of TP x CP and of EP x ETP per pipeline stage, times PP)."""
    if world_size is not None:
        return _at_least_one(world_size, "--world-size")
    if os.environ.get("WORLD_SIZE"):
        return _at_least_one(int(os.environ["WORLD_SIZE"]), "$WORLD_SIZE")
    return math.lcm(tp * cp, ep * (etp or tp)) * pp


def _at_least_one(world_size: int, name: str) -> int:
    if world_size < 1:
        raise ValueError(f"{name} must be >= 1 (the actor GPUs to plan for), got {world_size}")
    return world_size


def check_plan_flags(*, gpu_memory_gib: float, world_size: int | None) -> None:
    """The planner's own flags, as --dry-run reads them (ValueError naming the flag): --gpu-memory-gib a finite
    number > 0, --world-size >= 1 when given. A run checks them at start-up too (startup.check_flags): a colocated
    one sizes SGLang's share from --gpu-memory-gib."""
    check_gpu_memory(gpu_memory_gib)
    if world_size is not None:
        _at_least_one(world_size, "--world-size")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What plan_stages needs, parsed once from the flags and config.json (startup.plan_from_flags)."""

    arch: ModelArch
    layout: ParallelLayout
    """The layout over plan_world_size's ranks."""
    inputs: PlanInputs
    spec: ActivationSpec


def _suggestions(arch: ModelArch, layout: ParallelLayout, inputs: PlanInputs, spec: ActivationSpec
                 ) -> list[tuple[str, float]]:
    """(flags to change, resulting peak GiB) for the single changes that lower the peak, most useful first."""
    tries: list[tuple[str, ParallelLayout, PlanInputs]] = []
    if layout.tp > 1 and not layout.sp and spec.attention == "flash":
        tries.append(("--sequence-parallel", replace(layout, sp=True), inputs))
    if layout.recompute_granularity != "full":
        tries.append(("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                      replace(layout, recompute_granularity="full", recompute_method="uniform",
                              recompute_num_layers=1), inputs))
    if not inputs.use_distributed_optimizer and layout.dp * layout.cp > 1:
        tries.append(("--use-distributed-optimizer", layout, replace(inputs, use_distributed_optimizer=True)))
    if not inputs.fused_linear_logprob:
        tries.append(("--fused-linear-logprob", layout, replace(inputs, fused_linear_logprob=True)))
    if arch.is_moe:  # more expert ranks shard the expert weights, grads and optimizer; a cap bounds the routed tokens
        with contextlib.suppress(ValueError):  # EP x ETP no longer divides the ranks of a stage
            tries.append((f"--expert-model-parallel-size {layout.ep * 2}", replace(layout, ep=layout.ep * 2), inputs))
        if layout.ep > 1 and inputs.moe_capacity_factor is None:
            tries.append(("--moe-expert-capacity-factor 1.0", layout, replace(inputs, moe_capacity_factor=1.0)))
    half = inputs.tokens_per_micro_batch // 2
    if half >= inputs.max_seq_len:
        tries.append((f"--max-tokens-per-micro-batch {half}", layout, replace(inputs, tokens_per_micro_batch=half)))
    out = []
    for flags, lay, inp in tries:
        try:
            out.append((flags, peak_gib(plan_stages(arch, lay, inp, spec))))
        except ValueError:
            continue
    return out


def format_plan(arch: ModelArch, layout: ParallelLayout, inputs: PlanInputs, spec: ActivationSpec) -> list[str]:
    plans = plan_stages(arch, layout, inputs, spec)
    s = inputs.tokens_per_micro_batch if inputs.packed else min(inputs.max_seq_len, inputs.tokens_per_micro_batch)
    rec = layout.recompute_granularity or "off"
    if layout.recompute_granularity == "full":
        rec += f"/{layout.recompute_method} {layout.layers_recomputed_per_unit}"
    experts = (f"; experts ETP{layout.expert_tp} x EP{layout.ep} x EDP{layout.expert_dp} x PP{layout.pp}"
               if arch.is_moe else "")
    lines = [
        f"layout: TP{layout.tp} x PP{layout.pp} x CP{layout.cp} x DP{layout.dp} = {layout.world_size} GPUs{experts}; "
        f"sequence parallel {'on' if layout.sp else 'off'}; recompute {rec}; attention {spec.attention} "
        f"({'transformer_engine' if spec.attention == 'flash' else 'local'})",
        (f"micro-batch: {inputs.tokens_per_micro_batch} real tokens packed in one row (--pack-sequences); "
         if inputs.packed else f"micro-batch: {inputs.tokens_per_micro_batch} padded tokens, rows up to {s}; ")
        + f"{arch.num_layers // layout.pp} layers per stage"
        + (f" in {layout.virtual_stages(arch.num_layers)} interleaved chunks (--num-layers-per-virtual-pipeline-"
           f"stage {layout.layers_per_virtual_stage}; activations: Korthikanti 2022 4.2.3)"
           if layout.layers_per_virtual_stage else ""),
        f"{'GiB per GPU':<48}" + "".join(f"{'stage ' + str(p.stage):>10}" for p in plans),
    ]
    lines.append(f"{'  micro-batches in flight (1F1B: pp - stage)':<48}"
                 + "".join(f"{p.in_flight:>10d}" for p in plans))
    for key in plans[0].lines:
        lines.append(f"{key:<48}" + "".join(f"{p.lines[key] / GIB:>10.2f}" for p in plans))
    lines.append(f"{'total':<48}" + "".join(f"{p.total / GIB:>10.2f}" for p in plans))
    kw = dict(tokens=inputs.tokens_per_micro_batch, bytes_per_element=spec.bytes_per_element,
              fused_logprob=inputs.fused_logprob)
    full, head = logits_bytes(arch, layout, **kw), logits_bytes(arch, layout, **kw, fused_linear=True)
    lines.append(f"last-stage logits per micro-batch: {full / GIB:.2f} GiB as [tokens x V/tp] logits, "
                 f"{head / GIB:.2f} GiB with --fused-linear-logprob (saves {(full - head) / GIB:.2f} GiB; "
                 f"{'on' if inputs.fused_linear_logprob else 'off'})")
    if arch.is_moe:
        lines += moe_lines(arch, layout, inputs, spec)
    if inputs.colocate:
        lines += colocated_lines(arch, plans, inputs, spec)
    return lines


def moe_lines(arch: ModelArch, layout: ParallelLayout, inputs: PlanInputs, spec: ActivationSpec) -> list[str]:
    """The MoE terms of the plan, per MoE layer and micro-batch on one GPU: the routed-token factor assumed, what the
    router and experts save, the dispatcher's buffers and what the all-to-all moves."""
    tokens = inputs.tokens_per_micro_batch
    factor = moe_factor(layout, inputs)
    if layout.ep == 1:
        why = "EP1: every expert is local, exactly T x k copies"
    elif inputs.moe_capacity_factor is not None:
        why = f"--moe-expert-capacity-factor {inputs.moe_capacity_factor:g}: a hard cap"
    else:
        why = (f"dropless: assumed imbalance, the busiest EP rank gets {factor:g}x the mean (MOE_DROPLESS_IMBALANCE; "
               "--moe-expert-capacity-factor caps it)")
    copies = moe_routed_tokens(spec, layout, tokens=tokens, factor=factor)
    saved = moe_layer_bytes(spec, layout, tokens=tokens, factor=factor)
    n_moe = len(arch.moe_layers)
    return [
        f"MoE: {arch.num_experts} experts, top-{arch.num_experts_per_tok}, {n_moe} of {arch.num_layers} layers; "
        f"{arch.num_experts // layout.ep} experts per GPU per layer, each 1/{layout.expert_tp} (ETP)",
        f"MoE routed token copies per GPU per layer and micro-batch: {copies:,.0f} = "
        f"{moe_local_tokens(layout, tokens):,.0f} local tokens x top-{arch.num_experts_per_tok} x ETP{layout.expert_tp}"
        f" x {factor:g} ({why})",
        f"MoE saved per layer and micro-batch: {saved / GIB:.2f} GiB (router, permuted tokens, expert fc1/act/fc2; "
        f"the dense attention part comes on top)",
        f"MoE all-to-all per layer and micro-batch: {moe_alltoall_bytes(spec, layout, tokens=tokens) / 2**20:,.0f} "
        f"MiB sent to other EP ranks per direction (dispatch, combine; backward repeats both)",
    ]


def colocated_lines(arch: ModelArch, plans: list[StagePlan], inputs: PlanInputs, spec: ActivationSpec
                    ) -> list[str]:
    """The generation phase and the SGLang share (the table above is the training phase)."""
    share = sglang_share(arch, plans, inputs, spec.bytes_per_element)
    gen = generation_lines(share)
    gpu = inputs.gpu_memory_gib
    lines = ["phase: training = the table above (SGLang released its weights, KV cache and CUDA graphs)",
             f"phase: generation (actor's grads and optimizer state offloaded to host){'GiB per GPU':>14}"]
    for key, value in gen.items():
        lines.append(f"{key:<48}{value / GIB:>10.2f}")
    lines.append(f"{'total':<48}{sum(gen.values()) / GIB:>10.2f}")
    worst = max(plans, key=lambda p: max(sum(c) for c in zip(*startup_lines(p, inputs).values(), strict=True)))
    start = startup_lines(worst, inputs)
    lines.append(f"phase: start-up, stage {worst.stage} (engines released before the actor is built){'build':>10}"
                 f"{'resume':>10}")
    for key, (build, resume) in start.items():
        lines.append(f"{key:<48}{build / GIB:>10.2f}{resume / GIB:>10.2f}")
    new, old = startup_peaks(arch, plans, inputs, spec.bytes_per_element)
    lines.append(f"{'total':<48}{sum(b for b, _ in start.values()) / GIB:>10.2f}"
                 f"{sum(r for _, r in start.values()) / GIB:>10.2f}")
    lines.append(f"start-up: worst {new / GIB:.2f} GiB per GPU; the old order (actor built next to resident "
                 f"engines) held {old / GIB:.2f} GiB")
    worst = max(plans, key=lambda p: sum(save_lines(p, inputs).values()))
    save = save_lines(worst, inputs)
    lines.append(f"phase: save, stage {worst.stage} (--save: training phase, before the push){'GiB per GPU':>14}")
    for key, value in save.items():
        lines.append(f"{key:<48}{value / GIB:>10.2f}")
    lines.append(f"{'total':<48}{sum(save.values()) / GIB:>10.2f}")
    new, old = save_peaks(arch, plans, inputs, spec.bytes_per_element)
    lines.append(f"save: {new / GIB:.2f} GiB per GPU; saved in the generation phase (grads and optimizer onloaded "
                 f"next to the resident engines) it held {old / GIB:.2f} GiB")
    lines.append(
        f"SGLang share: --mem-fraction-static {share.mem_fraction_static:.2f} "
        f"({'computed from this plan' if share.computed else 'given'}) = {share.static / GIB:.2f} GiB of "
        f"{gpu:g}: weights {share.weights / GIB:.2f} + KV cache {share.kv_cache / GIB:.2f} GiB "
        f"({share.kv_tokens:,} tokens per engine of {inputs.rollout_gpus_per_engine} GPUs)")
    return lines


def phase_peaks_gib(arch: ModelArch, layout: ParallelLayout, inputs: PlanInputs, spec: ActivationSpec
                    ) -> dict[str, float]:
    """{'training': GiB, 'generation': GiB} of the fullest GPU (generation only with --colocate)."""
    plans = plan_stages(arch, layout, inputs, spec)
    out = {"training": peak_gib(plans)}
    if inputs.colocate:
        out["generation"] = sum(generation_lines(sglang_share(arch, plans, inputs, spec.bytes_per_element))
                                .values()) / GIB
    return out


def print_plan(plan: Plan, *, weight_sync_mode: str | None, out: TextIO | None = None, err: TextIO | None = None
               ) -> int:
    """Print the per-GPU plan to `out` (stdout); 0 when the peak fits --gpu-memory-gib, else 1. A layout the model
    does not split over: one line `plan: error: ...` on `err` (stderr), 2. `weight_sync_mode`: --weight-sync-mode."""
    out = out or sys.stdout
    arch, layout, inputs, spec = plan.arch, plan.layout, plan.inputs, plan.spec
    try:
        lines = format_plan(arch, layout, inputs, spec)
        phases = phase_peaks_gib(arch, layout, inputs, spec)
        peak = max(phases.values())
        if inputs.colocate:  # the start-up's and the save's worst moments count too (printed above the phases line)
            plans = plan_stages(arch, layout, inputs, spec)
            peak = max(peak, startup_peaks(arch, plans, inputs, spec.bytes_per_element)[0] / GIB,
                       save_peaks(arch, plans, inputs, spec.bytes_per_element)[0] / GIB)
    except ValueError as exc:
        print(f"plan: error: {exc}", file=err or sys.stderr)
        return 2
    for line in lines:
        print(line, file=out)
    from megatron_dapo.weight_sync.transports import weight_sync_mode as resolve_mode

    mode = resolve_mode(requested=weight_sync_mode, attach=True, cuda=True, colocate=inputs.colocate)
    print(host_copy_line(arch, mode=mode, colocate=inputs.colocate, bytes_per_element=spec.bytes_per_element),
          file=out)
    fits = peak <= inputs.gpu_memory_gib
    if inputs.colocate:
        print("phases: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in phases.items()), file=out)
    if fits:
        print(f"headroom: {(1 - peak / inputs.gpu_memory_gib) * 100:.1f}% of --gpu-memory-gib", file=out)
    else:
        print(f"over by {peak - inputs.gpu_memory_gib:.2f} GiB; single changes that lower the peak:", file=out)
        suggestions = _suggestions(arch, layout, inputs, spec)
        for flags, after in suggestions:
            verdict = "fits" if after <= inputs.gpu_memory_gib else "still over"
            print(f"  {flags}: peak {after:.2f} GiB ({verdict})", file=out)
        if not any(after <= inputs.gpu_memory_gib for _, after in suggestions):
            print("  no single flag change fits: spread the model over more GPUs (a larger "
                  "--tensor-model-parallel-size or --pipeline-model-parallel-size), or combine the changes above",
                  file=out)
    print(f"plan: peak {peak:.2f} GiB per GPU of {inputs.gpu_memory_gib:g} GiB", file=out)
    return 0 if fits else 1


if __name__ == "__main__":  # `python -m megatron_dapo.planner <train.py flags>`: the trainer's --dry-run, its status
    from megatron_dapo.startup import dry_run_main

    sys.exit(dry_run_main(sys.argv[1:]))
