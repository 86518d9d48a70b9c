"""What a layer and a micro-batch save for backward, per GPU: the activation terms of the memory plan.

Activations: the tensors autograd saves for backward, per transformer layer and micro-batch of T padded
tokens in rows of length s (b s = T). Following Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Sec. 4): a GPT layer with dropout saves 34 s b h + 5 a s^2 b
bytes in fp16; norm inputs/outputs and dropout masks (10 s b h) are replicated over TP ranks unless
sequence parallelism shards them, the rest is split over TP. `ActivationSpec` generalises the paper's
count to what this project runs (tests/unit/planner/test_planner.py checks both against the paper's formulas and
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
    constant cos / sin). Measured on CPU for torch (tests/unit/planner/test_planner.py); the TE count is read off TE's
    RMSNorm op (ops/basic/rmsnorm.py saves input_.contiguous() and the fp32 rstdevs), not measured.
  - multi-head latent attention (DeepSeek-V2 / V3: `kv_lora` > 0, mla_bytes): the q and kv latents with their
    RMSNorms (whole on every TP rank like the layer norms, SP shards them), new query and key of heads x (nope +
    rope) dims and a contiguous v of heads x v dims, no up-projection output; RoPE tables of the rope dims only, and
    none passed to the recompute checkpoints (MLA makes its own in each layer). Measured on CPU for the local spec;
    the TE count (fused norm-linears, fused MLA RoPE, cuDNN attention) is argued in mla_bytes, not measured.
Packing (--pack-sequences): a micro-batch is one [1, T] row of T real tokens, so every row-length term
(local attention scores, the explicit mask, the RoPE table) uses s = T; on TE (flash) only the RoPE
table does. Logits on the last stage: [T, V/tp] and their gradient, or with --fused-linear-logprob one
[chunk, V/tp] block plus the fp32 d weight accumulator of the chunked head.
Full recompute keeps each recompute unit's input (s b h, /t with SP) and rebuilds one unit (n layers of one
micro-batch) during its backward; selective recompute drops the core-attention internals.

The MoE block (Qwen3-MoE, DeepSeek-V3) replaces the dense MLP's term: its shared experts' MLP (DeepSeek; a dense MLP of
shared_ffn), the router's tensors per local token (softmax or sigmoid scores, the load-balancing loss's where it runs)
and, per routed token copy, its hidden state and the expert's fc1 / SwiGLU / prob products (moe_layer_bytes, measured
on CPU at EP1); the routed-token factor is the plan's (stages.moe_factor).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch


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
    shared_ffn: int = 0
    """SwiGLU inner size of an MoE layer's shared experts together (DeepSeek: n_shared_experts x
    moe_intermediate_size; megatron-core runs them as one MLP beside the routed experts); 0: none."""
    router_scores: str = "softmax"
    """'softmax' (Qwen3-MoE: top-k of the logits, softmax over the k kept) or 'sigmoid' (DeepSeek-V3: the sigmoid of
    every expert's logit, top-k, the k kept renormalised); see moe_layer_bytes."""
    aux_loss: bool = True
    """The router's load-balancing loss runs and saves its softmax scores (DeepSeek-V3's bias-balanced routing has
    none)."""
    q_lora: int = 0
    """Multi-head latent attention's q latent rank (q_lora_rank); 0: one q projection (DeepSeek-V2-Lite, or GQA)."""
    kv_lora: int = 0
    """Multi-head latent attention's kv latent rank (kv_lora_rank; DeepSeek-V2 / V3, see mla_bytes); 0: GQA."""
    rope_dim: int = 0
    """Dims of each q / k head RoPE turns (MLA: qk_rope_head_dim; the rest of head_dim has no position); 0: all."""
    v_dim: int = 0
    """Dims of each v head (MLA: v_head_dim); 0: head_dim."""

    def __post_init__(self) -> None:
        if self.kv_lora and not self.qk_norm:
            raise ValueError("multi-head latent attention (kv_lora > 0) is modelled with its q / kv latent RMSNorms "
                             "(qk_norm, megatron-core's qk_layernorm): every DeepSeek checkpoint has them")

    @property
    def kv_heads(self) -> int:
        return self.kv // self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dims of each q / k head RoPE turns (its cos / sin tables' width)."""
        return self.rope_dim or self.head_dim

    @property
    def context(self) -> int:
        """heads x v head dim: the attention output, linear_proj's input."""
        return self.heads * (self.v_dim or self.head_dim)

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
    recompute). TP shards all but the norm tensors, norm statistics, dropout masks and MLA's latents, which SP
    shards too; CP splits every token-proportional term. moe_factor: an MoE layer, whose MLP part is its shared
    experts' plus moe_layer_bytes(..., factor=moe_factor) instead of the dense MLP's."""
    e, t = spec.bytes_per_element, layout.tp
    tok = tokens / layout.cp
    rep = 2 * (spec.norm_tensors * spec.hidden * e + spec.norm_stats_bytes)  # two norms
    if spec.dropout:
        rep += 2 * spec.hidden  # attention-output and MLP-output dropout masks, 1 byte
    if spec.kv_lora:
        latents, attn, scores = mla_bytes(spec, seq_len=seq_len, selective=selective)
        rep += latents
    else:
        attn, scores = gqa_bytes(spec, tp=t, seq_len=seq_len, selective=selective)
    attn += spec.context * e  # attention output = linear_proj input
    mlp = mlp_bytes(spec, spec.ffn if moe_factor is None else spec.shared_ffn)
    sharded = attn + scores + mlp
    per_token = (rep / t if layout.sp else rep) + sharded / t
    rope = 4 * (seq_len / layout.cp) * spec.rotary_dim * e if spec.rope == "unfused" else 0.0
    moe = 0.0 if moe_factor is None else moe_layer_bytes(spec, layout, tokens=tokens, factor=moe_factor)
    return tok * per_token + rope + moe


def score_bytes(spec: ActivationSpec, seq_len: int) -> float:
    """Bytes per token of local DotProductAttention's softmax output [b, a, s, s] (a s entries of its row); with
    dropout also its mask (1 B) and output: the paper's 5 a s^2 b in fp16."""
    e = spec.bytes_per_element
    return spec.heads * seq_len * (e + (1 + e if spec.dropout else 0))


