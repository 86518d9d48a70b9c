"""Refusals that one rank meets reach every rank as the same one-line error, printed once (2 ranks, DP=2).

A crafted RNG state object that only rank 1 reads (issue 38 item 1), and a disk that fills only under rank 1's
writer, with and without --async-save (item 5): every rank raises a UserError (rank 0's `echo`, the others quiet,
as `python -m megatron_dapo.train` prints it), the payload never runs, and rank 0 removes the unfinished step_N.tmp.
Worker: tests/dist/checkpoint_refusals.py.
"""

from __future__ import annotations

import json

import pytest

from tests.torchrun import REPO, run_torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("refusals")
    run_torchrun(REPO / "tests" / "dist" / "checkpoint_refusals.py", str(out), timeout=600)
    return json.loads((out / "results.json").read_text())


def test_a_crafted_object_read_by_rank_1_is_refused_on_every_rank_and_never_run(results):
    assert results["planted"] == "rng_state/shard_1_2"
    assert not results["marker"], "the payload ran"
    for rank, got in enumerate(results["crafted"]):
        assert got["type"] == "UnsafeCheckpointError" and got["echo"] == (rank == 0), got
        assert "/__1_0.distcp (object rng_state/shard_1_2): refused, it pickles" in got["message"], got
        assert "\n" not in got["message"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_disk_full_under_rank_1_alone_is_one_error_on_every_rank_and_leaves_no_tmp(results, mode):
    for rank, got in enumerate(results[mode]):
        assert got["user_error"] and got["echo"] == (rank == 0), got
        assert got["message"].startswith("no space left on device writing a checkpoint (--save"), got
        assert "unexpected pos" not in got["message"] and "\n" not in got["message"], got
    assert results[mode][0]["message"].endswith("the unfinished step_0000001.tmp was removed")
    assert results[f"{mode}_left"] == []
