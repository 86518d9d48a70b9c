"""tools/gpu_smoke.sh --dry: the GPU smoke script's plumbing on CPU (gloo, tiny sizes), one launch for all
checks: every part runs and the JSON / markdown report carry their numbers. Also the script's formulas."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.torchrun import REPO, subprocess_env

sys.path.insert(0, str(REPO / "tools"))
import gpu_smoke  # noqa: E402

from megatron_dapo.models.hf_config import ModelArch  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_smoke")
    env = dict(subprocess_env(), OUT=str(out), PY=sys.executable)
    proc = subprocess.run(["bash", "tools/gpu_smoke.sh", "--dry"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    return proc, out


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_dry_run_reports_every_part_with_numbers(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    merged = json.loads((out / "gpu_smoke.json").read_text())
    assert merged["dry"] is True and list(merged["parts"]) == list(gpu_smoke.PARTS)
    parts = merged["parts"]
    assert all(p["status"] == "ok" and p["exit_code"] == 0 for p in parts.values()), parts

    # Issue 37 defect 1: every part that builds a model took the CUDA machine's branch of the layer-spec choice
    # (--dry answers CUDA-available there) and, TransformerEngine being absent, built megatron-core's local
    # layers by passing the choice explicitly; left to the default, those builders raise ImportError.
    for part in ("hf_logits", "trainer", "scale", "colocate"):
        layers = parts[part]["layers"]
        assert layers["cuda"] is True and layers["te"] is False, (part, layers)
        assert layers["transformer_impl"] == "local" and "transformer_engine is not installed" in layers["why"]
    assert parts["trainer"]["runs"]["device"]["layers"]["transformer_impl"] == "local"
    assert parts["hf_logits"]["rows"][0]["fusions"]["apply_rope_fusion"] is False  # only the choice pretended

    hf = parts["hf_logits"]["rows"]
    assert [r["dtype"] for r in hf] == ["float32", "bfloat16"]
    assert hf[0]["max_abs_logprob_err"] < 1e-4 and all(_number(r["max_abs_logit_err"]) for r in hf)

    trainer = parts["trainer"]
    assert [r["step"] for r in trainer["rows"]] == [1, 2, 3]
    # Both runs are on CPU here: the same seed gives the same numbers.
    assert trainer["probe_logp_max_abs_diff_device_vs_cpu"] == 0.0
    for row in trainer["rows"]:
        assert row["train/pg_loss device"] == row["train/pg_loss cpu"] and _number(row["train/grad_norm device"])
        assert row["mismatch/logprob_abs_diff_mean device"] < 1e-4
        assert row["train/kl device"] == row["train/kl cpu"] >= 0  # the frozen reference ran on both
    assert trainer["rows"][0]["train/kl device"] == 0.0  # step 1 trains at the reference's weights
    assert trainer["runs"]["device"]["backend"] == "gloo"

    kernels = parts["kernels"]["rows"]
    assert [r["dtype"] for r in kernels] == ["bfloat16", "float32"]
    for r in kernels:
        assert r["ok"] and all(_number(r[k]) for k in ("max_err_logp", "fused_ms", "naive_ms"))
        assert r["fused_peak_gib"] is None  # no CUDA memory statistics on CPU

    scale = parts["scale"]
    assert {r["tokens_per_micro_batch"] for r in scale["rows"]} == {64, 128}
    assert all(_number(r["tokens_per_s"]) and _number(r["grad_norm"]) for r in scale["rows"])
    if not any(r["recompute"] == "full" for r in scale["rows"]):
        assert any("recompute is not available in this build" in n for n in scale["notes"])

    colocate = parts["colocate"]
    assert colocate["weights_max_abs_diff_vs_no_offload"] == 0.0  # CPU: offload/onload is bit-exact
    assert [r["step"] for r in colocate["rows"]] == [1, 2]
    assert all(r["offloaded_gib"] > 0 and _number(r["to_generation_s"]) for r in colocate["rows"])

    ipc = parts["ipc"]  # CPU: the bucket crosses through /dev/shm to the receiver process, bytes equal
    assert [r["bucket"] for r in ipc["rows"]] == ["ipc_pool"] and ipc["rows"][0]["opened_in_receiver"]

    md = (out / "gpu_smoke.md").read_text()
    for part in gpu_smoke.PARTS:
        assert f"## {part}: ok" in md
    assert "| recompute | tokens_per_micro_batch |" in md and "| dtype | backend | vocab |" in md


def test_report_keeps_the_other_parts_when_one_fails(dry_run, tmp_path):
    """A part that timed out (no JSON, rc 124) is reported as such; the others keep their figures."""
    _, out = dry_run
    for part in gpu_smoke.PARTS:
        if part != "scale":
            (tmp_path / f"{part}.json").write_text((out / f"{part}.json").read_text())
            (tmp_path / f"{part}.rc").write_text("0")
    (tmp_path / "scale.rc").write_text("124")
    merged = gpu_smoke.report(tmp_path, dry=False)
    assert merged["parts"]["scale"]["status"] == "fail" and "timed out" in merged["parts"]["scale"]["error"]
    assert merged["parts"]["kernels"]["status"] == "ok" and merged["parts"]["kernels"]["rows"]
    assert "## scale: fail" in (tmp_path / "gpu_smoke.md").read_text()


def test_training_flops_formula():
    """Qwen2.5-1.5B at 2048 tokens per row, written out: 6 x matmul params + 12 x L x s x (heads x head_dim)."""
    arch = ModelArch.from_hf(gpu_smoke.QWEN2_5_1_5B)
    h, f, layers, q, kv, v = 1536, 8960, 28, 12 * 128, 2 * 128, 151936
    matmul = layers * (h * (q + 2 * kv) + q * h + 3 * h * f) + v * h
    assert gpu_smoke.train_flops_per_token(arch, 2048) == 6 * matmul + 12 * layers * 2048 * q
    assert 1.4e9 < matmul < 1.6e9  # "1.5B": the matmul parameters are the model less norms and biases


@pytest.mark.parametrize("cuda, te, want", [
    pytest.param(True, False, "local", id="lent-gpu-machine-without-te"),
    pytest.param(True, True, "transformer_engine", id="production-gpu"),
    pytest.param(False, False, "local", id="cpu"),
    pytest.param(False, True, "local", id="cpu-with-te-installed"),
])
def test_the_smoke_builds_with_te_only_where_cuda_and_te_both_are(cuda, te, want):
    assert gpu_smoke.choose_transformer_impl(cuda=cuda, te=te)["transformer_impl"] == want


def test_the_dry_path_takes_the_cuda_branch_of_the_layer_choice():
    """Under --dry, models.spec reads CUDA as available, so the trainer's default (TransformerEngine, required)
    is what a part would get on the lent GPU machine without the explicit choice: ImportError naming the flag."""
    from megatron_dapo.models import spec

    with gpu_smoke.device_path(True):
        assert spec.cuda_available() is True
        with pytest.raises(ImportError, match="--transformer-impl local"):
            spec.resolve_transformer_impl(None)
        assert gpu_smoke.layer_choice()["transformer_impl"] == "local"
        assert gpu_smoke._impl_flags() == ["--transformer-impl", "local"]
    assert spec.cuda_available() is False  # CPU again outside
