"""The parallelism flags: validation naming the flag, their path into megatron-core, and activation
recomputation giving the same log-probs, loss and gradients as no recomputation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.arguments import build_parser
from megatron_dapo.distributed.parallel import (
    ParallelLayout,
    layer_range,
    micro_batch_group_size,
    padded_vocab_size,
    schedulable_micro_batches,
    stage_layer_counts,
    validate_layout,
)
from megatron_dapo.flag_field import flag_field, flag_fields, flag_name
from megatron_dapo.models import spec
from megatron_dapo.models.config import transformer_config_from_arch
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.startup import layout_options
from tests.dist.actor_common import hf_to_full_mcore, make_samples, mcore_shards_for_rank, tiny_hf_model

ARCH = ModelArch(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=8,
                 num_kv_heads=4, head_dim=8)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(tp=1, sp=True), "--sequence-parallel"),
    (dict(cp=0), "--context-parallel-size"),
    (dict(recompute_granularity="partial"), "--recompute-granularity"),
    (dict(recompute_granularity="full"), "--recompute-method"),
    (dict(recompute_granularity="selective", recompute_method="uniform"), "--recompute-method"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0),
     "--recompute-num-layers"),
    (dict(overlap_param_gather=True), "--overlap-grad-reduce"),
    (dict(transformer_impl="local", cp=2), "--context-parallel-size"),
    (dict(transformer_impl="apex"), "--transformer-impl"),
    (dict(pp=1, layers_in_first_stage=1), "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size"),
    (dict(pp=1, layers_in_last_stage=1), "--decoder-last-pipeline-num-layers needs --pipeline-model-parallel-size"),
    (dict(pp=2, layers_in_first_stage=0), "--decoder-first-pipeline-num-layers must be a positive integer"),
    (dict(pp=2, layers_in_last_stage=-1), "--decoder-last-pipeline-num-layers must be a positive integer"),
    (dict(pp=2, layers_in_first_stage=2, layers_per_virtual_stage=1),
     "--decoder-first-pipeline-num-layers and --num-layers-per-virtual-pipeline-stage cannot be combined"),
    (dict(pp=2, layers_in_last_stage=2, layers_per_virtual_stage=1),
     "--decoder-last-pipeline-num-layers and --num-layers-per-virtual-pipeline-stage cannot be combined"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_layout_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ParallelLayout(**kwargs)


def test_recompute_layers_must_fit_a_stage():
    layout = ParallelLayout(pp=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)
    with pytest.raises(ValueError, match="--recompute-num-layers"):
        validate_layout(ARCH, layout)  # 2 layers per stage
    validate_layout(ARCH, ParallelLayout(pp=2, recompute_granularity="full", recompute_method="block",
                                         recompute_num_layers=2))


def test_recompute_layers_must_fit_each_stage_of_an_uneven_pipeline():
    """Each stage's own layer count bounds the recompute unit: at 3/1 stage 0 fits 3 layers, stage 1 does not."""
    for first, last, method, n, bad in ((3, None, "uniform", 3, 1), (1, None, "block", 2, 0), (None, 1, "block", 2, 1),
                                        (None, 3, "uniform", 3, 0)):
        layout = ParallelLayout(pp=2, layers_in_first_stage=first, layers_in_last_stage=last,
                                recompute_granularity="full", recompute_method=method, recompute_num_layers=n)
        with pytest.raises(ValueError, match=rf"--recompute-num-layers \({n}\) must be <= the 1 layers of pipeline "
                                             rf"stage {bad}"):
            validate_layout(ARCH, layout)
    validate_layout(ARCH, ParallelLayout(pp=2, layers_in_first_stage=1, recompute_granularity="full",
                                         recompute_method="uniform", recompute_num_layers=1))


