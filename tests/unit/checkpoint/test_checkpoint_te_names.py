"""Weight loading into a Transformer Engine spec model, on CPU without Transformer Engine.

With the TE spec the pre-attention / pre-MLP RMSNorms live inside `linear_qkv` / `linear_fc1` as
`layer_norm_weight`, and `input_layernorm` / `pre_mlp_layernorm` are IdentityOps. The layer spec here
is megatron-core's own `get_gpt_layer_with_transformer_engine_spec()`, with its backend provider
(`TESpecProvider`, which needs TE) swapped for a CPU one whose fused norm+linear registers the norm
weight as `layer_norm_weight` exactly like TE's `TELayerNormColumnParallelLinear` (tests/te_standins.py).
So the module tree, the parameter names and the forward are the TE spec's, and every HF -> Megatron load path
(`load_hf_into_actor`, `--mcore-checkpoint`, `--load`) and the export path are checked against HF. Every family,
MoE included, and the local <-> TE direction of each path: test_checkpoint_te_moe_names.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import (
    LAYOUT_ADAM_EPS,
    RESUMED_UPDATE_ATOL,
    hf_response_log_probs,
    make_samples,
    tiny_hf_model,
)
from tests.te_standins import CpuTENorm, CpuTESpecProvider

TE_NORM_NAMES = ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                 "decoder.layers.1.mlp.linear_fc1.layer_norm_weight")


@pytest.fixture(scope="module")
def te_world(tmp_path_factory):
    """(layout, hf model, arch, HF dir, make_actor(te: bool)); TE actors use megatron's TE layer spec."""
    from megatron.core.models.gpt import gpt_layer_specs

    layout = init_parallel(seed=0)
    hf = tiny_hf_model(seed=3)
    hf_dir = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(hf_dir, safe_serialization=True)
    arch = ModelArch.from_hf(hf.config)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpt_layer_specs, "TESpecProvider", CpuTESpecProvider, raising=False)
        te_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    local_spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")

    def make_actor(te: bool, **overrides) -> MegatronActor:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("megatron_dapo.models.gpt.get_layer_spec",
                       lambda use_te=None, config=None, options=None, vp_stage=None: te_spec if te else local_spec)
            if te:  # a TE build's final norm (megatron-core's LayerNormImpl is TENorm there)
                mp.setattr("megatron.core.transformer.transformer_block.LayerNormImpl", CpuTENorm)
            return MegatronActor(arch, ActorConfig(**{"lr": 1e-3, **overrides}), layout)

    yield layout, hf, arch, hf_dir, make_actor
    destroy_parallel()


def _hf_loaded(make_actor, hf_dir, te: bool, **overrides) -> MegatronActor:
    from megatron_dapo.trainer.build import load_hf_into_actor

    actor = make_actor(te, **overrides)
    load_hf_into_actor(actor, str(hf_dir))
    return actor


def test_te_spec_carries_the_fused_norm_names(te_world):
    names = {n for n, _ in te_world[4](True).module.named_parameters()}
    assert set(TE_NORM_NAMES) <= names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)