def gqa_bytes(spec: ActivationSpec, *, tp: int, seq_len: int, selective: bool) -> tuple[float, float]:
    """(attention inputs and q/k norms, scores) bytes per token of GQA attention before its output, all heads (the
    caller divides by TP)."""
    e = spec.bytes_per_element
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
        scores = score_bytes(spec, seq_len)
    if spec.qk_norm:
        attn += qk_norm_bytes(spec, tp)
    return attn, scores


def mla_bytes(spec: ActivationSpec, *, seq_len: int, selective: bool) -> tuple[float, float, float]:
    """(latents, attention inputs, scores) bytes per token of multi-head latent attention before its output, all
    heads: the latents are whole on every TP rank (SP shards them), the rest is split over TP (the caller divides).

    megatron-core 0.16.1's MLASelfAttention (local spec, measured on CPU: tests/unit/planner/test_planner.py):
      - q latent (q_lora_rank set): the down projection's output, its RMSNorm's normalised input and output (the up
        projection's input), 3 q_lora, and the fp32 rstd; none with one q projection (its input is the input norm's
        output, already counted);
      - kv latent: the down projection's output [kv_lora | rope] (the norm's input is a view of its kv_lora part
        and keeps all of it), the normalised latent and the norm's output (kv up projection's input): kv_lora + rope
        + 2 kv_lora, and the fp32 rstd;
      - attention inputs: query = cat(q nope, roped q rope) and key = cat(k nope, the roped shared rope key expanded
        to every head), both new [heads x (nope + rope)], and value, a contiguous copy of its split of the kv up
        projection's output [heads x v]; neither up projection's output is kept (RoPE saves only its cos / sin);
      - local DotProductAttention's softmax output (score_bytes); selective recompute (its checkpoint) keeps the
        three inputs only.
    Under Transformer Engine (the GPU plan; reasoned from the code, not measured: no TE here): the down projections
    are TELinear(parallel_mode='duplicated') and each latent norm is fused into its up projection
    (TELayerNormColumnParallelLinear), which saves its input and its norm's output, 2 x rank, and the rstd (the kv
    input, a strided view, made contiguous: kv_lora, so the rope part is not kept); the fused MLA RoPE kernels
    (apply_rope_fusion, YaRN) write query, key and value as new tensors and keep only the shared cos / sin tables; TE
    fused attention (cuDNN, q / k head dim 192 != v 128) saves query, key, value, its output and the fp32 softmax
    log-sum-exp per head. DeepSeek-V3 (128 heads, q 1536, kv 512 + 64, bf16) per token: latents 2 x 1536 x 2 + 4 +
    2 x 512 x 2 + 4 = 8.2 KB; attention (2 x 24576 + 16384) x 2 + 4 x 128 = 131.6 KB (/ TP), its output 32.8 KB more.
    """
    e, stats = spec.bytes_per_element, spec.norm_stats_bytes
    latents = spec.norm_tensors * spec.q_lora * e + stats if spec.q_lora else 0
    kv_input = spec.kv_lora + spec.rotary_dim if spec.norm_tensors == 3 else spec.kv_lora  # torch: a view of it
    latents += (kv_input + (spec.norm_tensors - 1) * spec.kv_lora) * e + stats
    attn = (2 * spec.q + spec.context) * e  # query, key, value
    scores = 0.0
    if spec.attention == "flash" and not selective:
        attn += 4 * spec.heads
    elif spec.attention != "flash" and not selective:
        scores = score_bytes(spec, seq_len)
    return latents, attn, scores


