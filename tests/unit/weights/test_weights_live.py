"""A converted torch_dist checkpoint in a live megatron-core GPTModel: config checks, logits vs HF, HF export
(tensors bit-exact; --export-hf's directory reloads in transformers with equal logits).

TP=1/PP=1 runs in this process for every registered family; one 4-rank torchrun launch
(tests/dist/weights_dist_ckpt.py) loads the first family's checkpoints (tied, untied) at TP x PP = 2x1, 1x2
and 2x2 and every other family's at 2x2 (one model each, tied and untied alternating), Qwen3-MoE also at EP2,
TP2 x EP2 (expert-TP 1) and, with a dense layer among MoE ones, PP2 x EP2 (at EP2 megatron-core's own GPTModel
loads it too), and saves those of the 2x2 layout and the MoE ones at EP2 as training-style checkpoints that
mcore-to-hf must convert back bit-exactly.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import save_file

from checkpoint_convert.cli import main as convert_main
from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import FAMILIES
from tests.torchrun import REPO, run_torchrun
from tests.unit.checkpoint_convert.test_convert import make_tiny_hf, read_all

WORKER = REPO / "tests" / "dist" / "weights_dist_ckpt.py"


@pytest.fixture(scope="module")
def parallel_1():
    from megatron_dapo.actor import destroy_parallel, init_parallel

    yield init_parallel(tp=1, pp=1)
    destroy_parallel()


def _convert(hf: Path, out: Path, *extra: str) -> Path:
    assert convert_main(["hf-to-mcore", "--hf-path", str(hf), "--save", str(out), *extra]) == 0
    return out


def _causal_forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    b, s = ids.shape
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(diagonal=1)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=torch.arange(s).expand(b, s), attention_mask=mask)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_single_process_logits_and_export_match_hf(
    tmp_path: Path, parallel_1: ParallelLayout, model_type: str, tied: bool
) -> None:
    from megatron_dapo.checkpoint.dist_load import load_model_weights
    from megatron_dapo.models import build_gpt_model
    from megatron_dapo.weights.export import iter_hf_weights

    hf_model = make_tiny_hf(tmp_path / "hf", tied=tied, model_type=model_type)
    arch = ModelArch.from_hf(tmp_path / "hf")
    model = build_gpt_model(arch).eval()
    # written for TP=2 (vocab padded to 256 either way): the checkpoint is layout-independent
    ckpt = _convert(tmp_path / "hf", tmp_path / "mc", "--tp", "2")
    assert load_model_weights(model, ckpt, arch) == ckpt / "release"
    ids = torch.randint(0, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    logits = _causal_forward(model, ids)[..., : arch.vocab_size]
    with torch.no_grad():
        reference = hf_model(ids).logits
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    exported = dict(iter_hf_weights(model, arch))
    original = read_all(tmp_path / "hf")
    assert set(exported) == set(original)
    assert all(torch.equal(exported[n], t) for n, t in original.items())
    # --export-hf's directory (shards + index + the source's config.json) loads in transformers as the family's
    # class, with HF's logits exactly (the tensors are bit-exact)
    from megatron_dapo.checkpoint.hf_export import export_hf

    actor = SimpleNamespace(chunks=[model], arch=arch, config=SimpleNamespace(torch_params_dtype=torch.float32))
    out = export_hf(actor, tmp_path / "export", tmp_path / "hf", max_shard_bytes=40_000)
    assert (out / "model.safetensors.index.json").exists()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf_model)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, reference)
    # exported tensors are copies: changing the model afterwards must not change them
    with torch.no_grad():
        model.decoder.final_layernorm.weight.add_(1.0)
    assert torch.equal(exported["model.norm.weight"], original["model.norm.weight"])


def test_load_checks_the_stored_config_before_reading(tmp_path: Path, parallel_1: ParallelLayout) -> None:
    from megatron_dapo.checkpoint.dist_load import load_model_weights
    from megatron_dapo.models import build_gpt_model
    from megatron_dapo.weights import CheckpointError

    make_tiny_hf(tmp_path / "hf", tied=False)
    ckpt = _convert(tmp_path / "hf", tmp_path / "mc")
    arch = ModelArch.from_hf(tmp_path / "hf")
    model = build_gpt_model(arch)
    for field, value, stored in [("rope_theta", 1e4, 1e6), ("tie_word_embeddings", True, False)]:
        other = ModelArch(**{**arch.to_dict(), field: value})
        with pytest.raises(CheckpointError, match=rf"{field}: --load {ckpt} has {stored!r}, "
                                                  rf"--hf-checkpoint config.json has {value!r}"):
            load_model_weights(model, ckpt, other)
    with pytest.raises(CheckpointError, match="per-rank safetensors format"):
        (tmp_path / "old").mkdir()
        (tmp_path / "old" / "args.json").write_text("{}")
        load_model_weights(model, tmp_path / "old", arch)


@pytest.mark.slow
def test_one_checkpoint_loads_at_tp_pp_1_2_and_training_checkpoints_convert_back(tmp_path: Path) -> None:
    # name -> (model_type, tied): the first family tied and untied, one model of each other family
    specs = {"untied": (FAMILIES[0], False), "tied": (FAMILIES[0], True)}
    specs |= {f: (f, i % 2 == 0) for i, f in enumerate(FAMILIES[1:])}
    specs["moe_mixed"] = ("qwen3_moe", False)  # a dense layer 1 among MoE ones: per-layer checkpoint keys
    models = {}
    for tie, (model_type, tied) in specs.items():
        overrides = {"mlp_only_layers": [1]} if tie == "moe_mixed" else None
        models[tie] = make_tiny_hf(tmp_path / f"hf_{tie}", tied=tied, seed=len(tie), model_type=model_type,
                                   overrides=overrides)
        moe = ModelArch.from_hf(models[tie].config).is_moe
        seq = 10 if moe else 9  # MoE at TP2 runs sequence-parallel: a length TP divides
        ids = torch.randint(0, 200, (2, seq), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            save_file({"ids": ids, "logits": models[tie](ids).logits.contiguous()}, tmp_path / f"ref_{tie}.safetensors")
        _convert(tmp_path / f"hf_{tie}", tmp_path / f"mc_{tie}")
        if model_type == "qwen3_moe":  # for megatron-core's own local-spec MoE model (no key renaming on its load)
            _convert(tmp_path / f"hf_{tie}", tmp_path / f"mc_{tie}_local", "--transformer-impl", "local")
    # Qwen3-MoE also at EP2 (dp 4), TP2 x EP2 with expert-TP 1 (+ SP) and PP2 x EP2 (mixed model)
    layouts = {"2x1": ["untied", "tied"], "1x2": ["untied", "tied"], "1x1x2": ["qwen3_moe"],
               "2x1x2x1": ["qwen3_moe"], "1x2x2": ["moe_mixed"], "2x2": list(specs)}
    out = run_torchrun(WORKER, str(tmp_path), ",".join(f"{k}={'+'.join(v)}" for k, v in layouts.items()), nproc=4,
                       timeout=600)
    oks = [line for line in out.splitlines() if line.startswith("OK ")]
    assert oks == [f"OK {layout} {tie}" for layout, names in layouts.items() for tie in names], out[-3000:]
    # The TP2 x PP2 training-style checkpoints (model under "model", step_N + latest) convert back exactly, and so do
    # the MoE ones saved with their experts split over EP ranks.
    saved = [(tie, tie) for tie in specs] + [(f"{tie}_{layout}", tie) for layout, names in layouts.items()
                                             for tie in names if layout.count("x") > 1]
    for run, tie in saved:
        argv = ["mcore-to-hf", "--load", str(tmp_path / f"train_{run}"), "--save", str(tmp_path / f"back_{run}")]
        assert convert_main(argv) == 1  # a training checkpoint stores no HF config: --hf-config is required
        assert convert_main([*argv, "--hf-config", str(tmp_path / f"hf_{tie}")]) == 0
        original, back = read_all(tmp_path / f"hf_{tie}"), read_all(tmp_path / f"back_{run}")
        assert set(back) == set(original)
        assert all(torch.equal(back[n], t) for n, t in original.items())
