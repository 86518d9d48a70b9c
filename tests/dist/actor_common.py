"""Shared helpers of the model/actor tests: a tiny HF model of any registered family, HF <-> megatron weight
copies, samples.

The weight copy is written out here on purpose (independent of megatron_dapo.weights) so the
equivalence tests check the model against HF, not one table against itself.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import families

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=256)
"""The Qwen2 config the single-family tests were written for (`tiny_hf_model`'s default)."""

FAMILIES: tuple[str, ...] = tuple(families())
"""Every registered model_type: the family-parametrized tests run each (a new family gets them)."""

LAYOUT_ADAM_EPS = 1e-3
"""Adam's eps (--adam-eps) in the tests that compare weights after train steps between layouts at lr 1e-3
(test_actor_parallel.py, test_actor_sp.py, test_actor_vpp.py, test_actor.py's micro-batch split; after a resume at
another layout or layer implementation: RESUMED_UPDATE_ATOL): the same optimizer code as the default 1e-8, with a
bounded sensitivity to the fp32 reduction order.

Two layouts differ in the order of their fp32 sums, so each gradient element g reaches Adam with a noise δ of a
few u * max|G| (u = 2^-24, G the tensor's gradient; measured up to 25 u * max|G| at either step, on AVX512 and under
ATEN_CPU_CAPABILITY=avx2 / default). Adam's step-k update is m / (sqrt(v) + eps), with bias-corrected
m = sum_j a_j g_j and v = sum_j b_j g_j^2 over the steps j <= k (a_j = (1 - b1) b1^(k-j) / (1 - b1^k), b_j
likewise with b2: each sums to 1). Two bounds follow:

- size: |m| / sqrt(v) <= R_k = sqrt(sum_j a_j^2 / b_j) (Cauchy-Schwarz). R_1 = 1; at betas (0.9, 0.999)
  R_2 = sqrt(0.47368^2 / 0.49975 + 0.52632^2 / 0.50025) = 1.0014. Each step moves a weight by at most
  R_k * lr (plus the decoupled weight decay lr * wd * w, the same in both runs): two runs never differ by more
  than 2 R_k lr per step, however ill-conditioned an element.
- sensitivity: |d update / d g_j| <= (a_j + R_k sqrt(b_j)) / (sqrt(v) + eps), so a noise δ in every gradient
  changes the update by at most (1 + R_k sqrt(k)) δ / (sqrt(v) + eps) <= (1 + R_k sqrt(k)) δ / eps.

At eps = 1e-8 the last bound is useless near g = 0: step 1 moves lr * g / (|g| + eps), whose slope is up to
lr / eps = 1e5 there, and whether one of a model's ~10^5 gradient elements sits within a few eps of 0 is up to the
seed (the seeds of these tests were once picked to dodge one on one machine). Measured on AVX512: an
output_layer.weight element with g = -4.3e-10 and a linear_proj.weight element with g = -2.1e-8 (tensor max 1.5e-2,
δ = 1.7e-9) end 1.4e-5 and 1.6e-5 apart after one step, which then also perturbs the next step's gradients
(δ up to 800 u * max|G|). No routing decision differed between the layouts at any step. At eps = lr = 1e-3
every element moves by at most lr * sum_k (1 + R_k sqrt(k)) δ / eps = (2 + 2.42) δ over two steps: <= 4e-7 at
max|G| <= 0.06, 25x under atol (measured 1.2e-7: one rounding of a weight near 1). And the comparison checks more:
with eps = 1e-8 step 1 moves every weight away from g = 0 by lr * sign(g), which hides any gradient error that
keeps the sign (a whole tensor's gradient off by a factor hides at every step); with eps = lr an element with |g| << eps
moves by ~g, so a weight 1e-5 off is a gradient 1e-5 off."""


RESUMED_UPDATE_ATOL = 5e-6
"""|weight - reference| after one train step that two actors start from equal weights and Adam state (a checkpoint
resumed at another expert layout or layer implementation) and compute in other fp32 reduction orders, at Adam's
eps = LAYOUT_ADAM_EPS = lr: only the last gradient differs, by a noise delta, which moves step k's update by at most
lr (a_k + R_k sqrt(b_k)) delta / eps (LAYOUT_ADAM_EPS's sensitivity bound for g_k alone: 2 at k = 1, 1.235 at
k = 2, 0.949 at k = 3) <= 2 delta; delta ~ 25 u max|G| <= 1.5e-6 with max|G| <= 1 under the clip to norm 1
(clip_grad 1.0), plus a rounding of |w| < 2 (1.2e-7): <= 3.1e-6. At the default eps 1e-8 the same noise on a
near-zero gradient moves a weight by up to lr. A lost or misplaced Adam moment moves an update by a fraction of lr
(1e-3), a gradient error by itself."""


def tiny_config(model_type: str = "qwen2", **overrides) -> dict:
    """config.json fields (no model_type) of a tiny `model_type` model: TINY for the default qwen2 (what the
    older tests were written for), the family's own `tiny_config` otherwise; `overrides` replace fields."""
    base = TINY if model_type == "qwen2" else dict(families()[model_type].tiny_config)
    return {**base, **overrides}


def tiny_hf_model(model_type: str = "qwen2", *, tie: bool = False, seed: int = 0, **overrides):
    """A random-weight HF causal LM of `model_type`'s family (fp32, eager attention) with nonzero q/k/v
    biases (where the family has them), router correction biases (DeepSeek-V3's) and norms (q_norm / k_norm
    included); `overrides` replace
    `tiny_config`'s fields (e.g. num_hidden_layers=4)."""
    fam = families()[model_type]
    torch.manual_seed(seed)
    cfg = fam.hf_config(**tiny_config(model_type, **overrides), tie_word_embeddings=tie,
                        attn_implementation="eager")
    model = fam.hf_causal_lm()(cfg).float().eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: randomise so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: it changes which experts are chosen
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def sharpen_router(hf, scale: float = 10.0):
    """Scale an MoE HF model's router weights (`mlp.gate.weight`, init std 0.02) by `scale` in place and return the
    model: routing then decided by clear top-k margins, so a tie broken differently by reduction-order noise (a
    different output, not a layout error) cannot happen in the layout comparisons."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(scale)
    return hf


def hf_to_full_mcore(sd: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """HF state dict -> TP=1 megatron names (global layers), unpadded vocab; q/k/v biases and the per-head
    q/k norms only where the state dict has them."""
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
                                    "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = sd["lm_head.weight"]
    g, d, qh = arch.num_kv_heads, arch.head_dim, arch.heads_per_group
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        mla = h + "self_attn.kv_a_proj_with_mqa.weight" in sd  # multi-head latent attention (DeepSeek-V3)
        if mla:
            _mla_to_mcore(sd, h, m, out)
        for kind in ("weight", "bias"):
            if mla or h + f"self_attn.q_proj.{kind}" not in sd:  # no q/k/v bias (Qwen3, Llama)
                continue
            q = sd[h + f"self_attn.q_proj.{kind}"].reshape(g, qh * d, -1)
            k = sd[h + f"self_attn.k_proj.{kind}"].reshape(g, d, -1)
            v = sd[h + f"self_attn.v_proj.{kind}"].reshape(g, d, -1)
            fused = torch.cat([q, k, v], dim=1).reshape(g * (qh + 2) * d, -1)  # per group: q heads, k, v
            out[m + f"self_attention.linear_qkv.{kind}"] = fused.squeeze(-1) if kind == "bias" else fused
        out[m + "self_attention.linear_proj.weight"] = sd[h + "self_attn.o_proj.weight"]
        if h + "mlp.gate.e_score_correction_bias" in sd:  # DeepSeek-V3's router bias (a buffer) and shared experts
            out[m + "mlp.router.expert_bias"] = sd[h + "mlp.gate.e_score_correction_bias"]
            x = m + "mlp.shared_experts."
            out[x + "linear_fc1.gate"] = sd[h + "mlp.shared_experts.gate_proj.weight"]
            out[x + "linear_fc1.up"] = sd[h + "mlp.shared_experts.up_proj.weight"]
            out[x + "linear_fc2.weight"] = sd[h + "mlp.shared_experts.down_proj.weight"]
        for qk in ("q", "k"):  # Qwen3's per-head RMSNorm on q and k (one [head_dim] weight, all heads)
            if h + f"self_attn.{qk}_norm.weight" in sd:
                out[m + f"self_attention.{qk}_layernorm.weight"] = sd[h + f"self_attn.{qk}_norm.weight"]
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        if h + "mlp.experts.gate_up_proj" in sd:  # an MoE layer (transformers 5 holds the experts fused)
            out[m + "mlp.router.weight"] = sd[h + "mlp.gate.weight"]
            gate_up, down = sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.down_proj"]
            for e in range(gate_up.shape[0]):  # global expert e; expert-parallel ranks pick theirs below
                x = m + f"mlp.experts.local_experts.{e}."
                out[x + "linear_fc1.gate"], out[x + "linear_fc1.up"] = gate_up[e].chunk(2)
                out[x + "linear_fc2.weight"] = down[e]
            continue
        out[m + "mlp.linear_fc1.gate"] = sd[h + "mlp.gate_proj.weight"]  # joined per TP shard below
        out[m + "mlp.linear_fc1.up"] = sd[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"]
    return out


def _mla_to_mcore(sd: dict[str, torch.Tensor], h: str, m: str, out: dict[str, torch.Tensor]) -> None:
    """One MLA layer's HF attention tensors (prefix `h`) under megatron-core's names (prefix `m`), into `out`: the
    layouts agree (q heads [nope | rope], kv_a rows [latent | rope key], kv_b rows per head [nope key | value]), so
    each is a copy; the latent norms are fused into the up projections (`layer_norm_weight`)."""
    a, x = h + "self_attn.", m + "self_attention."
    if a + "q_a_proj.weight" in sd:
        out[x + "linear_q_down_proj.weight"] = sd[a + "q_a_proj.weight"]
        out[x + "linear_q_up_proj.layer_norm_weight"] = sd[a + "q_a_layernorm.weight"]
        out[x + "linear_q_up_proj.weight"] = sd[a + "q_b_proj.weight"]
    else:  # no q bottleneck (q_lora_rank null: DeepSeek-V2-Lite)
        out[x + "linear_q_proj.weight"] = sd[a + "q_proj.weight"]
    out[x + "linear_kv_down_proj.weight"] = sd[a + "kv_a_proj_with_mqa.weight"]
    out[x + "linear_kv_up_proj.layer_norm_weight"] = sd[a + "kv_a_layernorm.weight"]
    out[x + "linear_kv_up_proj.weight"] = sd[a + "kv_b_proj.weight"]


def _kind(name: str) -> str:
    # MLA's down projections are whole on every TP rank (TELinear 'duplicated' and its local twin)
    if name.endswith(("layernorm.weight", "layer_norm_weight", "router.weight", "expert_bias", "down_proj.weight")):
        return "replicated"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "column"  # qkv (groups are contiguous), vocab rows, fc1 halves


def _stage_starts(arch: ModelArch, pp: int, stage_layers: Sequence[int] | None) -> list[int]:
    """First global layer of each PP stage, and the layer count after the last: `stage_layers` (each stage's layers,
    an uneven pipeline's, written out by the caller) or num_layers / pp each."""
    counts = list(stage_layers) if stage_layers is not None else [arch.num_layers // pp] * pp
    assert len(counts) == pp and sum(counts) == arch.num_layers, (counts, pp, arch.num_layers)
    return [sum(counts[:r]) for r in range(pp + 1)]


def mcore_shards_for_rank(full: dict[str, torch.Tensor], arch: ModelArch, *, tp: int, tp_rank: int, pp: int,
                          pp_rank: int, padded_vocab: int, ep: int = 1, ep_rank: int = 0, etp: int | None = None,
                          etp_rank: int | None = None, stage_layers: Sequence[int] | None = None
                          ) -> dict[str, torch.Tensor]:
    """This (tp_rank, pp_rank)'s stage-local megatron state from `hf_to_full_mcore` output; of the experts, EP rank
    `ep_rank`'s block of E / ep (renumbered from 0), split over `etp` expert-TP ranks (default: as TP). `stage_layers`:
    each PP stage's layer count (an uneven pipeline); default num_layers / pp each."""
    etp, etp_rank = (tp, tp_rank) if etp is None else (etp, etp_rank)
    per_expert = arch.num_experts // ep if arch.num_experts else 0
    experts = {}
    for name, t in full.items():  # experts: keep this EP rank's, numbered locally, split over expert-TP
        if ".local_experts." in name:
            e = int(name.split(".local_experts.")[1].split(".")[0])
            if ep_rank * per_expert <= e < (ep_rank + 1) * per_expert:
                experts[name.replace(f"local_experts.{e}.", f"local_experts.{e - ep_rank * per_expert}.")] = t
    full = {**{k: v for k, v in full.items() if ".local_experts." not in k}, **experts}
    start, end = _stage_starts(arch, pp, stage_layers)[pp_rank:pp_rank + 2]
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if name.startswith("decoder.layers."):
            layer = int(name.split(".")[2])
            if not start <= layer < end:
                continue
            local = name.replace(f"layers.{layer}.", f"layers.{layer - start}.", 1)
        elif name.startswith("embedding."):
            if not first:
                continue
            local = name
        else:
            if not last:
                continue
            local = name
        if name.startswith(("embedding.", "output_layer.")):
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], t.shape[1])])
        n, r = (etp, etp_rank) if ".local_experts." in local else (tp, tp_rank)
        if local.endswith(".gate"):
            up = full[name[:-len("gate")] + "up"]
            out[local[:-len("gate")] + "weight"] = torch.cat([t.chunk(n)[r], up.chunk(n)[r]])
            continue
        if local.endswith(".up"):
            continue
        kind = _kind(local)
        out[local] = t if kind == "replicated" else t.chunk(n, dim=1 if kind == "row" else 0)[r]
    if arch.tie_word_embeddings and last and not first:  # megatron keeps an embedding copy on the last stage
        emb = full["embedding.word_embeddings.weight"]
        emb = torch.cat([emb, emb.new_zeros(padded_vocab - emb.shape[0], emb.shape[1])])
        out["output_layer.weight"] = emb.chunk(tp)[tp_rank]
    return out


