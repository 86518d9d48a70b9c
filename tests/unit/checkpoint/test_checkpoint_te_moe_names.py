"""Dist-checkpoint keys under Transformer Engine and the local spec, for every registered family, MoE included.

megatron-core 0.16.1 keys one tensor differently per layer implementation: an MoE layer's pre-MLP norm is a TENorm
of its own under TE (`decoder.layers[.L].pre_mlp_layernorm.weight`), while the local spec maps it to the fused name
`mlp.linear_fc1.layer_norm_weight` (what a TE dense layer holds) in MoE layers too. The references are the models'
own `sharded_state_dict()` key sets: a TE model is megatron-core's TE spec (`get_gpt_decoder_block_spec` for an MoE
model: TEGroupedMLP experts, a dense layer among the MoE ones for the mixed case) built by megatron_dapo's
`build_gpt_model(use_te=True)` with CPU twins of the TE modules (tests/te_standins.py). Against them: the mapping
table's keys per implementation, the converter's output, `--load` of it into either implementation, resume of a
training checkpoint saved under the other implementation, mcore-to-hf of either, and export's HF names.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import apply_factories

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.checkpoint.ckpt_config import expected_global_shapes
from megatron_dapo.distributed.parallel import padded_vocab_size
from megatron_dapo.models import ModelArch, build_gpt_model
from tests.dist.actor_common import (
    FAMILIES,
    LAYOUT_ADAM_EPS,
    RESUMED_UPDATE_ATOL,
    hf_response_log_probs,
    make_samples,
    sharpen_router,
    tiny_hf_model,
)
from tests.te_standins import patch_te_build

CASES: dict[str, tuple[str, dict]] = {
    **{model_type: (model_type, {}) for model_type in FAMILIES},
    "qwen3_moe-mixed": ("qwen3_moe", dict(mlp_only_layers=[1])),  # layers 0, 2, 3 MoE, layer 1 dense: per-layer keys
}
"""Every registered family's tiny model (qwen3_moe: every layer MoE, stacked keys), and an MoE model with a dense
layer among the MoE ones."""

IMPLS = ("transformer_engine", "local")
CONFIG = ActorConfig(lr=1e-3, adam_eps=LAYOUT_ADAM_EPS)
"""Adam's eps = lr: the two implementations' updates from a resumed checkpoint differ by their fp32 reduction orders
only, bounded by RESUMED_UPDATE_ATOL for every element (at eps 1e-8 a near-zero gradient's noise moves one by up to
lr)."""


@pytest.fixture(scope="module")
def layout():
    yield init_parallel(seed=0)
    destroy_parallel()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """case -> (HF model, its directory, arch), built on first use."""
    built: dict[str, tuple] = {}

    def get(case: str):
        if case not in built:
            model_type, overrides = CASES[case]
            hf = tiny_hf_model(model_type, seed=3, **overrides)
            if ModelArch.from_hf(hf.config).is_moe:
                sharpen_router(hf)  # routing by clear top-k margins: no tie decided by reduction order
            out = tmp_path_factory.mktemp(case)
            hf.save_pretrained(out, safe_serialization=True)
            built[case] = hf, out, ModelArch.from_hf(hf.config)
        return built[case]

    return get


@contextlib.contextmanager
def built_as(impl: str):
    """Inside: models build with `impl`'s layer spec; 'transformer_engine' is a TE build's (tests/te_standins.py),
    through the actor's own build_gpt_model(use_te=True) (grouped-GEMM experts, megatron's TE block spec)."""
    with pytest.MonkeyPatch.context() as mp:
        if impl == "transformer_engine":
            patch_te_build(mp)
            mp.setattr("megatron_dapo.actor.actor.build_gpt_model",
                       lambda *a, **kw: build_gpt_model(*a, **{**kw, "use_te": True}))
        yield


def make_actor(arch: ModelArch, impl: str, layout) -> MegatronActor:
    with built_as(impl):
        return MegatronActor(arch, CONFIG, layout)


def model_keys(model: torch.nn.Module) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """What `model` asks a dist checkpoint for: {tensor key: global shape} (factories applied: what is stored) and
    the `_extra_state` objects' storage keys."""
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    tensors, objects = {}, set()
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensor):
            tensors[value.key] = tuple(value.global_shape)
        elif isinstance(value, ShardedObject):
            objects.add(value.unique_key)
    return tensors, objects


