"""Two gloo ranks (tests/dist/dataplane_wait.py, one launch, ~60 s): each DP rank receives exactly its
rows; an abort on rank 0 reaches the waiting rank; a rollout and an evaluation that outlast the default
process group's timeout (8 s) are waited out on the --rollout-timeout gloo group and the step completes,
while waits on groups with the default timeout, begun as rank 1 started waiting, fire first; a failure on
rank 0 while rank 1 waits for it (its evaluation, its metrics log, its weight push) and a failure of rank 1 in
a section make the other rank raise at once, naming the failed rank and what failed. No assertion reads a
clock: "outlasts" is the order of events on rank 1 (its default-timeout waits fired, then its wait returned),
and rank 0 answers only after them."""

from __future__ import annotations

import json

import pytest

from tests.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.slow
DEFAULT_TIMEOUT_S, STUCK_S = 8, 60.0
TIMED_OUT = f"Timed out waiting {DEFAULT_TIMEOUT_S * 1000}ms for recv operation to complete"  # gloo's words


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict[int, dict]:
    out_dir = tmp_path_factory.mktemp("dataplane")
    run_torchrun(REPO / "tests" / "dist" / "dataplane_wait.py", str(out_dir), timeout=400)
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)}


def _both(checks, name) -> list:
    return [checks[r][name] for r in (0, 1) if name in checks[r]]


def test_each_dp_rank_gets_exactly_its_share(checks):
    two = _both(checks, "two_replicas")
    one = _both(checks, "one_replica")
    assert len(two) == len(one) == 2
    assert all(c["equal"] and c["dp"] == 2 for c in two) and all(c["equal"] and c["dp"] == 1 for c in one)
    for name in ("two_replicas", "one_replica"):  # rank 0 receives nothing, rank 1 exactly its share's bytes
        assert checks[0][name]["bytes"] == 0
        assert checks[1][name]["bytes"] == checks[1][name]["expected_bytes"] > 0
    # --moe-routing-replay: the same shares with routed experts (uint8 ids, dtype kept) arrive exactly, both routes
    for name in ("two_replicas_routes", "one_replica_routes"):
        assert [c["equal"] for c in _both(checks, name)] == [True, True], name
        assert checks[0][name]["bytes"] == 0
        assert checks[1][name]["bytes"] == checks[1][name]["expected_bytes"] > checks[1][name[:-7]]["bytes"]
    # --kl-in-reward: each row's index and the step's rewards and groups arrive exactly (sent, and broadcast in a
    # replica), 8 bytes a row and 16 a step response more
    for name in ("two_replicas_table", "one_replica_table"):
        assert [c["equal"] for c in _both(checks, name)] == [True, True], name
        assert checks[1][name]["bytes"] == checks[1][name]["expected_bytes"] == \
            checks[1][name[:-6]]["bytes"] + 8 * 5 + 16 * 13  # 5 rows, 13 responses in the step
    # multi-turn rollouts: each row's generated mask (tool tokens 0) arrives exactly, 1 byte a response token more
    for name in ("two_replicas_tools", "one_replica_tools"):
        assert [c["equal"] for c in _both(checks, name)] == [True, True], name
        assert checks[1][name]["bytes"] == checks[1][name]["expected_bytes"] > checks[1][name[:-6]]["bytes"]


def test_abort_reaches_the_waiting_rank(checks):
    assert checks[0]["abort"] == "sent"
    assert checks[1]["abort"] == "global rank 0 failed while collecting the rollout batch; see its log"


def test_slow_rollout_outlasts_the_default_timeout_and_the_step_completes(checks):
    steps = _both(checks, "step")
    assert len(steps) == 2 and all(s["step"] == 1 for s in steps)
    # rank 1 was still waiting in distribute when two waits with the default timeout, begun as it entered, had
    # fired (rank 0 answered only then): it waited past the default timeout, on a group without it
    assert steps[1]["fired"] == [TIMED_OUT, TIMED_OUT] and checks[0]["gates"]["rollout"] is True
    order = checks[1]["order"]
    assert order.index("rollout clock fired") < order.index("distribute returned"), order
    assert sum(s["rows"] for s in steps) == 8 and min(s["rows"] for s in steps) == 4  # 2 prompts x 4, DP=2
    assert steps[0]["pg_loss"] == pytest.approx(steps[1]["pg_loss"])  # metrics reduced over DP
    assert steps[0]["mismatch"] == pytest.approx(steps[1]["mismatch"]) and steps[0]["mismatch"] > 0
    assert steps[0]["synced"] > 0  # rank 0's engine got the weights: the export ran on both ranks


def test_rank0_eval_is_waited_out(checks):
    assert checks[1]["eval_wait"]["fired"] == [TIMED_OUT, TIMED_OUT] and checks[0]["gates"]["eval"] is True
    order = checks[1]["order"]
    assert order.index("eval clock fired") < order.index("evaluate returned"), order


def test_rank0_eval_failure_reaches_the_waiting_rank_at_once(checks):
    """Rank 0's evaluation raises once rank 1 waits for it on the 1-hour wait group: rank 1 must raise at once.
    STUCK_S (60 s) bounds a hang, not a speed: the failure arrives within a round trip, the alternative is the hour."""
    assert checks[0]["eval_failure"] == "the eval server died"  # rank 0 re-raises its own error
    assert checks[0]["gates"]["eval_waiting"] is True  # it failed while rank 1 waited
    got = checks[1]["eval_failure"]
    assert not got["stuck"], f"rank 1 still waited for rank 0's failed evaluation after {STUCK_S} s"
    assert got["error"] == "global rank 0 failed during evaluation; see its log"


def test_a_failure_in_a_section_names_the_failed_rank(checks):
    assert checks[0]["section_failure"] == ("RuntimeError: global rank 1 failed while testing a failure on rank 1; "
                                            "see its log")
    assert checks[1]["section_failure"] == "ValueError: rank 1's part failed"


def test_a_failed_metrics_log_on_rank0_reaches_the_rank_waiting_for_the_next_batch(checks):
    assert checks[0]["log_failure"] == "OSError: No space left on device: metrics.jsonl"
    assert checks[1]["log_failure"] == ("RuntimeError: global rank 0 failed while logging the metrics of step 0; "
                                        "see its log")


def test_a_failed_weight_push_on_rank0_reaches_the_other_rank(checks):
    assert checks[0]["sync_failure"] == "the servers refused the update"
    assert checks[1]["sync_failure"] == "global rank 0 failed during the weight sync; see its log"