def mlp_bytes(spec: ActivationSpec, ffn: int) -> float:
    """Bytes per token (the caller divides by TP) a dense MLP of inner size `ffn` saves beyond its input: SwiGLU's fc1
    output (2 ffn) and silu(x1), x2 and their product (3 ffn; ffn with the fused SwiGLU), or the plain MLP's
    activation input and output (2 ffn). An MoE layer's shared experts are one such MLP (ffn = shared_ffn)."""
    e = spec.bytes_per_element
    if spec.gated:
        return (2 * ffn + (ffn if spec.swiglu_fused else 3 * ffn)) * e
    return 2 * ffn * e


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
    """Bytes an MoE block (router, dispatcher, routed experts) saves for backward per micro-batch, beside the shared
    experts' MLP (layer_activation_bytes); the pre-MLP norm is in layer_activation_bytes too (its output is the
    router's saved input). Measured exactly on CPU at EP1 (megatron-core's alltoall dispatcher, SequentialMLP;
    tests/unit/planner/test_planner.py):
      - router, per local token: int64 top-k indices and sort permutation (16 k B; the load-balancing loss's
        own top-k indices die with its integer branch before backward), the [E, T] routing map (bool, E) and probs
        (E x bytes), and the scores (router_scores): softmax, the fp32 top-k probs (4 k); sigmoid, the fp32 sigmoid
        of every expert (4 E) and the k chosen scores and their sum that renormalise them ((k + 1) x bytes);
      - the load-balancing loss (aux_loss): its fp32 softmax scores (4 E) per local token, per layer the int64
        tokens-per-expert and the loss;
      - experts, per routed token copy (moe_routed_tokens): its permuted hidden state (fc1's input, h), fc1's
        output (2 I), silu(x1), x2, their product and its product with the routing prob (fc2's input): 6 I
        (3 I with the fused weighted SwiGLU), each / ETP, and the permuted prob.
    Qwen3-30B-A3B (E 128, k 8, h 2048, I 768, bf16) per local token: router 1,056 B; experts 8 x (2048 + 6 x
    768 + 1) x 2 = 106.5 KB, x factor; a dense 6144-wide MLP would keep 61.4 KB. DeepSeek-V3 (E 256, k 8, h 7168,
    I 2048): router 128 + 4 x 256 + 9 x 2 + 256 x 3 = 1,938 B; experts 8 x (7168 + 6 x 2048 + 1) x 2 = 311.3 KB."""
    e, k, E = spec.bytes_per_element, spec.topk, spec.experts
    local = moe_local_tokens(layout, tokens)
    scores = 4 * k if spec.router_scores == "softmax" else 4 * E + (k + 1) * e
    aux = 4 * E if spec.aux_loss else 0
    router = local * (2 * 8 * k + scores + aux + E + E * e) + (8 * E + 4 if spec.aux_loss else 0)
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
    the explicit causal mask (local spec), the RoPE table kept by recompute checkpoints (GPTModel's, passed to every
    layer; under MLA it passes none, each layer's attention makes its own: measured)."""
    tok, s = tokens / layout.cp, seq_len / layout.cp
    out = 0.0
    if first:
        out += 8 * tok + (tok if layout.tp > 1 else 0)  # int64 ids; at TP > 1 also the out-of-shard bool mask
    if last:
        norm = spec.norm_tensors * spec.hidden * spec.bytes_per_element + spec.norm_stats_bytes
        out += tok * (norm / layout.tp if layout.sp else norm)
    if spec.causal_mask:
        out += s * s
    if recompute and not spec.kv_lora:
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