def merge_rank_shards(shards: dict[tuple[int, int], dict[str, torch.Tensor]], arch: ModelArch, *, tp: int,
                      pp: int, stage_layers: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """{(tp_rank, pp_rank): stage-local state} -> TP=1 names, global layers, fc1 [gate; up], no vocab pad.
    `stage_layers`: each PP stage's layer count (an uneven pipeline); default num_layers / pp each."""
    starts = _stage_starts(arch, pp, stage_layers)
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        for name in shards[(0, pp_rank)]:
            parts = [shards[(r, pp_rank)][name] for r in range(tp)]
            if name.startswith("decoder.layers."):
                layer = int(name.split(".")[2])
                glob = name.replace(f"layers.{layer}.", f"layers.{layer + starts[pp_rank]}.", 1)
            else:
                glob = name
            if name.endswith("linear_fc1.weight"):
                halves = [p.chunk(2) for p in parts]
                merged = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            elif _kind(name) == "replicated":
                merged = parts[0]
            else:
                merged = torch.cat(parts, dim=1 if _kind(name) == "row" else 0)
            if glob == "output_layer.weight" and arch.tie_word_embeddings:
                continue  # the embedding copy of a tied model
            if glob in ("embedding.word_embeddings.weight", "output_layer.weight"):
                merged = merged[:arch.vocab_size]  # drop the TP-dependent vocab padding
            out[glob] = merged
    return out


def make_samples(n: int, *, seed: int = 0, vocab: int = 300, max_len: int = 24, with_old: bool = True):
    """Varied-length TrainSamples with random advantages, some off-policy old log-probs and masks."""
    from megatron_dapo.actor import TrainSample

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = rng.randint(2, 8)
        resp = rng.randint(2, max_len - prompt)
        tokens = [rng.randrange(vocab) for _ in range(prompt + resp)]
        old = None
        if with_old and i % 2 == 0:
            old = -5.6 + 0.4 * torch.randn(resp, generator=gen)  # off-policy: ratios around 1, some clipped
        mask = None
        if i % 3 == 1:
            mask = (torch.rand(resp, generator=gen) > 0.3).float()
        samples.append(TrainSample(tokens=tokens, prompt_len=prompt, advantage=rng.uniform(-1.5, 1.5),
                                   old_log_probs=old, loss_mask=mask))
    return samples


def hf_response_log_probs(model, samples) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Reference log-probs and entropies of each response token from HF transformers."""
    logps, ents = [], []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.tokens])).logits[0].double()
            logsm = torch.log_softmax(logits, dim=-1)
            pos = torch.arange(s.prompt_len - 1, len(s.tokens) - 1)
            logps.append(logsm[pos, torch.tensor(s.tokens[s.prompt_len:])].float())
            ents.append(-(logsm[pos].exp() * logsm[pos]).sum(-1).float())
    return logps, ents


def draw_routers(hf, std: float = 0.3):
    """Redraw an MoE HF model's router weights (`mlp.gate.weight`) from N(0, std^2) in place and return the model:
    at HF's init std 0.02 routing is decided by small margins; wider routers make a routing mix-up move the logits a
    lot (the equivalence tests then see it)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, std)
    return hf


