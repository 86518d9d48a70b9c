"""The discrete-event stand-ins (megatron_dapo/simulate/) against formulas written out by hand, and the schedules'
invariants: the real collect_batch and StreamScheduler driven in simulated time."""

from __future__ import annotations

import pytest

from megatron_dapo.simulate.schedules import Hardware, Workload, fully_async, sync_batches, sync_colocated
from megatron_dapo.simulate.servers import ServerModel, ServerPool

MODEL = ServerModel(t0=0.01, t1=0.001, max_running=2, prefill_tps=1000.0)


def _run(pool: ServerPool) -> list:
    done = []
    while (t := pool.next_event()) != float("inf"):
        done += pool.advance(t)
    return done


def test_requests_decode_together_at_the_iteration_rate_and_queue_past_max_running():
    pool = ServerPool(MODEL, servers=1)
    a, b, c = pool.submit([(100, 10, "a"), (300, 10, "b"), (50, 10, "c")])
    done = _run(pool)
    # a and b run together (2 running: 0.012 s an iteration); c queues until a ends, then runs beside b
    t_a = 100 * 0.012
    t_c = t_a + 50 * 0.012
    t_b = t_c + (300 - 150) * 0.011  # b alone after c
    assert [r.tag for r in done] == ["a", "c", "b"]
    assert (a.done_at, c.done_at, b.done_at) == pytest.approx((t_a, t_c, t_b))
    assert pool.busy_seconds() == pytest.approx(t_b)
    assert pool.generated_tokens == 450


def test_a_retract_push_holds_each_server_for_the_push_and_its_re_prefill_and_splits_versions():
    pool = ServerPool(MODEL, servers=2)
    (a,) = pool.submit([(100, 10, "a")])
    (b,) = pool.submit([(40, 20, "b")])
    pool.advance(20 * 0.011)  # 20 tokens each
    hold = pool.update_weights(1, push_s=2.0)
    assert hold == pytest.approx(2.0 + (20 + 20) / 1000.0)  # the longer: server b, prompt 20 + 20 generated
    _run(pool)
    assert a.spans() == ((0, 20), (1, 80)) and b.spans() == ((0, 20), (1, 20))
    assert a.done_at == pytest.approx(20 * 0.011 + 2.0 + 30 / 1000 + 80 * 0.011)
    (c,) = pool.submit([(5, 1, "c")])  # admitted after the push: all of it new weights
    _run(pool)
    assert c.spans() == ((1, 5),)


def test_a_request_prefilled_at_admission_holds_its_server_and_goes_to_the_server_named():
    pool = ServerPool(MODEL, servers=2)
    (a,) = pool.submit([(100, 10, "a")], server=1)
    pool.advance(20 * 0.011)
    (b,) = pool.submit([(40, 10, "b")], server=1, prefill=500)  # a waits while b's 500 tokens are prefilled
    (c,) = pool.submit([(10, 10, "c")])  # the least-loaded: server 0
    assert (a.server, b.server, c.server) == (1, 1, 0)
    _run(pool)
    assert c.done_at == pytest.approx(20 * 0.011 + 10 * 0.011)
    assert b.done_at == pytest.approx(20 * 0.011 + 0.5 + 40 * 0.012)
    assert a.done_at == pytest.approx(b.done_at + 40 * 0.011)
    assert pool.busy_seconds() == pytest.approx(a.done_at + 10 * 0.011)


def test_abort_ends_running_with_their_tokens_and_queued_with_none():
    pool = ServerPool(MODEL, servers=1)
    pool.submit([(100, 1, "a"), (100, 1, "b"), (100, 1, "q")])
    pool.advance(10 * 0.012)
    ended = {r.tag: r.generated for r in pool.abort_all()}
    assert ended == {"a": 10, "b": 10, "q": 0}
    assert pool.next_event() == float("inf")


def _small(**kw) -> tuple[Workload, Hardware]:
    w = Workload(batch_groups=8, n_samples=4, keep_rate=0.5, mean_length=200, max_length=1000, prompt_tokens=20,
                 **kw)
    hw = Hardware(server=ServerModel(t0=0.01, t1=0.0005, max_running=16, prefill_tps=5000.0), server_gpus=1,
                  train_tokens_per_gpu_s=2000.0, step_overhead_s=1.0, push_s=0.5, switch_s=1.0)
    return w, hw


def test_sync_batches_go_through_collect_batch_and_keep_b_informative_groups():
    w, hw = _small()
    batches = sync_batches(w, hw, servers=2, steps=3)
    assert len(batches) == 3 and all(b.gen_s > 0 and 0 < b.busy_s <= b.gen_s + 1e-9 for b in batches)
    # trained tokens: B groups of G responses, each at least 1 token plus the prompt, at most max_length
    assert all(8 * 4 * 21 <= b.tokens <= 8 * 4 * 1020 for b in batches)
    r = sync_colocated(w, hw, gpus=2, steps=3, warmup=1)
    expected = sum(b.gen_s + hw.switch_s + hw.train_s(b.tokens, 2) for b in batches[1:]) / 2
    assert r.seconds_per_step == pytest.approx(expected)  # the same seeded batches, the formula per step


@pytest.mark.parametrize("k", [1, 2])
def test_fully_async_trains_every_token_within_k_and_no_faster_than_its_trainer(k):
    w, hw = _small()
    r = fully_async(w, hw, gen_gpus=2, train_gpus=1, max_staleness=k, steps=6, warmup=2)
    assert r.staleness and max(r.staleness) <= k and sum(r.staleness.values()) == pytest.approx(1.0)
    # the trainer alone needs its batch's tokens / throughput + overhead + the push it sends every step
    floor = 8 * 4 * 21 / hw.train_tokens_per_gpu_s + hw.step_overhead_s + hw.push_s
    assert r.seconds_per_step >= floor
    assert 0.0 <= r.server_idle < 1.0 and r.extra["generated_per_kept_token"] >= 1.0


def test_the_tool_prints_every_schedule_against_verls_recipe(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "tools" / "sim_async.py"
    spec = importlib.util.spec_from_file_location("sim_async", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["--quick", "--steps", "3", "--warmup", "1"])
    lines = capsys.readouterr().out.splitlines()
    names = [ln.split("  ")[0].rsplit(" ", 1)[0] for ln in lines[1:8]]  # without the GPUs (the best split)
    assert names == ["verl recipe colocated", "sync colocated", "sync split", "one-step-off", "fully async K=1",
                     "fully async K=2", "fully async K=4"]
    assert " 1.00x " in lines[1]  # verl's recipe is the baseline
    bound = float(next(ln for ln in lines if ln.startswith("work bound")).split(": ")[1].split(" s/step")[0])
    assert float(lines[6].split()[4]) >= bound  # fully async K=2 takes no less than every GPU busy all the time
    with pytest.raises(SystemExit):
        tool.main(["--steps", "3", "--warmup", "3"])
