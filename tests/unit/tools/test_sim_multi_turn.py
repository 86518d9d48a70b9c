"""The multi-turn rollout simulation (tools/sim_multi_turn.py) against closed forms: one conversation's time is its
turns' decode plus its calls plus (on a miss) its contexts' prefill; with every request running on one server a
round is a processor-sharing makespan written out by hand; the rounds schedule is its generation plus its tool
waves, exactly; tokens are conserved in every schedule; per-conversation continuation is never slower than rounds."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest

from megatron_dapo.simulate.schedules import Workload
from megatron_dapo.simulate.servers import ServerModel
from tests.torchrun import REPO

spec = importlib.util.spec_from_file_location("sim_multi_turn", REPO / "tools" / "sim_multi_turn.py")
smt = importlib.util.module_from_spec(spec)
sys.modules["sim_multi_turn"] = smt  # dataclasses look their module up by name
spec.loader.exec_module(smt)

MODEL = ServerModel(t0=0.01, t1=0.001, max_running=8, prefill_tps=1000.0)
WIDE = ServerModel(t0=0.01, t1=0.001, max_running=10_000, prefill_tps=1000.0)
SMALL = Workload(batch_groups=6, n_samples=4, mean_length=200, max_length=1000, prompt_tokens=20)
MULTI = ("rounds", "continuous")


def _ps_makespan(lengths: list[int], model: ServerModel) -> float:
    """Every request running on one server from 0: between the i-th and (i+1)-th shortest ending, the n - i still
    running advance together at 1 / (t0 + t1 (n - i)) tokens a second."""
    out, done = 0.0, 0
    ordered = sorted(lengths)
    for i, n in enumerate(ordered):
        out += (n - done) * model.iteration_s(len(ordered) - i)
        done = n
    return out


def test_turns_split_each_drawn_length_exactly_into_calls_plus_one_turns():
    turns = smt.split_turns(SMALL, calls=3, seed=5)
    drawn = [n for g in range(SMALL.batch_groups) for n in SMALL.draw(g)[0]]
    assert [sum(t) for t in turns] == drawn
    assert [len(t) for t in turns] == [min(3, n - 1) + 1 for n in drawn]
    assert all(n >= 1 for t in turns for n in t)
    assert turns == smt.split_turns(SMALL, calls=3, seed=5) != smt.split_turns(SMALL, calls=3, seed=6)


@pytest.mark.parametrize("schedule", MULTI)
@pytest.mark.parametrize("hit", [True, False], ids=["hit", "miss"])
def test_one_conversation_takes_its_turns_decode_plus_its_calls_plus_its_re_prefills(schedule, hit):
    tools = smt.Tools(calls=2, tool_tokens=7, tool_s=0.5, workers=1)
    out = smt.simulate([[100, 50, 200]], schedule, tools, model=MODEL, servers=1, cache_hit=hit, prompt_tokens=30)
    contexts = (30 + 100 + 7) + (30 + 100 + 7 + 50 + 7)  # before turns 2 and 3
    want = 350 * MODEL.iteration_s(1) + 2 * 0.5 + (0 if hit else contexts / MODEL.prefill_tps)
    assert out.seconds == pytest.approx(want, rel=1e-12)
    assert (out.calls, out.peak_calls, out.prefill_tokens) == (2, 1, 0 if hit else contexts)


def test_with_every_request_running_each_round_and_the_single_turn_step_are_processor_sharing_makespans():
    turns = [[30, 70, 5], [200, 1, 1], [10, 10, 10], [50, 400, 90], [1, 1, 1]]
    free = smt.Tools(calls=2, tool_tokens=0, tool_s=0.0, workers=1)
    single = smt.simulate(turns, "single", free, model=WIDE, servers=1)
    assert single.seconds == pytest.approx(_ps_makespan([sum(t) for t in turns], WIDE), rel=1e-12)
    rounds = smt.simulate(turns, "rounds", free, model=WIDE, servers=1)
    assert rounds.seconds == pytest.approx(sum(_ps_makespan([t[k] for t in turns], WIDE) for k in range(3)),
                                           rel=1e-12)
    assert rounds.round_calls == [5, 5, 0]


@pytest.mark.parametrize("hit", [True, False], ids=["hit", "miss"])
@pytest.mark.parametrize("workers", [1, 3, 64])
def test_a_rounds_step_is_its_generation_plus_its_tool_waves(hit, workers):
    turns = smt.split_turns(SMALL, calls=3, seed=1)
    tools = smt.Tools(calls=3, tool_tokens=50, tool_s=0.7, workers=workers)
    kw = dict(model=MODEL, servers=2, cache_hit=hit, prompt_tokens=20)
    out = smt.simulate(turns, "rounds", tools, **kw)
    gen = smt.simulate(turns, "rounds", smt.Tools(calls=3, tool_tokens=50, tool_s=0.0, workers=1), **kw)
    assert out.seconds == pytest.approx(gen.seconds + smt.rounds_tool_s(out.round_calls, workers, 0.7), rel=1e-12)
    assert out.round_calls[0] == sum(len(t) > 1 for t in turns)
    assert out.peak_calls == min(workers, max(out.round_calls))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("hit", [True, False], ids=["hit", "miss"])
def test_every_schedule_generates_the_drawn_tokens_and_continuation_is_never_slower_than_rounds(seed, hit):
    turns = smt.split_turns(SMALL, calls=3, seed=seed)
    tools = smt.Tools(calls=3, tool_tokens=50, tool_s=0.3, workers=4)
    kw = dict(model=MODEL, servers=2, cache_hit=hit, prompt_tokens=20)
    outs = {s: smt.simulate(turns, s, tools, **kw) for s in smt.SCHEDULES}
    drawn = sum(map(sum, turns))
    assert {s: o.generated for s, o in outs.items()} == dict.fromkeys(smt.SCHEDULES, drawn)
    calls = sum(len(t) - 1 for t in turns)
    assert outs["rounds"].calls == outs["continuous"].calls == calls
    assert outs["continuous"].seconds <= outs["rounds"].seconds
    contexts = sum(20 + sum(t[:k]) + 50 * k for t in turns for k in range(1, len(t)))
    assert outs["rounds"].prefill_tokens == outs["continuous"].prefill_tokens == (0 if hit else contexts)
    for s in MULTI:  # no conversation beats running alone with its tools never queued
        for t, done in zip(turns, outs[s].conv_done, strict=True):
            assert done >= sum(t) * MODEL.iteration_s(1) + (len(t) - 1) * 0.3 - 1e-9


def test_without_calls_every_schedule_is_the_single_turn_one():
    turns = smt.split_turns(SMALL, calls=0, seed=0)
    tools = smt.Tools(calls=0, tool_s=1.0, workers=1)
    times = [smt.simulate(turns, s, tools, model=MODEL, servers=2, cache_hit=False).seconds for s in smt.SCHEDULES]
    assert times[0] == times[1] == times[2]


def test_workers_needed_is_the_fewest_that_keep_tools_within_the_share():
    calls = [100, 37, 5]
    for gen, share in [(10.0, 0.05), (50.0, 0.2), (3.0, 0.5)]:
        fits = [w for w in range(1, 101) if smt.rounds_tool_s(calls, w, 0.2) <= share * (gen + smt.rounds_tool_s(
            calls, w, 0.2)) + 1e-12]
        assert smt.rounds_workers_needed(calls, gen, 0.2, share) == (min(fits) if fits else None)
    assert smt.rounds_workers_needed(calls, 1.0, 0.2, 0.05) is None  # 3 rounds x 0.2 s > 5% of a 1 s step


def test_the_tool_prints_one_row_a_schedule(capsys):
    smt.main(["--quick", "--servers", "1", "--calls", "1", "--mean-length", "300"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0].split(" (")[0] for line in lines[1:6]] == [
        "single-turn", "rounds", "rounds", "continuous", "continuous"]
    assert lines[1].split()[4] == "1.00x"


def test_flags_out_of_range_are_named():
    with pytest.raises(SystemExit):
        smt.main(["--tool-share", "1.5"])
    with pytest.raises(SystemExit):
        smt.main(["--quick", "--workers", "0"])
    with pytest.raises(SystemExit):
        smt.main(["--quick", "--tool-s", "-1"])


def test_continuous_workers_needed_is_the_fewest_within_the_share_or_none():
    turns = smt.split_turns(SMALL, calls=3, seed=0)
    kw = dict(model=MODEL, servers=2, prompt_tokens=20)
    tools = smt.Tools(calls=3, tool_tokens=50, tool_s=0.3, workers=1)
    gen = smt.simulate(turns, "continuous", smt.Tools(calls=3, tool_s=0.0, workers=1), **kw).seconds

    def step(w: int) -> float:
        return smt.simulate(turns, "continuous", smt.Tools(calls=3, tool_tokens=50, tool_s=0.3, workers=w),
                            **kw).seconds

    need = smt.continuous_workers_needed(turns, tools, gen, 0.1, servers=2, cache_hit=True, model=MODEL,
                                         prompt_tokens=20)
    assert step(need) - gen <= 0.1 * step(need) and (need == 1 or step(need - 1) - gen > 0.1 * step(need - 1))
    assert smt.continuous_workers_needed(turns, dataclasses.replace(tools, tool_s=1e3), gen, 0.1, servers=2,
                                         cache_hit=True, model=MODEL, prompt_tokens=20) is None


@pytest.mark.parametrize("seed", [0, 3])
def test_with_room_for_every_request_and_instant_tools_continuation_is_the_single_turn_step(seed):
    """A turn resubmitted the instant the last one ends, on the same server with a free slot, goes on at the same
    rate: only a queue (max_running) or a tool's latency makes continuation differ from one long request."""
    turns = smt.split_turns(SMALL, calls=3, seed=seed)
    tools = smt.Tools(calls=3, tool_tokens=50, tool_s=0.0, workers=1)
    single, cont = (smt.simulate(turns, s, tools, model=WIDE, servers=3) for s in ("single", "continuous"))
    assert cont.seconds == pytest.approx(single.seconds, rel=1e-9)
    assert cont.conv_done == pytest.approx(single.conv_done, rel=1e-9)