# (layers, PP, model chunks per PP rank, --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers):
# VPP only at PP > 1, the layers cut into PP x chunks equal runs; uneven: the end stages given, the rest cut evenly
# over the middle stages (VPP refused with them: ParallelLayout.__post_init__)
LAYER_GRID = [(n, pp, v, None, None) for n in (4, 6, 8, 12, 24) for pp in (1, 2, 3, 4) for v in (1, 2, 3)
              if n % (pp * v) == 0 and (v == 1 or pp > 1)]
UNEVEN_GRID = [(4, 2, 1, 1, None), (4, 2, 1, None, 1), (4, 2, 1, 1, 3), (4, 2, 1, 3, 1), (5, 2, 1, 2, None),
               (7, 3, 1, 1, None), (7, 3, 1, None, 3), (5, 3, 1, 1, 2), (9, 4, 1, 3, None), (12, 4, 1, 2, 4),
               (10, 4, 1, 1, 3), (64, 3, 1, 20, 20), (64, 3, 1, 16, 24), (64, 4, 1, 14, 14), (64, 5, 1, 10, 18)]


def _grid_id(n: int, pp: int, v: int, first: int | None, last: int | None) -> str:
    return f"L{n}-pp{pp}-vpp{v}" + (f"-first{first}" if first else "") + (f"-last{last}" if last else "")


@pytest.mark.parametrize("num_layers, pp, vpp, first, last", LAYER_GRID + UNEVEN_GRID,
                         ids=[_grid_id(*case) for case in LAYER_GRID + UNEVEN_GRID])
def test_layer_range_is_megatron_cores_placement(num_layers, pp, vpp, first, last):
    """Which layers each (PP rank, virtual chunk) holds, against megatron-core's own answer for the TransformerConfig
    the actor builds from the same layout (get_transformer_layer_offset + get_num_layers_to_build, as its
    TransformerBlock places layers); together the chunks hold every layer once."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = ParallelLayout(pp=pp, layers_per_virtual_stage=num_layers // (pp * vpp) if vpp > 1 else None,
                            layers_in_first_stage=first, layers_in_last_stage=last)
    arch = dataclasses.replace(ARCH, num_layers=num_layers)
    cfg = transformer_config_from_arch(arch, pp=pp, layout=layout)
    assert (cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage) == (first, last)
    assert layout.virtual_stages(num_layers) == vpp
    held = []
    for r in range(pp):
        for c in range(vpp):
            vp_stage = c if vpp > 1 else None
            offset = get_transformer_layer_offset(cfg, vp_stage=vp_stage, pp_rank=r)
            count = get_num_layers_to_build(cfg, vp_stage=vp_stage, pp_rank=r)
            assert layer_range(num_layers, layout, r, c) == range(offset, offset + count), (r, c)
            held += layer_range(num_layers, layout, r, c)
    assert sorted(held) == list(range(num_layers))
    with pytest.raises(ValueError, match="pp_rank"):
        layer_range(num_layers, layout, pp)
    with pytest.raises(ValueError, match="chunk"):
        layer_range(num_layers, layout, 0, vpp)


def test_layer_range_refuses_layers_that_do_not_cut():
    with pytest.raises(ValueError, match=r"num_hidden_layers \(6\) is not divisible by --pipeline-model-parallel-size"):
        layer_range(6, ParallelLayout(pp=4), 0)
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage"):
        layer_range(8, ParallelLayout(pp=2, layers_per_virtual_stage=3), 0)


def _megatron_core_accepts(num_layers: int, pp: int, first: int | None, last: int | None) -> bool:
    """Whether megatron-core's TransformerConfig takes this uneven split (its __post_init__ checks)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=8, pipeline_model_parallel_size=pp,
                          pipeline_dtype=torch.float32, num_layers_in_first_pipeline_stage=first,
                          num_layers_in_last_pipeline_stage=last)
    except ValueError:
        return False
    return True


