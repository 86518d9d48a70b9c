"""torchrun worker (4 ranks): one torch_dist checkpoint per model loads at several TP x PP (x EP x ETP) layouts.

Args: WORK LAYOUTS. WORK holds, per model NAME, hf_NAME/ (an HF model of any registered family), mc_NAME/
(hf-to-mcore output; an MoE model's also as mc_NAME_local/, --transformer-impl local) and ref_NAME.safetensors (HF
logits of fixed ids). LAYOUTS is e.g.
"2x1=untied+tied,2x2=untied+tied+qwen3,2x1x2x1=moe" (tp x pp [x ep [x expert-tp]], dp filling the world, = the
models to load there; an MoE model at TP > 1 runs with sequence parallelism, as megatron-core requires). For
each layout and model, every rank loads the checkpoint through `load_model_weights`, runs a pipelined
forward and checks logits against HF's, then exports the model with `iter_hf_weights` and checks every
tensor bit-exact against the HF files. At the last layout each of its models is also saved as a
training-style checkpoint (`<WORK>/train_NAME/step_0000003`, model under key "model") for the test to
convert back with mcore-to-hf, and so is an MoE model at a layout with EP > 1 (`train_NAME_<layout>`).
Prints "OK <layout> NAME" per check.
"""

import os
import sys

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from safetensors.torch import load_file

from megatron_dapo.actor import destroy_parallel, init_parallel
from megatron_dapo.checkpoint.dist_load import load_model_weights
from megatron_dapo.models import ModelArch, build_gpt_model
from megatron_dapo.weights.export import iter_hf_weights
from megatron_dapo.weights.hf_format import HFCheckpointReader


def pipelined_logits(model, ids: torch.Tensor, arch: ModelArch, sp: bool = False) -> torch.Tensor | None:
    """Full-vocab logits [b, s, vocab] on last-stage ranks (None elsewhere): stage by stage, TP-gathered (under
    sequence parallelism a stage passes its TP rank's s / tp positions on; the output layer gathers them)."""
    b, s = ids.shape
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(diagonal=1)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    with torch.no_grad():
        if pp_rank > 0:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            hidden = torch.empty(s // tp if sp else s, b, arch.hidden_size)
            dist.recv(hidden, src=ranks[pp_rank - 1])
            model.set_input_tensor(hidden)
        out = model(input_ids=ids, position_ids=torch.arange(s).expand(b, s), attention_mask=mask)
        if pp_rank < pp - 1:
            dist.send(out.contiguous(), dst=ranks[pp_rank + 1])
            return None
    parts = [torch.empty_like(out) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : arch.vocab_size]


def megatron_core_logits(work: str, tie: str, ids: torch.Tensor, ep: int) -> torch.Tensor:
    """Logits of megatron-core's own GPTModel (TP1 x PP1 x EP `ep`: its TransformerConfig and block spec written out
    from config.json, tests/unit/checkpoint_convert/test_convert_mcore_load.py) after `dist_checkpointing.load` of
    the converter output, which is what Megatron-LM does: no megatron_dapo code between the checkpoint and the model."""
    import argparse
    import json

    from megatron.core.models.gpt import GPTModel, gpt_layer_specs

    from tests.unit.checkpoint_convert.test_convert_mcore_load import rope_kwargs, transformer_config

    with open(os.path.join(work, f"hf_{tie}", "config.json")) as f:
        config = json.load(f)
    with HFCheckpointReader(os.path.join(work, f"hf_{tie}")) as hf:
        tconfig = transformer_config(config, set(hf.specs), expert_model_parallel_size=ep)
    spec = gpt_layer_specs.get_gpt_decoder_block_spec(tconfig, use_transformer_engine=False, normalization="RMSNorm")
    # hf-to-mcore --transformer-impl local: the local spec's key for an MoE layer's pre-MLP norm (the default output
    # has TE's, which megatron_dapo's load_model_weights reads into this spec too, megatron-core's own load not)
    release = os.path.join(work, f"mc_{tie}_local", "release")
    with torch.serialization.safe_globals([argparse.Namespace]):
        padded = torch.load(os.path.join(release, "common.pt"), weights_only=True)["args"].padded_vocab_size
        model = GPTModel(tconfig, spec, vocab_size=padded, max_sequence_length=config["max_position_embeddings"],
                         share_embeddings_and_output_weights=config["tie_word_embeddings"], **rope_kwargs(config))
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, release)["model"])
    b, s = ids.shape
    with torch.no_grad():
        out = model.eval()(ids, torch.arange(s).expand(b, s), torch.ones(1, 1, s, s, dtype=torch.bool).triu(1))
    return out[..., : config["vocab_size"]]


def check_layout(work: str, shape: str, names: list[str], save_training: bool) -> None:
    tp, pp, ep, etp = (*(int(x) for x in shape.split("x")), 1, None)[:4]
    init_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    for tie in names:
        arch = ModelArch.from_hf(os.path.join(work, f"hf_{tie}"))
        sp = arch.is_moe and tp > 1
        model = build_gpt_model(arch, sequence_parallel=sp).eval()
        load_model_weights(model, os.path.join(work, f"mc_{tie}"), arch)
        ref = load_file(os.path.join(work, f"ref_{tie}.safetensors"))
        logits = pipelined_logits(model, ref["ids"], arch, sp)
        if logits is not None:
            torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5)
            print(f"DIFF {shape} {tie} {(logits - ref['logits']).abs().max().item():.2e}", flush=True)
        if arch.is_moe and ep > 1 and tp == pp == 1:  # megatron-core's own MoE GPTModel at EP > 1 too
            own = megatron_core_logits(work, tie, ref["ids"], ep)
            torch.testing.assert_close(own, ref["logits"], rtol=1e-5, atol=1e-5)
            print(f"DIFF {shape} {tie} megatron-core {(own - ref['logits']).abs().max().item():.2e}", flush=True)
        exported = {name: t.clone() for name, t in iter_hf_weights([model], arch)}
        with HFCheckpointReader(os.path.join(work, f"hf_{tie}")) as hf:
            assert set(exported) == set(hf.specs), sorted(set(exported) ^ set(hf.specs))
            bad = [n for n in exported if not torch.equal(exported[n], hf.get(n))]
        assert not bad, f"exported tensors differ from HF: {bad[:5]}"
        # the last layout's models, and MoE models wherever their experts are split over EP ranks
        for run in [f"train_{tie}"] * save_training + [f"train_{tie}_{shape}"] * (arch.is_moe and ep > 1):
            step = os.path.join(work, run, "step_0000003")
            if dist.get_rank() == 0:
                os.makedirs(step)
            dist.barrier()
            dist_checkpointing.save({"model": model.sharded_state_dict()}, step)
            if dist.get_rank() == 0:
                with open(os.path.join(work, run, "latest"), "w") as f:
                    f.write("step_0000003")
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"OK {shape} {tie}", flush=True)
    destroy_parallel(keep_process_group=True)


def main() -> None:
    work, layouts = sys.argv[1], sys.argv[2].split(",")
    for i, layout in enumerate(layouts):
        shape, names = layout.split("=")
        check_layout(work, shape, names.split("+"), save_training=i == len(layouts) - 1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
