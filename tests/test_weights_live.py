"""A converted checkpoint in a live megatron-core GPTModel: strict load, logits vs HF, HF export.

Single-process checks run here; TP=2 and PP=2 run under torchrun (tests/dist/weights_export.py) and
are compared with both the original HF tensors and this process's TP=1 export.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from checkpoint_convert.cli import main as convert_main
from megatron_dapo.models.hf_config import Qwen2Arch
from megatron_dapo.parallel import ParallelLayout
from tests.test_convert import make_tiny_hf, read_all
from tests.torchrun import run_torchrun

WORKER = Path(__file__).parent / "dist" / "weights_export.py"


@pytest.fixture(scope="module")
def parallel_1():
    from megatron_dapo.actor import destroy_parallel, init_parallel

    yield init_parallel(tp=1, pp=1)
    destroy_parallel()


def _convert(hf: Path, out: Path, tp: int, pp: int) -> Path:
    assert (
        convert_main(
            ["hf-to-mcore", "--hf-path", str(hf), "--save", str(out), "--tp", str(tp), "--pp", str(pp)]
        )
        == 0
    )
    return out


def _causal_forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    b, s = ids.shape
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(diagonal=1)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=torch.arange(s).expand(b, s), attention_mask=mask)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_single_process_logits_and_export_match_hf(
    tmp_path: Path, parallel_1: ParallelLayout, tied: bool
) -> None:
    from megatron_dapo.models import build_gpt_model
    from megatron_dapo.weights import load_mcore_checkpoint
    from megatron_dapo.weights.export import iter_hf_weights

    hf_model = make_tiny_hf(tmp_path / "hf", tied=tied)
    arch = Qwen2Arch.from_hf(tmp_path / "hf")
    model = build_gpt_model(arch).eval()
    assert (
        load_mcore_checkpoint(model, _convert(tmp_path / "hf", tmp_path / "mc", 1, 1), parallel_1)
        == "release"
    )
    ids = torch.randint(0, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    logits = _causal_forward(model, ids)[..., : arch.vocab_size]
    with torch.no_grad():
        reference = hf_model(ids).logits
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    exported = dict(iter_hf_weights(model, arch))
    original = read_all(tmp_path / "hf")
    assert set(exported) == set(original)
    assert all(torch.equal(exported[n], t) for n, t in original.items())


def test_load_is_strict_and_names_the_layout_mismatch(tmp_path: Path, parallel_1: ParallelLayout) -> None:
    from megatron_dapo.models import build_gpt_model
    from megatron_dapo.weights import CheckpointError, load_mcore_checkpoint

    make_tiny_hf(tmp_path / "hf", tied=False)
    mc2 = _convert(tmp_path / "hf", tmp_path / "mc2", 2, 1)
    arch = Qwen2Arch.from_hf(tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"sharded for tp=2, pp=1 .* --tensor-model-parallel-size 1"):
        load_mcore_checkpoint(build_gpt_model(arch), mc2, parallel_1)
    tied_model = build_gpt_model(Qwen2Arch(**{**arch.to_dict(), "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match=r"unexpected \['output_layer.weight'\]"):
        load_mcore_checkpoint(tied_model, _convert(tmp_path / "hf", tmp_path / "mc1", 1, 1), parallel_1)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "tied"), [(2, 1, True), (1, 2, False)], ids=["tp2-tied", "pp2-untied"])
def test_torchrun_export_equals_hf_and_single_process(
    tmp_path: Path, parallel_1: ParallelLayout, tp: int, pp: int, tied: bool
) -> None:
    from megatron_dapo.models import build_gpt_model
    from megatron_dapo.weights import load_mcore_checkpoint
    from megatron_dapo.weights.export import iter_hf_weights

    hf_model = make_tiny_hf(tmp_path / "hf", tied=tied, seed=tp + 2 * pp)
    ckpt = _convert(tmp_path / "hf", tmp_path / "mc", tp, pp)
    (tmp_path / "out").mkdir()
    # One launch per layout: re-initialising parallel groups inside one torchrun world hung under gloo.
    run_torchrun(
        WORKER, str(ckpt), str(tmp_path / "hf"), str(tmp_path / "out"), str(tp), str(pp), nproc=2, timeout=300
    )
    # The single-process export of the same HF model (converted at TP=1, PP=1) is the reference.
    arch = Qwen2Arch.from_hf(tmp_path / "hf")
    single = build_gpt_model(arch).eval()
    load_mcore_checkpoint(single, _convert(tmp_path / "hf", tmp_path / "mc1", 1, 1), parallel_1)
    reference = dict(iter_hf_weights(single, arch))
    original = read_all(tmp_path / "hf")
    assert set(reference) == set(original)
    assert all(torch.equal(reference[n], t) for n, t in original.items())
    for rank in range(tp * pp):  # every rank of the model-parallel group receives the whole model
        with safe_open(tmp_path / "out" / f"rank{rank}.safetensors", framework="pt") as f:
            assert set(f.keys()) == set(reference), rank
            for name, tensor in reference.items():
                assert torch.equal(f.get_tensor(name), tensor), (rank, name)
    if pp == 1:
        with safe_open(tmp_path / "out" / "logits.safetensors", framework="pt") as f:
            with torch.no_grad():
                expected = hf_model(f.get_tensor("ids")).logits
            torch.testing.assert_close(f.get_tensor("logits"), expected, rtol=1e-5, atol=1e-5)
