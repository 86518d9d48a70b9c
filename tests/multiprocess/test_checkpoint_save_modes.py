"""--ckpt-fully-parallel-save and --async-save on 2 ranks (DP=2): each save loads back to the identical
state on every rank; fully-parallel splits the bytes over the DP ranks; an async step stays `.tmp`
until finalised on all ranks; no child process outlives the saver. One torchrun launch."""

from __future__ import annotations

import json

import pytest

from tests.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("save-modes")
    run_torchrun(REPO / "tests" / "dist" / "checkpoint_save_modes.py", str(out), timeout=600)
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("mode", ["default", "fully-parallel", "async", "fully-parallel+async"])
def test_save_mode_loads_back_identically(results, mode):
    r = results[mode]
    assert r["all_ranks_equal"], mode
    assert r["extra"] == {"step": 3, "mode": mode} and r["latest"] == "step_0000003"
    assert r["children_after_close"] == [], r["children_after_close"]
    if "async" in mode:
        assert r["unrenamed_before_finalize"], "the async step was renamed before its write was finalised"


def test_fully_parallel_save_splits_the_bytes_over_dp(results):
    for mode in ("default", "async"):  # DP rank 0 writes the replicated model + optimizer alone
        rank0, rank1 = results[mode]["distcp_bytes_per_rank"]
        assert rank1 < 0.1 * (rank0 + rank1), (mode, rank0, rank1)
    for mode in ("fully-parallel", "fully-parallel+async"):
        rank0, rank1 = results[mode]["distcp_bytes_per_rank"]
        assert 0.3 < rank1 / (rank0 + rank1) < 0.7, (mode, rank0, rank1)