def single_process_world(hf_seed: int, model_type: str = "qwen2", *, router_std: float | None = None):
    """Generator for a module-scoped fixture: (layout, tiny HF model, arch) in a 1-rank parallel state; an MoE
    model's routers drawn at `router_std` (`draw_routers`) when given."""
    from megatron_dapo.actor import destroy_parallel, init_parallel

    layout = init_parallel(seed=0)
    hf = tiny_hf_model(model_type, seed=hf_seed)
    if router_std is not None:
        draw_routers(hf, router_std)
    yield layout, hf, ModelArch.from_hf(hf.config)
    destroy_parallel()


def single_process_run(arch: ModelArch, hf_state_dict: dict[str, torch.Tensor], config, samples, *, seed: int,
                       steps: int) -> dict:
    """The TP=1 reference of the layout tests: `config`'s actor with `hf_state_dict`'s weights computes `samples`'
    log-probs and entropies, then trains `steps` train_steps on them; {"logps", "entropies": per sample,
    "metrics": per step, "weights": the updated weights in `merge_rank_shards` names}, in a 1-rank parallel state
    of its own (destroyed on return)."""
    from megatron_dapo.actor import MegatronActor, destroy_parallel, init_parallel

    layout = init_parallel(seed=seed)
    reset_moe_tracker()
    try:
        actor = MegatronActor(arch, config, layout)
        load_hf_state_dict(actor, hf_state_dict)
        logps, ents = actor.compute_log_probs(samples, with_entropy=True)
        metrics = [actor.train_step(samples) for _ in range(steps)]
        weights = merge_rank_shards({(0, 0): actor.state_dict_for_export()}, arch, tp=1, pp=1)
    finally:
        destroy_parallel()
    return {"logps": logps, "entropies": ents, "metrics": metrics, "weights": weights}