def test_an_uneven_split_is_refused_where_megatron_core_refuses_it():
    """Over a grid of layer counts, PP sizes and end-stage layers, `layer_range` refuses (naming the flags) every split
    megatron-core's TransformerConfig refuses, and accepts every split it accepts, except the one megatron-core lets
    through: end stages holding more than every layer (a negative remainder that a single middle stage "divides")."""
    for num_layers in (3, 4, 5, 7, 8, 12):
        for pp in (2, 3, 4):
            for first in (None, 1, 2, 3, 5):
                for last in (None, 1, 2, 4):
                    if first is None and last is None:
                        continue
                    layout = ParallelLayout(pp=pp, layers_in_first_stage=first, layers_in_last_stage=last)
                    case = (num_layers, pp, first, last)
                    negative = num_layers - (first or 0) - (last or 0) < 0
                    try:
                        counts = stage_layer_counts(num_layers, layout)
                    except ValueError as err:
                        assert "--decoder-" in str(err) and "--pipeline-model-parallel-size" in str(err), case
                        assert negative or not _megatron_core_accepts(*case), case
                        continue
                    assert _megatron_core_accepts(*case), case
                    assert sum(counts) == num_layers and min(counts) >= 1, case
                    assert [len(layer_range(num_layers, layout, r)) for r in range(pp)] == counts, case
    with pytest.raises(ValueError, match=r"= -2 layers do not split evenly"):  # megatron-core: -2 % 1 == 0, accepted
        stage_layer_counts(4, ParallelLayout(pp=3, layers_in_first_stage=3, layers_in_last_stage=3))
    assert _megatron_core_accepts(4, 3, 3, 3)


def test_uneven_flags_reach_the_transformer_config():
    args = build_parser().parse_args([*REQUIRED, "--pipeline-model-parallel-size", "3",
                                      "--decoder-first-pipeline-num-layers", "1",
                                      "--decoder-last-pipeline-num-layers", "3"])
    layout = ParallelLayout.from_world(3, **layout_options(args))
    assert (layout.pp, layout.layers_in_first_stage, layout.layers_in_last_stage) == (3, 1, 3)
    arch = dataclasses.replace(ARCH, num_layers=6)
    cfg = transformer_config_from_arch(arch, pp=3, layout=layout)
    assert (cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage) == (1, 3)
    assert [layer_range(6, layout, r) for r in range(3)] == [range(0, 1), range(1, 3), range(3, 6)]
    even = transformer_config_from_arch(arch, pp=3, layout=ParallelLayout(pp=3))
    assert (even.num_layers_in_first_pipeline_stage, even.num_layers_in_last_pipeline_stage) == (None, None)


