"""The plan printed (`--dry-run`, `python -m megatron_dapo.planner`): the table of every stage, the MoE and colocated
phases' lines, rank 0's host copy, the verdict against --gpu-memory-gib and, over it, the single flag changes that
lower the peak; and the planner's own flags (--gpu-memory-gib, --world-size).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TextIO

from megatron_dapo.distributed.parallel import ParallelLayout, stage_layer_counts, uneven_end_stages
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.planner.activations import (
    ActivationSpec,
    logits_bytes,
    moe_alltoall_bytes,
    moe_layer_bytes,
    moe_local_tokens,
    moe_routed_tokens,
)
from megatron_dapo.planner.colocated import (
    generation_lines,
    phase_peaks_gib,
    save_lines,
    save_peaks,
    sglang_share,
    startup_lines,
    startup_peaks,
)
from megatron_dapo.planner.stages import (
    GIB,
    PlanInputs,
    StagePlan,
    check_gpu_memory,
    moe_factor,
    peak_gib,
    plan_stages,
)


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
        + _layers_per_stage(arch, layout)
        + (f" in {layout.virtual_stages(arch.num_layers)} interleaved chunks (--num-layers-per-virtual-pipeline-"
           f"stage {layout.layers_per_virtual_stage}; activations: Korthikanti 2022 4.2.3)"
           if layout.layers_per_virtual_stage else ""),
        f"{'GiB per GPU':<48}" + "".join(f"{'stage ' + str(p.stage):>10}" for p in plans),
    ]
    lines.append(f"{'  micro-batches in flight (1F1B: pp - stage)':<48}"
                 + "".join(f"{p.in_flight:>10d}" for p in plans))
    counts = stage_layer_counts(arch.num_layers, layout)
    if len(set(counts)) > 1:  # an uneven pipeline: each stage's decoder layers beside its bytes
        lines.append(f"{'  decoder layers (uneven pipeline)':<48}" + "".join(f"{n:>10d}" for n in counts))
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


def _layers_per_stage(arch: ModelArch, layout: ParallelLayout) -> str:
    """The plan's "layers per stage" phrase: one count when every stage holds the same, else each stage's."""
    counts = stage_layer_counts(arch.num_layers, layout)
    if len(set(counts)) == 1:
        return f"{counts[0]} layers per stage"
    flags = " / ".join(uneven_end_stages(layout))
    return f"{'/'.join(map(str, counts))} layers on stages 0..{layout.pp - 1} ({flags})"


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


PY_TOKEN_BYTES = 79
"""Rank 0's host bytes per response token held as Sample lists: a token id (an int object above the 256 cached
ones, 28 B, plus its 8 B list slot), its log-prob (a float object, 24 + 8 B) and its version slot (8 B): 76 B, plus
up to 1/8 of the three slots for a list built by appending (CPython's over-allocation)."""
STATE_TOKEN_BYTES = 16
"""The same token in a checkpoint's packed state: int32 id, fp32 log-prob, int32 version, ~4 B of the rest."""
STREAM_KEEP_RATE = 0.5
"""The keep rate the fully async line assumes (DAPO's dynamic sampling keeps fewer groups as training goes on)."""


def stream_state_line(*, max_staleness: int, batch_groups: int, n_samples: int, max_response_length: int,
                      over_sample_factor: float = 1.0, keep_rate: float = STREAM_KEEP_RATE,
                      max_in_flight: int | None = None) -> str:
    """The plan's rank-0 host-memory line for --max-staleness K (rollout/streaming.py): the groups in flight, at most
    ceil(factor x K x B / keep rate) and at most `max_in_flight` (--max-in-flight-groups, or the rollout's default
    from the engine's capacity), plus the lead's D = max(1, K - 1) batches ahead and the one being built, each of G
    responses, all at --max-response-length (the worst case: a cut brings every prefix back to rank 0). Qwen2.5-32B
    DAPO (B 512, G 16, 20480 tokens, K 2), uncapped: 3072 groups, 1.0e9 tokens, 74 GiB as lists."""
    lead = max(1, max_staleness - 1)
    in_flight = math.ceil(over_sample_factor * max_staleness * batch_groups / keep_rate)
    capped = max_in_flight is not None and max_in_flight < in_flight
    if capped:
        in_flight = max_in_flight
    groups = in_flight + (lead + 1) * batch_groups
    tokens = groups * n_samples * max_response_length
    cap = f"{in_flight:,} of them in flight, --max-in-flight-groups; " if capped else ""
    return (f"rank 0 host memory: fully async state (--max-staleness {max_staleness}) at most {groups:,} groups "
            f"({cap}{groups * n_samples:,} responses, {tokens:,} tokens at --max-response-length, keep rate "
            f"{keep_rate:g} assumed): {tokens * PY_TOKEN_BYTES / GIB:.1f} GiB as lists, "
            f"{tokens * STATE_TOKEN_BYTES / GIB:.1f} GiB in a checkpoint")


SANDBOX_CPU_S = 0.0335
"""CPU seconds of one trivial sandboxed call (interpreter start, jail, print): tools/bench_sandbox.py, 2-core x86_64."""


def tool_use_line(*, workers: int, memory_mib: int, max_processes: int, max_file_mib: int, batch_groups: int,
                  n_samples: int, max_turns: int, max_response_length: int) -> str:
    """The plan's rank-0 host line for --tool-template (rollout/multi_turn.py, tool_use/): the sandbox's worst case in
    memory (--tool-workers programs, each --tool-memory-mib of address space per process, its processes, its tmpfs),
    and per step the calls at most (B x G x (--max-turns - 1)), their CPU at the measured cost of a trivial call, and
    the turns' request bodies if every turn resubmitted the whole --max-response-length context (ID_JSON_BYTES an id).
    Qwen2.5-32B DAPO with TOOL_TEMPLATE=qwen (B 512, G 16, 9 turns, 16 workers of 1 GiB): 65,536 calls at most, 36.6
    core-minutes of trivial calls, 288 GiB of address space in the worst case (RLIMIT_AS bounds each process, no
    cgroup bounds a program's processes together: a program that forks its 16 and fills each is that large)."""
    calls = batch_groups * n_samples * (max_turns - 1)
    turns = batch_groups * n_samples * max_turns
    address = workers * (memory_mib * (max_processes + 2) + max_file_mib) / 1024
    body = turns * max_response_length * ID_JSON_BYTES / 1e9
    return (f"rank 0 host: tool sandbox (--tool-template) {workers} programs at once, at most {address:.1f} GiB of "
            f"address space and tmpfs ({memory_mib} MiB x {max_processes + 2} processes + {max_file_mib} MiB each); "
            f"per step at most {calls:,} calls ({calls * SANDBOX_CPU_S / 60:.1f} core-minutes at "
            f"{SANDBOX_CPU_S * 1e3:.1f} ms a trivial call) and {body:.1f} GB of turn requests if every one of "
            f"{turns:,} turns resent --max-response-length ids")


ID_JSON_BYTES = 7.3
"""A token id in a JSON request body: ~7.3 B with its separator (Qwen's 151,665 ids, uniform; measured)."""
LOGPROB_JSON_BYTES = 36.4
"""One [log-prob, id, null] entry of SGLang's input_token_logprobs in a JSON reply (measured likewise)."""


def served_teacher_line(*, batch_groups: int, n_samples: int, max_prompt_length: int, max_response_length: int,
                        dp: int, max_concurrency: int) -> str:
    """The plan's line for --teacher-url (rollout/sglang/teacher.py): per step, one scoring request per response (B x
    G), from each of the `dp` replicas' scorer at most --teacher-max-concurrency in flight; at the maximum lengths
    the JSON up (every id of prompt + response) and down (one entry per response token), the tokens the teacher
    prefills, and the replica's broadcast of fp32 log-probs. The teacher's GPUs are its own: they are not in this
    plan. Qwen3-8B student (DP 32), B 512, G 16, 2,048 + 20,480 tokens: 8,192 requests, 185 M tokens, 1.3 GB up,
    6.1 GB down."""
    requests = batch_groups * n_samples
    tokens = requests * (max_prompt_length + max_response_length)
    response_tokens = requests * max_response_length
    per_replica = math.ceil(requests / dp)
    return (f"served teacher (--teacher-url), per step at the maximum lengths: {requests:,} scoring requests "
            f"({per_replica:,} from each of {dp} data-parallel replicas, <= {max_concurrency} in flight each), "
            f"{tokens / 1e6:,.1f} M tokens prefilled by the teacher, {tokens * ID_JSON_BYTES / 1e9:.2f} GB of JSON up "
            f"and {response_tokens * LOGPROB_JSON_BYTES / 1e9:.2f} GB down; each replica broadcasts "
            f"{per_replica * max_response_length * 4 / 2**20:,.0f} MiB of fp32 log-probs to its ranks. The "
            f"teacher's GPUs are its own, not in this plan")


def print_plan(plan: Plan, *, weight_sync_mode: str, out: TextIO | None = None, err: TextIO | None = None,
               host_lines: Sequence[str] = ()) -> int:
    """Print the per-GPU plan to `out` (stdout); 0 when the peak fits --gpu-memory-gib, else 1. A layout the model
    does not split over: one line `plan: error: ...` on `err` (stderr), 2. `weight_sync_mode`: rank 0's transport,
    resolved by the caller (weight_sync/transports/; the planner sits below weight_sync/ and imports none of it).
    `host_lines`: more rank-0 host-memory lines, printed under the host copy's (`stream_state_line`)."""
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
    print(host_copy_line(arch, mode=weight_sync_mode, colocate=inputs.colocate,
                         bytes_per_element=spec.bytes_per_element), file=out)
    for line in host_lines:
        print(line, file=out)
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