def hf_actor(hf, layout, config=None):
    """A single-process (TP1, PP1) MegatronActor of `hf`'s architecture holding `hf`'s weights; `config`: its
    ActorConfig (lr 1e-3 unless given)."""
    from megatron_dapo.actor import ActorConfig, MegatronActor

    actor = MegatronActor(ModelArch.from_hf(hf.config), config or ActorConfig(lr=1e-3), layout)
    load_hf_weights(actor, hf)
    return actor


def world_actor(world, **config):
    """`hf_actor` in a `single_process_world` (layout, hf, arch): its HF weights in an actor of ActorConfig(**config),
    lr 1e-3 unless given."""
    from megatron_dapo.actor import ActorConfig

    layout, hf, _ = world
    return hf_actor(hf, layout, ActorConfig(**{"lr": 1e-3, **config}))


def load_hf_weights(actor, hf) -> None:
    """Copy `hf`'s weights into a single-process (TP1, PP1) actor through this module's own mapping."""
    load_hf_state_dict(actor, hf.state_dict())


def load_hf_state_dict(actor, state_dict: dict[str, torch.Tensor]) -> None:
    """load_hf_weights from an HF state dict (what torchrun workers receive instead of the model)."""
    from megatron_dapo.distributed.parallel import padded_vocab_size

    full = hf_to_full_mcore(state_dict, actor.arch)
    actor.load_shards(mcore_shards_for_rank(full, actor.arch, tp=1, tp_rank=0, pp=1, pp_rank=0,
                                            padded_vocab=padded_vocab_size(actor.arch.vocab_size, 1)))