def stored(iter_dir) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """{tensor key: global shape} and the object keys a torch_dist checkpoint holds (from its metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
    tensors = {k: tuple(md.size) for k, md in metadata.items() if hasattr(md, "size")}
    return tensors, set(metadata) - set(tensors)


def convert_to_mcore(hf_dir, out, *flags: str) -> None:
    from checkpoint_convert.cli import main as convert

    assert convert(["hf-to-mcore", "--hf-path", str(hf_dir), "--save", str(out), *flags]) == 0


@pytest.mark.parametrize("case", CASES)
def test_table_keys_are_each_implementations_model_keys(layout, hf_models, case):
    """The mapping table's dist keys per implementation (`stored_tensors(arch, impl)`) are exactly the tensors a
    model of that implementation asks for, with their global shapes; they differ only in an MoE layer's norm."""
    _, _, arch = hf_models(case)
    padded = padded_vocab_size(arch.vocab_size, 1)
    models = {}
    for impl in IMPLS:
        with built_as(impl):
            models[impl], _ = model_keys(build_gpt_model(arch, use_te=impl == "transformer_engine"))
        assert models[impl] == expected_global_shapes(arch, padded, impl), impl
    te, local = models["transformer_engine"], models["local"]
    moe_norms = {f"decoder.layers.{'' if arch.all_layers_moe else f'{i}.'}pre_mlp_layernorm.weight"
                 for i in arch.moe_layers}
    assert set(te) - set(local) == moe_norms
    assert len(set(local) - set(te)) == len(moe_norms)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
def test_converter_writes_what_a_model_asks_for(layout, hf_models, case, impl, tmp_path):
    """hf-to-mcore output (default: TE's keys; --transformer-impl local: the local spec's): exactly that model's tensor
    keys and global shapes, and every `_extra_state` object it asks for (TE: TEGroupedMLP's per expert, the TENorms':
    q/k norms, an MoE layer's pre-MLP norm, the final norm), so megatron-core's own load needs no renaming."""
    _, hf_dir, arch = hf_models(case)
    convert_to_mcore(hf_dir, tmp_path / "mc", *(["--transformer-impl", "local"] if impl == "local" else []))
    with built_as(impl):
        tensors, objects = model_keys(build_gpt_model(arch, use_te=impl == "transformer_engine"))
    have_tensors, have_objects = stored(tmp_path / "mc" / "release")
    assert have_tensors == tensors
    assert objects <= have_objects, sorted(objects - have_objects)[:5]