def test_hf_load_into_te_actor_matches_hf_and_the_local_spec(te_world):
    _, hf, _, hf_dir, make_actor = te_world
    te, local = _hf_loaded(make_actor, hf_dir, True), _hf_loaded(make_actor, hf_dir, False)
    samples = make_samples(3, seed=2)
    for got, want in zip(te.compute_log_probs(samples), hf_response_log_probs(hf, samples)[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # export: the same local-spec keys and tensors from either spec; and it loads back (round trip)
    te_sd, local_sd = te.state_dict_for_export(), local.state_dict_for_export()
    assert set(te_sd) == set(local_sd)
    for name in local_sd:
        assert torch.equal(te_sd[name], local_sd[name]), name
    fresh = make_actor(True)
    fresh.load_shards(te_sd)
    assert all(torch.equal(a, b) for a, b in zip(fresh.module.parameters(), te.module.parameters(), strict=True))


def test_hf_export_from_te_actor_equals_hf(te_world):
    from megatron_dapo.weights.export import iter_hf_weights

    _, hf, arch, hf_dir, make_actor = te_world
    exported = dict(iter_hf_weights(_hf_loaded(make_actor, hf_dir, True).model, arch))
    reference = hf.state_dict()
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name


def test_converter_checkpoint_into_te_actor(te_world, tmp_path):
    """hf-to-mcore output (torch_dist, TE key names) as --load into a TE-spec actor: train.build_actor's path."""
    from checkpoint_convert.cli import main as convert
    from megatron_dapo.checkpoint.dist_load import load_model_weights

    _, hf, arch, hf_dir, make_actor = te_world
    assert convert(["hf-to-mcore", "--hf-path", str(hf_dir), "--save", str(tmp_path / "mc")]) == 0
    actor = make_actor(True)
    load_model_weights(actor.module, tmp_path / "mc", arch)
    actor.optimizer.reload_model_params()
    samples = make_samples(2, seed=5)
    for got, want in zip(actor.compute_log_probs(samples), hf_response_log_probs(hf, samples)[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_dist_checkpoint_of_local_spec_resumes_into_te_spec(te_world, tmp_path):
    """--save from a local-spec run, --load into a TE-spec run: megatron maps the norms to TE keys."""
    from megatron_dapo.checkpoint.training import load_checkpoint, save_checkpoint

    _, hf, _, hf_dir, make_actor = te_world
    # Adam's eps = lr: the two specs' next updates differ by their fp32 reduction orders only, bounded by
    # RESUMED_UPDATE_ATOL for every element (at eps 1e-8 a near-zero gradient's noise moves one by up to lr)
    local = _hf_loaded(make_actor, hf_dir, False, adam_eps=LAYOUT_ADAM_EPS)
    local.train_step(make_samples(4, seed=1))
    save_checkpoint(tmp_path, 1, local, extra={})
    te = make_actor(True, adam_eps=LAYOUT_ADAM_EPS)
    assert load_checkpoint(tmp_path, te)["step"] == 1
    te_sd, local_sd = te.state_dict_for_export(), local.state_dict_for_export()
    for name in local_sd:
        assert torch.equal(te_sd[name], local_sd[name]), name
    # and the next update is the same (Adam state restored under the TE names too)
    samples = make_samples(4, seed=9)
    assert te.train_step(samples)["grad_norm"] == pytest.approx(local.train_step(samples)["grad_norm"], rel=1e-6)
    for name, p in local.state_dict_for_export().items():
        torch.testing.assert_close(te.state_dict_for_export()[name], p, rtol=0, atol=RESUMED_UPDATE_ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _extra_state_keys(actor: MegatronActor) -> set[str]:
    """The storage keys of the `_extra_state` ShardedObjects this actor's model asks for at load."""
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {v.unique_key for v in nested_values(actor.module.sharded_state_dict())
            if isinstance(v, ShardedObject) and v.key.endswith("._extra_state")}


def test_converter_writes_every_extra_state_a_te_model_asks_for(te_world, tmp_path):
    """The TE key set (four linears per layer, the final norm) is a subset of what hf-to-mcore stores."""
    from checkpoint_convert.cli import main as convert
    from megatron_dapo.weights.extra_state import stored_keys

    _, _, arch, hf_dir, make_actor = te_world
    assert convert(["hf-to-mcore", "--hf-path", str(hf_dir), "--save", str(tmp_path / "mc")]) == 0
    wanted = _extra_state_keys(make_actor(True))
    assert "decoder.final_layernorm._extra_state/shard_0_1" in wanted
    assert len(wanted) == 4 * arch.num_layers + 1
    assert wanted <= stored_keys(tmp_path / "mc" / "release")


def test_checkpoint_without_extra_state_loads_into_te_actor(te_world, tmp_path):
    """Converter output lacking every `_extra_state` (an older converter, another tool) loads under TE: the
    absent ones arrive as None, the weights equal HF's."""
    import importlib

    from checkpoint_convert.cli import main as convert
    from megatron_dapo.checkpoint.dist_load import load_model_weights

    hf_to_mcore = importlib.import_module("checkpoint_convert.hf_to_mcore")  # the package re-exports a function
    _, hf, arch, hf_dir, make_actor = te_world
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_to_mcore, "extra_state_objects", lambda arch, impl: {})
        assert convert(["hf-to-mcore", "--hf-path", str(hf_dir), "--save", str(tmp_path / "mc")]) == 0
    actor = make_actor(True)
    load_model_weights(actor.module, tmp_path / "mc", arch)
    actor.optimizer.reload_model_params()
    assert actor.module.decoder.final_layernorm.extra_state_loaded == [None]
    samples = make_samples(2, seed=5)
    for got, want in zip(actor.compute_log_probs(samples), hf_response_log_probs(hf, samples)[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