def merge_layout_shards(ranks: list[dict], arch: ModelArch, *, tp: int, pp: int, dp: int, ep: int = 1,
                        etp: int | None = None, edp: int = 1, stage_layers: Sequence[int] | None = None
                        ) -> tuple[list[dict], list[dict]]:
    """Per-rank results (each with "weights" and its tp/pp/dp/ep/etp/edp ranks, as tests/dist/actor_parallel.py saves
    them) -> (per DP replica: the non-expert weights, per expert-DP replica: the experts), in `merge_rank_shards`'
    names with global expert numbers (EP rank r's local expert j is global r * E / ep + j); `stage_layers` as there."""
    etp = tp if etp is None else etp
    per_rank = arch.num_experts // ep if arch.num_experts else 0
    dense, experts = [], []
    for d in range(dp):
        shards = {(r["tp_rank"], r["pp_rank"]): {k: v for k, v in r["weights"].items() if ".local_experts." not in k}
                  for r in ranks if r["dp_rank"] == d}
        assert len(shards) == tp * pp, (d, sorted(shards))
        dense.append(merge_rank_shards(shards, arch, tp=tp, pp=pp, stage_layers=stage_layers))
    if not per_rank:
        return dense, experts
    for x in range(edp):
        shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        seen = set()
        for r in ranks:
            if r["edp_rank"] != x or (r["ep_rank"], r["etp_rank"], r["pp_rank"]) in seen:
                continue  # the TP ranks of one expert-TP rank hold the same experts (expert-TP < TP)
            seen.add((r["ep_rank"], r["etp_rank"], r["pp_rank"]))
            part = shards.setdefault((r["etp_rank"], r["pp_rank"]), {})
            for k, v in r["weights"].items():
                if ".local_experts." in k:
                    j = int(k.split(".local_experts.")[1].split(".")[0])
                    part[k.replace(f".local_experts.{j}.", f".local_experts.{r['ep_rank'] * per_rank + j}.")] = v
        assert len(seen) == ep * etp * pp, (x, sorted(seen))
        experts.append(merge_rank_shards(shards, arch, tp=etp, pp=pp, stage_layers=stage_layers))
    return dense, experts


def reset_moe_tracker() -> None:
    """Forget megatron-core's process-wide MoE logging tracker (per-layer aux-loss sums, sized by the FIRST MoE
    model's layer count): a test building a second MoE model with more layers in the same process would index past
    it (IndexError in moe_utils.save_to_aux_losses_tracker)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
