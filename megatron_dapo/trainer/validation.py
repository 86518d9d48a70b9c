"""Start-up checks of `python -m megatron_dapo.train` that span several flags or a flag and the model.

Pure functions of numbers (each raises `UserError` naming the flags to change), plus `share_verdict`,
which carries global rank 0's verdict on the inputs only it reads (the prompt files) to every rank.
Every check runs before the model is built, so a mistake costs seconds, not a model load.
"""

from __future__ import annotations

from megatron_dapo.errors import UserError


def _positive(**flags: int) -> None:
    for flag, value in flags.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be an integer >= 1, got {value!r}")


def data_parallel_size(world_size: int, *, tp: int, pp: int, cp: int = 1) -> int:
    """world size / (TP x PP x CP); raise when the processes do not split into whole model replicas."""
    _positive(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp)
    replica = tp * pp * cp
    if world_size % replica:
        layout = f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}"
        if cp != 1:
            layout += f" x context-parallel size {cp}"
        raise UserError(f"{world_size} processes do not split into model replicas of {layout} = {replica} ranks; "
                        f"change the process count or the layout")
    return world_size // replica


def check_batch_arithmetic(*, rollout_batch_size: int, n_samples_per_prompt: int, global_batch_size: int,
                           dp: int) -> int:
    """Responses per optimizer step; raise unless every mini-batch of a step is full and splits evenly over DP.

    A step trains on rollout_batch_size x n_samples_per_prompt responses in mini-batches of
    global_batch_size (0 = all of them in one); each mini-batch is shared out over the dp ranks.
    A remainder would train a short last mini-batch (4 responses with --global-batch-size 3: updates of
    3 and 1) or give DP ranks unequal shares, so both must divide exactly.
    """
    _positive(rollout_batch_size=rollout_batch_size, n_samples_per_prompt=n_samples_per_prompt)
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 0:
        raise UserError(f"--global-batch-size must be an integer >= 0 (0 = the whole step), got {global_batch_size!r}")
    per_step = rollout_batch_size * n_samples_per_prompt
    gbs = global_batch_size or per_step
    if per_step % gbs:
        raise UserError(
            f"--rollout-batch-size {rollout_batch_size} x --n-samples-per-prompt {n_samples_per_prompt} = "
            f"{per_step} responses per step is not a multiple of --global-batch-size {gbs}: the last update "
            f"of each step would train on {per_step % gbs}; pick a --global-batch-size that divides {per_step}"
        )
    if gbs % dp:
        what = f"--global-batch-size {gbs}" if global_batch_size else \
            f"the step's {gbs} responses (--rollout-batch-size x --n-samples-per-prompt, --global-batch-size 0)"
        raise UserError(f"{what} does not split evenly over {dp} data-parallel ranks; make it a multiple of {dp}")
    return gbs


def check_context(*, max_prompt_length: int, max_response_length: int, context: int, allow_exceed: bool) -> None:
    """Raise unless the longest prompt plus the longest response fits the model's positions.

    `context` is max_position_embeddings of --hf-checkpoint's config.json. Past it RoPE positions are
    outside what the model was trained on and the rollout engine may refuse or truncate the request.
    """
    _positive(max_prompt_length=max_prompt_length, max_response_length=max_response_length)
    total = max_prompt_length + max_response_length
    if total > context and not allow_exceed:
        raise UserError(
            f"--max-prompt-length {max_prompt_length} + --max-response-length {max_response_length} = {total} "
            f"tokens exceeds the model's context of {context} (max_position_embeddings in --hf-checkpoint's "
            f"config.json); lower them, or pass --allow-exceed-context to run past it"
        )


def check_vocab(*, tokenizer_size: int, vocab_size: int, tokenizer_dir: str, hf_checkpoint: str) -> None:
    """Raise when the tokenizer can emit ids the model's embedding has no row for.

    `tokenizer_size` is len(tokenizer) (base vocabulary + added tokens); the model's vocab_size may be
    larger (Qwen2.5: 151,665 tokens in 152,064 rows) but never smaller.
    """
    if tokenizer_size > vocab_size:
        raise UserError(
            f"the tokenizer of {tokenizer_dir} has {tokenizer_size} tokens but the model of {hf_checkpoint} "
            f"has vocab_size {vocab_size}: token ids {vocab_size}..{tokenizer_size - 1} have no embedding; "
            f"pass the model's own tokenizer (--tokenizer) or the matching model (--hf-checkpoint)"
        )


def check_model_layout(arch, layout, *, hf_checkpoint: str) -> None:
    """Raise UserError naming the flag when the model of `hf_checkpoint` (`arch`, a ModelArch) does not split
    over `layout` (a ParallelLayout): heads, kv heads and ffn vs --tensor-model-parallel-size, layers vs
    --pipeline-model-parallel-size and the virtual stages, --recompute-num-layers vs a stage. The same check
    the actor makes when it is built, made here so it fails before any process group or model exists."""
    from megatron_dapo.distributed.parallel import validate_layout

    try:
        validate_layout(arch, layout)
    except ValueError as err:
        raise UserError(f"the model of --hf-checkpoint {hf_checkpoint} does not split over this layout: {err}"
                        ) from err


def share_verdict(error: UserError | None) -> None:
    """Raise on every rank when global rank 0's checks failed (collective; call on all ranks).

    Rank 0 raises its own error (main prints it); the others raise a copy with echo=False, so one
    line is shown for the whole world. Without an initialised world of more than one process, `error` is raised
    as is. Cost: one broadcast of a short string over a gloo group; ranks other than 0 wait here for
    rank 0 to finish reading the prompt files (seconds for DAPO-Math-17k), outside any NCCL watchdog.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    message = share_from_rank0(None if error is None else str(error))
    if message is None:
        return
    if error is not None:
        raise error
    raise UserError(message, echo=False)


def share_from_rank0(value: str | None) -> str | None:
    """Global rank 0's `value` on every rank (collective; call on all ranks): one broadcast of a short string over
    a gloo group made for it, outside any NCCL watchdog. `value` itself without a world of more than one process."""
    import torch.distributed as dist

    from megatron_dapo.distributed import comm

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    group = dist.new_group(backend="gloo")
    shared = comm.broadcast_object(value, 0, group)
    dist.destroy_process_group(group)
    return shared