def test_flags_reach_the_transformer_config():
    args = build_parser().parse_args([
        "--hf-checkpoint", "x", "--num-steps", "1", "--prompt-data", "x", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel",
        "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2",
        "--overlap-grad-reduce", "--overlap-param-gather", "--transformer-impl", "transformer_engine"])
    layout = ParallelLayout.from_world(16, **layout_options(args))
    assert (layout.tp, layout.pp, layout.cp, layout.dp, layout.sp) == (2, 2, 2, 2, True)
    assert (layout.overlap_grad_reduce, layout.overlap_param_gather, layout.transformer_impl) == (
        True, True, "transformer_engine")
    cfg = transformer_config_from_arch(ARCH, tp=2, pp=2, layout=layout)
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size) == (2, 2, 2)
    assert cfg.sequence_parallel is True
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", 2)
    with pytest.raises(ValueError, match="--context-parallel-size"):
        ParallelLayout.from_world(12, **layout_options(args))


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_the_interleaved_schedule_runs_groups_of_pp_micro_batches(pp):
    """Depth-first (megatron-core's default group size PP): a step's micro-batch count is rounded up to the next
    multiple of PP, and without VPP it is left as it is."""
    vpp = ParallelLayout(pp=pp, layers_per_virtual_stage=1)
    for count in range(1, 13):
        assert micro_batch_group_size(vpp, count) == pp
        assert schedulable_micro_batches(vpp, count) == -(-count // pp) * pp
        assert schedulable_micro_batches(ParallelLayout(pp=pp), count) == count


@pytest.mark.parametrize("pp, vpp", [(2, 2), (2, 4), (3, 2), (4, 3)])
def test_planned_chunks_in_flight_are_megatron_cores_warmup(pp, vpp):
    """The planner's peak chunk-micro-batches on each stage = megatron-core's own warm-up count for that stage (its
    get_pp_rank_microbatches, told the group size the actor hands it) + the first 1F1B forward, capped by the step's
    M x v chunk-micro-batches."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from megatron_dapo.planner.stages import PlanInputs, _in_flight

    layout = ParallelLayout(pp=pp, layers_per_virtual_stage=1)
    for m in sorted({schedulable_micro_batches(layout, c) for c in range(1, 13)}):
        for stage in range(pp):
            group = SimpleNamespace(size=lambda: pp, rank=lambda s=stage: s)
            comm = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp)
            total, _, warmup, _ = get_pp_rank_microbatches(m, vpp, micro_batch_group_size(layout, m),
                                                           p2p_communicator=comm)
            want = min(warmup + 1, total)
            _, chunks = _in_flight(layout, PlanInputs(tokens_per_micro_batch=1, max_seq_len=1, num_micro_batches=m),
                                   stage, vpp)
            assert chunks == want, (m, stage)


# Each ParallelLayout field's flag, written out here (Megatron-LM's names), not read from the fields' metadata.
LAYOUT_FLAGS = {
    "tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
    "layers_per_virtual_stage": "--num-layers-per-virtual-pipeline-stage",
    "layers_in_first_stage": "--decoder-first-pipeline-num-layers",
    "layers_in_last_stage": "--decoder-last-pipeline-num-layers", "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size", "sp": "--sequence-parallel",
    "recompute_granularity": "--recompute-granularity", "recompute_method": "--recompute-method",
    "recompute_num_layers": "--recompute-num-layers", "overlap_grad_reduce": "--overlap-grad-reduce",
    "overlap_param_gather": "--overlap-param-gather", "transformer_impl": "--transformer-impl",
}
REQUIRED = ["--hf-checkpoint", "x", "--num-steps", "1", "--prompt-data", "x"]


def test_every_layout_field_but_dp_is_declared_with_megatrons_flag():
    assert {f.name for f in dataclasses.fields(ParallelLayout)} - {f.name for f in flag_fields(ParallelLayout)} == {
        "dp"}
    assert {f.name: flag_name(ParallelLayout, f.name) for f in flag_fields(ParallelLayout)} == LAYOUT_FLAGS


def test_a_layout_flag_reaches_its_field_and_one_left_out_keeps_the_fields_default():
    defaults = {name: getattr(ParallelLayout(), name) for name in LAYOUT_FLAGS}
    assert layout_options(build_parser().parse_args(REQUIRED)) == defaults
    given = dict(tp=4, pp=2, layers_per_virtual_stage=3, layers_in_first_stage=5, layers_in_last_stage=7, cp=2,
                 ep=8, etp=1, sp=True, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2,
                 overlap_grad_reduce=True, overlap_param_gather=True, transformer_impl="local")
    argv = list(REQUIRED)
    for name, value in given.items():
        argv += [LAYOUT_FLAGS[name]] if value is True else [LAYOUT_FLAGS[name], str(value)]
    assert layout_options(build_parser().parse_args(argv)) == given
    with pytest.raises(SystemExit):  # choices come from the field: argparse refuses the rest
        build_parser().parse_args([*REQUIRED, "--recompute-method", "sideways"])


def test_a_flag_field_names_a_long_flag():
    with pytest.raises(ValueError, match="must start with '--'"):
        flag_field("tensor-model-parallel-size", default=1)


def test_transformer_engine_is_required_on_cuda(monkeypatch):
    assert spec.resolve_transformer_impl("local") == "local"
    monkeypatch.setattr(spec, "te_available", lambda: False)
    assert spec.resolve_transformer_impl(None) == ("transformer_engine" if torch.cuda.is_available() else "local")
    with pytest.raises(ImportError, match="--transformer-impl local"):
        spec.resolve_transformer_impl("transformer_engine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU box where TE fails to import
    with pytest.raises(ImportError, match="CUDA is available.*--transformer-impl local"):
        spec.resolve_transformer_impl(None)
    with pytest.raises(ImportError, match="--transformer-impl local"):
        spec.get_layer_spec(None)  # no silent fallback to the local spec


# ---- recompute == no recompute (single process, local spec) ----------------------------------------------

@pytest.fixture(scope="module")
def world():
    init_parallel(seed=0)
    hf = tiny_hf_model(seed=4)
    yield hf, ModelArch.from_hf(hf.config)
    destroy_parallel()


def _actor(world, layout: ParallelLayout) -> MegatronActor:
    hf, arch = world
    actor = MegatronActor(arch, ActorConfig(lr=1e-3, clip_grad=0.0, max_tokens_per_micro_batch=60), layout)
    full = hf_to_full_mcore(hf.state_dict(), arch)
    actor.load_shards(mcore_shards_for_rank(full, arch, tp=1, tp_rank=0, pp=1, pp_rank=0,
                                            padded_vocab=padded_vocab_size(arch.vocab_size, 1)))
    return actor


RECOMPUTE = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}


@pytest.fixture(scope="module")
def reference(world):
    samples = make_samples(6, seed=3)
    actor = _actor(world, ParallelLayout())
    logps = actor.compute_log_probs(samples)
    actor.train_step(samples)
    grads = {n: p.main_grad.clone() for n, p in actor.model.module.named_parameters()}
    return samples, logps, grads


@pytest.mark.parametrize("name", list(RECOMPUTE))
def test_recompute_gives_identical_log_probs_and_grads(world, reference, name):
    samples, want_logps, want_grads = reference
    actor = _actor(world, ParallelLayout(**RECOMPUTE[name]))
    assert actor.module.config.recompute_granularity == RECOMPUTE[name]["recompute_granularity"]
    for got, want in zip(actor.compute_log_probs(samples), want_logps, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    actor.train_step(samples)
    for n, p in actor.model.module.named_parameters():
        torch.testing.assert_close(p.main_grad, want_grads[n], atol=1e-7, rtol=1e-6, msg=n)


def test_overlap_flags_reach_ddp_and_change_no_result(world):
    """--overlap-grad-reduce / --overlap-param-gather set mcore's DDP config; two steps match the default."""
    hf, arch = world
    samples = make_samples(6, seed=3)
    results = []
    for layout in (ParallelLayout(), ParallelLayout(overlap_grad_reduce=True, overlap_param_gather=True)):
        actor = MegatronActor(arch, ActorConfig(lr=1e-3, clip_grad=0.0, max_tokens_per_micro_batch=60,
                                                use_distributed_optimizer=True), layout)
        assert (actor.model.ddp_config.overlap_grad_reduce, actor.model.ddp_config.overlap_param_gather) == (
            layout.overlap_grad_reduce, layout.overlap_param_gather)
        full = hf_to_full_mcore(hf.state_dict(), arch)
        actor.load_shards(mcore_shards_for_rank(full, arch, tp=1, tp_rank=0, pp=1, pp_rank=0,
                                                padded_vocab=padded_vocab_size(arch.vocab_size, 1)))
        norms = [actor.train_step(samples)["grad_norm"] for _ in range(2)]
        results.append((norms, {k: v.clone() for k, v in actor.state_dict_for_export().items()}))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    for name, w in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], w, atol=1e-6, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        MegatronActor(arch, ActorConfig(lr=1e-3), ParallelLayout(overlap_grad_reduce=True, overlap_param_gather=True))