@pytest.mark.parametrize("case", CASES)
def test_converter_output_loads_into_either_implementation(layout, hf_models, case, tmp_path):
    """--load of hf-to-mcore output (train.build_actor's load_model_weights) into a TE and a local-spec actor: each
    then matches HF's log-probs; export (iter_hf_weights) of the TE one gives HF's names and tensors back."""
    from megatron_dapo.checkpoint.dist_load import load_model_weights
    from megatron_dapo.weights.export import iter_hf_weights
    from tests.unit.checkpoint_convert.test_convert import read_all

    hf, hf_dir, arch = hf_models(case)
    convert_to_mcore(hf_dir, tmp_path / "mc")
    samples = make_samples(2, seed=5)
    want = hf_response_log_probs(hf, samples)[0]
    for impl in ("local", "transformer_engine"):
        actor = make_actor(arch, impl, layout)
        load_model_weights(actor.module, tmp_path / "mc", arch)
        actor.optimizer.reload_model_params()
        for got, ref in zip(actor.compute_log_probs(samples), want, strict=True):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)  # fp32 forward vs HF's: reduction order only
    exported = dict(iter_hf_weights(actor.model, arch))  # the last one: the TE actor
    reference = read_all(hf_dir)  # the on-disk names (per-expert tensors), what SGLang takes
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("saved_as, resumed_as", [("local", "transformer_engine"), ("transformer_engine", "local")])
@pytest.mark.parametrize("case", CASES)
def test_training_checkpoint_resumes_under_the_other_implementation(layout, hf_models, case, saved_as, resumed_as,
                                                                     tmp_path):
    """A --save of one implementation: resumes under the other (weights and Adam state: the next update is the same),
    loads as --load weights into it, and mcore-to-hf gives the saving actor's HF export back bit for bit."""
    from checkpoint_convert.cli import main as convert
    from megatron_dapo.checkpoint.dist_load import load_model_weights
    from megatron_dapo.checkpoint.training import load_checkpoint, save_checkpoint, step_dir
    from megatron_dapo.trainer.build import load_hf_into_actor
    from megatron_dapo.weights.export import iter_hf_weights
    from tests.unit.checkpoint_convert.test_convert import read_all

    _, hf_dir, arch = hf_models(case)
    source = make_actor(arch, saved_as, layout)
    load_hf_into_actor(source, str(hf_dir))
    source.train_step(make_samples(4, seed=1))
    save_checkpoint(tmp_path / "run", 1, source, extra={})
    source_hf = {name: t.clone() for name, t in iter_hf_weights(source.model, arch)}
    saved = step_dir(tmp_path / "run", 1)
    saved_tensors, _ = stored(saved)
    with built_as(saved_as):  # each implementation saves its own keys (the optimizer's follow them)
        assert {k for k in saved_tensors if not k.startswith("optimizer.")} == set(model_keys(source.module)[0])

    resumed = make_actor(arch, resumed_as, layout)
    assert load_checkpoint(tmp_path / "run", resumed)["step"] == 1
    source_sd = {name: p.clone() for name, p in source.state_dict_for_export().items()}  # as saved
    resumed_sd = resumed.state_dict_for_export()
    assert set(source_sd) == set(resumed_sd)
    for name, p in source_sd.items():
        assert torch.equal(resumed_sd[name], p), name
    samples = make_samples(4, seed=9)
    # same weights, Adam moments and batch: the same update up to the two specs' reduction orders (fp32)
    assert resumed.train_step(samples)["grad_norm"] == pytest.approx(source.train_step(samples)["grad_norm"], rel=1e-6)
    for name, p in source.state_dict_for_export().items():
        torch.testing.assert_close(resumed.state_dict_for_export()[name], p, rtol=0, atol=RESUMED_UPDATE_ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")

    weights_only = make_actor(arch, resumed_as, layout)
    load_model_weights(weights_only.module, saved, arch)
    for name, p in weights_only.state_dict_for_export().items():
        assert torch.equal(p, source_sd[name]), name

    assert convert(["mcore-to-hf", "--load", str(saved), "--save", str(tmp_path / "hf"),
                    "--hf-config", str(hf_dir), "--tokenizer-path", str(hf_dir)]) == 0
    back = read_all(tmp_path / "hf")
    assert set(back) == set(source_hf)
    for name, t in source_hf.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("saved_as, resumed_as", [("local", "transformer_engine"), ("transformer_engine", "local")])
def test_a_distributed_optimizer_checkpoint_resumes_only_under_its_own_implementation(layout, hf_models, saved_as,
                                                                                      resumed_as, tmp_path):
    """--use-distributed-optimizer keeps the optimizer state as one flat buffer in the order the model registers
    its parameters, which differs between the two specs (TE fuses the norms into the linears) at the same size:
    megatron-core would load it onto the wrong parameters without a word. The checkpoint records its layer
    implementation (in a stored key); the other one is refused naming both flags, its own resumes exactly."""
    from megatron_dapo.checkpoint.training import (
        CheckpointLayoutError,
        layer_impl_of,
        load_checkpoint,
        save_checkpoint,
        saved_layer_impl,
        step_dir,
    )
    from megatron_dapo.trainer.build import load_hf_into_actor
    from megatron_dapo.weights.extra_state import stored_keys

    def actor_of(impl: str) -> MegatronActor:
        with built_as(impl):
            return MegatronActor(arch, ActorConfig(lr=1e-3, use_distributed_optimizer=True), layout)

    _, hf_dir, arch = hf_models("qwen2")
    source = actor_of(saved_as)
    assert layer_impl_of(source.modules) == saved_as
    load_hf_into_actor(source, str(hf_dir))
    source.train_step(make_samples(4, seed=1))
    save_checkpoint(tmp_path / "run", 1, source, extra={})
    assert saved_layer_impl(stored_keys(step_dir(tmp_path / "run", 1))) == saved_as

    with pytest.raises(CheckpointLayoutError,
                       match=rf"--transformer-impl {saved_as} and --use-distributed-optimizer.*"
                             rf"builds --transformer-impl {resumed_as}.*resume with --transformer-impl {saved_as}"):
        load_checkpoint(tmp_path / "run", actor_of(resumed_as))

    same = actor_of(saved_as)
    assert load_checkpoint(tmp_path / "run", same)["step"] == 1
    samples = make_samples(4, seed=9)
    assert same.train_step(samples)["grad_norm"] == source.train_step(samples)["grad_norm"]  # same code, same state
