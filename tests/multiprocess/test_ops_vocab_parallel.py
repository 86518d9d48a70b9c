"""2-process gloo vocab-parallel test: each rank holds a vocab slice; results equal the full-vocab run."""

from __future__ import annotations

import pytest

from tests.torchrun import REPO, run_torchrun


@pytest.mark.slow
def test_vocab_parallel_matches_single_process(monkeypatch):
    # The worker also runs the Triton kernels, under the interpreter (set before the ranks import triton).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    out = run_torchrun(REPO / "tests/dist/ops_vocab_parallel.py", "torch", "triton", nproc=2, timeout=300)
    for rank in (0, 1):
        for case in ("logits-torch", "logits-triton", "fused-linear"):
            assert f"rank{rank} {case} OK" in out, out[-4000:]
