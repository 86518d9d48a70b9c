"""Mutation pass over megatron_dapo's core: apply one hand-written mutant at a time to a scratch copy of the
repository, run the tests that guard that code, and record whether the suite noticed (killed) or not (survived).

Each mutant is a (file, exact old text, new text) replacement that must match exactly once; the file is restored
byte for byte after its run. Run it on a COPY of the repository, never on a checkout others use:

    cp -r . /tmp/mut   # without .venv*, runs/, outputs/
    PYTHONPATH=/tmp/mut .venv/bin/python /tmp/mut/tools/mutation_pass.py --root /tmp/mut [--only ID ...]

Output: one line per mutant (id, killed/survived, the first failing test) and a JSON record under --out.
Killed means pytest exited non-zero (a failing test, an import error) or ran past --timeout-s. docs/MUTATIONS.md
records the last pass: every mutant, the test that killed it, and why each survivor is an equivalent mutant. A
mutant whose old text no longer matches (the code moved on) is reported as `bad-mutant`: update its text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

LOSS = ("tests/unit/algorithm/test_algorithm_loss.py", "tests/unit/algorithm/test_algorithm_losses.py",
        "tests/unit/algorithm/test_algorithm_mismatch.py", "tests/unit/algorithm/test_algorithm_registry.py",
        "tests/unit/actor/test_actor_losses.py")
ADV = ("tests/unit/algorithm/test_algorithm_sampling.py", "tests/unit/algorithm/test_algorithm_losses.py",
       "tests/unit/algorithm/test_algorithm_registry.py", "tests/unit/rollout/test_routing_data.py")
DYN = ("tests/unit/algorithm/test_algorithm_sampling.py", "tests/unit/rollout/test_collect.py",
       "tests/unit/rollout/test_collect_property.py")
OVER = ("tests/unit/algorithm/test_algorithm_sampling.py", "tests/unit/rollout/test_collect.py",
        "tests/unit/algorithm/test_algorithm_registry.py", "tests/unit/trainer/test_dataplane.py")
MIS = ("tests/unit/algorithm/test_algorithm_mismatch.py", "tests/unit/algorithm/test_algorithm_losses.py")
LAYOUT = ("tests/unit/weights/test_weights_layout.py", "tests/unit/checkpoint_convert/test_convert.py",
          "tests/unit/checkpoint_convert/test_convert_families.py",
          "tests/unit/checkpoint_convert/test_convert_mcore_load.py",
          "tests/unit/checkpoint_convert/test_convert_errors.py")
SAMPLER = ("tests/unit/data/test_data_sampler.py",)
DATA = ("tests/unit/trainer/test_dataplane.py", "tests/unit/actor/test_batching.py",
        "tests/unit/rollout/test_routing_data.py", "tests/unit/actor/test_packing.py")


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


def m(id_: str, path: str, old: str, new: str, tests: tuple[str, ...], what: str) -> Mutant:
    return Mutant(id_, path, old, new, tests, what)


A = "megatron_dapo/algorithm/"
W = "megatron_dapo/weights/"
MUTANTS: tuple[Mutant, ...] = (
    # ---- loss: decoupled clip, token-level aggregation, TIS -------------------------------------------------
    m("loss-eps-swap", A + "loss.py", "1.0 - config.eps_low, 1.0 + config.eps_high)\n    token_loss",
      "1.0 - config.eps_high, 1.0 + config.eps_low)\n    token_loss", LOSS, "eps_low/eps_high swapped in the clamp"),
    m("loss-max-to-min", A + "loss.py", "token_loss = torch.maximum(unclipped, clipped)",
      "token_loss = torch.minimum(unclipped, clipped)", LOSS, "pessimistic max -> min"),
    m("loss-clipped-sign", A + "loss.py", "clipped = -advantages * torch.clamp(ratio, 1.0 - config.eps_low",
      "clipped = advantages * torch.clamp(ratio, 1.0 - config.eps_low", LOSS, "sign of the clipped term"),
    m("loss-logratio-swap", A + "loss.py", "torch.clamp(log_probs - old_log_probs, -LOG",
      "torch.clamp(old_log_probs - log_probs, -LOG", LOSS, "log-ratio operands swapped"),
    m("loss-clamp-20-to-2", A + "loss.py", "LOG_RATIO_CLAMP = 20.0", "LOG_RATIO_CLAMP = 2.0", LOSS,
      "log-ratio clamp 20 -> 2"),
    m("loss-tokenmean-denom-all", A + "loss.py", "return masked.sum(), mask.sum()",
      "return masked.sum(), torch.ones_like(mask).sum()", LOSS, "token-mean denominator counts padding"),
    m("loss-tokenmean-nomask", A + "loss.py", "masked = token_values * mask\n", "masked = token_values\n", LOSS,
      "numerator ignores the mask"),
    m("loss-has-tokens-ge", A + "loss.py", "has_tokens = tokens_per_seq > 0", "has_tokens = tokens_per_seq >= 0",
      LOSS, "seq-mean denominators count empty rows"),
    m("loss-seqsum-is-mean", A + "loss.py", "seq_values = seq_sums\n",
      "seq_values = seq_sums / tokens_per_seq.clamp(min=1.0)\n", LOSS, "seq-mean-token-sum divides by length"),
    m("loss-dual-any-sign", A + "loss.py", "dual_active = (advantages < 0) & (token_loss > cap)",
      "dual_active = token_loss > cap", LOSS, "dual clip also for A > 0"),
    m("loss-dual-le", A + "loss.py", "dual_active = (advantages < 0) & (token_loss > cap)",
      "dual_active = (advantages <= 0) & (token_loss > cap)", LOSS, "dual clip A < 0 -> A <= 0"),
    m("loss-tis-ignored", A + "loss.py", "return token_loss * is_weights.detach().to(token_loss.dtype)",
      "return token_loss", LOSS, "TIS weights dropped"),
    m("loss-tis-not-detached", A + "loss.py", "return token_loss * is_weights.detach().to(token_loss.dtype)",
      "return token_loss * is_weights.to(token_loss.dtype)", LOSS, "TIS weights not detached"),
    m("loss-clipfrac-high-sign", A + "loss.py", "clip_high = (ratio > 1.0 + config.eps_high) & (advantages > 0)",
      "clip_high = (ratio > 1.0 + config.eps_high) & (advantages < 0)", LOSS, "clipfrac_high counts A < 0"),
    m("loss-clipfrac-low-eps", A + "loss.py", "clip_low = (ratio < 1.0 - config.eps_low)",
      "clip_low = (ratio < 1.0 - config.eps_high)", LOSS, "clipfrac_low uses eps_high"),
    m("loss-kl-sign", A + "loss.py", '"approx_kl": (-terms.log_ratio * maskf).sum()',
      '"approx_kl": (terms.log_ratio * maskf).sum()', LOSS, "approx_kl sign"),
    m("loss-no-fp32", A + "loss.py", "dtype = torch.promote_types(log_probs.dtype, torch.float32)",
      "dtype = log_probs.dtype", LOSS, "bf16 log-probs not promoted to fp32"),
    m("loss-old-not-detached", A + "loss.py", "old_log_probs.detach().to(dtype), advantages.detach()",
      "old_log_probs.to(dtype), advantages.detach()", LOSS, "old log-probs not detached"),
    m("loss-eps-low-le1", A + "loss.py", "if not 0.0 <= self.eps_low <= 1.0:", "if not 0.0 <= self.eps_low < 1.0:",
      LOSS, "eps_low = 1 refused (no lower clip, CISPO's paper setting)"),
    m("grpo-agg-token", A + "grpo_loss.py", 'GRPO_AGG_MODE = "seq-mean-token-mean"', 'GRPO_AGG_MODE = "token-mean"',
      LOSS, "GRPO aggregates token-mean"),
    m("drgrpo-no-lmax", A + "grpo_loss.py", "loss_sum=seq_sums / config.max_response_length",
      "loss_sum=seq_sums", LOSS, "Dr. GRPO without 1/L_max"),
    m("gspo-sum-not-mean", A + "gspo.py", ".sum(dim=-1) / tokens.clamp(min=1.0)", ".sum(dim=-1)", LOSS,
      "GSPO sequence ratio: sum instead of mean"),
    # ---- advantages -------------------------------------------------------------------------------------------
    m("adv-biased-std", A + "advantages.py", "group.std(unbiased=unbiased)", "group.std(unbiased=False)", ADV,
      "population std"),
    m("adv-no-eps", A + "advantages.py", "(group.std(unbiased=unbiased) + eps)", "group.std(unbiased=unbiased)", ADV,
      "eps dropped (all-equal group -> NaN)"),
    m("adv-global-mean", A + "advantages.py", "centred = group - group.mean()", "centred = group - rewards.mean()",
      ADV, "batch mean instead of group mean"),
    m("adv-singleton", A + "advantages.py", "if group.numel() == 1:", "if group.numel() == 0:", ADV,
      "size-1 group normalised (NaN)"),
    m("adv-drgrpo-std", A + "advantages.py", "return group_advantages(rewards, group_ids, normalize_std=False)",
      "return group_advantages(rewards, group_ids, normalize_std=True)", ADV, "Dr. GRPO divides by std"),
    m("adv-broadcast-len", A + "advantages.py", "torch.full((int(n),), float(a))",
      "torch.full((int(n) + 1,), float(a))", ADV, "broadcast one token too many"),
    # ---- dynamic sampling -------------------------------------------------------------------------------------
    m("ds-or", A + "dynamic_sampling.py", "any(values) and not all(values)", "any(values) or not all(values)", DYN,
      "all-wrong groups kept"),
    m("ds-keep-all-correct", A + "dynamic_sampling.py", "any(values) and not all(values)", "any(values)", DYN,
      "all-correct groups kept"),
    m("ds-min-floor", A + "dynamic_sampling.py", "max(self.stats.keep_rate, KEEP_RATE_FLOOR)",
      "min(self.stats.keep_rate, KEEP_RATE_FLOOR)", DYN, "keep-rate floor max -> min"),
    m("ds-floor-not-ceil", A + "dynamic_sampling.py", "return math.ceil(over_sample_factor * self.needed / rate)",
      "return int(over_sample_factor * self.needed / rate)", DYN, "round size floored"),
    m("ds-full-gt", A + "dynamic_sampling.py", "return len(self.kept) >= self.config.rollout_batch_size",
      "return len(self.kept) > self.config.rollout_batch_size", DYN, "full one group late"),
    m("ds-exhausted-gt", A + "dynamic_sampling.py", "self.stats.rounds >= limit", "self.stats.rounds > limit", DYN,
      "one generation round too many"),
    m("ds-counts-swapped", A + "dynamic_sampling.py", "            if all(values):\n",
      "            if not all(values):\n", DYN, "all_correct / all_wrong counters swapped"),
    m("ds-counts-any", A + "dynamic_sampling.py", "            if all(values):\n", "            if any(values):\n",
      DYN, "all(values) -> any(values) among uninformative groups"),
    m("ds-no-surplus", A + "dynamic_sampling.py",
      "        if self.full:\n            self.stats.surplus_groups += 1\n            return False",
      "        if self.full:\n            return False", DYN, "surplus not counted"),
    m("ds-ignore-enabled", A + "dynamic_sampling.py", "if self.config.enabled and not group_is_informative(values):",
      "if not group_is_informative(values):", DYN, "--no-dynamic-sampling still filters"),
    m("ds-seen-not-counted", A + "dynamic_sampling.py", "        self.stats.seen_groups += 1\n", "", DYN,
      "decided groups not counted (keep rate)"),
    m("ds-batch-unsliced", A + "dynamic_sampling.py", "return self.kept[: self.config.rollout_batch_size]",
      "return self.kept", DYN, "batch not cut at rollout_batch_size"),
    # ---- overlong -----------------------------------------------------------------------------------------------
    m("ov-lt", A + "overlong.py", "if length <= expected:", "if length < expected:", OVER,
      "penalty starts one token early"),
    m("ov-ge-lmax", A + "overlong.py", "if length > config.max_response_length:",
      "if length >= config.max_response_length:", OVER, "L_max itself takes the -1 branch"),
    m("ov-sign", A + "overlong.py", "config.penalty_factor * (expected - length) / config.buffer_length",
      "config.penalty_factor * (length - expected) / config.buffer_length", OVER, "penalty sign"),
    m("ov-div-lmax", A + "overlong.py", "(expected - length) / config.buffer_length",
      "(expected - length) / config.max_response_length", OVER, "divides by L_max, not L_cache"),
    m("ov-factor-over", A + "overlong.py", "return -config.penalty_factor", "return -1.0", OVER,
      "over-length penalty ignores the factor"),
    m("ov-filter-always", A + "overlong.py", "0.0 if (config.filter_truncated and t) else 1.0",
      "0.0 if t else 1.0", OVER, "truncated samples filtered without --overlong-filter"),
    m("ov-buffer-lt", A + "overlong.py", "if not 0 <= self.buffer_length <= self.max_response_length:",
      "if not 0 <= self.buffer_length < self.max_response_length:", OVER, "L_cache = L_max refused"),
    # ---- TIS / MIS --------------------------------------------------------------------------------------------
    m("mis-logr-swap", A + "mismatch.py", "diff = old_log_probs.detach().to(dtype) - rollout_log_probs.detach()",
      "diff = rollout_log_probs.detach().to(dtype) - old_log_probs.detach()", MIS, "mismatch ratio inverted"),
    m("tis-lower-bound", A + "mismatch.py", "rollout_log_probs)).clamp(max=cap)",
      "rollout_log_probs)).clamp(min=1.0 / cap, max=cap)", MIS, "TIS gets a lower bound 1/C"),
    m("mis-token-lt", A + "mismatch.py", "keep = log_r.abs() <= bound", "keep = log_r.abs() < bound", MIS,
      "token MIS boundary excluded"),
    m("mis-seq-sum", A + "mismatch.py", "(log_r * maskf).sum(dim=-1, keepdim=True) / count.clamp(min=1.0)",
      "(log_r * maskf).sum(dim=-1, keepdim=True)", MIS, "sequence MIS: sum instead of geometric mean"),
    m("mis-seq-unmasked", A + "mismatch.py", "log_g = (log_r * maskf).sum(dim=-1, keepdim=True)",
      "log_g = log_r.sum(dim=-1, keepdim=True)", MIS, "sequence MIS reads padding"),
    m("mis-keep-unmasked", A + "mismatch.py", "return keep & (maskf > 0)", "return keep", MIS,
      "MIS keep mask true on padding"),
    m("tis-weights-unmasked", A + "mismatch.py", "config.tis_cap) * (mask != 0)", "config.tis_cap)", MIS,
      "TIS weights nonzero on padding"),
    m("mis-k3-sign", A + "mismatch.py", '"kl_k3": ((ratio - 1.0 - log_r) * maskf).sum()',
      '"kl_k3": ((ratio - 1.0 + log_r) * maskf).sum()', MIS, "k3 sign"),
    # ---- HF <-> megatron mapping and layout -----------------------------------------------------------------
    m("qkv-kv-swap", W + "layout.py", "return torch.cat([q, k, v], dim=1).reshape(-1, *trailing)",
      "return torch.cat([q, v, k], dim=1).reshape(-1, *trailing)", LAYOUT, "interleave q, v, k"),
    m("qkv-split-kv-swap", W + "layout.py",
      "        k.reshape(arch.kv_size, *trailing),\n        v.reshape(arch.kv_size",
      "        v.reshape(arch.kv_size, *trailing),\n        k.reshape(arch.kv_size", LAYOUT, "split returns q, v, k"),
    m("qkv-no-group", W + "layout.py", "    q = q.reshape(g, arch.heads_per_group * d, *trailing)\n",
      "    q = q.reshape(arch.heads_per_group * d, g, *trailing).transpose(0, 1)\n", LAYOUT,
      "q heads taken strided, not per group"),
    m("row-split-dim0", W + "layout.py", "return list(torch.chunk(hf_tensors[0], tp, dim=1))",
      "return list(torch.chunk(hf_tensors[0], tp, dim=0))", LAYOUT, "row-parallel split on dim 0"),
    m("column-split-dim1", W + "layout.py",
      "return list(torch.chunk(hf_tensors[0], tp, dim=0))\n    if kind == \"row\"",
      "return list(torch.chunk(hf_tensors[0], tp, dim=1))\n    if kind == \"row\"", LAYOUT,
      "column-parallel split on dim 1"),
    m("fc1-up-gate", W + "layout.py", "return [torch.cat([g, u], dim=0) for g, u in zip(gate, up",
      "return [torch.cat([u, g], dim=0) for g, u in zip(gate, up", LAYOUT, "fc1 shard = [up; gate]"),
    m("fc1-unsplit", W + "layout.py", "gate, up = (torch.chunk(t, tp, dim=0) for t in hf_tensors)",
      "gate, up = (torch.chunk(torch.cat(list(hf_tensors)), 2 * tp, dim=0)[i::2] for i in (0, 1))", LAYOUT,
      "fc1 split of the concatenation, not per tensor"),
    m("fc1-merge-swap", W + "layout.py", "return [_cat([g for g, _ in halves], 0), _cat([u for _, u in halves], 0)]",
      "return [_cat([u for _, u in halves], 0), _cat([g for g, _ in halves], 0)]", LAYOUT, "merge gives up, gate"),
    m("vocab-pad-tp1", W + "layout.py", "pad = padded_vocab_size(arch.vocab_size, tp) - arch.vocab_size",
      "pad = padded_vocab_size(arch.vocab_size, 1) - arch.vocab_size", LAYOUT, "vocab padded for TP=1"),
    m("vocab-merge-uncut", W + "layout.py", "return [full[: arch.vocab_size]]", "return [full]", LAYOUT,
      "vocab padding not cut on export"),
    m("shape-row-dim0", W + "layout.py", "return (shapes[0][0], shapes[0][1] // tp)  # row",
      "return (shapes[0][0] // tp, shapes[0][1])  # row", LAYOUT, "row shard shape split on dim 0"),
    m("seg-v-at-k", W + "layout.py", "RowSegment(2, g * d, (g + 1) * d, at + q_rows + d)",
      "RowSegment(2, g * d, (g + 1) * d, at + q_rows)", LAYOUT, "v rows written over k rows"),
    m("seg-k-rows", W + "layout.py", "RowSegment(1, g * d, (g + 1) * d, at + q_rows)",
      "RowSegment(1, 0, d, at + q_rows)", LAYOUT, "every group reads k head 0"),
    m("map-kv-bias-swap", "megatron_dapo/models/dense.py",
      '_H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"',
      '_H + "self_attn.v_proj.bias", _H + "self_attn.k_proj.bias"', LAYOUT, "table: k/v bias names swapped"),
    m("map-norms-swap", "megatron_dapo/models/dense.py",
      'hf=(_H + "input_layernorm.weight",)', 'hf=(_H + "post_attention_layernorm.weight",)', LAYOUT,
      "table: input_layernorm reads post_attention_layernorm"),
    m("map-expert-gate-up", "megatron_dapo/models/moe.py",
      'hf=(_H + "mlp.experts.{expert}.gate_proj.weight", _H + "mlp.experts.{expert}.up_proj.weight")',
      'hf=(_H + "mlp.experts.{expert}.up_proj.weight", _H + "mlp.experts.{expert}.gate_proj.weight")', LAYOUT,
      "table: expert gate/up swapped"),
    m("map-entry-in-layer", "megatron_dapo/models/family.py",
      "return self.layers == \"all\" or arch.is_moe_layer(layer) == (self.layers == \"moe\")",
      "return self.layers == \"all\" or arch.is_moe_layer(layer) != (self.layers == \"moe\")", LAYOUT,
      "dense entries in MoE layers"),
    m("map-output-layer-tied", W + "mapping.py", "return not tied or not is_first_stage", "return not tied", LAYOUT,
      "tied last stage (PP>1) without output layer"),
    m("map-layer-offset", W + "layout.py", "global_layer = None if layer is None else layer + layer_offset",
      "global_layer = layer", LAYOUT, "export ignores the PP layer offset"),
    m("plan-global-layer", "megatron_dapo/distributed/parallel.py",
      "start = chunk * sum(per_chunk) + sum(per_chunk[:pp_rank])", "start = 0", LAYOUT,
      "stage tensors read layer `local` of the HF model"),
    m("plan-global-expert", W + "plan.py", "expert = ep_rank * local_experts + j", "expert = j", LAYOUT,
      "EP rank reads experts 0.. of its own"),
    m("plan-etp-rank", W + "plan.py", "yield name, shards[etp_rank if entry.per_expert else tp_rank]",
      "yield name, shards[tp_rank]", LAYOUT, "experts sharded by TP rank, not expert-TP rank"),
    m("moe-sparse-step", "megatron_dapo/models/moe.py", "(i + 1) % step == 0", "i % step == 0",
      (*LAYOUT, "tests/unit/models/test_models_moe.py::test_moe_layers_are_the_layers_hf_builds_sparse"),
      "decoder_sparse_step off by one"),
    # ---- converter name and shard rules ---------------------------------------------------------------------
    m("conv-row-offset", "checkpoint_convert/hf_to_mcore.py", "offset = (*prefix, seg.row + lo - seg.hf_lo,",
      "offset = (*prefix, seg.row + lo,", LAYOUT, "hf->mcore chunk placed at HF row, not global row"),
    m("conv-chunk-overrun", "checkpoint_convert/hf_to_mcore.py", "return max(1, chunk_bytes // max(1, row_bytes))",
      "return max(1, chunk_bytes // max(1, row_bytes)) + 1", LAYOUT, "chunks one row over --chunk-mb"),
    m("conv-back-row-offset", "checkpoint_convert/mcore_to_hf.py",
      " " * 32 + "seg.row + lo - seg.hf_lo)", " " * 32 + "seg.row + lo)", LAYOUT, "mcore->hf reads at HF row"),
    m("conv-gqa-flag", "checkpoint_convert/hf_to_mcore.py",
      '"group_query_attention": arch.num_kv_heads != arch.num_heads',
      '"group_query_attention": arch.num_kv_heads == arch.num_heads', LAYOUT, "megatron arg GQA inverted"),
    m("conv-untie-flag", "checkpoint_convert/hf_to_mcore.py",
      '"untie_embeddings_and_output_weights": not arch.tie_word_embeddings',
      '"untie_embeddings_and_output_weights": arch.tie_word_embeddings', LAYOUT, "megatron arg untie inverted"),
    m("conv-index-order", "megatron_dapo/checkpoint/ckpt_config.py",
      "return (*((layer,) if self.stacked else ()), *((expert,) if self.entry.per_expert else ()))",
      "return (*((expert,) if self.entry.per_expert else ()), *((layer,) if self.stacked else ()))", LAYOUT,
      "stored index (expert, layer)"),
    m("pad-vocab-plus-one", "megatron_dapo/distributed/parallel.py", "return -(-vocab_size // multiple) * multiple",
      "return (vocab_size // multiple + 1) * multiple", LAYOUT, "vocab padded one block too many at a multiple"),
    m("layout-kv-heads-check", "megatron_dapo/distributed/parallel.py", "    if arch.num_kv_heads % layout.tp:\n",
      "    if False:\n", LAYOUT, "kv heads vs TP not checked"),
    # ---- sampler resume -------------------------------------------------------------------------------------
    m("samp-seed-sum", "megatron_dapo/data/sampler.py", "np.random.SeedSequence([seed, epoch])",
      "np.random.SeedSequence(seed + epoch)", SAMPLER, "permutation seeded by seed + epoch"),
    m("samp-droplast-le", "megatron_dapo/data/sampler.py", "if self.num_items - self.position < n:",
      "if self.num_items - self.position <= n:", SAMPLER, "drop_last skips an exactly fitting batch"),
    m("samp-position-lost", "megatron_dapo/data/sampler.py", "self.epoch, self.position = epoch, position",
      "self.epoch = epoch", SAMPLER, "position not restored"),
    m("samp-epoch-lost", "megatron_dapo/data/sampler.py", "self.epoch, self.position = epoch, position",
      "self.position = position", SAMPLER, "epoch not restored"),
    m("samp-stale-order", "megatron_dapo/data/sampler.py", "if self._order_epoch != self.epoch:",
      "if self._order is None:", SAMPLER, "order not recomputed after a new epoch"),
    m("samp-position-lt", "megatron_dapo/data/sampler.py", "if not 0 <= position <= self.num_items:",
      "if not 0 <= position < self.num_items:", SAMPLER, "position at the epoch's end refused"),
    m("samp-state-position", "megatron_dapo/data/sampler.py", '"position": self.position,',
      '"position": 0,', SAMPLER, "state saves position 0"),
    # ---- data plane: pack/unpack, DP split, micro-batches ---------------------------------------------------
    m("pack-p-r-swap", "megatron_dapo/trainer/dataplane.py", "(m, r.sample.prompt_len, r.sample.response_len)",
      "(m, r.sample.response_len, r.sample.prompt_len)", DATA, "prompt/response length swapped on the wire"),
    m("unpack-logp-offset", "megatron_dapo/trainer/dataplane.py", "tok, lp = tok + p + r, lp + r",
      "tok, lp = tok + p + r, lp + p + r", DATA, "log-prob offset advances by the whole row"),
    m("routes-numel", "megatron_dapo/trainer/dataplane.py", "int((meta[:, 1] + meta[:, 2] - 1).sum())",
      "int((meta[:, 1] + meta[:, 2]).sum())",
      # torchrun: only it receives
      (*DATA, "tests/multiprocess/test_dataplane_dist.py::test_each_dp_rank_gets_exactly_its_share"),
      "route buffer one token per row too long"),
    m("dp-no-attn", "megatron_dapo/actor/batching.py", "cost = [length * (1.0 + attn_coef * length) for",
      "cost = [length * (1.0 + 0.0 * length) for", DATA, "DP balance ignores attention cost"),
    m("dp-unsorted", "megatron_dapo/actor/batching.py", "return [sorted(p) for p in parts]", "return parts", DATA,
      "DP shares unsorted"),
    m("dp-load-reset", "megatron_dapo/actor/batching.py", "loads[r] = load + cost[i]", "loads[r] = cost[i]", DATA,
      "greedy forgets a rank's load"),
    m("dp-swap-le", "megatron_dapo/actor/batching.py", "if 0 < d < gap and min(d, gap - d) > best:",
      "if 0 < d <= gap and min(d, gap - d) > best:", DATA, "swap that exchanges the extremes"),
    m("mb-budget-lt", "megatron_dapo/actor/batching.py",
      "(len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens",
      "(len(groups[-1]) + 1) * lengths[groups[-1][0]] < max_tokens", DATA, "padded budget exclusive"),
    m("mb-firstfit-lt", "megatron_dapo/actor/batching.py", "if lengths[i] <= free:", "if lengths[i] < free:", DATA,
      "packed budget exclusive"),
    m("loop-dp-share", "megatron_dapo/trainer/loop.py", "[[[mb[i] for i in split[d]] for mb, split",
      "[[[mb[i] for i in split[0]] for mb, split", DATA, "every DP rank gets rank 0's rows"),
    m("loop-keep-mask", "megatron_dapo/trainer/loop.py",
      "loss_mask=float(k) * torch.tensor(s.generated(), dtype=torch.float32)",
      "loss_mask=1.0 * torch.tensor(s.generated(), dtype=torch.float32)", DATA, "overlong filter mask not applied"),
    m("loop-tool-mask", "megatron_dapo/trainer/loop.py",
      "loss_mask=float(k) * torch.tensor(s.generated(), dtype=torch.float32)",
      "loss_mask=torch.full((len(s.response_ids),), float(k))", DATA, "a tool's tokens in the loss"),
    # ---- the code behind the docs' numbers (issue 39 item 11) ---------------------------------------------------
    m("conv-pad-one-chunk", "checkpoint_convert/hf_to_mcore.py",
      "            for lo in range(arch.vocab_size, padded_vocab, step):\n"
      "                pad = (min(step, padded_vocab - lo), *lazy.shape[1:])",
      "            for lo in range(arch.vocab_size, padded_vocab, padded_vocab):\n"
      "                pad = (padded_vocab - lo, *lazy.shape[1:])", LAYOUT, "vocab padding as one chunk"),
    m("fused-head-unchunked", "megatron_dapo/ops/fused_linear.py",
      "    chunk = chunk_size or default_chunk_tokens(vocab_local)", "    chunk = hidden.shape[0]",
      ("tests/unit/ops/test_ops_fused_linear.py",), "fused head makes the [tokens, vocab] logits"),
    m("router-retry-30", "megatron_dapo/rollout/sglang/engine.py",
      "time.monotonic() - self._router_down_at > ROUTER_RETRY_S", "time.monotonic() - self._router_down_at > 30.0",
      ("tests/unit/rollout/sglang/test_rollout_sglang_http.py", "-k", "router"), "router tried again after 30 s"),
    m("router-retry-never", "megatron_dapo/rollout/sglang/engine.py",
      "return self._router_down_at is None or time.monotonic()",
      "return self._router_down_at is None and time.monotonic()",
      ("tests/unit/rollout/sglang/test_rollout_sglang_http.py", "-k", "router"),
      "a failed router is never tried again"),
    m("colocated-recover-noop", "megatron_dapo/weight_sync/colocated_push.py",
      "    def recover(self, server: int) -> None:\n        raise RuntimeError(",
      "    def recover(self, server: int) -> None:\n        return\n        raise RuntimeError(",
      ("tests/unit/trainer/test_colocate.py", "-k", "lost_mid_run"), "colocated recover re-syncs nothing and goes on"),
    m("tiny-base-held-out", "tools/make_tiny_base.py", "if expr not in seen and len(eval_records) < args.num_eval:",
      "if len(eval_records) < args.num_eval:", ("tests/unit/tools/test_ablation.py", "-k", "shipped_base"),
      "held-out prompts may repeat"),
    m("planner-dispatcher-2x", "megatron_dapo/planner/stages.py", "MOE_DROPLESS_IMBALANCE = 2.0",
      "MOE_DROPLESS_IMBALANCE = 2.5", ("tests/unit/planner/test_planner.py", "-k", "a3b_plan_is"),
      "the planner's assumed imbalance (the 58 GiB plan moves)"),
)


def run_one(root: str, mutant: Mutant, timeout_s: int, extra: tuple[str, ...]) -> dict:
    """Apply `mutant` under `root`, run its tests (plus `extra`), restore the file; return the record."""
    path = os.path.join(root, mutant.path)
    with open(path) as f:
        original = f.read()
    count = original.count(mutant.old)
    if count != 1:
        return {"id": mutant.id, "status": f"bad-mutant (old text found {count} times)"}
    line = original[: original.index(mutant.old)].count("\n") + 1
    try:
        with open(path, "w") as f:
            f.write(original.replace(mutant.old, mutant.new))
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests, *extra]
        env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            rc, out = -1, "timeout"
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
        return {"id": mutant.id, "file": f"{mutant.path}:{line}", "what": mutant.what,
                "status": "survived" if rc == 0 else "killed", "rc": rc, "by": failed[:3],
                "tail": out.strip().splitlines()[-1:] if out else [], "s": round(time.monotonic() - t0, 1)}
    finally:
        with open(path, "w") as f:
            f.write(original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="the scratch copy of the repository to mutate")
    parser.add_argument("--only", nargs="*", default=None, help="mutant ids to run (default: all)")
    parser.add_argument("--extra-tests", nargs="*", default=(), help="test paths run with every mutant")
    parser.add_argument("--timeout-s", type=int, default=600,
                        help="per-mutant pytest limit (a timeout counts as killed)")
    parser.add_argument("--out", default="mutation_results.jsonl", help="JSON lines written here")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    args = parser.parse_args()
    if os.path.exists(os.path.join(args.root, ".git")):  # a checkout others may be running tests in
        parser.error("--root is a git checkout: mutate a scratch copy (see the module docstring)")
    unknown = sorted(set(args.only or ()) - {mu.id for mu in MUTANTS})
    if unknown:
        parser.error(f"--only: no mutant {unknown} (--list prints them)")
    chosen = [mu for mu in MUTANTS if args.only is None or mu.id in args.only]
    if args.list:
        for mu in chosen:
            print(f"{mu.id:26s} {mu.path}  {mu.what}")
        return
    with open(args.out, "a") as out:
        for mu in chosen:
            record = run_one(args.root, mu, args.timeout_s, tuple(args.extra_tests))
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"{record['id']:26s} {record['status']:9s} {record.get('s', '')}s {' '.join(record.get('by', []))}",
                  flush=True)


if __name__ == "__main__":
    main()
